"""Disk promotions read ahead off the engine thread: the engine keeps stepping the running
requests while a waiting request's prefix blocks are read, then admits it with the disk hit."""

from __future__ import annotations

import logging
import threading

from ds4d.cache.blocks import BlockPool
from ds4d.cache.disk import HEADER, DiskTier
from ds4d.cache.manager import PrefixCache
from ds4d.engine.offline import OfflineEngine
from ds4d.engine.request import FinishReason
from tests.toy_model import reference_tokens
from tests.toy_state_model import ToyBlockModel, ToyStateModel, reference_state_tokens
from tests.unit.test_cache_engine import BLOCK_BYTES, BS, A, B, C, keys_of, serve
from tests.unit.test_engine import req

FILE_BYTES = HEADER.size + BS * 4 + BLOCK_BYTES


class HeldDiskTier(DiskTier):
    """A disk tier whose reads ahead wait until the test opens ``gate``."""

    def __init__(self, ctx, options) -> None:
        super().__init__(ctx, options)
        self.gate = threading.Event()

    def _load_ahead(self, key):
        self.gate.wait(60)
        return super()._load_ahead(key)


def make(disk_dir, *, num_blocks=32, tier=DiskTier, model=None, **disk_options):
    model = model or ToyBlockModel(BS)
    pool = BlockPool(num_blocks, BS)
    disk = tier(None, {"directory": str(disk_dir), "compat_hash": b"toy", "budget_bytes": 64 * FILE_BYTES,
                       **disk_options})
    cache = PrefixCache(pool, tiers=[disk], model=model, block_bytes=BLOCK_BYTES)
    engine = OfflineEngine(model, max_num_seqs=4, step_tokens=64, prefill_chunk=16, cache=cache, namespace=b"toy",
                           eos_token_ids=frozenset({0}))
    return engine, engine.outputs, disk


def a_on_disk(tmp_path) -> list[int]:
    """Serve A once and flush it to disk: a fresh engine on that directory has A's blocks on disk only."""
    engine, outputs, _ = make(tmp_path)
    cold = serve(engine, outputs, "a", A, n=4)[0]
    assert engine.flush_cache()
    return cold


def tokens_of(outputs, rid) -> list[int]:
    return [t for o in outputs if o.request_id == rid for t in o.new_token_ids]


def step_until_decoding(engine, outputs, rid) -> None:
    for _ in range(100):
        if tokens_of(outputs, rid):
            return
        engine.step()
    raise AssertionError(f"{rid} never started decoding")


def test_held_disk_read_does_not_stall_running_requests_and_the_hit_is_exact(tmp_path):
    cold = a_on_disk(tmp_path)
    assert cold == reference_tokens(A, 4)
    engine, outputs, disk = make(tmp_path, tier=HeldDiskTier)
    cache = engine.scheduler.cache
    engine.submit(req("long", B, 40))
    step_until_decoding(engine, outputs, "long")
    engine.submit(req("a2", A, 4))
    before = len(tokens_of(outputs, "long"))
    for _ in range(6):                          # the reads are held: "long" decodes on, "a2" waits
        engine.step()
    assert len(tokens_of(outputs, "long")) == before + 6
    a2 = {seq.request_id: seq for seq in engine.scheduler.waiting}["a2"]
    assert a2.state_slot is None and not tokens_of(outputs, "a2")
    promotions = cache.stats()["promotions"]
    assert promotions["pending_blocks"] == 3 and promotions["waiting_requests"] == 1
    assert promotions["completed_blocks"] == 0
    assert disk.stats()["pending_reads"] == 3
    assert {r.id: r.phase for r in engine.snapshot().active}["a2"] == "reading"
    disk.gate.set()
    steps = 0
    while engine.scheduler.has_work:
        engine.step()
        steps += 1
        assert steps < 100_000, "no progress"
    assert tokens_of(outputs, "a2") == cold
    assert tokens_of(outputs, "long") == reference_tokens(B, 40)
    final = [o for o in outputs if o.request_id == "a2"][-1]
    assert final.finish_reason is FinishReason.LENGTH
    assert final.cached_tokens == 12 and dict(final.cached_by_tier) == {"disk": 12}
    stats = cache.stats()
    assert stats["promotions"] == {"pending_blocks": 0, "waiting_requests": 0, "completed_blocks": 3,
                                   "background_read_bytes": 3 * FILE_BYTES}
    assert stats["tiers"]["disk"]["hits"] == 3 and stats["tiers"]["disk"]["background_reads"] == 3
    assert disk.stats()["pending_reads"] == 0 and disk._read_reserved == 0
    assert engine.scheduler.pool.num_free == engine.scheduler.pool.num_blocks


