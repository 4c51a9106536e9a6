"""State checkpoints, for models with per-sequence state, and how they move through the tiers.

A model such as DeepSeek-V4 can only continue a sequence from position ``p``
if it has the sequence's state (sliding-window ring, compressor tails) at
exactly ``p``.  The engine saves one where later prompts are likely to resume
(the scheduler's ``checkpoint_positions``: end of each prompt and generation,
end of the system prompt and tools, message boundaries, every N tokens).

A checkpoint is found through the block-hash chain: it is filed under the key
of its last *full* block (``anchor``; the salted namespace root when ``p`` is
inside the first block) together with the token ids of the partly filled block
after it (``tail``) and a copy of that block's KV (``partial``).  A lookup walks
the new prompt's matched blocks from the longest down and takes the first
checkpoint whose tail equals the prompt's tokens there, so a hit is exact:
every full block was verified token by token and the tail is compared here.

Where a checkpoint lives follows its blocks.  The :class:`CheckpointStore`
indexes every known checkpoint; at most ``capacity`` of them are *hot* (held
here, in host memory, LRU).  One leaves the hot set when its anchor block is
evicted from the KV pool (it goes down with its block) or when the hot set is
full; it is then packed into one payload (:func:`pack`) and stored in the cache
tiers like a block, under its own key (:func:`tier_key`) with its tail as the
token ids that a hit is verified against, so the RAM and disk budgets count it
and the disk tier checksums it.  A lookup that lands on a cold checkpoint reads
it back from the first tier holding it.  A checkpoint no tier holds any more,
or whose anchor block was dropped from the last tier, is forgotten.

With a persistent tier (disk), a graceful shutdown stores every checkpoint
there and writes the index (``checkpoints.json``: format version, model
compatibility hash, SHA-256 of the entries) to that tier's directory; the next
start reads it back and keeps the entries the tier still holds.  A file that
fails any check is deleted and logged, never used.  A snapshot that is not made
of tensors cannot be packed: it stays hot and is lost when it leaves.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ds4d.cache.tiers import payload_view, replace_file

log = logging.getLogger("ds4d.cache")

FILE_FORMAT = "ds4d-checkpoints"
FILE_VERSION = 2
PACK_MAGIC = b"DS4DCKP1"


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

    @property
    def ident(self) -> tuple[bytes, tuple[int, ...]]:
        return self.anchor, self.tail


@dataclass(frozen=True)
class CheckpointRef:
    """What the index knows of a checkpoint, hot or cold."""

    anchor: bytes
    tail: tuple[int, ...]
    num_tokens: int
    full_blocks: int
    key: bytes
    """Its key in the cache tiers (:func:`tier_key`)."""


def tier_key(anchor: bytes, tail: Sequence[int]) -> bytes:
    """The key a checkpoint is stored under in the tiers (never a block key: another prefix)."""
    h = hashlib.sha256(b"state-checkpoint")
    h.update(anchor)
    h.update(b",".join(str(t).encode() for t in tail))
    return h.digest()


def _ref(ckpt: Checkpoint) -> CheckpointRef:
    return CheckpointRef(ckpt.anchor, ckpt.tail, ckpt.num_tokens, ckpt.full_blocks, tier_key(ckpt.anchor, ckpt.tail))


class CheckpointStore:
    """The index of every known checkpoint, and an LRU of at most ``capacity`` hot ones."""

    def __init__(self, capacity: int, block_size: int) -> None:
        self.capacity = capacity
        self.block_size = block_size
        self._hot: OrderedDict[tuple[bytes, tuple[int, ...]], Checkpoint] = OrderedDict()
        self._refs: dict[tuple[bytes, tuple[int, ...]], CheckpointRef] = {}
        self._by_anchor: dict[bytes, set[tuple[int, ...]]] = {}
        self._by_key: dict[bytes, tuple[bytes, tuple[int, ...]]] = {}
        self.saved = 0
        self.used = 0
        self.demoted = 0
        self.promoted = 0

    def __len__(self) -> int:
        return len(self._refs)

    @property
    def num_hot(self) -> int:
        return len(self._hot)

    def hot_bytes(self) -> int:
        return sum(_nbytes(c.state) + _nbytes(c.partial) for c in self._hot.values())

    def hot(self) -> list[Checkpoint]:
        """The hot checkpoints, least recently used first."""
        return list(self._hot.values())

    def refs(self) -> list[CheckpointRef]:
        return list(self._refs.values())

    def is_checkpoint_key(self, key: bytes) -> bool:
        return key in self._by_key

    def add(self, checkpoint: Checkpoint, *, saved: bool = True) -> list[Checkpoint]:
        """Make ``checkpoint`` hot (the most recently used); the hot ones it pushed out (to store
        in the tiers)."""
        if self.capacity <= 0:
            return []
        ident = checkpoint.ident
        if ident not in self._refs:
            self.index(_ref(checkpoint))
            self.saved += saved
        self._hot[ident] = checkpoint
        self._hot.move_to_end(ident)
        out = []
        while len(self._hot) > self.capacity:
            out.append(self._hot.popitem(last=False)[1])
        return out

    def index(self, ref: CheckpointRef) -> None:
        """Know of a cold checkpoint (one stored in the tiers)."""
        ident = (ref.anchor, ref.tail)
        self._refs[ident] = ref
        self._by_anchor.setdefault(ref.anchor, set()).add(ref.tail)
        self._by_key[ref.key] = ident

    def cool(self, anchors: set[bytes]) -> list[Checkpoint]:
        """Take the hot checkpoints anchored at ``anchors`` (blocks leaving the pool) out of the
        hot set; they stay indexed (the caller stores them in the tiers)."""
        out = []
        for anchor in anchors:
            for tail in self._by_anchor.get(anchor, ()):
                ckpt = self._hot.pop((anchor, tail), None)
                if ckpt is not None:
                    out.append(ckpt)
        return out

    def forget(self, ident: tuple[bytes, tuple[int, ...]]) -> None:
        ref = self._refs.pop(ident, None)
        if ref is None:
            return
        self._hot.pop(ident, None)
        self._by_key.pop(ref.key, None)
        tails = self._by_anchor[ref.anchor]
        tails.discard(ref.tail)
        if not tails:
            del self._by_anchor[ref.anchor]

    def forget_key(self, key: bytes) -> None:
        """A tier dropped ``key`` for good: the checkpoint stored under it (if any) is gone, and so
        is every checkpoint anchored at it (a block key), which no prompt can reach any more."""
        if key in self._by_key:
            self.forget(self._by_key[key])
        for tail in list(self._by_anchor.get(key, ())):
            self.forget((key, tail))

    def ref(self, ident: tuple[bytes, tuple[int, ...]]) -> CheckpointRef | None:
        return self._refs.get(ident)

    def get_hot(self, ref: CheckpointRef) -> Checkpoint | None:
        return self._hot.get((ref.anchor, ref.tail))

    def find(self, token_ids: Sequence[int], keys: Sequence[bytes], root: bytes, *, max_full_blocks: int,
             max_tokens: int, reachable: Callable[[CheckpointRef], bool] = lambda ref: True,
             touch: bool = True) -> CheckpointRef | None:
        """The checkpoint reaching furthest into ``token_ids`` using at most ``max_full_blocks``
        of its leading (already verified) blocks and at most ``max_tokens`` tokens, hot or held by
        a tier (``reachable``).  With ``touch`` (a lookup that uses it) it is counted and, if hot,
        becomes the most recently used."""
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
                ref = self._refs[(anchor, tail)]
                if (anchor, tail) not in self._hot and not reachable(ref):
                    continue
                if best is None or len(tail) > len(best.tail):
                    best = ref
            if best is not None:
                if touch:
                    self.used += 1
                    if (anchor, best.tail) in self._hot:
                        self._hot.move_to_end((anchor, best.tail))
                return best
        return None


def _nbytes(x: Any) -> int:
    if x is None:
        return 0
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    if isinstance(x, (bytes, bytearray, memoryview)):
        return len(x)
    return 0


# --------------------------------------------------------------------------- one checkpoint as one payload


def _flatten(state: Any, tensors: list[torch.Tensor]) -> Any:
    """The nesting of ``state`` with each tensor replaced by its index in ``tensors``; None when
    ``state`` is not made of tensors and lists of them."""
    if isinstance(state, torch.Tensor):
        tensors.append(state)
        return len(tensors) - 1
    if isinstance(state, (list, tuple)):
        parts = [_flatten(x, tensors) for x in state]
        return None if any(p is None for p in parts) else parts
    return None


def _unflatten(shape: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(shape, int):
        return tensors[shape]
    return [_unflatten(x, tensors) for x in shape]


def pack(ckpt: Checkpoint) -> torch.Tensor | None:
    """``ckpt`` as one uint8 CPU tensor (a tier payload); None when its state is not tensors.

    Layout: ``PACK_MAGIC``, a u32 header length, the JSON header (anchor, tail, position, block
    count, the state's nesting, each tensor's dtype and shape), then each tensor's bytes."""
    tensors: list[torch.Tensor] = []
    nesting = _flatten(ckpt.state, tensors)
    if nesting is None:
        return None
    if ckpt.partial is not None:
        tensors.append(torch.frombuffer(bytearray(payload_view(ckpt.partial)), dtype=torch.uint8)
                       if not isinstance(ckpt.partial, torch.Tensor) else ckpt.partial)
    host = [t.detach().to("cpu").contiguous() for t in tensors]
    header = json.dumps({"anchor": ckpt.anchor.hex(), "tail": list(ckpt.tail), "num_tokens": ckpt.num_tokens,
                         "full_blocks": ckpt.full_blocks, "state": nesting, "partial": ckpt.partial is not None,
                         "tensors": [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in host]}).encode()
    parts = [torch.frombuffer(bytearray(PACK_MAGIC + len(header).to_bytes(4, "little") + header), dtype=torch.uint8)]
    parts += [t.reshape(-1).view(torch.uint8) for t in host if t.numel()]
    return torch.cat(parts)


