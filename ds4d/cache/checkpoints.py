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

With a persistent tier (disk), a graceful shutdown also writes the checkpoints
to ``checkpoints.safetensors`` in that tier's directory (temporary file, then
rename) and the next start reads them back, so a restarted daemon resumes a
sequence from blocks on disk.  The file carries a format version, the model
compatibility hash and a SHA-256 over every tensor; a file that fails any check
is deleted and logged, never used.  Only snapshots made of tensors (as
DeepSeek-V4's are) are written.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ds4d.cache.tiers import replace_file

log = logging.getLogger("ds4d.cache")

FILE_FORMAT = "ds4d-checkpoints"
FILE_VERSION = 1


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

    def items(self) -> list[Checkpoint]:
        """Every checkpoint, least recently used first."""
        return list(self._items.values())

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
             max_tokens: int, touch: bool = True) -> Checkpoint | None:
        """The checkpoint reaching furthest into ``token_ids`` using at most ``max_full_blocks``
        of its leading (already verified) blocks and at most ``max_tokens`` tokens.  With
        ``touch`` (a lookup that uses it) it becomes the most recently used and is counted."""
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
                if touch:
                    self._items.move_to_end((anchor, best))
                    self.used += 1
                return self._items[(anchor, best)]
        return None


# --------------------------------------------------------------------------- persistence


def _tensors_of(state: Any) -> list[torch.Tensor] | None:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in state):
        return list(state)
    return None


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def save_checkpoints(store: CheckpointStore, path: Path, compat: bytes) -> int:
    """Write every checkpoint whose state is tensors to ``path``; how many were written."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    entries = []
    for ckpt in store.items():
        state = _tensors_of(ckpt.state)
        if state is None:
            continue
        n = len(entries)
        for j, t in enumerate(state):
            tensors[f"{n}.state.{j}"] = t.detach().to("cpu").contiguous().clone()
        if ckpt.partial is not None:
            raw = ckpt.partial if isinstance(ckpt.partial, torch.Tensor) else torch.frombuffer(
                bytearray(ckpt.partial), dtype=torch.uint8)
            tensors[f"{n}.partial"] = raw.to("cpu").contiguous().clone()
        entries.append({"anchor": ckpt.anchor.hex(), "tail": list(ckpt.tail), "num_tokens": ckpt.num_tokens,
                        "full_blocks": ckpt.full_blocks, "state": len(state),
                        "list": not isinstance(ckpt.state, torch.Tensor)})
    meta = {"format": FILE_FORMAT, "version": str(FILE_VERSION), "compat": compat.hex(),
            "entries": json.dumps(entries), "sha256": _digest(tensors)}
    if not replace_file(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta), "state checkpoints", log):
        return 0
    return len(entries)


def load_checkpoints(store: CheckpointStore, path: Path, compat: bytes) -> int:
    """Add the checkpoints saved in ``path`` to ``store``; a damaged or foreign file is deleted."""
    from safetensors import safe_open

    if not path.exists():
        return 0
    try:
        with safe_open(str(path), framework="pt") as fh:
            meta = fh.metadata() or {}
            tensors = {name: fh.get_tensor(name) for name in fh.keys()}  # noqa: SIM118 - not a dict
        problem = None
        if meta.get("format") != FILE_FORMAT or meta.get("version") != str(FILE_VERSION):
            problem = "not a ds4d checkpoint file of this version"
        elif meta.get("compat") != compat.hex():
            problem = "written for another model (compatibility hash differs)"
        elif meta.get("sha256") != _digest(tensors):
            problem = "checksum mismatch"
        entries = json.loads(meta.get("entries", "[]")) if problem is None else []
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types for a damaged file
        problem, entries = f"unreadable ({type(exc).__name__}: {exc})", []
    if problem is not None:
        log.warning("state checkpoints %s: deleting: %s", path, problem)
        path.unlink(missing_ok=True)
        return 0
    for n, e in enumerate(entries):
        state = [tensors[f"{n}.state.{j}"] for j in range(e["state"])]
        partial = tensors.get(f"{n}.partial")
        store.add(Checkpoint(bytes.fromhex(e["anchor"]), tuple(e["tail"]), e["num_tokens"],
                             state if e["list"] else state[0], partial, e["full_blocks"]))
    return len(entries)
