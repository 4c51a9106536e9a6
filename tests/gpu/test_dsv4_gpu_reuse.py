"""DeepSeek-V4 on a CUDA GPU: block copies between the pool and host tiers, and compiled decode.

* ``export_blocks`` / ``import_blocks`` move compressed-KV blocks between the
  device pool and host memory bit for bit, and an agent's second turn served
  from a state checkpoint plus blocks demoted to the RAM tier gives the same
  greedy tokens as computing it from scratch (float32).
* ``compile_decode`` (torch.compile inside the CUDA graphs) gives the same
  greedy tokens as the eager decode step, logits within 2e-4 (float32).
"""

from __future__ import annotations

import pytest
import torch

from ds4d.models.deepseek_v4 import load_model, write_tiny_checkpoint
from ds4d.models.deepseek_v4.paths import ForwardPaths
from tests.unit.test_cache_dsv4 import engine, serve
from tests.unit.test_dsv4_model import Driver, _tokens

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-reuse"), seed=5, layers=[0, 4, 128, 4])


def test_block_round_trip_on_the_device(checkpoint):
    model = load_model(checkpoint, dtype=torch.bfloat16, device="cuda")
    model.allocate_cache(6, 2)
    pools = model.cache.block_pools()
    for pool in pools:
        pool.copy_(torch.randn(pool.shape, device="cuda").to(pool.dtype))
    before = [pool.clone() for pool in pools]
    payloads = model.export_blocks([1, 4])
    assert all(p.device.type == "cpu" and p.numel() == model.info.cache_bytes_per_block for p in payloads)
    model.import_blocks([0, 2], [payloads[1], payloads[0]])
    for old, new in zip(before, pools):
        assert torch.equal(new[0], old[4]) and torch.equal(new[2], old[1])
        assert torch.equal(new[[1, 3, 4, 5]], old[[1, 3, 4, 5]])


def test_second_turn_from_checkpoint_and_ram_equals_recompute(checkpoint):
    model = load_model(checkpoint, dtype=torch.float32, device="cuda")
    turn1 = _tokens(model, 200, 60)
    core, outputs = engine(model, num_blocks=5, ram_blocks=8)
    gen1, _, _ = serve(core, outputs, "t1", turn1, 6)
    serve(core, outputs, "other", _tokens(model, 580, 61), 2)  # pushes turn 1's block to RAM
    turn2 = turn1 + gen1 + _tokens(model, 40, 62)
    gen2, cached2, by_tier = serve(core, outputs, "t2", turn2, 6)
    assert cached2 == len(turn1) + len(gen1) - 1 and by_tier == {"ram": cached2}, by_tier  # blocks and checkpoint
    cold, cold_outputs = engine(model, prefix=False)
    assert serve(cold, cold_outputs, "cold", turn2, 6)[0] == gen2


def test_periodic_checkpoint_through_ram_and_disk_equals_recompute(checkpoint, tmp_path):
    """A prompt parting from a cached one mid-message resumes at the periodic checkpoint before
    the parting point, its state packed from pinned host memory into the RAM tier and, after a
    restart, read back from the disk tier (float32)."""
    model = load_model(checkpoint, dtype=torch.float32, device="cuda")
    shared = _tokens(model, 600, 73)
    first, second = shared + _tokens(model, 100, 74), shared + _tokens(model, 80, 75)
    core, outputs = engine(model, num_blocks=6, ram_blocks=8, ram_checkpoints=4, every_tokens=256,
                           disk_dir=tmp_path)
    serve(core, outputs, "a", first, 5)
    serve(core, outputs, "other", _tokens(model, 580, 61), 2)  # "a"'s tail blocks and checkpoints go to RAM
    gen, cached, by_tier = serve(core, outputs, "b", second, 5)
    assert cached == 512 and by_tier == {"gpu": 128, "ram": 384}, by_tier
    cold, cold_outputs = engine(model, prefix=False)
    expected = serve(cold, cold_outputs, "cold", second, 5)[0]
    assert gen == expected
    core.scheduler.cache.flush()
    restarted, restarted_outputs = engine(model, every_tokens=256, disk_dir=tmp_path)
    gen, cached, by_tier = serve(restarted, restarted_outputs, "b2", second, 5)
    assert cached == 512 and by_tier == {"disk": 512} and gen == expected


def _greedy(model, ids, steps):
    driver = Driver(model, seed=3)
    driver.start("a")
    token = int(driver.prefill("a", ids, 64)[-1].argmax())
    tokens, rows = [token], []
    for _ in range(steps):
        logits = driver.step([("a", [tokens[-1]], 1)])[0][0]
        rows.append(logits)
        tokens.append(int(logits.argmax()))
    return tokens, torch.stack(rows)


def test_compiled_decode_equals_eager(checkpoint):
    eager = load_model(checkpoint, dtype=torch.float32, device="cuda",
                       paths=ForwardPaths.for_device("cuda").replace(decode_graphs="off"))
    compiled = load_model(checkpoint, dtype=torch.float32, device="cuda",
                          paths=ForwardPaths.for_device("cuda", compile_decode=True))
    ids = _tokens(eager, 150, 9)
    want_tokens, want = _greedy(eager, ids, 12)
    got_tokens, got = _greedy(compiled, ids, 12)
    assert got_tokens == want_tokens
    assert (got - want).abs().max().item() < 2e-4


def test_a_warmed_up_model_captured_every_bucket_and_gives_the_same_tokens(checkpoint):
    """``ds4d.engine.warmup`` on the device: every decode bucket captured as a CUDA graph up front, then
    an agent's two turns (the second reusing the first) give the tokens of a model that was not warmed."""
    from ds4d.cuda.graphs import decode_buckets
    from ds4d.engine.offline import default_policy
    from ds4d.engine.warmup import warm_up

    host = load_model(checkpoint, dtype=torch.float32, device="cpu")
    turn1, follow = _tokens(host, 300, 70), _tokens(host, 40, 71)
    results = []
    for warmed in (False, True):
        model = load_model(checkpoint, dtype=torch.float32, device="cuda")
        core, outputs = engine(model, num_blocks=12)
        if warmed:
            report = warm_up(model, default_policy(), num_blocks=12, max_num_seqs=2, step_tokens=512, prefill_chunk=512,
                             max_context=1536, lookahead=True)
            buckets = decode_buckets(2, 12)
            assert report.decode_buckets == len(buckets) and len(model._graphs) == len(buckets)
            assert report.reused_tokens > 0
        gen1, _, _ = serve(core, outputs, "t1", turn1, 6)
        gen2, cached2, _ = serve(core, outputs, "t2", turn1 + gen1 + follow, 6)
        assert cached2 > 0
        results.append((gen1, gen2, cached2))
    assert results[0] == results[1]
