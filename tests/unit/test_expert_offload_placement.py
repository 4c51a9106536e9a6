"""The placement policy on its own: plain Python, no tensors."""

from __future__ import annotations

import pytest

from ds4d.cuda.host_memory import free_huge_pages, huge_pages_fit
from ds4d.models.deepseek_v4.placement import PlacementPolicy, capacity_for_budget, hits, plan_placement

MIB = 1 << 20


@pytest.mark.parametrize(
    ("budget", "expected"),
    [(0, 0), (100 * MIB, 0), (148 * MIB, 1), (100 * MIB + 48 * MIB * 10, 10), (1 << 50, 64)],
)
def test_capacity_for_budget(budget, expected):
    assert capacity_for_budget(budget, 48 * MIB, 100 * MIB, 64) == expected


def test_no_counts_spread_evenly_over_layers():
    hot = plan_placement([[0] * 8 for _ in range(3)], 7)
    assert [len(h) for h in hot] == [3, 2, 2]
    assert hot == [[0, 1, 2], [0, 1], [0, 1]]


def test_most_routed_pairs_win_across_layers():
    counts = [[9, 0, 0, 1], [5, 5, 5, 5], [0, 0, 7, 0]]
    assert plan_placement(counts, 3) == [[0], [], [2]] or plan_placement(counts, 3) == [[0], [0], [2]]
    hot = plan_placement(counts, 3)
    assert hits(counts, hot) == 9 + 7 + 5
    assert plan_placement(counts, 0) == [[], [], []]
    assert plan_placement(counts, 100) == [[0, 1, 2, 3]] * 3


@pytest.mark.parametrize("capacity", [0, 1, 5, 11, 24])
def test_plan_is_optimal_for_hits(capacity):
    counts = [[(7 * layer + 3 * e) % 11 for e in range(8)] for layer in range(3)]
    hot = plan_placement(counts, capacity)
    assert sum(map(len, hot)) == min(capacity, 24)
    best = sorted((c for row in counts for c in row), reverse=True)[:capacity]
    assert hits(counts, hot) == sum(best)


def test_static_never_replans_and_uses_calibration():
    calib = [[0, 0, 4, 0], [1, 0, 0, 0]]
    policy = PlacementPolicy(2, 4, 2, mode="static", replan_tokens=1, calibration=calib)
    assert policy.initial() == [[2], [0]]
    policy.observe(0, [0, 100, 0, 0])
    assert not policy.due()


def test_online_replans_when_routing_moves_and_not_on_noise():
    policy = PlacementPolicy(1, 4, 1, mode="online", replan_tokens=10, min_gain=0.1)
    current = policy.initial()
    assert current == [[0]]
    policy.observe(0, [5, 0, 0, 0])
    assert not policy.due()
    policy.observe(0, [0, 0, 20, 0])
    assert policy.due()
    moved = policy.replan(current)
    assert moved == [[2]] and policy.replans == 1 and not policy.due()
    # counts halve at each re-plan: expert 2 now at 10
    policy.observe(0, [0, 0, 0, 10.5])  # 3 at 10.5: under 10% better, stay
    assert policy.replan(moved) is None
    policy.observe(0, [0, 0, 0, 20])  # 2 at 5, 3 at 5.25 + 20: move
    assert policy.replan(moved) == [[3]] and policy.replans == 2


def test_bad_mode_is_refused():
    with pytest.raises(ValueError, match="placement"):
        PlacementPolicy(1, 4, 1, mode="sometimes")


BUDDY = """Node 0, zone      DMA      0      0      0      0      0      0      0      0      1      1      3
Node 0, zone    DMA32      5      4      3      2      1      1      1      1      1      2      4
Node 0, zone   Normal   1000    500    200    100     50     20     10      5      2      3      7
"""


