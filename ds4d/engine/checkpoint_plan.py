"""Where, inside a prompt, a model with per-sequence state saves state checkpoints.

A stateful model (DeepSeek-V4) resumes a prompt only at a saved checkpoint
(``ds4d/cache/checkpoints.py``).  Besides the end of every prompt and every
generation (request boundaries, saved by the scheduler in any case), a prompt
is checkpointed where a later prompt is likely to part from it:

* before a volatile tail (``EngineRequest.volatile_tail``): the next turn renders
  the last tokens otherwise;
* at the end of the stable prefix (``EngineRequest.stable_prefix``: system prompt
  and tool declarations), which new sessions and subagents repeat;
* at message starts (``EngineRequest.message_starts``), the latest first, each
  kept when it lies at least a quarter of the periodic spacing (one block at
  least) from every other checkpoint and from where the prompt resumed (an
  agent's next turn resumes at the end of its previous one, a token or two
  before its new message starts: no second checkpoint there);
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


def checkpoint_positions(request: EngineRequest, *, every_tokens: int, block_size: int,
                         resumed_at: int = 0) -> tuple[int, ...]:
    """Sorted prompt positions past ``resumed_at`` (where reuse left the prompt) and before its
    end to checkpoint at."""
    n = len(request.prompt_ids)
    marks = {request.stable_prefix}
    tail = min(max(request.volatile_tail, 0), n)
    if tail:
        marks.add(n - tail)
    if every_tokens > 0:
        marks.update(range(every_tokens, n, every_tokens))
    kept = sorted(p for p in marks if resumed_at < p < n)
    near = sorted([*kept, resumed_at] if resumed_at else kept)
    gap = max(every_tokens // 4, block_size)
    for p in sorted((p for p in set(request.message_starts) if resumed_at < p < n), reverse=True):
        i = bisect.bisect_left(near, p)
        if all(abs(near[j] - p) >= gap for j in (i - 1, i) if 0 <= j < len(near)):
            bisect.insort(near, p)
            kept.append(p)
    return tuple(sorted(kept))
