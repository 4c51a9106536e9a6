"""The engine's ``Model`` for DeepSeek-V4.1: state slots plus a paged pool of compressed KV.

What a V4.1 sequence leaves behind splits as V4's does (``deepseek_v4/cache.py``):

* **Block pool** (shared, paged, in the engine's block accounting): per KV source layer
  the compressed KV entries, ``block_size_tokens / ratio`` per block, and at a KV source
  that is also an index source the index keys beside them.  An entry is written once, when
  its last token arrives, and never changes, so a full block can be shared between
  sequences and copied to the prefix cache's lower tiers (``export_blocks`` /
  ``import_blocks``: every pool's rows of the block, source by source, as bytes).
* **State slot** (one per running sequence): the forward's
  :class:`~ds4d.models.deepseek_v41.state.SequenceState` minus the entries: the window
  ring of every layer, the ratio-2 compressor tails, the last Engram token ids, the
  position, and how many entries each source holds.  ``save_state`` copies it
  (a list of tensors), ``load_state`` restores it into any slot; with the sequence's
  blocks that is everything needed to go on (prefix reuse at a state checkpoint).

The forward runs the chunks of a step one after the other through
:meth:`DeepseekV41Model.forward`; with the model's ``batched_decode`` path (CUDA) the
one-token chunks of a step go through :meth:`DeepseekV41Model.decode_many` together.  A
prefill chunk that wants at most its last logits runs on the triangle of rows they and the
state depend on (``model.row_plan``).  A chunk at position 0 starts a fresh state, any
other continues its slot's state, which must stand exactly at the chunk's ``start_pos``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ds4d.contracts import ForwardBatch, ModelInfo, Tokenizer
from ds4d.models.deepseek_v4.cache import payload_rows
from ds4d.models.deepseek_v41.model import DeepseekV41Model
from ds4d.models.deepseek_v41.state import GroupState, GrowingRows, SequenceState

DEFAULT_BLOCK_TOKENS = 128


class PagedRows:
    """A sequence's rows of one pool ``[num_blocks, rows_per_block, width]``, through its block table.

    The same interface as :class:`~ds4d.models.deepseek_v41.state.GrowingRows` (``count``,
    ``append``, ``view``), so the attention code cannot tell them apart."""

    def __init__(self, pool: torch.Tensor, count: int = 0) -> None:
        self.pool = pool
        self.count = count
        self.blocks = torch.empty(0, dtype=torch.long, device=pool.device)

    def append(self, rows: torch.Tensor) -> None:
        per_block = self.pool.shape[1]
        last = self.count + rows.shape[0] - 1
        if rows.shape[0] and last // per_block >= self.blocks.numel():
            raise ValueError(f"entry {last} lies past the sequence's {self.blocks.numel()} blocks")
        index = torch.arange(self.count, last + 1, device=self.pool.device)
        self.pool[self.blocks[index // per_block], index % per_block] = rows.to(self.pool.dtype)
        self.count += rows.shape[0]

    def view(self) -> torch.Tensor:
        per_block = self.pool.shape[1]
        used = self.blocks[: -(-self.count // per_block)]
        return self.pool[used].reshape(-1, self.pool.shape[2])[: self.count]

    def clone(self) -> GrowingRows:
        copy = GrowingRows(self.pool.shape[2], self.pool.dtype, self.pool.device)
        copy.append(self.view())
        return copy


class DeepseekV41Pool:
    """The tensors of ``num_blocks`` blocks: per KV source its entry pool and (index sources) key pool."""

    def __init__(self, model: DeepseekV41Model, num_blocks: int, block_tokens: int) -> None:
        cfg = model.cfg
        self.num_blocks = num_blocks
        self.entries: dict[int, torch.Tensor] = {}
        self.index_keys: dict[int, torch.Tensor] = {}
        for plan in model.plans:
            if not plan.is_kv_source:
                continue
            per_block = block_tokens // plan.ratio
            self.entries[plan.layer] = torch.zeros(num_blocks, per_block, cfg.head_dim, dtype=model.dtype,
                                                   device=model.device)
            if plan.is_index_source:
                self.index_keys[plan.layer] = torch.zeros(num_blocks, per_block, cfg.index_head_dim,
                                                          dtype=model.dtype, device=model.device)

    def pools(self) -> list[torch.Tensor]:
        """The paged tensors in payload order: per source (layer order) its entries, then its index keys."""
        out = []
        for source, entries in sorted(self.entries.items()):
            out.append(entries)
            if source in self.index_keys:
                out.append(self.index_keys[source])
        return out

    def payload_bytes(self) -> int:
        return sum(pool[0].numel() * pool.element_size() for pool in self.pools())


def bytes_per_block(model: DeepseekV41Model, block_tokens: int) -> int:
    size = torch.empty((), dtype=model.dtype).element_size()
    total = 0
    for plan in model.plans:
        if plan.is_kv_source:
            width = model.cfg.head_dim + (model.cfg.index_head_dim if plan.is_index_source else 0)
            total += block_tokens // plan.ratio * width * size
    return total


def state_bytes_per_seq(model: DeepseekV41Model) -> int:
    """Window rings plus at most one tail row (kv and gate, float32) per ratio-2 source and the Engram ids."""
    cfg = model.cfg
    size = torch.empty((), dtype=model.dtype).element_size()
    rings = cfg.num_hidden_layers * cfg.sliding_window * cfg.head_dim * size
    tails = sum(2 * (plan.ratio - 1) * cfg.head_dim * 4 for plan in model.plans if plan.is_kv_source)
    return rings + tails + 8 * (model.hasher.history if model.hasher is not None else 0)


class DeepseekV41Serving:
    """A loaded V4.1 model with its block pool and state slots (``Model``, ``StatefulModel``,
    ``BlockCopyModel``)."""

    def __init__(self, model: DeepseekV41Model, tokenizer: Tokenizer, *, block_tokens: int = DEFAULT_BLOCK_TOKENS,
                 parameter_bytes: int = 0, extra: dict[str, Any] | None = None) -> None:
        ratios = {plan.ratio for plan in model.plans if plan.ratio}
        if any(block_tokens % ratio for ratio in ratios):
            raise ValueError(f"block_tokens {block_tokens} must be a multiple of every compress ratio {sorted(ratios)}")
        cfg = model.cfg
        self.model = model
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.block_tokens = block_tokens
        self.pool: DeepseekV41Pool | None = None
        self.slots: list[SequenceState | None] = []
        self.triangular_prefill = True
        """A prefill chunk that wants at most its last logits runs the layers after the last KV source
        on the rows those logits and the state depend on only (``model.row_plan``)."""
        self.info = ModelInfo(
            family="deepseek_v41",
            name=cfg.name,
            vocab_size=cfg.vocab_size,
            max_context_tokens=cfg.max_position_embeddings,
            block_size_tokens=block_tokens,
            cache_bytes_per_block=bytes_per_block(model, block_tokens),
            state_bytes_per_seq=state_bytes_per_seq(model),
            **chat_plugins(),
            dtype=str(model.dtype).removeprefix("torch."),
            device=str(model.device),
            parameter_bytes=parameter_bytes,
            extra={"compress_ratios": [plan.ratio for plan in model.plans],
                   "kv_source_layers": list(cfg.kv_source_layer_ids),
                   "sliding_window": cfg.sliding_window, "forward_paths": model.paths.as_dict(), **(extra or {})},
        )

    # ------------------------------------------------------------------ Model

    def allocate_cache(self, num_blocks: int, max_seqs: int) -> None:
        self.pool = None
        self.pool = DeepseekV41Pool(self.model, num_blocks, self.block_tokens)
        self.slots = [None] * max_seqs

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        if self.pool is None:
            raise RuntimeError("allocate_cache() must run before forward()")
        self._check(batch)
        tokens = batch.input_tokens.tolist() if batch.input_tokens is not None else None
        steps = []
        for n, chunk in enumerate(batch.chunks):
            ids = [int(tokens[n])] if tokens is not None else list(chunk.token_ids)
            if not ids:
                continue
            state = self._state_for(chunk.state_slot, chunk.start_pos)
            self._bind(state, chunk.block_ids)
            steps.append((n, state, ids))
        results: dict[int, torch.Tensor] = {}
        singles = [step for step in steps if len(step[2]) == 1] if self.model.paths.batched_decode else []
        if len(singles) > 1:  # one-token chunks through the layers together
            logits = self.model.decode_many([state for _, state, _ in singles], [ids[0] for *_, ids in singles])
            results = {n: logits[i: i + 1] for i, (n, _, _) in enumerate(singles)}
        for n, state, ids in steps:
            if n not in results:
                last_only = self.triangular_prefill and batch.chunks[n].logits_tokens <= 1 and len(ids) > 1
                results[n] = self.model.forward(state, ids, last_only=last_only)
        out = []
        for n, _, _ in steps:
            wanted, logits = batch.chunks[n].logits_tokens, results[n]
            if wanted:
                out.append(logits[logits.shape[0] - wanted:])
        if not out:
            return torch.zeros(0, self.cfg.vocab_size, dtype=torch.float32, device=self.model.device)
        return torch.cat(out).float()

    def _check(self, batch: ForwardBatch) -> None:
        slots = [c.state_slot for c in batch.chunks]
        if len(set(slots)) != len(slots):
            raise ValueError("two chunks in one step share a state slot")
        for chunk in batch.chunks:
            end = chunk.start_pos + len(chunk.token_ids)
            if not 0 <= chunk.state_slot < len(self.slots):
                raise ValueError(f"state slot {chunk.state_slot} outside 0..{len(self.slots) - 1}")
            if len(chunk.block_ids) < -(-end // self.block_tokens):
                raise ValueError(f"{len(chunk.block_ids)} blocks cannot hold positions up to {end}")
            if any(not 0 <= b < self.pool.num_blocks for b in chunk.block_ids):
                raise ValueError(f"block id outside 0..{self.pool.num_blocks - 1}")
            if not 0 <= chunk.logits_tokens <= len(chunk.token_ids):
                raise ValueError("logits_tokens exceeds the chunk length")
            if end > self.cfg.max_position_embeddings:
                raise ValueError(f"position {end} beyond max_position_embeddings")
        if batch.input_tokens is not None and any(len(c.token_ids) != 1 for c in batch.chunks):
            raise ValueError("input_tokens feeds one token per chunk")

    def _state_for(self, slot: int, start_pos: int) -> SequenceState:
        if start_pos == 0:
            self.slots[slot] = self._fresh_state(counts={})
        state = self.slots[slot]
        if state is None or state.position != start_pos:
            where = "empty" if state is None else f"at position {state.position}"
            raise ValueError(f"state slot {slot} is {where}, the chunk starts at {start_pos}")
        return state

    def _fresh_state(self, counts: dict[int, tuple[int, int]]) -> SequenceState:
        state = SequenceState.empty(self.cfg, self.model.device, self.model.dtype)
        for source, group in state.groups.items():
            entries, keys = counts.get(source, (0, 0))
            group.entries = PagedRows(self.pool.entries[source], entries)
            if source in self.pool.index_keys:
                group.index_keys = PagedRows(self.pool.index_keys[source], keys)
        return state

    def _bind(self, state: SequenceState, block_ids: Sequence[int]) -> None:
        table = torch.tensor(list(block_ids), dtype=torch.long, device=self.model.device)
        for group in state.groups.values():
            for rows in (group.entries, group.index_keys):
                if isinstance(rows, PagedRows):
                    rows.blocks = table

    def place_probe_state(self, slot: int, position: int) -> None:
        """Put in ``slot`` a state standing at ``position`` whose contents are zeros: the window rings
        full, every source holding the entries (and index keys) of ``position`` tokens, a ratio-2
        tail where the position is odd.  For the GPU memory plan's profiling step, which only needs a
        forward at the end of a long prompt to allocate what a real one would."""
        counts = {}
        for plan in self.model.plans:
            if plan.is_kv_source:
                entries = position // plan.ratio
                counts[plan.layer] = (entries, entries if plan.is_index_source else 0)
        state = self._fresh_state(counts)
        state.position = position
        cfg, device = self.cfg, self.model.device
        for plan in self.model.plans:
            if plan.is_kv_source and plan.ratio > 1:
                tail = position % plan.ratio
                group = state.groups[plan.layer]
                group.tail_kv = torch.zeros(tail, cfg.head_dim, dtype=torch.float32, device=device)
                group.tail_gate = torch.zeros(tail, cfg.head_dim, dtype=torch.float32, device=device)
        if self.model.hasher is not None:
            state.engram_ids = torch.zeros(min(position, self.model.hasher.history), dtype=torch.int64)
        self.slots[slot] = state

    # ------------------------------------------------------------------ StatefulModel

    def save_state(self, slot: int) -> list[torch.Tensor]:
        """``slot``'s state as tensors: [position and per source (entries, index keys), Engram ids,
        the window rings in layer order, per source (tail kv, tail gate)].  The entries themselves
        are in the sequence's blocks."""
        state = self.slots[slot]
        if state is None:
            raise ValueError(f"state slot {slot} holds no sequence")
        header = [state.position]
        tails = []
        for _, group in sorted(state.groups.items()):
            header += [group.entries.count, group.index_keys.count]
            tails += [group.tail_kv.clone(), group.tail_gate.clone()]
        return [torch.tensor(header, dtype=torch.long), state.engram_ids.clone(),
                *(ring.clone() for ring in state.windows), *tails]

    def load_state(self, slot: int, snapshot: list[torch.Tensor]) -> None:
        layers, sources = self.cfg.num_hidden_layers, sorted(self.cfg.kv_source_layer_ids)
        if len(snapshot) != 2 + layers + 2 * len(sources) or snapshot[0].numel() != 1 + 2 * len(sources):
            raise ValueError("state snapshot does not match this model's state layout")
        header = snapshot[0].tolist()
        counts = {source: (header[1 + 2 * i], header[2 + 2 * i]) for i, source in enumerate(sources)}
        state = self._fresh_state(counts)
        state.position = header[0]
        state.engram_ids = snapshot[1].clone()
        device = self.model.device
        for layer in range(layers):
            if snapshot[2 + layer].shape != state.windows[layer].shape:
                raise ValueError("state snapshot does not match this model's state layout")
            state.windows[layer] = snapshot[2 + layer].to(device, copy=True)
        for i, source in enumerate(sources):
            group: GroupState = state.groups[source]
            group.tail_kv = snapshot[2 + layers + 2 * i].to(device, copy=True)
            group.tail_gate = snapshot[3 + layers + 2 * i].to(device, copy=True)
        self.slots[slot] = state

    # ------------------------------------------------------------------ BlockCopyModel

    def export_blocks(self, block_ids: Sequence[int]) -> list[torch.Tensor]:
        """Each block as one uint8 host tensor: every pool's rows of the block, in :meth:`DeepseekV41Pool.pools` order."""
        if self.pool is None:
            raise RuntimeError("allocate_cache() must run first")
        pools = self.pool.pools()
        if not block_ids or not pools:
            return [torch.empty(0, dtype=torch.uint8) for _ in block_ids]
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.model.device)
        rows = torch.cat([pool.index_select(0, index).reshape(len(block_ids), -1).view(torch.uint8)
                          for pool in pools], dim=1).cpu()
        return list(rows.unbind(0))

    def import_blocks(self, block_ids: Sequence[int], payloads: Sequence[Any]) -> None:
        if self.pool is None:
            raise RuntimeError("allocate_cache() must run first")
        raw = payload_rows(block_ids, payloads, self.pool.payload_bytes())
        pools = self.pool.pools()
        if not raw or not pools:
            return
        rows = torch.stack(raw).to(self.model.device)
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.model.device)
        offset = 0
        for pool in pools:
            size = pool[0].numel() * pool.element_size()
            values = rows[:, offset:offset + size].contiguous().view(pool.dtype).view(len(block_ids), *pool.shape[1:])
            pool.index_copy_(0, index, values)
            offset += size


def chat_plugins() -> dict[str, str]:
    """The chat plugins a V4.1 model asks for by default (``chat_encoder = auto`` etc.): the V4.1
    chat format (spaced DSML tags, ``<｜System｜>``, numeric reasoning effort)."""
    return {"default_chat_encoder": "deepseek_v41", "default_reasoning_parser": "deepseek_v41",
            "default_tool_parser": "dsml_v41"}
