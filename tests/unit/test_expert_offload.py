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
from ds4d.models.deepseek_v4.paths import ForwardPaths

GROUPED = ForwardPaths(fast_path=True)
"""Grouped experts and batched decode: the paths the GPU runs."""

LAYERS = [0, 4, 128, 4]


pytestmark = pytest.mark.usefixtures("one_torch_thread")



@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("offload"), seed=7, layers=LAYERS)


@pytest.fixture(scope="module")
def reference(checkpoint):
    model = load_model(checkpoint, paths=GROUPED)
    return _steps(model)


def _offloaded(checkpoint, vram_bytes: int = 0, **options) -> tuple:
    model = load_model(checkpoint, paths=GROUPED)
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


# ---------------------------------------------------------------- float experts: the host keeps only cold ones

RANDOM_LAYERS = [0, 0, 4, 128]


def _random_model(options: OffloadOptions | None = None):
    """A random model of small widths with float experts (the bank kind whose device form is the stored
    form), its experts adopted layer by layer as they are drawn when ``options`` is given."""
    from ds4d.bench.random_v4 import base_config
    from ds4d.models.deepseek_v4.config import DeepseekV4Config
    from ds4d.models.deepseek_v4.model import DeepseekV4Model
    from ds4d.models.deepseek_v4.random_init import RandomReader
    from ds4d.models.deepseek_v4.weights import read_weights

    cfg = DeepseekV4Config.from_dict({**base_config(tiny=True), "num_hidden_layers": len(RANDOM_LAYERS),
                                      "compress_ratios": RANDOM_LAYERS}, name="random-v4")
    reader = RandomReader(cfg, dtype=torch.float32, device="cpu", seed=5)
    offload = ExpertOffload(None, cfg, device="cpu", dtype=torch.float32, options=options) if options else None
    adopted = []

    def sink(layer, bank):
        adopted.append((layer, offload.adopt(layer, bank)))
        assert bank.weights == {} and bank.gate_up is None  # handed over before the next layer is drawn
        return bank

    weights = read_weights(reader, expert_sink=sink if offload else None)
    if offload:
        offload.finish()
        assert [layer for layer, _ in adopted] == list(range(len(RANDOM_LAYERS)))
    model = DeepseekV4Model(cfg, weights, tokenizer=None, dtype=torch.float32, expert_offload=offload, paths=GROUPED)
    return model, offload


@pytest.fixture(scope="module")
def random_reference():
    model, _ = _random_model()
    return model.info.parameter_bytes, _steps(model)


def _each_expert_once(offload: ExpertOffload) -> None:
    """Every expert is either in a device bank or in a host slot, never both, never neither."""
    slots = []
    for layer, bank in enumerate(offload.banks):
        for expert in range(offload.experts):
            on_host = offload.host_slot[layer][expert] is not None
            assert (bank.slot_of[expert] >= 0) != on_host, (layer, expert)
            if on_host:
                slots.append(offload.host_slot[layer][expert])
    assert len(set(slots)) == len(slots)  # no slot holds two experts
    assert len(slots) + len(offload.slots.free) == offload.slots.slots


def test_streamed_float_experts_host_keeps_only_cold_ones(random_reference):
    parameter_bytes, want = random_reference
    probe = _random_model(OffloadOptions(vram_bytes=0, stage_experts=2))[1]
    budget = probe.staging_bytes + 30 * probe.device_expert_bytes
    model, offload = _random_model(OffloadOptions(vram_bytes=budget, stage_experts=2, decode_cold="copy"))
    assert not offload.keeps_all and offload.kind == "float"
    total = len(RANDOM_LAYERS) * model.cfg.n_routed_experts
    assert sum(map(len, offload.hot_experts())) == 30
    assert offload.host_experts() == total - 30
    assert offload.slots.slots == total - 30 + 2  # the cold experts and one spare staging bank
    assert offload.memory_plan()["routed experts (host RAM, pinned)"]["ram_bytes"] == \
        offload.slots.slots * offload.slots.slot_bytes
    _each_expert_once(offload)
    assert model.info.parameter_bytes == parameter_bytes  # the experts still count, once
    _assert_same(_steps(model), want)
    assert offload.expert_stats()["bytes_copied"] > 0
    # fewer hot experts: the host grows by exactly what the demoted ones need
    offload.set_placement([list(range(2 + layer)) for layer in range(len(RANDOM_LAYERS))])
    _each_expert_once(offload)
    assert offload.host_experts() == offload.slots.slots == total - 14
    assert offload.demoted_bytes == 16 * offload.host_expert_bytes
    _assert_same(_steps(model), want)


def test_placement_moves_demote_to_host_and_keep_outputs(random_reference):
    _, want = random_reference
    model, offload = _random_model(OffloadOptions(vram_bytes=0, stage_experts=2, decode_cold="auto",
                                                  cpu_threads=2))
    experts, total = model.cfg.n_routed_experts, len(RANDOM_LAYERS) * model.cfg.n_routed_experts
    assert offload.host_experts() == total
    rng = random.Random(5)
    hot_counts = []

    def move(step: int) -> None:
        hot = [sorted(rng.sample(range(experts), rng.randrange(0, experts + 1))) for _ in RANDOM_LAYERS]
        offload.set_placement(hot)
        assert offload.hot_experts() == hot
        _each_expert_once(offload)
        hot_counts.append(sum(map(len, hot)))

    _assert_same(_steps(model, between=move), want)
    assert offload.demoted_bytes > 0 and offload.placement_bytes > 0
    assert min(hot_counts) < max(hot_counts)
    # every move's demotions fit in the slots its promotions freed: the host never grew
    assert offload.slots.slots == total + 2
