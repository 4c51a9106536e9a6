"""Where, inside a prompt, a model with per-sequence state saves state checkpoints.

A stateful model (DeepSeek-V4) resumes a prompt only at a saved checkpoint
(``ds4d/cache/checkpoints.py``).  Besides the end of every prompt and every
generation (request boundaries, saved by the scheduler in any case), a prompt
is checkpointed where a later prompt is likely to part from it:

* before a volatile tail (``EngineRequest.volatile_tail``): the next turn renders
  the last tokens otherwise;
* at the end of the stable prefix (``EngineRequest.stable_prefix``: system prompt
  and tool declarations), which new sessions and subagents repeat;
* at message starts (``EngineRequest.message_starts``), thinned so that no two
  checkpoints are closer than a quarter of the periodic spacing (one block at
  least); the last message start is always kept (an edited or regenerated last
  message parts there);
* every ``every_tokens`` tokens (absolute positions, a multiple of the block
  size: prompts sharing a long prefix land on the same positions, and such a
  checkpoint needs no copy of a partly filled block), so a prompt that parts
  from a cached one anywhere recomputes at most ``every_tokens`` tokens.

The V4 family can save its state at any position (window ring and compressor
tails hold whatever the position leaves unfinished), so every position above is
valid; the scheduler ends a prefill chunk exactly at each one.
"""

from __future__ import annotations

import bisect

from ds4d.engine.request import EngineRequest


def checkpoint_positions(request: EngineRequest, *, every_tokens: int, block_size: int) -> tuple[int, ...]:
    """Sorted prompt positions strictly inside the prompt to checkpoint at."""
    n = len(request.prompt_ids)
    marks = set()
    tail = min(max(request.volatile_tail, 0), n)
    if tail:
        marks.add(n - tail)
    marks.add(request.stable_prefix)
    if every_tokens > 0:
        marks.update(range(every_tokens, n, every_tokens))
    kept = sorted(p for p in marks if 0 < p < n)
    starts = sorted({p for p in request.message_starts if 0 < p < n}, reverse=True)
    gap = max(every_tokens // 4, block_size)
    for rank, p in enumerate(starts):
        i = bisect.bisect_left(kept, p)
        near = min((abs(kept[j] - p) for j in (i - 1, i) if 0 <= j < len(kept)), default=gap)
        if rank == 0 or near >= gap:
            bisect.insort(kept, p)
    return tuple(sorted(set(kept)))
