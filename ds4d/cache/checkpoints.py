"""State checkpoints at request boundaries, for models with per-sequence state.

A model such as DeepSeek-V4 can only continue a sequence from position ``p``
if it has the sequence's state (sliding-window ring, compressor tails) at
exactly ``p``.  The engine saves one when a prompt has been computed (``p`` =
prompt length) and when a request ends (``p`` = prompt + generated tokens that
were fed back, i.e. all but the last sampled token), so an agent's next turn,
whose prompt repeats the previous prompt and reply, resumes at the end of the
previous turn.

A checkpoint is found through the block-hash chain: it is filed under the key
of its last *full* block (``anchor``; the salted namespace root when ``p`` is
inside the first block) together with the token ids of the partly filled block
after it (``tail``) and a copy of that block's KV (``partial``).  A lookup walks
the new prompt's matched blocks from the longest down and takes the first
checkpoint whose tail equals the prompt's tokens there, so a hit is exact:
every full block was verified token by token and the tail is compared here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Checkpoint:
    anchor: bytes
    tail: tuple[int, ...]
    num_tokens: int
    """Position the state is at (tokens 0 .. num_tokens-1 are in it)."""
    state: Any
    """What the model's save_state returned."""
    partial: Any | None
    """KV payload of the block holding the tail (None when the tail is empty)."""
    full_blocks: int
    """Whole blocks before the tail (their KV comes from the block cache)."""


class CheckpointStore:
    """An LRU of at most ``capacity`` checkpoints."""

    def __init__(self, capacity: int, block_size: int) -> None:
        self.capacity = capacity
        self.block_size = block_size
        self._items: OrderedDict[tuple[bytes, tuple[int, ...]], Checkpoint] = OrderedDict()
        self._by_anchor: dict[bytes, set[tuple[int, ...]]] = {}
        self.saved = 0
        self.used = 0

    def __len__(self) -> int:
        return len(self._items)

    def add(self, checkpoint: Checkpoint) -> None:
        if self.capacity <= 0:
            return
        ident = (checkpoint.anchor, checkpoint.tail)
        if ident in self._items:
            self._items.move_to_end(ident)
            return
        self._items[ident] = checkpoint
        self._by_anchor.setdefault(checkpoint.anchor, set()).add(checkpoint.tail)
        self.saved += 1
        while len(self._items) > self.capacity:
            (anchor, tail), _ = self._items.popitem(last=False)
            tails = self._by_anchor[anchor]
            tails.discard(tail)
            if not tails:
                del self._by_anchor[anchor]

    def find(self, token_ids: Sequence[int], keys: Sequence[bytes], root: bytes, *, max_full_blocks: int,
             max_tokens: int) -> Checkpoint | None:
        """The checkpoint reaching furthest into ``token_ids`` using at most ``max_full_blocks``
        of its leading (already verified) blocks and at most ``max_tokens`` tokens."""
        bs = self.block_size
        for j in range(min(max_full_blocks, len(keys)), -1, -1):
            anchor = keys[j - 1] if j else root
            tails = self._by_anchor.get(anchor)
            if not tails:
                continue
            best = None
            for tail in tails:
                end = j * bs + len(tail)
                if end > max_tokens or end == 0 or tuple(token_ids[j * bs:end]) != tail:
                    continue
                if best is None or len(tail) > len(best):
                    best = tail
            if best is not None:
                self._items.move_to_end((anchor, best))
                self.used += 1
                return self._items[(anchor, best)]
        return None
