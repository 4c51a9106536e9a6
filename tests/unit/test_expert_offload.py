"""Routed experts split over a "device" bank and host RAM give the all-on-device logits bit for bit.

The offload machinery is device-agnostic, so here the "device" is the CPU and
the host copies are separate CPU tensors: the same skip logic, staging and
host-expert paths run as on a GPU.  The peer is the same checkpoint with every
expert on the device, both on the grouped-expert path (``fast_path``), and the
comparison is ``torch.equal`` on every step's logits.
"""

from __future__ import annotations

import random

import pytest
import torch

from ds4d.contracts import ForwardBatch, SeqChunk
from ds4d.models.deepseek_v4 import load_model, write_tiny_checkpoint
from ds4d.models.deepseek_v4.offload import ExpertOffload, OffloadOptions

LAYERS = [0, 4, 128, 4]


pytestmark = pytest.mark.usefixtures("one_torch_thread")



@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("offload"), seed=7, layers=LAYERS)


@pytest.fixture(scope="module")
def reference(checkpoint):
    model = load_model(checkpoint)
    model.fast_path = True
    return _steps(model)


def _offloaded(checkpoint, vram_bytes: int = 0, **options) -> tuple:
    model = load_model(checkpoint)
    model.fast_path = True
    offload = ExpertOffload(model.weights, model.cfg, device="cpu", dtype=model.dtype,
                            options=OffloadOptions(vram_bytes=vram_bytes, stage_experts=2, **options))
    model.expert_offload = offload
    return model, offload


def _steps(model, between=None) -> list[torch.Tensor]:
    """Two prompts in chunks (one step holds both), then batched and solo decode steps."""
    rng = random.Random(3)
    first = [rng.randrange(1000, 50000) for _ in range(200)]
    second = [rng.randrange(1000, 50000) for _ in range(150)]
    model.allocate_cache(16, 2)
    out = [model.forward(ForwardBatch((SeqChunk(0, tuple(first[:120]), 0, (3,), 4),)))]
    out.append(model.forward(ForwardBatch((SeqChunk(0, tuple(first[120:140]), 120, (3, 7), 2),
                                           SeqChunk(1, tuple(second[:100]), 0, (9,), 1)))))
    for step, pos in enumerate(range(140, 160)):
        if between is not None:
            between(step)
        chunks = [SeqChunk(0, (first[pos],), pos, (3, 7), 1)]
        if step % 3:
            theirs = 100 + step
            chunks.append(SeqChunk(1, (second[theirs],), theirs, (9,), 1))
        out.append(model.forward(ForwardBatch(tuple(chunks))))
    return out


def _assert_same(got, want) -> None:
    assert len(got) == len(want)
    for index, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"step {index}: max |diff| {(a - b).abs().max().item():.3e}"


def test_every_expert_cold_copies_only_used_experts(checkpoint, reference):
    model, offload = _offloaded(checkpoint, decode_cold="copy")
    assert offload.hot_experts() == [[]] * len(LAYERS)
    before = offload.expert_stats()
    assert before["bytes_copied"] == 0 and before["gpu_experts"] == 0
    _assert_same(_steps(model), reference)
    stats = offload.expert_stats()
    experts, k = model.cfg.n_routed_experts, model.cfg.num_experts_per_tok
    for row in stats["layers"]:
        assert row["hit_rate"] == 0.0 and row["cpu_experts"] == 0
        # every call either copied or skipped each expert, never both, never neither
        assert row["copied_experts"] + row["skipped_transfers"] == row["calls"] * experts
        assert row["bytes_copied"] == row["copied_experts"] * offload.host_expert_bytes
        assert row["bytes_skipped"] == row["skipped_transfers"] * offload.host_expert_bytes
    # a solo decode step routes one token to k experts: the other experts are skipped in every layer
    solo_steps = sum(1 for step in range(20) if step % 3 == 0)
    assert all(row["skipped_transfers"] >= solo_steps * (experts - k) for row in stats["layers"])
    assert stats["skipped_transfers"] > 0 and stats["bytes_skipped"] > 0


