"""The prefix cache across tiers: lookup, promotion, demotion, checkpoints, accounting.

Plain bookkeeping around three collaborators: the :class:`BlockPool` (the
``gpu`` tier), the lower tiers fastest first (``ram``, ``disk``; any
:class:`~ds4d.contracts.CacheTier`), and the model, which copies blocks
(:class:`~ds4d.contracts.BlockCopyModel`) and, for models with per-sequence
state, saves and loads state (:class:`~ds4d.contracts.StatefulModel`).

* **Lookup** (``acquire``): the longest run of leading full blocks, each found
  in the first tier that holds it, every hit verified against its token ids.
  At least one prompt token is always left to compute (its logits give the next
  token).  A stateful model reuses only up to a state checkpoint
  (``checkpoints.py``).
* **Promotion**: blocks found below the pool get fresh pool blocks and are
  copied in; they stay in the tier that served them (inclusive tiers), so a
  later eviction costs no copy.
* **Reads ahead** (``prefetch``): before a waiting sequence is admitted, the
  blocks it would promote from a slow tier (disk,
  :class:`~ds4d.contracts.ReadAheadCacheTier`) are read on that tier's threads;
  the scheduler leaves the sequence waiting, and keeps stepping the running
  ones, until every read is done, then admits it through ``acquire``, whose
  promotion takes the loaded payloads.  Reads wanted by no waiting sequence any
  more (admitted, aborted, or now found higher up) are cancelled.
* **Demotion**: a block evicted from the pool is copied out before its new
  owner's forward step and stored in the first lower tier; what that tier
  evicts goes to the next; what the last tier evicts is gone.
* **Accounting**: per tier, block hits and misses (a miss is a lookup that
  reached the tier and did not find the block), bytes in and out, evictions;
  per request, reused tokens by tier; ``last_miss`` says in words why the
  latest request did not reuse everything it could have.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from ds4d.cache.blocks import BlockPool, PrefixMatch
from ds4d.cache.checkpoint_tiers import CheckpointTiers
from ds4d.cache.checkpoints import CheckpointRef, CheckpointStore
from ds4d.cache.misses import MissLog
from ds4d.cache.tiers import GpuTier
from ds4d.contracts import (
    AsyncBlockCopyModel,
    BlockCopyModel,
    CacheTier,
    DemotingCacheTier,
    ReadAheadCacheTier,
    StatefulModel,
)

log = logging.getLogger("ds4d.cache")

@dataclass
class Reuse:
    """What a new sequence starts with."""

    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0
    by_tier: dict[str, int] = field(default_factory=dict)
    lookups: dict[str, list[int]] = field(default_factory=dict)
    """Per tier [block hits, block misses] of this lookup (applied by :meth:`PrefixCache.commit`)."""
    why_not_more: str = ""
    """Why the lookup did not reuse everything it could have ("" when it did)."""


@dataclass(frozen=True)
class _Walk:
    """Where a prompt's leading blocks were found (:meth:`PrefixCache._walk`)."""

    gpu: PrefixMatch
    found: list[int]
    """Per block after the pool's match, the index of the first lower tier holding it."""
    limit: int
    """Blocks a lookup may reuse at most (one prompt token is always computed)."""
    ref: CheckpointRef | None
    """The checkpoint reuse resumes at (stateful models)."""
    use: int
    """Leading blocks worth taking."""
    room: int | None = None
    """How many of ``found`` the pool had room to promote, when fewer than all."""


