"""State checkpoints across the cache tiers: saving, finding, demoting, promoting, persisting.

The prefix cache (``manager.py``) hands this the model's state calls and the
tier chain; the rules of where a checkpoint lives are in ``checkpoints.py``.
Every move is bookkeeping on the engine thread: a checkpoint is host memory
from the moment it is saved, so demoting one is packing it into one payload
and storing it in the first tier that takes it (the prefix cache's
``put`` chain, which hands what a tier evicts to the next tier down).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ds4d.cache.checkpoints import (
    Checkpoint,
    CheckpointRef,
    CheckpointStore,
    load_index,
    pack,
    save_index,
    unpack,
)
from ds4d.contracts import CacheTier

log = logging.getLogger("ds4d.cache")

INDEX_FILE = "checkpoints.json"


class CheckpointTiers:
    def __init__(self, store: CheckpointStore, *, state_model: Any, mover: Any, tiers: Sequence[CacheTier],
                 put: Callable[[bytes, tuple[int, ...], Any], None]) -> None:
        self.store = store
        self.block_size = store.block_size
        self.state_model = state_model
        self.mover = mover
        self.tiers = list(tiers)
        self.put = put
        """Store a payload in the tier chain from the top (the prefix cache's demotion path)."""
        self._later: list[Checkpoint] = []
        self.index_file = self._index_file()
        if self.index_file is not None:
            refs = [r for r in load_index(*self.index_file) if self.tiers[-1].contains(r.key)]
            for ref in refs:
                store.index(ref)
            if refs:
                log.info("prefix cache: %d state checkpoints indexed from %s", len(refs), self.index_file[0])
            old = self.index_file[0].with_name("checkpoints.safetensors")  # before checkpoints were tier entries
            if old.exists():
                log.info("prefix cache: removing %s, written by an earlier version", old)
                old.unlink(missing_ok=True)

    def _index_file(self) -> tuple[Path, bytes] | None:
        """Where the persistent tier's checkpoints are indexed across restarts (path, compat hash)."""
        if self.store.capacity <= 0 or not self.tiers:
            return None
        last = self.tiers[-1]
        root, compat = getattr(last, "root", None), getattr(last, "compat_hash", None)
        if not last.stats().get("persistent") or root is None or compat is None:
            return None
        return Path(root) / INDEX_FILE, compat

    def root(self, namespace: bytes) -> bytes:
        return hashlib.sha256(b"checkpoint-root" + namespace).digest()

    # ------------------------------------------------------------------ saving and finding

    def save(self, token_ids: Sequence[int], keys: Sequence[bytes], namespace: bytes, block_ids: Sequence[int],
             slot: int) -> None:
        """Checkpoint a sequence whose first ``len(token_ids)`` tokens are in its KV and ``slot``."""
        if self.store.capacity <= 0 or not token_ids:
            return
        bs = self.block_size
        full = len(token_ids) // bs
        tail = tuple(token_ids[full * bs:])
        anchor = keys[full - 1] if full else self.root(namespace)
        partial = self.mover.export_blocks([block_ids[full]])[0] if tail else None
        state = _to_host(self.state_model.save_state(slot))
        self._demote(self.store.add(Checkpoint(anchor, tail, len(token_ids), state, partial, full)))

    def reachable(self, ref: CheckpointRef) -> bool:
        return any(t.contains(ref.key) for t in self.tiers)

    def stored_in(self, ref: CheckpointRef) -> CacheTier | None:
        """The tier a lookup would read ``ref`` from (None when it is hot, or held nowhere)."""
        if self.store.get_hot(ref) is not None:
            return None
        return next((t for t in self.tiers if t.contains(ref.key)), None)

    def find(self, token_ids: Sequence[int], keys: Sequence[bytes], namespace: bytes, *, max_full_blocks: int,
             touch: bool = True) -> CheckpointRef | None:
        return self.store.find(token_ids, keys, self.root(namespace), max_full_blocks=max_full_blocks,
                               max_tokens=len(token_ids) - 1, reachable=self.reachable, touch=touch)

    def settle(self) -> None:
        """Store what :meth:`fetch` pushed out of the hot set (after the blocks it goes with were
        read from the tiers: storing it first could evict them)."""
        later, self._later = self._later, []
        self._demote(later)

    def fetch(self, ref: CheckpointRef) -> tuple[Checkpoint | None, str]:
        """The checkpoint ``ref`` names and the tier it came from ("gpu" for a hot one: it sits
        beside the pool).  A cold one read back becomes hot; one no tier can give back intact is
        forgotten (None)."""
        hot = self.store.get_hot(ref)
        if hot is not None:
            return hot, "gpu"
        for tier in self.tiers:
            if not tier.contains(ref.key):
                continue
            payload = tier.get(ref.key, ref.tail)
            ckpt = unpack(payload, ref) if payload is not None else None
            if ckpt is not None:
                self.store.promoted += 1
                self._later += self.store.add(ckpt, saved=False)  # stored after the promotion reads its blocks
                return ckpt, tier.name
            log.warning("state checkpoint at token %d: the %s tier gave back no intact copy", ref.num_tokens,
                        tier.name)
        self.store.forget((ref.anchor, ref.tail))
        return None, ""

    # ------------------------------------------------------------------ demotion

    def cool(self, evicted_keys: set[bytes]) -> None:
        """Blocks left the pool: the hot checkpoints anchored at them go down with them."""
        if evicted_keys and self.store.num_hot:
            self._demote(self.store.cool(evicted_keys), cooling=True)

    def _demote(self, checkpoints: list[Checkpoint], *, cooling: bool = False) -> None:
        """Store ``checkpoints`` (out of the hot set) in the tiers.  One that cannot be packed is
        lost, unless it is ``cooling`` (its blocks left the pool and may come back from a tier):
        then it stays hot until more recent ones push it out."""
        for ckpt in checkpoints:
            ref = self.store.ref(ckpt.ident)
            if ref is None or self.reachable(ref):
                continue  # forgotten meanwhile, or a tier still holds it (it was promoted from there)
            payload = pack(ckpt) if self.tiers else None
            if payload is None and cooling and self.tiers:
                self._demote(self.store.add(ckpt, saved=False))
                continue
            if payload is None:
                self.store.forget(ckpt.ident)
                continue
            self.store.demoted += 1
            self.put(ref.key, ref.tail, payload)
            if not self.reachable(ref):
                self.store.forget(ckpt.ident)  # no tier took it

    def dropped(self, key: bytes) -> None:
        """The last tier dropped ``key`` (a block or a checkpoint)."""
        self.store.forget_key(key)

    # ------------------------------------------------------------------ shutdown

    def flush(self, target: CacheTier | None) -> None:
        """Store every hot checkpoint in the persistent tier ``target`` and write the index of
        those it holds.  Upper tiers' checkpoints are flushed with their blocks."""
        if self.index_file is None or target is None:
            return
        for ckpt in self.store.hot():
            ref = self.store.ref(ckpt.ident)
            if ref is not None and not target.contains(ref.key) and (payload := pack(ckpt)) is not None:
                target.put(ref.key, ref.tail, payload)
        refs = [r for r in self.store.refs() if target.contains(r.key)]
        saved = save_index(refs, *self.index_file)
        log.info("prefix cache: %d state checkpoints written to the %s tier, indexed in %s", saved, target.name,
                 self.index_file[0])

    def stats(self) -> dict:
        s = self.store
        return {"count": len(s), "hot": s.num_hot, "hot_bytes": s.hot_bytes(), "saved": s.saved, "used": s.used,
                "demoted": s.demoted, "promoted": s.promoted}


def _to_host(snapshot: Any) -> Any:
    """A state snapshot with its device tensors copied to host memory (pinned with CUDA), so
    checkpoints do not hold GPU memory the plan did not count; load_state copies them back."""
    if isinstance(snapshot, torch.Tensor):
        if snapshot.device.type == "cpu":
            return snapshot
        host = torch.empty(snapshot.shape, dtype=snapshot.dtype, pin_memory=True)
        return host.copy_(snapshot)
    if isinstance(snapshot, (list, tuple)):
        return type(snapshot)(_to_host(x) for x in snapshot)
    return snapshot