def test_solo_decode_step_copies_exactly_the_routed_experts(checkpoint):
    model, offload = _offloaded(checkpoint, decode_cold="copy")
    model.allocate_cache(4, 1)
    model.forward(ForwardBatch((SeqChunk(0, (4242,), 0, (0,), 1),)))
    experts, k = model.cfg.n_routed_experts, model.cfg.num_experts_per_tok
    for row in offload.expert_stats()["layers"]:
        assert (row["copied_experts"], row["skipped_transfers"]) == (k, experts - k)


def test_half_on_device_with_host_experts_in_decode(checkpoint, reference):
    experts = 8
    model, offload = _offloaded(checkpoint, decode_cold="cpu", cpu_threads=2)
    offload.set_placement([[e for e in range(experts) if (e + layer) % 2] for layer in range(len(LAYERS))])
    _assert_same(_steps(model), reference)
    stats = offload.expert_stats()
    assert stats["gpu_experts"] == len(LAYERS) * experts // 2
    assert all(row["cpu_experts"] > 0 and 0 < row["hit_rate"] < 1 for row in stats["layers"])
    assert all(row["copied_experts"] > 0 for row in stats["layers"])  # prefill chunks still stage


def test_all_on_device_copies_nothing(checkpoint, reference):
    model, offload = _offloaded(checkpoint, vram_bytes=1 << 40)
    assert offload.expert_stats()["ram_experts"] == 0
    _assert_same(_steps(model), reference)
    stats = offload.expert_stats()
    assert stats["bytes_copied"] == 0 and stats["skipped_transfers"] == 0
    assert all(row["hit_rate"] == 1.0 for row in stats["layers"])


def test_budget_sets_the_number_of_device_experts(checkpoint):
    _, probe = _offloaded(checkpoint)
    budget = probe.staging_bytes + 11 * probe.device_expert_bytes + probe.device_expert_bytes // 2
    _, offload = _offloaded(checkpoint, vram_bytes=budget)
    hot = offload.hot_experts()
    assert sum(map(len, hot)) == 11
    assert max(map(len, hot)) - min(map(len, hot)) <= 1  # before any routing: spread evenly
    plan = offload.memory_plan()
    assert plan["routed experts (device banks)"]["vram_bytes"] == 11 * offload.device_expert_bytes


def test_placement_changes_between_steps_keep_outputs(checkpoint, reference):
    model, offload = _offloaded(checkpoint, decode_cold="auto")
    rng = random.Random(11)

    def move(step: int) -> None:
        offload.set_placement([sorted(rng.sample(range(8), rng.randrange(0, 9))) for _ in LAYERS])

    _assert_same(_steps(model, between=move), reference)
    assert offload.placement_bytes > 0


def test_online_placement_moves_toward_routed_experts(checkpoint, reference):
    _, probe = _offloaded(checkpoint)
    budget = probe.staging_bytes + 8 * probe.device_expert_bytes
    model, offload = _offloaded(checkpoint, vram_bytes=budget, placement="online", replan_tokens=16)
    _assert_same(_steps(model), reference)
    stats = offload.expert_stats()
    assert stats["replans"] >= 1 and stats["gpu_experts"] == 8
    counts = offload.policy.counts
    hot = offload.hot_experts()
    # what sits on the device is among the most-routed experts the policy saw
    chosen = sorted((counts[layer][e] for layer, ids in enumerate(hot) for e in ids), reverse=True)
    left = sorted((counts[layer][e] for layer in range(len(LAYERS)) for e in range(8) if e not in hot[layer]),
                  reverse=True)
    assert sum(chosen) >= sum(left[: len(chosen)]) * 0.5


def test_watermark_refuses_host_ram_it_does_not_have(checkpoint):
    model = load_model(checkpoint)
    with pytest.raises(MemoryError, match="watermark"):
        ExpertOffload(model.weights, model.cfg, device="cpu", dtype=model.dtype,
                      options=OffloadOptions(vram_bytes=0, mem_watermark_bytes=1 << 40),
                      mem_available=lambda: 1 << 30)
