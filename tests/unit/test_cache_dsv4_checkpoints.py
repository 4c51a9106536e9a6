"""State checkpoints inside a prompt on a tiny DeepSeek-V4, through the engine, CPU float32.

Every reuse path must give the greedy tokens of a cold run: a checkpoint at the
end of a shared system prompt (another session), a periodic one (a prompt that
parts mid-message), one demoted with its blocks to RAM and promoted back, one
read from disk after a restart, and, when the disk copy is damaged, the next
earlier one.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest

from ds4d.cache.blocks import BlockPool, block_keys
from ds4d.cache.checkpoints import tier_key
from ds4d.cache.manager import PrefixCache
from ds4d.cache.ram import RamTier
from ds4d.engine.offline import OfflineEngine
from tests.unit.test_cache_dsv4 import checkpoint_bytes, engine
from tests.unit.test_dsv4_model import _tokens, checkpoint, model  # noqa: F401 - fixtures
from tests.unit.test_engine import req, run

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def serve(core, outputs, rid, prompt, n=5, **marks):
    outputs.clear()
    tokens, _, _ = run(core, outputs, [dataclasses.replace(req(rid, prompt, n), **marks)])
    final = [o for o in outputs if o.request_id == rid][-1]
    return tokens[rid], final.cached_tokens, dict(final.cached_by_tier)


def cold_tokens(v4, prompt, n=5):
    cold, outputs = engine(v4, prefix=False)
    return serve(cold, outputs, "cold", prompt, n)[0]


def test_sessions_sharing_a_system_prompt_resume_after_it(model):  # noqa: F811
    system = _tokens(model, 300, 70)
    first, second = system + _tokens(model, 90, 71), system + _tokens(model, 60, 72)
    core, outputs = engine(model)
    assert serve(core, outputs, "a", first, stable_prefix=300, message_starts=(300,))[1] == 0
    gen, cached, by_tier = serve(core, outputs, "b", second, stable_prefix=300, message_starts=(300,))
    assert cached == 300 and by_tier == {"gpu": 300}
    assert gen == cold_tokens(model, second)

    unmarked, unmarked_outputs = engine(model)  # without the boundary only request ends are saved
    serve(unmarked, unmarked_outputs, "a", first)
    assert serve(unmarked, unmarked_outputs, "b", second)[1] == 0


def test_a_prompt_parting_mid_message_loses_at_most_the_period(model):  # noqa: F811
    shared = _tokens(model, 600, 73)
    first, second = shared + _tokens(model, 100, 74), shared + _tokens(model, 80, 75)
    core, outputs = engine(model, every_tokens=200)
    assert core.scheduler.cache.checkpoint_every_tokens == 256  # rounded up to whole blocks
    serve(core, outputs, "a", first)
    gen, cached, by_tier = serve(core, outputs, "b", second)
    assert cached == 512 and by_tier == {"gpu": 512}  # the last multiple of 256 before they part
    assert gen == cold_tokens(model, second)
    assert core.scheduler.cache.stats()["checkpoints"]["every_tokens"] == 256


def test_a_periodic_checkpoint_goes_to_ram_with_its_blocks_and_comes_back(model):  # noqa: F811
    shared = _tokens(model, 600, 73)
    first, second = shared + _tokens(model, 100, 74), shared + _tokens(model, 80, 75)
    core, outputs = engine(model, num_blocks=6, ram_blocks=8, ram_checkpoints=4, every_tokens=256)
    serve(core, outputs, "a", first)
    serve(core, outputs, "other", _tokens(model, 580, 61), 2)  # takes 5 of the 6 blocks: "a" goes to RAM
    cache = core.scheduler.cache
    assert cache.stats()["checkpoints"]["demoted"] >= 2  # the checkpoints anchored at the evicted blocks
    gen, cached, by_tier = serve(core, outputs, "b", second)
    assert cached == 512 and by_tier == {"gpu": 128, "ram": 384}  # the head block stayed in the pool
    assert cache.stats()["checkpoints"]["promoted"] == 1  # the state at 512, from RAM
    assert gen == cold_tokens(model, second)


def test_no_room_for_a_checkpoint_in_ram_means_no_reuse_of_its_blocks(model):  # noqa: F811
    """The RAM budget counts checkpoints: one too big for it is dropped, and so no state is
    there to resume the blocks demoted beside it; the output stays exact."""
    shared = _tokens(model, 600, 73)
    first, second = shared + _tokens(model, 100, 74), shared + _tokens(model, 80, 75)
    core, outputs = engine(model, num_blocks=6, ram_blocks=8, ram_checkpoints=0, every_tokens=256)
    serve(core, outputs, "a", first)
    serve(core, outputs, "other", _tokens(model, 580, 61), 2)
    gen, cached, _ = serve(core, outputs, "b", second)
    assert cached == 0 and "no state checkpoint" in core.scheduler.cache.last_miss
    assert gen == cold_tokens(model, second)


def test_restart_reads_periodic_checkpoints_from_disk_and_skips_a_damaged_one(model, tmp_path, caplog):  # noqa: F811
    shared = _tokens(model, 600, 73)
    first, second = shared + _tokens(model, 100, 74), shared + _tokens(model, 80, 75)
    core, outputs = engine(model, disk_dir=tmp_path, every_tokens=256)
    serve(core, outputs, "a", first)
    core.scheduler.cache.flush()  # a graceful shutdown: hot checkpoints to disk, and their index
    expected = cold_tokens(model, second)

    restarted, restarted_outputs = engine(model, disk_dir=tmp_path, every_tokens=256)
    gen, cached, by_tier = serve(restarted, restarted_outputs, "b", second)
    assert cached == 512 and by_tier == {"disk": 512} and gen == expected
    disk = restarted.scheduler.cache.tiers[-1]
    assert disk.stats()["background_reads"] == 4 + 1  # the blocks and the state checkpoint, read ahead

    # the checkpoint at 512 damaged on disk: a miss (deleted, logged), the one at 256 is used instead
    keys = block_keys(second, 128, b"v4")
    path = disk.root / f"{tier_key(keys[3], ()).hex()}.blk"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    again, again_outputs = engine(model, disk_dir=tmp_path, every_tokens=256)
    with caplog.at_level(logging.WARNING):
        gen, cached, by_tier = serve(again, again_outputs, "c", second)
    assert cached == 256 and by_tier == {"disk": 256} and gen == expected
    assert not path.exists() and "gave back no intact copy" in caplog.text


def test_a_checkpoint_pushed_out_of_host_memory_by_other_sessions_is_found_in_ram(model):  # noqa: F811
    """Other sessions' checkpoints push a session's out of the hot set (``cache_checkpoints``): it
    goes to the RAM tier, and the session's next turn still resumes at the end of its last one."""
    turn1 = _tokens(model, 200, 60)
    core, outputs = engine(model, num_blocks=12, ram_blocks=8, ram_checkpoints=6, checkpoints=2)
    gen1 = serve(core, outputs, "t1", turn1, 6)[0]
    for i in range(3):
        serve(core, outputs, f"other{i}", _tokens(model, 150, 80 + i), 2)  # two checkpoints each
    stats = core.scheduler.cache.stats()["checkpoints"]
    assert stats["hot"] == 2 and stats["demoted"] == 6 and stats["count"] == 8, stats
    turn2 = turn1 + gen1 + _tokens(model, 40, 62)
    gen2, cached2, by_tier = serve(core, outputs, "t2", turn2, 6)
    assert cached2 == len(turn1) + len(gen1) - 1
    assert by_tier == {"gpu": 128, "ram": cached2 - 128}  # block 0 in the pool; the state and its tail from RAM
    assert gen2 == cold_tokens(model, turn2, 6)


