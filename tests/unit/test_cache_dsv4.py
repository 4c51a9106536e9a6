"""Prefix reuse on a tiny DeepSeek-V4 through the engine: state checkpoints plus block copies.

The model copies a block's compressed-KV (and lightning-indexer) pool rows of
every layer out of and into its pool (``export_blocks`` / ``import_blocks``),
so blocks demoted to RAM come back bit-identical.  Greedy output of an agent's
second turn must be the same with reuse (checkpoint at the end of turn 1,
blocks from the pool or RAM) as computed from scratch.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from ds4d.cache.blocks import BlockPool
from ds4d.cache.disk import DiskTier
from ds4d.cache.manager import PrefixCache
from ds4d.cache.ram import RamTier
from ds4d.contracts import BlockCopyModel, StatefulModel
from ds4d.engine.offline import OfflineEngine
from tests.unit.test_dsv4_model import _tokens, checkpoint, model  # noqa: F401 - fixtures
from tests.unit.test_engine import req, run

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_v4_block_copy_round_trip(model):  # noqa: F811
    assert isinstance(model, StatefulModel) and isinstance(model, BlockCopyModel)
    model.allocate_cache(6, 2)
    pools = model.cache.block_pools()
    assert pools, "the tiny checkpoint has compressed layers"
    generator = torch.Generator().manual_seed(3)
    for pool in pools:
        pool.copy_(torch.randn(pool.shape, generator=generator).to(pool.dtype))
    before = [pool.clone() for pool in pools]
    payloads = model.export_blocks([1, 4])
    assert [p.numel() for p in payloads] == [model.info.cache_bytes_per_block] * 2
    assert all(p.dtype == torch.uint8 and p.device.type == "cpu" for p in payloads)
    model.import_blocks([0, 2], [payloads[1], bytes(payloads[0].numpy())])  # tensors and plain bytes
    for old, new in zip(before, pools):
        assert torch.equal(new[0], old[4]) and torch.equal(new[2], old[1])
        assert torch.equal(new[[1, 3, 4, 5]], old[[1, 3, 4, 5]])
    with pytest.raises(ValueError, match="expected"):
        model.import_blocks([0], [b"short"])
    with pytest.raises(ValueError, match="payloads"):
        model.import_blocks([0, 1], payloads[:1])


def checkpoint_bytes(v4) -> int:
    """What one state checkpoint takes in a tier, at most: the state, a partial block, a header."""
    return v4.info.state_bytes_per_seq + v4.info.cache_bytes_per_block + 4096


def engine(v4, *, num_blocks=12, ram_blocks=0, ram_checkpoints=2, prefix=True, disk_dir=None, lookahead=False,
           every_tokens=0, checkpoints=64):
    """An engine over the tiny V4; the RAM tier's budget holds ``ram_blocks`` blocks plus
    ``ram_checkpoints`` state checkpoints (the budget counts both)."""
    info = v4.info
    pool = BlockPool(num_blocks, info.block_size_tokens, prefix_caching=prefix)
    ram = ram_blocks * info.cache_bytes_per_block + ram_checkpoints * checkpoint_bytes(v4)
    tiers = [RamTier(None, {"budget_bytes": ram})] if ram_blocks else []
    if disk_dir is not None:
        tiers.append(DiskTier(None, {"directory": str(disk_dir), "budget_bytes": 1 << 30, "compat_hash": b"v4"}))
    cache = PrefixCache(pool, tiers=tiers, model=v4, block_bytes=info.cache_bytes_per_block,
                        checkpoints=checkpoints, checkpoint_every_tokens=every_tokens)
    core = OfflineEngine(v4, max_num_seqs=2, step_tokens=512, prefill_chunk=512, cache=cache, namespace=b"v4",
                         lookahead=lookahead)
    return core, core.outputs


def serve(core, outputs, rid, prompt, n):
    outputs.clear()
    tokens, _, _ = run(core, outputs, [req(rid, prompt, n)])
    final = [o for o in outputs if o.request_id == rid][-1]
    return tokens[rid], final.cached_tokens, dict(final.cached_by_tier)


@pytest.mark.parametrize("ram_blocks", [0, 8])
def test_agent_second_turn_on_v4_equals_recompute(model, ram_blocks):  # noqa: F811
    turn1 = _tokens(model, 200, 60)
    core, outputs = engine(model, num_blocks=5 if ram_blocks else 12, ram_blocks=ram_blocks)
    gen1, cached1, _ = serve(core, outputs, "t1", turn1, 6)
    assert cached1 == 0
    if ram_blocks:
        serve(core, outputs, "other", _tokens(model, 580, 61), 2)   # 5 blocks: pushes turn 1's block to RAM
    turn2 = turn1 + gen1 + _tokens(model, 40, 62)
    gen2, cached2, by_tier = serve(core, outputs, "t2", turn2, 6)
    assert cached2 == len(turn1) + len(gen1) - 1
    if ram_blocks:
        # the block and the checkpoint after it (state and partial block) went down together
        assert by_tier == {"ram": cached2}, by_tier
        checkpoints = core.scheduler.cache.stats()["checkpoints"]
        assert checkpoints["demoted"] >= 1 and checkpoints["promoted"] == 1, checkpoints
        copies = core.scheduler.cache.stats()["copies"]
        assert copies["promoted_blocks"] == 1 and copies["demoted_blocks"] >= 1, copies
        assert copies["promote_seconds"] > 0 and copies["demote_seconds"] > 0, copies

    cold, cold_outputs = engine(model, prefix=False)
    assert serve(cold, cold_outputs, "cold", turn2, 6)[0] == gen2


def test_volatile_tail_checkpoint_lets_the_next_turn_reuse_the_prompt_before_it(model):  # noqa: F811
    """A prompt whose last token the next turn renders differently (V4's ``<think>`` hand-over
    without tools): the engine checkpoints before it, so the next turn reuses all but that token
    and continues exactly as computed from scratch; without the mark it reuses nothing."""
    turn1 = _tokens(model, 200, 60)
    turn2 = turn1[:-1] + _tokens(model, 41, 63)
    assert turn2[len(turn1) - 1] != turn1[-1]
    core, outputs = engine(model)
    outputs.clear()
    tokens, _, _ = run(core, outputs, [dataclasses.replace(req("t1", turn1, 6), volatile_tail=1)])
    cold, cold_outputs = engine(model, prefix=False)
    assert tokens["t1"] == serve(cold, cold_outputs, "cold1", turn1, 6)[0]  # the cut chunk changes nothing
    gen2, cached2, by_tier = serve(core, outputs, "t2", turn2, 6)
    assert cached2 == len(turn1) - 1 and by_tier == {"gpu": cached2}
    assert serve(cold, cold_outputs, "cold2", turn2, 6)[0] == gen2

    unmarked, unmarked_outputs = engine(model)
    serve(unmarked, unmarked_outputs, "t1", turn1, 6)
    assert serve(unmarked, unmarked_outputs, "t2", turn2, 6)[1] == 0


def test_restart_resumes_from_disk_blocks_and_saved_checkpoints(model, tmp_path, caplog):  # noqa: F811
    turn1 = _tokens(model, 200, 60)
    core, outputs = engine(model, disk_dir=tmp_path)
    gen1, _, _ = serve(core, outputs, "t1", turn1, 6)
    core.scheduler.cache.flush()  # what a graceful shutdown does once the engine thread stopped
    path = core.scheduler.cache.checkpoints.index_file[0]
    assert path.parent.parent == tmp_path and path.exists()

    turn2 = turn1 + gen1 + _tokens(model, 40, 62)
    restarted, restarted_outputs = engine(model, disk_dir=tmp_path)  # a fresh pool: only the disk remembers
    gen2, cached2, by_tier = serve(restarted, restarted_outputs, "t2", turn2, 6)
    assert cached2 == len(turn1) + len(gen1) - 1
    assert by_tier == {"disk": cached2}, by_tier  # blocks and the checkpoint, read back from disk
    cold, cold_outputs = engine(model, prefix=False)
    assert serve(cold, cold_outputs, "cold", turn2, 6)[0] == gen2

    # a damaged checkpoint index is deleted and logged; blocks alone do not resume a stateful model
    restarted.scheduler.cache.flush()
    path.write_text(path.read_text().replace('"num_tokens": 205', '"num_tokens": 204'))
    with caplog.at_level(logging.WARNING, logger="ds4d.cache"):
        again, again_outputs = engine(model, disk_dir=tmp_path)
    assert "checksum mismatch" in caplog.text and not path.exists()
    assert serve(again, again_outputs, "t3", turn2, 6)[1] == 0


def test_lookahead_on_v4_and_the_next_turn_reuses_its_checkpoint(model):  # noqa: F811
    """Turn 1 decoded with steps queued ahead, ending on a stop token mid-stream: the step queued
    behind the last one writes one position past the end (window slot, compressor tails, maybe a
    compressed entry).  Turn 1's tokens are those of step-by-step decoding, and turn 2, which
    reuses turn 1's checkpoint, gives what a cold engine computes."""
    turn1 = _tokens(model, 200, 60)
    plain, plain_outputs = engine(model)
    full, _, _ = serve(plain, plain_outputs, "p1", turn1, 12)
    stop = full[7]

    def stopping(rid, prompt):
        return dataclasses.replace(req(rid, prompt, 40), params=dataclasses.replace(
            req(rid, prompt, 40).params, stop_token_ids=frozenset({stop})))

    core, outputs = engine(model, lookahead=True)
    tokens, _, _ = run(core, outputs, [stopping("t1", turn1)])
    gen1 = tokens["t1"]
    assert gen1 == full[:full.index(stop) + 1] and core.steps_ahead > 0
    turn2 = turn1 + gen1 + _tokens(model, 40, 62)
    gen2, cached2, _ = serve(core, outputs, "t2", turn2, 6)
    assert cached2 == len(turn1) + len(gen1) - 1
    cold, cold_outputs = engine(model, prefix=False)
    assert serve(cold, cold_outputs, "cold", turn2, 6)[0] == gen2


def step_by_step_and_ahead(v4, max_tokens: int) -> list[tuple[dict, int]]:
    """Two prompts decoded step by step, then with steps queued ahead: (tokens, steps ahead) of each."""
    prompts = {"a": _tokens(v4, 90, 70), "b": _tokens(v4, 130, 71)}
    results = []
    for lookahead in (False, True):
        core, outputs = engine(v4, prefix=False, lookahead=lookahead)
        tokens, _, _ = run(core, outputs, [req(k, p, max_tokens) for k, p in prompts.items()])
        results.append((tokens, core.steps_ahead))
    return results


def test_lookahead_through_the_padded_decode_step(model):  # noqa: F811
    """The decode path the CUDA graphs replay (bucket-padded rows, tokens packed with positions and
    block tables), run eagerly on the CPU: tokens fed on the device give the tokens fed from the host."""
    from ds4d.models.deepseek_v4.paths import ForwardPaths

    padded = model.with_paths(ForwardPaths(fast_path=True, decode_graphs="padded"))
    (plain, none_ahead), (ahead, steps_ahead) = step_by_step_and_ahead(padded, 10)
    assert none_ahead == 0 and steps_ahead > 0 and ahead == plain
    assert len(padded._graphs) > 0  # the padded decode step ran
