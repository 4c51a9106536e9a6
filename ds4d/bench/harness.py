"""Drive an engine in-process, step by step, and time prefill and decode separately.

No HTTP, no thread: the benchmark steps an :class:`OfflineEngine` itself and books each
step's wall time as prefill (the step computed prompt tokens) or decode (it
computed only one token per running sequence).  Mixed steps count as prefill.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ds4d.contracts import Model
from ds4d.engine.offline import OfflineEngine
from ds4d.engine.request import EngineRequest, SamplingParams


@dataclass(frozen=True)
class RunTiming:
    prefill_tokens: int
    prefill_s: float
    decode_tokens: int
    decode_s: float

    @property
    def prefill_tok_s(self) -> float:
        return self.prefill_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0


def make_engine(model: Model, *, max_num_seqs: int, context_tokens: int, prefill_chunk: int,
                lookahead: bool = False) -> OfflineEngine:
    """An engine for ``max_num_seqs`` sequences of ``context_tokens``, no prefix caching, outputs dropped."""
    return OfflineEngine(model, max_num_seqs=max_num_seqs, context_tokens=context_tokens,
                         prefill_chunk=prefill_chunk, prefix_caching=False, namespace=b"bench",
                         lookahead=lookahead, publish=lambda outputs: None)


def run_batch(engine: OfflineEngine, prompts: list[list[int]], max_tokens: int, sync=lambda: None,
              after_decode_step=None, sampling: dict | None = None) -> RunTiming:
    """Generate ``max_tokens`` for every prompt at once (greedy, or ``sampling``'s temperature /
    top_p / top_k); time prefill and decode steps.

    ``after_decode_step``: called after each decode step (e.g. a profiler's ``step``)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **(sampling or {"temperature": 0.0}))
    for i, p in enumerate(prompts):
        engine.submit(EngineRequest(f"bench-{time.monotonic_ns()}-{i}", tuple(p), params))
    stats = engine.stats
    prefill_s = decode_s = 0.0
    prefill_tokens = decode_tokens = 0
    while engine.has_work:
        p0, d0 = stats.prefill_tokens_total, stats.decode_tokens_total
        t0 = time.perf_counter()
        engine.step()
        if not engine.lookahead:  # looking ahead, the next step is already queued: waiting for it would
            sync()              # serialise what the engine overlaps (each step() resolves one step anyway)
        dt = time.perf_counter() - t0
        dp, dd = stats.prefill_tokens_total - p0, stats.decode_tokens_total - d0
        if dp:
            prefill_s += dt
            prefill_tokens += dp
        else:
            decode_s += dt
            decode_tokens += dd
            if after_decode_step is not None:
                after_decode_step()
    return RunTiming(prefill_tokens, prefill_s, decode_tokens, decode_s)