def test_buddyinfo_counts_free_2mib_blocks():
    # order 9 counts once, order 10 (4 MiB) twice: (1 + 2*3) + (2 + 2*4) + (3 + 2*7)
    assert free_huge_pages(BUDDY) == 7 + 10 + 17
    assert huge_pages_fit(34 * 2 * (1 << 20), BUDDY)
    assert not huge_pages_fit(35 * 2 * (1 << 20), BUDDY)
    assert not huge_pages_fit(1 << 20, BUDDY)


def test_offload_options_follow_the_config_knobs(tmp_path):
    from ds4d.config import load_config
    from ds4d.models.deepseek_v4.knobs import offload_options

    env = {"DS4D_CONFIG": str(tmp_path / "none.toml")}
    assert offload_options(load_config({}, environ=env).config, {}) is None
    cfg = load_config({"expert_vram_gib": "2", "expert_placement": "static", "expert_decode_cold": "copy",
                       "expert_cpu_threads": "3", "expert_fetch_ahead": "4", "device": "cuda"}, environ=env).config
    opts = offload_options(cfg, {})
    assert (opts.vram_bytes, opts.placement, opts.decode_cold, opts.cpu_threads, opts.fetch_ahead) == (
        2 * 2**30, "static", "copy", 3, 4)

    def ahead(**knobs) -> int:
        return offload_options(load_config({"expert_vram_gib": "2", **knobs}, environ=env).config, {}).fetch_ahead

    assert ahead(device="cuda") == 12  # on by default, batch 2 of V4's top-6
    assert ahead(device="cuda", expert_fetch_ahead="0") == 0  # off
    assert ahead(device="cpu") == 0  # nothing to overlap with on the CPU
    assert offload_options(cfg, {"expert_vram_gib": 0}) is None  # plugin options win over the config


def test_registration_pieces_never_split_a_slot():
    """A copy may not span two cudaHostRegister ranges, so slots of expert bytes sit inside one piece."""
    from ds4d.cuda.host_memory import register_pieces

    slot = 13_369_344  # one V4-Flash MXFP4 expert, 256-byte aligned parts
    start, count = 1 << 21, 300
    pieces = register_pieces(start, count * slot, unit=slot)
    assert pieces[0][0] == start and sum(size for _, size in pieces) == count * slot
    assert all(a + size == b for (a, size), (b, _) in zip(pieces, pieces[1:]))  # contiguous, no gap
    assert all(size % slot == 0 and size <= 1 << 30 for _, size in pieces)
    assert len(pieces) == -(-count // ((1 << 30) // slot))
    assert register_pieces(start, 5 << 30) == [(start + (i << 30), 1 << 30) for i in range(5)]


def test_host_slots_hand_out_aligned_disjoint_views():
    """Each slot's parts are views at 256-byte aligned offsets inside the slot; writing one slot's part
    leaves every other slot and part alone; slots given back are handed out again before the pool grows."""
    import torch

    from ds4d.cuda.host_memory import HostArena, HostSlots, PinnedRegistry

    template = {"gu": torch.zeros(6, 10, dtype=torch.uint8), "sgu": torch.zeros(6, 1, dtype=torch.uint8),
                "w2": torch.zeros(3, 7, dtype=torch.bfloat16)}
    slots = HostSlots(template, HostArena(), PinnedRegistry(1))
    assert [at for _, _, _, at, _ in slots.layout] == [0, 256, 512] and slots.slot_bytes == 768
    slots.grow(3)
    taken = [slots.take() for _ in range(3)]
    assert taken == [(0, 0), (0, 1), (0, 2)] and slots.bytes == 3 * 768
    for number, slot in enumerate(taken):
        for name, view in slots.parts(slot).items():
            assert view.shape == template[name].shape and view.dtype == template[name].dtype
            view.fill_(number + 1)
    for number, slot in enumerate(taken):
        assert all(bool((view == number + 1).all()) for view in slots.parts(slot).values())
    slots.give(taken[1])
    assert slots.take() == taken[1] and slots.slots == 3  # reused, no growth
    fresh = slots.take()  # none free: a new chunk of one slot
    assert fresh == (1, 0) and slots.slots == 4
    slots.reserve(2)
    assert len(slots.free) == 2 and slots.slots == 6
