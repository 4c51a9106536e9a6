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

from ds4d.cache.blocks import block_keys
from ds4d.cache.checkpoints import tier_key
from tests.unit.test_cache_dsv4 import engine
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

    # the checkpoint at 512 damaged on disk: a miss (deleted, logged), the one at 256 is used instead
    keys = block_keys(second, 128, b"v4")
    disk = restarted.scheduler.cache.tiers[-1]
    path = disk.root / f"{tier_key(keys[3], ()).hex()}.blk"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    again, again_outputs = engine(model, disk_dir=tmp_path, every_tokens=256)
    with caplog.at_level(logging.WARNING):
        gen, cached, by_tier = serve(again, again_outputs, "c", second)
    assert cached == 256 and by_tier == {"disk": 256} and gen == expected
    assert not path.exists() and "gave back no intact copy" in caplog.text
