"""What the asyncio side may know about the engine: frozen objects, built where the state lives.

:class:`EngineCapabilities` are facts fixed when the engine is built (read
once, before the engine thread starts).  :class:`EngineSnapshot` is the
engine's state at one moment, built on the engine thread between two steps
(:meth:`EngineCore.request_snapshot`) and never changed afterwards, so the
event loop reads it without touching the scheduler, the pool, the cache or the
model while the engine thread mutates them.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from ds4d.engine.request import Sequence
    from ds4d.engine.scheduler import Scheduler
    from ds4d.engine.stats import EngineStats


@runtime_checkable
class DecodeGraphModel(Protocol):
    """A model that captures decode steps in graphs and may fall back to running them eagerly
    (``DeepseekV4Model``, with ``ForwardPaths.graph_fallback``)."""

    @property
    def graph_failure(self) -> str | None:
        """The first decode graph capture failure (``"Type: message"``) after which decode ran eagerly;
        None while decode runs as built."""


@dataclass(frozen=True)
class EngineCapabilities:
    """What the routes may plan with, fixed for the engine's life."""

    prefix_reuse: bool
    """Prompts reuse cached prefixes; when False, ``reuse_off_reason`` says why."""
    reuse_off_reason: str
    exact_reuse: bool
    """Reuse goes through state checkpoints (a model with per-sequence state), so a prompt can reuse
    up to any token, not only whole blocks."""
    decode_lookahead: bool
    """Decode steps are queued behind their predecessor (asked for, and the model takes device tokens)."""
    block_size_tokens: int
    num_blocks: int


@dataclass(frozen=True)
class RequestView:
    """One request in flight, as ``/v1/ds4d/stats`` lists it."""

    id: str
    phase: str
    """``queued``, ``reading`` (its cached prefix is being read from disk), ``prefill`` or ``decode``."""
    prefill_chunk: int
    prefill_chunks: int
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    tok_s: float
    age_s: float


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine at one moment (``/v1/ds4d/stats`` and ``/metrics`` are made from one)."""

    taken_at: float
    """``time.monotonic()`` when it was built."""
    running: int
    waiting: int
    active: tuple[RequestView, ...]
    arrived_total: int
    finished_total: int
    prefill_tokens_total: int
    decode_tokens_total: int
    preemptions_total: int
    prefill_tok_s: float
    decode_tok_s: float
    """Recent throughput as of ``taken_at`` (``EngineStats.throughput``)."""
    total_blocks: int
    free_blocks: int
    used_blocks: int
    cached_blocks: int
    block_size_tokens: int
    cache_hits: int
    """Requests that reused cached blocks (``cache_misses``: that reused nothing)."""
    cache_misses: int
    evictions: int
    cache: Mapping[str, Any]
    """``PrefixCache.stats()`` (tiers, promotions, copies, checkpoints); the snapshot's own copy."""
    experts: Mapping[str, Any] | None
    """Expert-offload counters when the model offloads experts, else None."""
    steps_ahead_total: int
    decode_graph_failure: str | None = None
    """The first decode graph capture failure (``"Type: message"``) of a model that then ran decode
    eagerly (``DecodeGraphModel``); None when decode runs as built."""


def capabilities_of(scheduler: Scheduler, lookahead: bool) -> EngineCapabilities:
    return EngineCapabilities(
        prefix_reuse=scheduler.prefix_reuse, reuse_off_reason=scheduler.reuse_off_reason,
        exact_reuse=scheduler.cache.stateful, decode_lookahead=lookahead,
        block_size_tokens=scheduler.pool.block_size, num_blocks=scheduler.pool.num_blocks)


def take_snapshot(scheduler: Scheduler, seqs: Iterable[Sequence], stats: EngineStats, model: Any,
                  steps_ahead: int) -> EngineSnapshot:
    """The engine's state now.  Engine thread only (or no engine thread running)."""
    now = time.monotonic()
    pool = scheduler.pool
    prefill_tok_s, decode_tok_s = stats.throughput()
    expert_stats = getattr(model, "expert_stats", None)
    return EngineSnapshot(
        taken_at=now, running=len(scheduler.running), waiting=len(scheduler.waiting),
        active=tuple(_view(scheduler, seq, now) for seq in seqs),
        arrived_total=stats.arrived_total, finished_total=stats.finished_total,
        prefill_tokens_total=stats.prefill_tokens_total, decode_tokens_total=stats.decode_tokens_total,
        preemptions_total=stats.preemptions_total, prefill_tok_s=prefill_tok_s, decode_tok_s=decode_tok_s,
        total_blocks=pool.num_blocks, free_blocks=pool.num_free, used_blocks=pool.num_used,
        cached_blocks=pool.num_cached, block_size_tokens=pool.block_size,
        cache_hits=pool.hits, cache_misses=pool.misses, evictions=pool.evictions, cache=scheduler.cache.stats(),
        experts=(expert_stats() if expert_stats is not None else None) or None, steps_ahead_total=steps_ahead,
        decode_graph_failure=model.graph_failure if isinstance(model, DecodeGraphModel) else None)


def _view(scheduler: Scheduler, seq: Sequence, now: float) -> RequestView:
    uncomputed_prompt = max(0, seq.num_prompt_tokens - max(seq.num_computed_tokens, seq.cached_tokens))
    if seq.state_slot is None:
        phase = "reading" if scheduler.cache.reading(seq.request_id) else "queued"
    elif not seq.output_ids:
        phase = "prefill"
    else:
        phase = "decode"
    total_chunks = seq.chunks_done + -(-uncomputed_prompt // scheduler.prefill_chunk)
    decode_s = now - seq.first_token_at if seq.first_token_at else 0.0
    return RequestView(
        id=seq.request_id, phase=phase, prefill_chunk=seq.chunks_done,
        prefill_chunks=max(total_chunks, seq.chunks_done), prompt_tokens=seq.num_prompt_tokens,
        cached_tokens=seq.cached_tokens, generated_tokens=len(seq.output_ids),
        tok_s=round(len(seq.output_ids) / decode_s, 2) if decode_s > 0 else 0.0,
        age_s=round(now - seq.arrival_time, 3))