def test_abort_while_reading_leaks_nothing(tmp_path):
    cold = a_on_disk(tmp_path)
    engine, outputs, disk = make(tmp_path, tier=HeldDiskTier)
    cache, pool = engine.scheduler.cache, engine.scheduler.pool
    free_at_start = pool.num_free
    engine.submit(req("a2", A, 4))
    for _ in range(3):
        engine.step()
    assert cache.stats()["promotions"]["pending_blocks"] == 3
    engine.abort("a2")
    assert not engine.scheduler.has_work and "a2" not in {r.id for r in engine.snapshot().active}
    assert cache.stats()["promotions"]["pending_blocks"] == 0
    assert cache.stats()["promotions"]["waiting_requests"] == 0
    assert disk.stats()["pending_reads"] == 0 and pool.num_free == free_at_start
    disk.gate.set()                             # the cancelled reads end; nothing takes them
    assert serve(engine, outputs, "a3", A, n=4) == (cold, 12, {"disk": 12})
    disk.close()                                # waits for the reader threads
    assert disk._read_reserved == 0 and pool.num_free == free_at_start
    assert all(disk.contains(k) for k in keys_of(A))


def test_damaged_file_found_by_a_reader_is_a_logged_miss_as_before(tmp_path, caplog):
    cold = a_on_disk(tmp_path)
    engine, outputs, disk = make(tmp_path)
    damaged = disk.root / f"{keys_of(A)[1].hex()}.blk"
    raw = bytearray(damaged.read_bytes())
    raw[-1] ^= 0xFF
    damaged.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="ds4d.cache.disk"):
        assert serve(engine, outputs, "a2", A, n=4) == (cold, 4, {"disk": 4})   # block 0 only
    assert "checksum mismatch" in caplog.text and not damaged.exists()
    assert disk.stats()["damaged_files"] == 1 and not disk.contains(keys_of(A)[1])
    assert engine.scheduler.cache.stats()["promotions"]["pending_blocks"] == 0


def test_reads_past_the_memory_cap_are_read_at_admission(tmp_path):
    cold = a_on_disk(tmp_path)
    engine, outputs, disk = make(tmp_path, max_read_bytes=FILE_BYTES)
    assert serve(engine, outputs, "a2", A, n=4) == (cold, 12, {"disk": 12})
    s = disk.stats()
    assert s["background_reads"] == 1 and s["background_read_bytes"] == FILE_BYTES
    assert s["bytes_out"] == 3 * FILE_BYTES and disk._read_reserved == 0


def test_synchronous_reads_when_reads_ahead_are_off(tmp_path):
    cold = a_on_disk(tmp_path)
    engine, outputs, disk = make(tmp_path, tier=HeldDiskTier, background_reads=False)
    assert serve(engine, outputs, "a2", A, n=4) == (cold, 12, {"disk": 12})   # the held gate is never reached
    assert disk.stats()["background_reads"] == 0
    assert engine.scheduler.cache.stats()["promotions"]["completed_blocks"] == 0


def test_stateful_model_resumes_from_its_checkpoint_with_blocks_read_ahead(tmp_path):
    engine, outputs, disk = make(tmp_path, num_blocks=6, model=ToyStateModel(BS))
    turn1 = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    gen, _, _ = serve(engine, outputs, "t1", turn1, n=5)     # checkpoint at 14 tokens: 3 full blocks + 2
    serve(engine, outputs, "b", B)                            # push turn 1's blocks out of the pool
    serve(engine, outputs, "c", C)
    disk.drain()                                            # on disk, not in the write queue
    turn2 = turn1 + gen + [7, 7, 8, 8, 9, 9]
    gen2, cached, by_tier = serve(engine, outputs, "t2", turn2, n=4)
    assert gen2 == reference_state_tokens(turn2, 4)
    assert cached == 14 and by_tier == {"disk": 12, "gpu": 2}
    assert engine.scheduler.cache.stats()["promotions"]["completed_blocks"] == 3
    assert engine.scheduler.cache.stats()["checkpoints"]["used"] == 1   # the read-ahead lookup does not count