def unpack(payload: Any, ref: CheckpointRef) -> Checkpoint | None:
    """The checkpoint packed in ``payload``; None when it is malformed or not the one ``ref`` names."""
    try:
        raw = payload_view(payload)
        if bytes(raw[:8]) != PACK_MAGIC:
            return None
        size = int.from_bytes(raw[8:12], "little")
        head = json.loads(bytes(raw[12:12 + size]))
        if (bytes.fromhex(head["anchor"]), tuple(head["tail"]), head["num_tokens"], head["full_blocks"]) != \
                (ref.anchor, ref.tail, ref.num_tokens, ref.full_blocks):
            return None
        data = torch.frombuffer(bytearray(raw[12 + size:]), dtype=torch.uint8)
        tensors, offset = [], 0
        for dtype, shape in head["tensors"]:
            kind = getattr(torch, dtype)
            n = torch.Size(shape).numel() * torch.empty((), dtype=kind).element_size()
            tensors.append(data[offset:offset + n].clone().view(kind).reshape(shape))  # aligned
            offset += n
        if offset != data.numel():
            return None
    except (ValueError, KeyError, TypeError, AttributeError, RuntimeError):
        return None
    partial = tensors.pop() if head["partial"] else None
    return Checkpoint(ref.anchor, ref.tail, ref.num_tokens, _unflatten(head["state"], tensors), partial,
                      ref.full_blocks)


