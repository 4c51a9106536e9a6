"""The prefix cache through the engine on toy models: demotion, promotion, restart, accounting."""

from __future__ import annotations

from ds4d.cache.blocks import BlockPool, block_keys
from ds4d.cache.disk import DiskTier
from ds4d.cache.manager import PrefixCache
from ds4d.cache.ram import RamTier
from ds4d.engine.offline import OfflineEngine
from ds4d.engine.request import EngineRequest, SamplingParams
from tests.toy_model import reference_tokens
from tests.toy_state_model import ToyAsyncBlockModel, ToyBlockModel
from tests.unit.test_engine import req, run

BS = 4
BLOCK_BYTES = BS * 8


def make(num_blocks=8, ram_blocks=0, disk_dir=None, disk_blocks=0, model=None, prefix=True, checkpoints=8,
         max_num_seqs=4):
    model = model or ToyBlockModel(BS)
    pool = BlockPool(num_blocks, BS, prefix_caching=prefix)
    tiers = []
    if ram_blocks:
        tiers.append(RamTier(None, {"budget_bytes": ram_blocks * BLOCK_BYTES}))
    if disk_dir is not None:
        from ds4d.cache.disk import HEADER
        tiers.append(DiskTier(None, {"directory": str(disk_dir), "compat_hash": b"toy",
                                     "budget_bytes": disk_blocks * (HEADER.size + BS * 4 + BLOCK_BYTES)}))
    cache = PrefixCache(pool, tiers=tiers, model=model, block_bytes=BLOCK_BYTES, checkpoints=checkpoints)
    engine = OfflineEngine(model, max_num_seqs=max_num_seqs, step_tokens=64, prefill_chunk=16, cache=cache,
                           namespace=b"toy", eos_token_ids=frozenset({0}))
    return engine, engine.outputs, model


def serve(engine, outputs, rid, prompt, n=2, **kw):
    outputs.clear()
    tokens, _, _ = run(engine, outputs, [req(rid, prompt, n, **kw)])
    final = [o for o in outputs if o.request_id == rid][-1]
    return tokens[rid], final.cached_tokens, dict(final.cached_by_tier)


def keys_of(prompt, salt=b""):
    return block_keys(prompt, BS, b"toy" + salt)


A = list(range(1, 14))        # 13 tokens: 3 full blocks reusable (one token left to compute)
B = [40 + i for i in range(13)]
C = [20 + i for i in range(13)]


def test_pool_evictions_are_demoted_to_ram_in_lru_order_and_promoted_back():
    engine, outputs, model = make(num_blocks=5, ram_blocks=16)
    cache = engine.scheduler.cache
    ram = cache.tiers[0]
    assert serve(engine, outputs, "a", A)[0] == reference_tokens(A, 2)
    # A finished: its 3 full blocks (keys of A[:12]) are cached in the pool, tail first in the LRU
    serve(engine, outputs, "b", B)
    # B needed 4 blocks from a pool of 5 holding 3 cached ones: the tail block of A went first
    assert [e.key for e in ram.entries()] == keys_of(A)[2:0:-1]
    tokens, cached, by_tier = serve(engine, outputs, "a2", A)
    assert tokens == reference_tokens(A, 2)
    assert cached == 12 and by_tier == {"gpu": 4, "ram": 8}
    assert model.imported and len(model.imported) == 2
    stats = cache.stats()["tiers"]
    assert stats["ram"]["hits"] == 2 and stats["gpu"]["hits"] == 1
    assert stats["ram"]["bytes_out"] == 2 * BLOCK_BYTES


def test_ram_overflow_goes_to_disk_and_disk_hits_are_exact(tmp_path):
    engine, outputs, _ = make(num_blocks=5, ram_blocks=1, disk_dir=tmp_path, disk_blocks=32)
    ram, disk = engine.scheduler.cache.tiers
    serve(engine, outputs, "a", A)
    serve(engine, outputs, "b", B)
    serve(engine, outputs, "c", C)
    assert ram.stats()["blocks"] == 1 and disk.stats()["blocks"] >= 3
    tokens, cached, by_tier = serve(engine, outputs, "a2", A)
    assert tokens == reference_tokens(A, 2)
    assert cached == 12 and by_tier.get("disk", 0) >= 4 and sum(by_tier.values()) == 12


