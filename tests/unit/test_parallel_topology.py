"""Placement of stages x expert-parallel ranks on GPUs, planned from link matrices (no GPU needed)."""

from __future__ import annotations

import sys

import pytest

from ds4d.parallel.topology import (
    NVLINK,
    PCIE,
    Placement,
    describe,
    main,
    parse_layout,
    plan_placement,
    read_link_matrix,
)


def _links(n: int, nvlink_pairs, default: int = PCIE) -> list[list[int]]:
    matrix = [[default if i != j else 0 for j in range(n)] for i in range(n)]
    for a, b in nvlink_pairs:
        matrix[a][b] = matrix[b][a] = NVLINK
    return matrix


def _groups(placement: Placement) -> set[frozenset[int]]:
    return {frozenset(stage) for stage in placement.grid}


def test_two_stages_by_two_put_expert_groups_on_the_nvlink_pairs():
    links = _links(4, [(0, 1), (2, 3)])
    placement = plan_placement(links, stages=2, ep_size=2)
    assert placement.grid == ((0, 1), (2, 3))
    assert placement.ep_link_score == 2 * NVLINK
    assert [placement.device_of(rank) for rank in range(4)] == [0, 1, 2, 3]


def test_pairs_that_are_not_neighbours_in_numbering_are_found():
    links = _links(4, [(0, 2), (1, 3)])
    placement = plan_placement(links, stages=2, ep_size=2)
    assert _groups(placement) == {frozenset({0, 2}), frozenset({1, 3})}
    assert placement.ep_link_score == 2 * NVLINK
    # the identity order would put the chatty groups on PCIe
    assert placement.grid != ((0, 1), (2, 3))


def test_auto_layout_follows_the_links():
    assert parse_layout("auto", 4, _links(4, [(0, 1), (2, 3)])) == (2, 2)
    everything = [(a, b) for a in range(8) for b in range(a + 1, 8)]
    assert parse_layout("auto", 8, _links(8, everything)) == (1, 8)  # NVSwitch: one stage, EP over all
    quads = [(a, b) for quad in ((0, 1, 2, 3), (4, 5, 6, 7)) for a in quad for b in quad if a < b]
    assert parse_layout("auto", 8, _links(8, quads)) == (2, 4)
    assert parse_layout("auto", 2, _links(2, [])) == (2, 1)  # no NVLink: layer split only
    assert parse_layout("auto", 4, None) == (1, 4)  # unknown topology: expert parallel


def test_eight_gpus_as_two_nvlink_quads():
    quads = [(a, b) for quad in ((0, 2, 4, 6), (1, 3, 5, 7)) for a in quad for b in quad if a < b]
    placement = plan_placement(_links(8, quads), stages=2, ep_size=4)
    assert _groups(placement) == {frozenset({0, 2, 4, 6}), frozenset({1, 3, 5, 7})}


def test_explicit_layouts_and_bad_ones():
    assert parse_layout("ep", 4) == (1, 4)
    assert parse_layout("pp", 4) == (4, 1)
    assert parse_layout("2x2", 4) == (2, 2)
    assert parse_layout("2X4", 8) == (2, 4)
    with pytest.raises(ValueError, match="needs 6 GPUs"):
        parse_layout("3x2", 4)
    with pytest.raises(ValueError, match="STAGESxEP"):
        parse_layout("wide", 4)
    with pytest.raises(ValueError, match="need 4 GPUs"):
        plan_placement(_links(2, []), 2, 2)


def test_stage_order_follows_a_chain_of_links():
    # NVLink chain 3 - 0 - 2 - 1: a four-stage layer split should walk it
    links = _links(4, [(3, 0), (0, 2), (2, 1)], default=0)
    placement = plan_placement(links, stages=4, ep_size=1)
    order = [stage[0] for stage in placement.grid]
    assert placement.stage_link_score == 3 * NVLINK
    assert order in ([3, 0, 2, 1], [1, 2, 0, 3])


def test_matching_ranks_of_neighbouring_stages_share_links():
    # expert pairs (0,1) and (2,3); across stages only 0-3 and 1-2 are NVLinked
    links = _links(4, [(0, 1), (2, 3), (0, 3), (1, 2)], default=0)
    placement = plan_placement(links, stages=2, ep_size=2)
    upper, lower = placement.grid
    assert {frozenset(upper), frozenset(lower)} == {frozenset({0, 1}), frozenset({2, 3})}
    assert all(links[a][b] == NVLINK for a, b in zip(upper, lower))
    assert placement.stage_link_score == 2 * NVLINK


def test_subset_of_gpus_and_description():
    links = _links(6, [(1, 2), (4, 5)])
    placement = plan_placement(links, stages=2, ep_size=2, gpus=[1, 2, 4, 5])
    assert _groups(placement) == {frozenset({1, 2}), frozenset({4, 5})}
    text = describe(placement, links)
    assert "2 stage(s) x 2 expert-parallel rank(s)" in text
    assert text.count("expert-parallel links: NVLink") == 2
    assert "rank 0 -> GPU 1" in text


def test_without_nvml_the_plan_keeps_the_given_order(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails as when nvidia-ml-py is absent
    assert read_link_matrix([0, 1]) is None
    main(["--gpus", "0,1,2,3", "--layout", "2x2"])
    out = capsys.readouterr().out
    assert "NVML unavailable" in out
    assert "stage 0: rank 0 -> GPU 0, rank 1 -> GPU 1" in out
    assert "stage 1: rank 2 -> GPU 2, rank 3 -> GPU 3" in out


def test_torchrun_job_places_one_stage_per_host(monkeypatch):
    from ds4d.parallel.launch import TorchrunJob

    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
           "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    job = TorchrunJob.from_environment(use_cuda=True)
    assert (job.rank, job.world_size, job.local_rank, job.local_world_size) == (5, 8, 1, 4)
    auto = job.placement("auto")  # two hosts of four: the all-reduce stays inside a host
    assert (auto.stages, auto.ep_size) == (2, 4)
    assert [auto.device_of(rank) for rank in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert auto.device_of(job.rank) == job.local_rank
    flat = job.placement("ep")
    assert (flat.stages, flat.ep_size) == (1, 8) and flat.device_of(5) == 1
    monkeypatch.delenv("MASTER_PORT")
    with pytest.raises(RuntimeError, match="MASTER_PORT not set"):
        TorchrunJob.from_environment(use_cuda=True)
