"""Why a prompt did not reuse more of the prefix cache, in words (``PrefixCache.last_miss``).

Plain bookkeeping: the keys of blocks dropped from the last tier that held them
(bounded), and which cache salts each first block was seen under (bounded), so
a miss can say "evicted from the ram tier" or "cache salt differs" rather than
only "no match".
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence

_REMEMBER_KEYS = 65536
_REMEMBER_FIRST_BLOCKS = 4096


class MissLog:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.dropped_total = 0
        self._dropped: OrderedDict[bytes, str] = OrderedDict()  # key -> tier it was last evicted from
        self._first_block_salts: OrderedDict[bytes, set[str]] = OrderedDict()

    def dropped(self, key: bytes, tier: str) -> None:
        """Block ``key`` left ``tier``, the last one that held it."""
        self.dropped_total += 1
        self._dropped[key] = tier
        self._dropped.move_to_end(key)
        if len(self._dropped) > _REMEMBER_KEYS:
            self._dropped.popitem(last=False)

    def note_first_block(self, token_ids: Sequence[int], salt: str) -> None:
        if len(token_ids) < self.block_size:
            return
        plain = hashlib.sha256(repr(tuple(token_ids[:self.block_size])).encode()).digest()
        self._first_block_salts.setdefault(plain, set()).add(salt)
        self._first_block_salts.move_to_end(plain)
        if len(self._first_block_salts) > _REMEMBER_FIRST_BLOCKS:
            self._first_block_salts.popitem(last=False)

    def explain(self, token_ids: Sequence[int], keys: Sequence[bytes], limit: int, reused: int, salt: str, *,
                stateful_held: Callable[[bytes], bool] | None = None) -> str:
        """Why ``reused`` of at most ``limit`` blocks' tokens were reused ("" when all were);
        ``stateful_held`` (a model with per-sequence state): whether a tier holds a block."""
        bs = self.block_size
        if limit == 0 or reused >= limit * bs:
            return ""
        i = reused // bs
        if stateful_held is not None and stateful_held(keys[i]):
            why = (f"no state checkpoint at or after token {reused} that this prompt continues (a stateful "
                   "model resumes only where one was saved: request ends, the end of the system prompt, "
                   "message starts, every cache_checkpoint_every_tokens)")
        elif keys[i] in self._dropped:
            why = f"block {i} (tokens {i * bs}..{(i + 1) * bs - 1}) was evicted from the {self._dropped[keys[i]]} tier"
        elif i == 0:
            plain = hashlib.sha256(repr(tuple(token_ids[:bs])).encode()).digest()
            if self._first_block_salts.get(plain, set()) - {salt}:
                why = "cache salt differs: these tokens are cached under another API key or cache_salt"
            else:
                why = "no block matched: the first block was never cached"
        else:
            why = f"prefix diverged in block {i} (tokens {i * bs}..{(i + 1) * bs - 1}) from everything cached"
        return f"reused {reused} of {len(token_ids)} prompt tokens; {why}"