# --------------------------------------------------------------------------- the index across restarts


def _entries_digest(entries: list) -> str:
    return hashlib.sha256(json.dumps(entries, sort_keys=True).encode()).hexdigest()


def save_index(refs: Sequence[CheckpointRef], path: Path, compat: bytes) -> int:
    """Write the index of ``refs`` (checkpoints stored in the persistent tier); how many."""
    entries = [{"anchor": r.anchor.hex(), "tail": list(r.tail), "num_tokens": r.num_tokens,
                "full_blocks": r.full_blocks} for r in refs]
    doc = {"format": FILE_FORMAT, "version": FILE_VERSION, "compat": compat.hex(), "entries": entries,
           "sha256": _entries_digest(entries)}
    if not replace_file(path, lambda tmp: tmp.write_text(json.dumps(doc)), "state checkpoint index", log):
        return 0
    return len(entries)


def load_index(path: Path, compat: bytes) -> list[CheckpointRef]:
    """The checkpoints listed in ``path``; a damaged or foreign file is deleted and logged."""
    if not path.exists():
        return []
    try:
        doc = json.loads(path.read_text())
        entries = doc.get("entries", [])
        problem = None
        if doc.get("format") != FILE_FORMAT or doc.get("version") != FILE_VERSION:
            problem = "not a ds4d checkpoint index of this version"
        elif doc.get("compat") != compat.hex():
            problem = "written for another model (compatibility hash differs)"
        elif doc.get("sha256") != _entries_digest(entries):
            problem = "checksum mismatch"
        refs = [] if problem else [
            CheckpointRef(bytes.fromhex(e["anchor"]), tuple(e["tail"]), e["num_tokens"], e["full_blocks"],
                          tier_key(bytes.fromhex(e["anchor"]), e["tail"])) for e in entries]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        problem, refs = f"unreadable ({type(exc).__name__}: {exc})", []
    if problem is not None:
        log.warning("state checkpoint index %s: deleting: %s", path, problem)
        path.unlink(missing_ok=True)
        return []
    return refs