def test_a_turn_whose_blocks_went_to_ram_waits_for_pool_room_rather_than_recomputing(model):  # noqa: F811
    """Another session, still decoding, pushed most of a session's blocks to RAM and holds the pool:
    the pool has room for a first prefill chunk but not for promoting the blocks up to the
    session's checkpoint.  The next turn waits for the running request to end and then resumes
    at the end of its previous turn, instead of being admitted at once with nothing reused."""
    info = model.info
    pool = BlockPool(14, info.block_size_tokens)
    ram = RamTier(None, {"budget_bytes": 8 * info.cache_bytes_per_block + 3 * checkpoint_bytes(model)})
    cache = PrefixCache(pool, tiers=[ram], model=model, block_bytes=info.cache_bytes_per_block)
    core = OfflineEngine(model, max_num_seqs=2, step_tokens=512, prefill_chunk=128, cache=cache, namespace=b"v4")
    outputs = core.outputs
    turn1 = _tokens(model, 900, 90)
    gen1 = serve(core, outputs, "a1", turn1, 6)[0]  # 7 full blocks and a partial one

    outputs.clear()
    core.submit(req("b", _tokens(model, 1400, 91), 20))  # 11 blocks: four of "a1"'s go to RAM
    while not any(o.request_id == "b" and o.new_token_ids for o in outputs):
        core.step()
    turn2 = turn1 + gen1 + _tokens(model, 40, 92)
    core.submit(req("a2", turn2, 5))
    core.run_until_idle()
    order = [o.request_id for o in outputs if o.new_token_ids]
    assert order.index("a2") > max(i for i, rid in enumerate(order) if rid == "b")  # admitted once "b" ended
    final = [o for o in outputs if o.request_id == "a2"][-1]
    assert final.cached_tokens == len(turn1) + len(gen1) - 1
    assert dict(final.cached_by_tier).get("ram", 0) >= 4 * 128
    assert [t for o in outputs if o.request_id == "a2" for t in o.new_token_ids] == cold_tokens(model, turn2)