class PrefixCache:
    def __init__(
        self,
        pool: BlockPool,
        *,
        tiers: Sequence[CacheTier] = (),
        model: Any = None,
        block_bytes: int = 0,
        checkpoints: int = 64,
        checkpoint_every_tokens: int = 0,
        gpu_tier: GpuTier | None = None,
        mem_available: Callable[[], int] | None = None,
        mem_watermark_bytes: int = 0,
    ) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.mover = model if isinstance(model, BlockCopyModel) else None
        self.state_model = model if isinstance(model, StatefulModel) else None
        self.stateful = self.state_model is not None
        live = [t for t in tiers if t.stats().get("budget_bytes", 1) > 0]
        if live and self.mover is None:
            log.warning("the model cannot copy KV blocks out of its pool: cache tiers %s are off",
                        ", ".join(t.name for t in live))
            live = []
        self.tiers = live
        self.gpu = gpu_tier or GpuTier(None, {})
        self.gpu.bind(pool, block_bytes)
        pool.keep_evicted = True  # demoted to the tiers, or remembered to explain a later miss
        self.checkpoints = CheckpointTiers(CheckpointStore(checkpoints if self.stateful else 0, self.block_size),
                                           state_model=self.state_model, mover=self.mover, tiers=self.tiers,
                                           put=lambda key, tokens, payload: self._put_chain(0, key, tokens, payload))
        self.checkpoint_every_tokens = _every(checkpoint_every_tokens, self.block_size) if self.stateful else 0
        """Periodic checkpoint spacing of a long prefill (a multiple of the block size; 0 = none)."""
        self.mem_available = mem_available
        self.mem_watermark_bytes = mem_watermark_bytes
        self._mem_checked = 0.0
        self.counters = {name: {"hits": 0, "misses": 0, "tokens": 0} for name in self.tier_names}
        self.cached_tokens_total = 0
        self.last_miss = ""
        self.misses = MissLog(self.block_size)
        self._pending: list[tuple[bytes, tuple[int, ...], Any]] = []
        self._copying: list[tuple[list[tuple[bytes, tuple[int, ...]]], list[Any], Any]] = []
        """Evicted blocks whose copy out of the pool is still under way: (keys and tokens, payloads,
        done handle), oldest first (``AsyncBlockCopyModel``)."""
        self.async_export = isinstance(model, AsyncBlockCopyModel)
        self.copies = {"promoted_blocks": 0, "promote_seconds": 0.0, "demoted_blocks": 0, "demote_seconds": 0.0}
        """Blocks copied into the pool from lower tiers and out of it, and the engine thread's time
        spent on each (reads from the tiers and the model's import; the model's export and the puts)."""
        self.reads_ahead = any(isinstance(t, ReadAheadCacheTier) for t in self.tiers)
        self._reads_of: dict[str, dict[bytes, tuple[ReadAheadCacheTier, Future]]] = {}  # owner -> its reads
        self._read_owners: dict[bytes, set[str]] = {}  # key read ahead -> waiting owners
        self.promotions_completed = 0

    @property
    def tier_names(self) -> list[str]:
        return ["gpu", *(t.name for t in self.tiers)]

    @property
    def reusable(self) -> bool:
        """Prefix reuse is possible with this model (stateful ones need block copies too)."""
        return self.pool.prefix_caching and (not self.stateful or self.mover is not None)

    # ------------------------------------------------------------------ lookup and promotion

    def acquire(self, token_ids: Sequence[int], keys: Sequence[bytes], namespace: bytes, salt: str,
                slot: int) -> Reuse:
        """Take every reusable leading block for a new sequence (state loaded into ``slot``)."""
        bs = self.block_size
        self.misses.note_first_block(token_ids, salt)
        walk = self._walk(token_ids, keys, namespace)
        lookups = self._count(walk.gpu.num_blocks, walk.found, walk.limit)
        ckpt, ckpt_tier = None, ""
        while walk.ref is not None:
            ckpt, ckpt_tier = self.checkpoints.fetch(walk.ref)
            if ckpt is not None:
                break
            walk = self._walk(token_ids, keys, namespace)  # that one could not be read back: the next best
        gpu, found, use = walk.gpu, walk.found, walk.use
        shared = gpu.block_ids[:use]
        self.pool.acquire(PrefixMatch(shared, list(keys[:len(shared)])))
        extra = 1 if ckpt is not None and ckpt.partial is not None else 0
        promoted, blank = self._promote(token_ids, keys, len(shared), found[:use - len(shared)], extra=extra)
        self.checkpoints.settle()
        blocks = shared + promoted
        by_tier = {"gpu": len(shared) * bs}
        for t in found[:len(promoted)]:
            by_tier[self.tiers[t].name] = by_tier.get(self.tiers[t].name, 0) + bs
        if ckpt is not None:
            if len(blocks) == ckpt.full_blocks and (blank is not None or not extra):
                if blank is not None:
                    self.mover.import_blocks([blank], [ckpt.partial])
                    blocks.append(blank)
                self.state_model.load_state(slot, ckpt.state)
                by_tier[ckpt_tier] = by_tier.get(ckpt_tier, 0) + len(ckpt.tail)
            else:
                if blank is not None:
                    self.pool.release([blank])
                ckpt = None
        if self.stateful and ckpt is None and blocks:  # blocks without a state at their end are no use
            self.pool.release(blocks)
            blocks, by_tier = [], {}
        num_tokens = ckpt.num_tokens if ckpt is not None else len(blocks) * bs
        why = self.misses.explain(token_ids, keys, walk.limit, num_tokens, salt,
                                 stateful_held=self._held if self.stateful else None)
        if why and walk.room is not None:
            why += (f" (the KV pool had room to promote only {walk.room} of the {len(walk.found)} blocks "
                    "held below it)")
        return Reuse(blocks, num_tokens, {k: v for k, v in by_tier.items() if v}, lookups, why)

    def _walk(self, token_ids: Sequence[int], keys: Sequence[bytes], namespace: bytes, *,
              touch: bool = True) -> _Walk:
        """Where the prompt's leading blocks are: the pool's match, then per further block the
        index of the first lower tier holding it; the block limit; the checkpoint (stateful
        models); and how many leading blocks are worth taking.  A stateful model looks for a
        checkpoint among the blocks the pool has room to promote (an earlier one, say a
        periodic one, when the pool cannot take every block below it)."""
        limit = min((len(token_ids) - 1) // self.block_size, len(keys))
        gpu = self.pool.match(token_ids, keys[:limit])
        found: list[int] = []  # index into self.tiers, per block after the pool's
        for i in range(gpu.num_blocks, limit):
            where = next((t for t, tier in enumerate(self.tiers) if tier.contains(keys[i])), None)
            if where is None:
                break
            found.append(where)
        if not self.stateful:
            return _Walk(gpu, found, limit, None, gpu.num_blocks + len(found))
        room = max(self.pool.num_free - sum(self.pool.ref_count(b) == 0 for b in gpu.block_ids) - 1, 0)
        available = gpu.num_blocks + min(len(found), room)
        ref = self.checkpoints.find(token_ids, keys, namespace, max_full_blocks=available, touch=touch)
        return _Walk(gpu, found, limit, ref, ref.full_blocks if ref else 0, room if room < len(found) else None)

    def room_to_resume(self, token_ids: Sequence[int], keys: Sequence[bytes], namespace: bytes) -> bool:
        """False when a stateful model's furthest checkpoint for this prompt lies past the blocks the
        pool has room to promote now (admitted now, it would resume earlier, or not at all)."""
        if not self.stateful:
            return True
        walk = self._walk(token_ids, keys, namespace, touch=False)
        if walk.room is None:
            return True
        best = self.checkpoints.find(token_ids, keys, namespace, touch=False,
                                     max_full_blocks=walk.gpu.num_blocks + len(walk.found))
        return best is None or (walk.ref is not None and best.num_tokens <= walk.ref.num_tokens)

    def commit(self, reuse: Reuse) -> None:
        """Account a lookup whose sequence was admitted (a sequence sent back to wait for
        blocks looks up again later; only the lookup that sticks is counted)."""
        for name, (hits, misses) in reuse.lookups.items():
            self.counters[name]["hits"] += hits
            self.counters[name]["misses"] += misses
        for name, n in reuse.by_tier.items():
            self.counters[name]["tokens"] += n
        self.cached_tokens_total += reuse.num_tokens
        if reuse.why_not_more:
            self.last_miss = reuse.why_not_more

    def _promote(self, token_ids, keys, start: int, found: list[int], *,
                 extra: int) -> tuple[list[int], int | None]:
        """Copy the blocks found below the pool into fresh pool blocks; with ``extra``, one
        more blank block (returned second, or None) once every found block made it."""
        if not found and not extra:
            return [], None
        bs = self.block_size
        fresh = self.pool.allocate(len(found) + extra)
        if fresh is None:
            return [], None
        began = time.perf_counter()
        payloads = []
        for n, t in enumerate(found):
            i = start + n
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            payload = None
            for tier in self.tiers[t:]:
                payload = tier.get(keys[i], tokens)
                if payload is not None:
                    break
            if payload is not None and keys[i] in self._read_owners:
                self.promotions_completed += 1
            if payload is None:
                break
            payloads.append(payload)
        got = time.perf_counter()
        self._export_evicted()  # the fresh blocks may have held cached KV: copy it out first
        if payloads:
            imported = time.perf_counter()
            self.mover.import_blocks(fresh[:len(payloads)], payloads)
            for n, block in enumerate(fresh[:len(payloads)]):
                i = start + n
                self.pool.register(block, keys[i], token_ids[i * bs:(i + 1) * bs])
            self.copies["promoted_blocks"] += len(payloads)
            self.copies["promote_seconds"] += got - began + time.perf_counter() - imported
        self._store_pending()
        blank = fresh[len(found)] if extra and len(payloads) == len(found) else None
        unused = [b for b in fresh[len(payloads):] if b != blank]
        if unused:
            self.pool.release(unused)
        return fresh[:len(payloads)], blank

    # ------------------------------------------------------------------ reads ahead

    def prefetch(self, owner: str, token_ids: Sequence[int], keys: Sequence[bytes], namespace: bytes) -> bool:
        """Start background reads of the blocks a waiting sequence (``owner``) would promote from
        a tier that reads ahead; True when none of them is still in flight (admit it now)."""
        if not self.reads_ahead:
            return True
        walk = self._walk(token_ids, keys, namespace, touch=False)
        gpu, found, use = walk.gpu, walk.found, walk.use
        wanted: dict[bytes, tuple[ReadAheadCacheTier, Future]] = {}
        for n, t in enumerate(found[:max(0, use - gpu.num_blocks)]):
            tier, key = self.tiers[t], keys[gpu.num_blocks + n]
            if isinstance(tier, ReadAheadCacheTier) and (future := tier.read_ahead(key)) is not None:
                wanted[key] = (tier, future)
        if walk.ref is not None and (tier := self.checkpoints.stored_in(walk.ref)) is not None:
            if isinstance(tier, ReadAheadCacheTier) and (future := tier.read_ahead(walk.ref.key)) is not None:
                wanted[walk.ref.key] = (tier, future)  # the state checkpoint, when it is not hot
        before = self._reads_of.pop(owner, {})
        for key in wanted:
            self._read_owners.setdefault(key, set()).add(owner)
        if wanted:
            self._reads_of[owner] = wanted
        for key in before.keys() - wanted.keys():
            self._unwant(owner, key, before[key][0])
        return all(future.done() for _, future in wanted.values())

    def release_reads(self, owner: str) -> None:
        """``owner`` was admitted or removed: cancel its reads ahead that nobody else waits for
        (those its promotion took are gone already)."""
        for key, (tier, _) in self._reads_of.pop(owner, {}).items():
            self._unwant(owner, key, tier)

    def _unwant(self, owner: str, key: bytes, tier: ReadAheadCacheTier) -> None:
        owners = self._read_owners.get(key)
        if owners is None:
            return
        owners.discard(owner)
        if not owners:
            del self._read_owners[key]
            tier.cancel_read(key)

    def reading(self, owner: str) -> bool:
        """``owner`` waits for a read ahead still in flight."""
        return any(not future.done() for _, future in self._reads_of.get(owner, {}).values())

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, token_ids: Sequence[int], keys: Sequence[bytes], namespace: bytes,
                        block_ids: Sequence[int], slot: int) -> None:
        """Checkpoint a sequence whose first ``len(token_ids)`` tokens are in its KV and ``slot``."""
        if self.stateful and self.mover is not None:
            self.checkpoints.save(token_ids, keys, namespace, block_ids, slot)

    # ------------------------------------------------------------------ demotion

    def after_plan(self) -> None:
        """Copy out what the plan's allocations evicted, before the step overwrites it."""
        self._export_evicted()
        self._store_pending()

    def _export_evicted(self) -> None:
        evicted = self.pool.take_evicted()
        if not evicted:
            return
        self.checkpoints.cool({key for _, key, _ in evicted})  # they go down with their anchor blocks
        if not self.tiers:
            for _, key, _ in evicted:
                self._remember_dropped(key, "gpu")
            return
        first = self.tiers[0]
        todo = [(b, k, t) for b, k, t in evicted if not first.contains(k)]
        if todo:
            began = time.perf_counter()
            ids, entries = [b for b, _, _ in todo], [(k, t) for _, k, t in todo]
            if self.async_export:
                payloads, done = self.mover.start_export(ids)
            else:
                payloads, done = self.mover.export_blocks(ids), None
            self._copying.append((entries, payloads, done))
            self.copies["demoted_blocks"] += len(todo)
            self.copies["demote_seconds"] += time.perf_counter() - began

    def _collect_copies(self, *, wait: bool = False) -> None:
        """Queue for the tiers the evicted blocks whose copies are complete (all with ``wait``)."""
        while self._copying:
            entries, payloads, done = self._copying[0]
            if done is not None and not wait and not done.query():
                break
            if done is not None:
                done.synchronize()
            self._copying.pop(0)
            self._pending += [(k, t, p) for (k, t), p in zip(entries, payloads)]

    def _store_pending(self, *, wait: bool = False) -> None:
        self._collect_copies(wait=wait)
        pending, self._pending = self._pending, []
        self._shed_if_low_memory()
        if not pending:
            return
        began = time.perf_counter()
        for key, tokens, payload in pending:
            self._put_chain(0, key, tokens, payload)
        self.copies["demote_seconds"] += time.perf_counter() - began

    def _put_chain(self, index: int, key: bytes, tokens: tuple[int, ...], payload: Any) -> None:
        if index >= len(self.tiers):
            self._remember_dropped(key, self.tier_names[index])
            return
        tier = self.tiers[index]
        if not tier.put(key, tokens, payload):
            self._put_chain(index + 1, key, tokens, payload)  # too big for this tier: try the next
            return
        self._cascade(index)

    def _cascade(self, index: int) -> None:
        tier = self.tiers[index]
        if not isinstance(tier, DemotingCacheTier):
            return
        for entry in tier.take_evicted():
            below = self.tiers[index + 1] if index + 1 < len(self.tiers) else None
            if below is None or entry.payload is None:
                self._remember_dropped(entry.key, tier.name)
            elif not below.contains(entry.key):
                self._put_chain(index + 1, entry.key, entry.token_ids, entry.payload)

    def _shed_if_low_memory(self) -> None:
        if self.mem_available is None or not self.tiers or self.tiers[0].name != "ram":
            return
        now = time.monotonic()
        if now - self._mem_checked < 1.0:
            return
        self._mem_checked = now
        short = self.mem_watermark_bytes - self.mem_available()
        if short > 0:
            freed = self.tiers[0].evict(short)
            if freed:
                log.warning("host MemAvailable below the watermark: RAM cache tier shed %d bytes", freed)
            self._cascade(0)

    def flush(self) -> None:
        """At shutdown: copy the pool's hashed blocks and the upper tiers into the last,
        persistent tier (disk), then close every tier.  Engine thread stopped."""
        self._store_pending(wait=True)  # evicted blocks still being copied out of the pool
        target = self.tiers[-1] if self.tiers and self.tiers[-1].stats().get("persistent") else None
        if target is not None:
            written = 0
            for tier in self.tiers[:-1]:
                if isinstance(tier, DemotingCacheTier):
                    for entry in tier.entries():
                        if not target.contains(entry.key) and target.put(entry.key, entry.token_ids, entry.payload):
                            written += 1
            todo = [(b, k, t) for b, k, t in self.pool.keyed_blocks() if not target.contains(k)]
            for n in range(0, len(todo), 64):
                part = todo[n:n + 64]
                for (_, key, tokens), payload in zip(part, self.mover.export_blocks([b for b, _, _ in part])):
                    written += target.put(key, tokens, payload)
            log.info("prefix cache: flushed %d blocks to the %s tier", written, target.name)
        self.checkpoints.flush(target)
        for tier in self.tiers:
            if isinstance(tier, DemotingCacheTier):
                tier.close()

    # ------------------------------------------------------------------ accounting

    def _count(self, in_pool: int, found: list[int], limit: int) -> dict[str, list[int]]:
        c = {name: [0, 0] for name in self.tier_names}
        c["gpu"][0] += in_pool
        for t in found:
            c["gpu"][1] += 1
            for name in self.tier_names[1:t + 1]:
                c[name][1] += 1
            c[self.tiers[t].name][0] += 1
        if in_pool + len(found) < limit:
            for name in self.tier_names:
                c[name][1] += 1
        return c if limit else {}

    def _remember_dropped(self, key: bytes, tier: str) -> None:
        was_checkpoint = self.checkpoints.store.is_checkpoint_key(key)
        self.checkpoints.dropped(key)  # a checkpoint, or the block those after it are anchored at
        if not was_checkpoint:
            self.misses.dropped(key, tier)

    def note_miss(self, reason: str) -> None:
        self.last_miss = reason

    def _held(self, key: bytes) -> bool:
        return self.pool.has_key(key) or any(t.contains(key) for t in self.tiers)

    def stats(self) -> dict:
        tiers = {}
        for name, tier in [("gpu", self.gpu), *((t.name, t) for t in self.tiers)]:
            s = dict(tier.stats())
            c = self.counters[name]
            looked = c["hits"] + c["misses"]
            tiers[name] = {**s, "hits": c["hits"], "misses": c["misses"], "cached_tokens": c["tokens"],
                           "hit_rate": round(c["hits"] / looked, 4) if looked else 0.0}
        promotions = {"pending_blocks": len(self._read_owners),
                      "waiting_requests": sum(self.reading(owner) for owner in list(self._reads_of)),
                      "completed_blocks": self.promotions_completed,
                      "background_read_bytes": sum(tiers[t.name].get("background_read_bytes", 0)
                                                   for t in self.tiers if isinstance(t, ReadAheadCacheTier))}
        return {"tiers": tiers, "last_miss": self.last_miss, "cached_tokens_total": self.cached_tokens_total,
                "dropped_blocks_total": self.misses.dropped_total, "promotions": promotions,
                "copies": {k: round(v, 4) if isinstance(v, float) else v for k, v in self.copies.items()},
                "checkpoints": {**self.checkpoints.stats(), "every_tokens": self.checkpoint_every_tokens}
                if self.stateful else None}


def _every(tokens: int, block_size: int) -> int:
    """``tokens`` rounded up to a whole number of blocks (a periodic checkpoint needs no partial block)."""
    return -(-max(tokens, 0) // block_size) * block_size
