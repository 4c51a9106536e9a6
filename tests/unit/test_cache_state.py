"""Prefix reuse for a model with per-sequence state: checkpoints at request boundaries."""

from __future__ import annotations

from tests.toy_state_model import ToyStateModel, reference_state_tokens
from tests.unit.test_cache_engine import make, serve

P1 = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]          # 10 tokens: end of prompt inside block 2


def state_engine(**kw):
    return make(model=ToyStateModel(4), **kw)


def test_agent_second_turn_resumes_at_end_of_previous_generation():
    core, outputs, model = state_engine(num_blocks=16)
    gen, cached, _ = serve(core, outputs, "t1", P1, n=5)
    assert gen == reference_state_tokens(P1, 5) and cached == 0
    turn2 = P1 + gen + [7, 7, 8, 8, 9, 9]
    gen2, cached2, by_tier = serve(core, outputs, "t2", turn2, n=4)
    assert gen2 == reference_state_tokens(turn2, 4)
    assert cached2 == len(P1) + 5 - 1          # everything fed to the model in turn 1
    assert by_tier == {"gpu": cached2}
    assert model.loads == 1
    stats = core.scheduler.cache.stats()["checkpoints"]
    assert stats["used"] == 1 and stats["saved"] >= 2


def test_tokenization_differing_at_the_boundary_falls_back_to_end_of_prompt():
    core, outputs, _ = state_engine(num_blocks=16)
    gen, _, _ = serve(core, outputs, "t1", P1, n=5)
    # the replayed reply re-tokenises differently from its 3rd token on
    turn2 = P1 + gen[:2] + [60, 61] + [7, 8, 9]
    gen2, cached2, _ = serve(core, outputs, "t2", turn2, n=4)
    assert gen2 == reference_state_tokens(turn2, 4)
    assert cached2 == len(P1)                   # the checkpoint at the end of the prompt


def test_identical_prompt_without_checkpoint_is_recomputed_and_explained():
    core, outputs, model = state_engine(num_blocks=16)
    serve(core, outputs, "a", P1, n=2)
    again, cached, _ = serve(core, outputs, "b", P1, n=2)
    assert again == reference_state_tokens(P1, 2) and cached == 0 and model.loads == 0
    assert "no state checkpoint" in core.scheduler.cache.last_miss


def test_two_branches_from_one_checkpoint_are_both_exact():
    core, outputs, _ = state_engine(num_blocks=24)
    gen, _, _ = serve(core, outputs, "t1", P1, n=3)
    for i, extra in enumerate(([11, 12], [13, 14, 15, 16, 17])):
        turn = P1 + gen + extra
        out, cached, _ = serve(core, outputs, f"b{i}", turn, n=3)
        assert out == reference_state_tokens(turn, 3) and cached == len(P1) + 2


def test_block_aligned_checkpoint_needs_no_partial_block():
    core, outputs, _ = state_engine(num_blocks=16)
    prompt = list(range(1, 9))                  # 8 tokens: ends exactly on a block boundary
    gen, _, _ = serve(core, outputs, "t1", prompt, n=1)
    turn2 = prompt + gen + [5, 5, 5]
    out, cached, _ = serve(core, outputs, "t2", turn2, n=2)
    assert out == reference_state_tokens(turn2, 2) and cached == 8


def test_stateful_blocks_come_back_from_ram_with_their_checkpoint():
    core, outputs, _ = state_engine(num_blocks=7, ram_blocks=16)
    gen, _, _ = serve(core, outputs, "t1", P1, n=5)   # 14 tokens fed: 3 full blocks + a partial one
    other = [50 + i for i in range(17)]
    serve(core, outputs, "x", other, n=2)           # needs 5 of 7 blocks: pushes turn 1's blocks to RAM
    turn2 = P1 + gen + [7, 8]
    out, cached, by_tier = serve(core, outputs, "t2", turn2, n=3)
    assert out == reference_state_tokens(turn2, 3)
    assert cached == 14 and by_tier.get("ram", 0) > 0 and sum(by_tier.values()) == 14


def test_checkpoints_off_means_no_reuse_but_exact_output():
    core, outputs, _ = state_engine(num_blocks=16, checkpoints=0)
    gen, _, _ = serve(core, outputs, "t1", P1, n=5)
    turn2 = P1 + gen + [7]
    out, cached, _ = serve(core, outputs, "t2", turn2, n=2)
    assert out == reference_state_tokens(turn2, 2) and cached == 0