def test_flush_then_restart_serves_disk_hits(tmp_path):
    engine, outputs, _ = make(num_blocks=8, ram_blocks=2, disk_dir=tmp_path, disk_blocks=64)
    serve(engine, outputs, "a", A)
    assert engine.flush_cache()
    fresh, outputs2, _ = make(num_blocks=8, ram_blocks=2, disk_dir=tmp_path, disk_blocks=64)
    tokens, cached, by_tier = serve(fresh, outputs2, "a2", A)
    assert tokens == reference_tokens(A, 2)
    assert cached == 12 and by_tier == {"disk": 12}
    assert fresh.scheduler.cache.stats()["tiers"]["disk"]["hits"] == 3


def test_salt_and_last_miss_explanations(tmp_path):
    engine, outputs, _ = make(num_blocks=5)
    cache = engine.scheduler.cache
    serve(engine, outputs, "a", A)
    assert "never cached" in cache.last_miss
    outputs.clear()
    run(engine, outputs, [EngineRequest("s", tuple(A), SamplingParams(max_tokens=2, temperature=0.0,
                                                                    ignore_eos=True), cache_salt="other")])
    assert [o.cached_tokens for o in outputs][-1] == 0
    assert "salt differs" in cache.last_miss
    serve(engine, outputs, "b", B)          # pushes A's blocks out of a pool with no lower tier
    serve(engine, outputs, "c", C)
    assert serve(engine, outputs, "a2", A)[1] < 12
    assert "evicted from the gpu tier" in cache.last_miss
    partial = A[:8] + [60, 61, 62, 63, 1]
    serve(engine, outputs, "p", A)
    assert serve(engine, outputs, "p2", partial)[1] == 8
    assert "diverged in block 2" in cache.last_miss


def test_prefix_caching_off_is_explained():
    engine, outputs, _ = make(prefix=False)
    serve(engine, outputs, "a", A)
    assert serve(engine, outputs, "a2", A)[1] == 0
    assert "prefix caching is disabled" in engine.scheduler.cache.last_miss


def test_no_tiers_without_block_copy_model():
    from tests.toy_model import ToyModel
    pool = BlockPool(4, BS)
    cache = PrefixCache(pool, tiers=[RamTier(None, {"budget_bytes": 1000})], model=ToyModel(BS))
    assert cache.tiers == []


def test_many_requests_with_tiny_pool_and_tiers_stay_exact(tmp_path):
    engine, outputs, _ = make(num_blocks=6, ram_blocks=3, disk_dir=tmp_path, disk_blocks=5, max_num_seqs=2)
    prompts = [[(i * 7 + j) % 50 + 1 for j in range(9 + i % 5)] for i in range(6)]
    for rnd in range(3):
        for i, p in enumerate(prompts):
            assert serve(engine, outputs, f"r{rnd}-{i}", p, n=3)[0] == reference_tokens(p, 3)
    s = engine.scheduler.cache.stats()["tiers"]
    assert s["ram"]["hits"] + s["disk"]["hits"] > 0
    assert s["disk"]["bytes"] <= engine.scheduler.cache.tiers[1].budget_bytes
    assert engine.scheduler.pool.num_free == engine.scheduler.pool.num_blocks


def test_evicted_blocks_copied_out_without_waiting_reach_ram_once_the_copy_lands(tmp_path):
    """``AsyncBlockCopyModel``: a block evicted from the pool goes to the RAM tier only once its
    copy out of the pool is complete (a payload read earlier would be zeros and give wrong tokens
    on the next hit); shutdown waits for the copies still under way."""
    engine, outputs, model = make(num_blocks=5, ram_blocks=16, model=ToyAsyncBlockModel(BS, lag=3))
    cache, ram = engine.scheduler.cache, engine.scheduler.cache.tiers[0]
    serve(engine, outputs, "a", A)
    serve(engine, outputs, "b", B)  # evicts two of A's blocks: their copies are started
    assert model.handles
    assert len(ram.entries()) == sum(len(h.payloads) for h in model.handles if h.landed) < 2
    for _ in range(4):
        cache.after_plan()  # each plan asks once more: the copies land and are stored
    assert all(h.landed for h in model.handles) and len(ram.entries()) == 2
    tokens, cached, by_tier = serve(engine, outputs, "a2", A)
    assert tokens == reference_tokens(A, 2) and by_tier.get("ram", 0) > 0 and cached == 12

    late, late_outputs, late_model = make(num_blocks=5, disk_dir=tmp_path, disk_blocks=16,
                                          model=ToyAsyncBlockModel(BS, lag=100))
    serve(late, late_outputs, "a", A)
    serve(late, late_outputs, "b", B)
    assert any(not h.landed for h in late_model.handles)
    late.scheduler.cache.flush()  # waits for them, then writes everything to the last tier
    assert all(h.landed for h in late_model.handles)
