"""Routed experts of a DeepSeek-V4 GGUF file offloaded in their blocks: hot ones in a device bank, cold
ones in host slots, copied as stored and read by the GGUF kernels where they land.

The "device" is the CPU and the kernels run in Triton's interpreter (as in test_dsv4_gguf_native.py), so
the skip logic, staging banks, the layer-by-layer pass bank and placement moves run as on a GPU.  The
peer is the same file with every expert in the device bank; the rows of each (token, expert) pair are
computed by the same kernel wherever the expert sits, so the logits must be equal bit for bit.  Experts
run on host threads (``decode_cold = cpu``) are decoded and multiplied by ``bmm``, another order of float32
sums: those steps are compared within float32 rounding.

Up to ``moe_gemv.MAX_ROWS`` (token, expert) rows a MoE call takes a GEMV per row, past it the grouped
tiles; here the line is lowered to 8 rows so the prompt steps (tens of rows) take the tiles and the
decode steps (2-4 rows) the GEMV, as prompts and decode steps do at the real line of 96 (and the
interpreter runs a few tiles much faster than a GEMV per row).
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("gguf")

from ds4d.cuda import moe_gemv
from ds4d.models.deepseek_v4.gguf_loader import (
    GGUFSet,
    GGUFWeightReader,
    kept_summary,
    load_gguf_model,
    read_config,
    read_gguf_weights,
)
from ds4d.models.deepseek_v4.model import DeepseekV4Model
from ds4d.models.deepseek_v4.offload import OffloadOptions
from ds4d.models.deepseek_v4.paths import ForwardPaths
from ds4d.models.deepseek_v4.stored import GgufMatrices
from tests.parity.make_gguf_v4_fixtures import OUT as FIXTURES
from tests.unit.test_dsv4_model import Driver

pytestmark = [pytest.mark.usefixtures("one_torch_thread", "wide_gguf_gemv_programs"),
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="the GPU runs the compiled kernels (tests/gpu)")]

FIRST = [(i * 7919) % 500 + 3 for i in range(72)]
SECOND = [(i * 104729) % 500 + 3 for i in range(40)]
PATHS = ForwardPaths(fast_path=True, decode_graphs="off")


def _load(name: str, offload: OffloadOptions | None = None, int8_inputs: bool = False) -> DeepseekV4Model:
    files = GGUFSet(FIXTURES / name)
    try:
        cfg = read_config(files)
        reader = GGUFWeightReader(files, cfg, dtype=torch.float32, native=True, int8_inputs=int8_inputs)
        weights, experts = read_gguf_weights(reader, offload)
    finally:
        files.close()
    return DeepseekV4Model(cfg, weights, tokenizer=None, dtype=torch.float32, paths=PATHS, expert_offload=experts)


def _options(vram_bytes: int = 0, **options) -> OffloadOptions:
    return OffloadOptions(vram_bytes=vram_bytes, stage_experts=2, **options)


@pytest.fixture(scope="module", autouse=True)
def grouped_tiles_past_eight_rows():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(moe_gemv, "MAX_ROWS", 8)
        yield


def _run(model: DeepseekV4Model, between=None, decode_steps: int = 4) -> list[torch.Tensor]:
    """Two prompts (one in two chunks, the second chunk in the same step as the other prompt), then
    decode steps of both rows and of one; ``between(step)`` runs before each decode step."""
    driver = Driver(model)
    driver.start("a")
    driver.start("b")
    out = [driver.step([("a", FIRST[:48], 2)])[0]]
    out += driver.step([("a", FIRST[48:], 2), ("b", SECOND, 1)])
    ids = {"a": int(out[1][-1].argmax()), "b": int(out[2][-1].argmax())}
    for step in range(decode_steps):
        if between is not None:
            between(step)
        rows = ["a", "b"] if step % 2 == 0 else ["a"]
        logits = driver.step([(name, [ids[name]], 1) for name in rows])
        for name, row in zip(rows, logits):
            ids[name] = int(row[-1].argmax())
        out += logits
    return out


def _assert_equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for index, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"output {index}: max |diff| {(a - b).abs().max().item():.3e}"


MIXED = "quant-IQ2_XXS.gguf"
"""Gate/up kept in IQ2_XXS blocks, the IQ4_NL down projection decoded: a bank mixing both."""
KEPT = "quant-Q6_K.gguf"
"""Gate/up Q6_K and down Q8_0, all kept in blocks."""

_REFERENCE: dict[str, list[torch.Tensor]] = {}


def _reference(name: str) -> list[torch.Tensor]:
    """The file's logits with every expert in the device bank."""
    if name not in _REFERENCE:
        _REFERENCE[name] = _run(_load(name))
    return _REFERENCE[name]


@pytest.mark.parametrize("name", [MIXED, KEPT])
def test_every_expert_cold_gives_the_on_device_logits(name):
    want = _reference(name)
    model = _load(name, _options(decode_cold="copy"))
    offload = model.expert_offload
    assert offload.form.kind == "gguf" and offload.hot_experts() == [[]] * model.cfg.num_hidden_layers
    assert offload.expert_stats()["form"] == {MIXED: "gguf IQ2_XXS/decoded", KEPT: "gguf Q6_K/Q8_0"}[name]
    stage = offload.staged.stages[0]
    assert isinstance(stage.gate_up, GgufMatrices) and stage.gate_up.raw.dtype == torch.uint8
    assert stage.gate_up.raw.data_ptr() == stage.packed["gate_up"].data_ptr()  # read where the copy lands
    slot = offload.slots.parts((0, 0))
    assert slot["gate_up"].dtype == torch.uint8
    assert offload.host_expert_bytes == sum(t.numel() * t.element_size() for t in slot.values())
    assert offload.device_expert_bytes == offload.host_expert_bytes
    _assert_equal(_run(model), want)
    stats = offload.expert_stats()
    copied = sum(layer["copied_experts"] for layer in stats["layers"])
    assert copied > 0 and stats["bytes_copied"] == copied * offload.host_expert_bytes
    assert stats["skipped_transfers"] > 0  # the tiny model has 4 experts a layer; decode steps use at most 4 of 12


@pytest.mark.parametrize("mode", ["gathered", "in-place", "fetched ahead"])
def test_decode_steps_read_cold_gguf_experts_by_address(mode):
    """Zero-copy decode (gate/up and down both in blocks): a decode step's rows read each expert through the
    layer's address table, from the device bank when hot and from its host slot when cold (or from a
    device copy the step gathered first, or fetched a layer ahead as predicted), with no routing read back,
    so the step can be captured in a CUDA graph; the logits are the on-device model's, bit for bit, through
    a placement move too."""
    want = _reference(KEPT)
    gather, ahead = mode != "in-place", 8 if mode == "fetched ahead" else 0
    probe = _load(KEPT, _options(gather_cold=gather, fetch_ahead=ahead))
    per_expert = probe.expert_offload.device_expert_bytes
    model = _load(KEPT, _options(per_expert * 3 + probe.expert_offload.staging_bytes, placement="static",
                                 gather_cold=gather, fetch_ahead=ahead))
    offload = model.expert_offload
    assert offload.zero_copy and offload.gather == gather and offload.capturable(2)
    assert offload.zero_copy_experts.ahead_rows == ahead
    layers, experts = model.cfg.num_hidden_layers, model.cfg.n_routed_experts

    def move(step: int) -> None:
        if step == 2:
            offload.set_placement([[layer % experts] for layer in range(layers)])

    _assert_equal(_run(model, move), want)
    stats = offload.expert_stats()
    pairs = layers * model.cfg.num_experts_per_tok * (2 + 1 + 2 + 1)  # every decode step's (row, expert) pairs
    assert stats["zero_copy"] and sum(layer["zero_copy_pairs"] for layer in stats["layers"]) == pairs
    assert stats["host_read_bytes"] > 0  # rows whose expert sat in host RAM
    hashed = stats["layers"][:model.cfg.num_hash_layers]  # their experts follow the token: always predicted
    assert all(row["fetched_ahead_pairs"] == (row["host_read_pairs"] if ahead else 0) for row in hashed)
    if ahead:
        assert sum(row["host_read_pairs"] for row in hashed) > 0
    else:
        assert stats["fetched_ahead_pairs"] == 0


@pytest.mark.parametrize("name", [MIXED])
def test_hot_and_cold_experts_and_a_placement_move_give_the_on_device_logits(name):
    """Half of the experts on the device (each expert once: a hot one has no host slot); before each
    decode step the placement moves, so experts are promoted from host slots and demoted back."""
    want = _reference(name)
    probe = _load(name, _options(decode_cold="copy"))
    half = 2 * probe.expert_offload.device_expert_bytes * probe.cfg.num_hidden_layers
    model = _load(name, _options(half + probe.expert_offload.staging_bytes, decode_cold="copy", placement="static"))
    offload = model.expert_offload
    hot = offload.hot_experts()
    layers, experts = model.cfg.num_hidden_layers, model.cfg.n_routed_experts
    assert sum(map(len, hot)) == layers * 2
    assert offload.host_experts() == layers * experts - layers * 2

    def move(step: int) -> None:
        offload.set_placement([[(e + step + 1) % experts for e in range(2)] for _ in range(layers)])

    _assert_equal(_run(model, move), want)
    assert offload.demoted_bytes > 0 and offload.placement_bytes > 0
    assert offload.host_experts() == layers * experts - layers * 2


@pytest.mark.parametrize("name", [KEPT])
def test_a_layer_by_layer_prefill_copies_each_cold_expert_once(name):
    """The model's layer-major prefill (``prefill_block``): blocks of 16 tokens share one copy of each
    cold expert in the pass bank, with the logits of the all-on-device model run the same way."""
    layer_major = PATHS.replace(prefill_block=16)
    reference = _load(name)
    reference.paths = layer_major
    want = _run(reference, decode_steps=0)
    model = _load(name, _options(decode_cold="copy"))
    model.paths = layer_major
    _assert_equal(_run(model, decode_steps=0), want)
    offload = model.expert_offload
    stats = offload.expert_stats()
    copied = sum(layer["copied_experts"] for layer in stats["layers"])
    # three steps of 48, 24 and 40 + 16 tokens, each layer's 4 experts copied at most once per step
    assert 0 < copied <= 3 * model.cfg.num_hidden_layers * model.cfg.n_routed_experts
    assert offload.memory_plan()["expert staging (one layer, layer-by-layer prefill)"]["vram_bytes"] > 0


@pytest.mark.parametrize("name", [MIXED])
def test_cold_experts_on_host_threads_agree_within_float32_rounding(name):
    want = _reference(name)
    model = _load(name, _options(decode_cold="cpu", cpu_max_rows=4))
    got = _run(model)
    assert sum(layer["cpu_experts"] for layer in model.expert_offload.expert_stats()["layers"]) > 0
    for a, b in zip(got, want):
        assert (a - b).abs().max().item() <= 1e-4 * b.abs().max().item()
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_the_summary_counts_offloaded_experts_in_their_blocks():
    model = _load("quant-Q6_K.gguf", _options())
    summary = kept_summary(model.weights, model.expert_offload)
    assert "6 Q6_K experts" in summary and "3 Q8_0 experts" in summary


def test_layers_whose_expert_types_differ_keep_host_slots_of_their_own():
    """llama-quantize's Q4_K_M mix: layers 0 and 1 store the down projection as Q5_0 (held decoded), layer 2
    as Q8_0 (kept in blocks).  Each form gets host slots and staging banks of its own size; the budget
    counts the largest layer's experts; a placement move runs over both forms; the logits are the
    on-device model's, bit for bit."""
    name = "quant-Q4_K_M.gguf"
    want = _run(_load(name))
    probe = _load(name, _options())
    sizes = probe.expert_offload.layer_expert_bytes
    assert sizes[0] == sizes[1] != sizes[2]
    assert probe.expert_offload.device_expert_bytes == max(sizes)
    assert probe.expert_offload.expert_stats()["form"] == "gguf Q4_K/decoded (layers 0, 1); gguf Q4_K/Q8_0 (layers 2)"
    model = _load(name, _options(2 * max(sizes) + probe.expert_offload.staging_bytes, decode_cold="copy",
                                 placement="static"))
    offload = model.expert_offload
    pools = offload.residency.pools
    assert len(pools) == 2 and len(offload.staged.staging) == 2
    assert {form.host_expert_bytes for form in pools} == set(sizes)
    assert all(slots.slot_bytes >= form.host_expert_bytes for form, slots in pools.items())
    layers, experts = model.cfg.num_hidden_layers, model.cfg.n_routed_experts
    assert sum(map(len, offload.hot_experts())) == 2

    def move(step: int) -> None:
        offload.set_placement([[(step + layer) % experts] if layer != 1 else [] for layer in range(layers)])

    _assert_equal(_run(model, move), want)
    assert offload.demoted_bytes > 0
    assert offload.host_experts() == layers * experts - 2
    plan = offload.memory_plan()
    assert plan["routed experts (host RAM, pinned)"]["ram_bytes"] == sum(slots.bytes for slots in pools.values())
    assert plan["routed experts (device banks)"]["vram_bytes"] == sizes[0] + sizes[2]


def test_a_file_decoded_on_the_cpu_offloads_its_float_experts():
    """Without the kernels (``weight_format`` auto on the CPU) the file is decoded and its experts
    offloaded as float values, with the logits of the same file's experts all on the device."""
    want = _run(load_gguf_model(FIXTURES / "quant-Q2_K.gguf", paths=PATHS))
    model = load_gguf_model(FIXTURES / "quant-Q2_K.gguf", paths=PATHS, offload=_options(decode_cold="copy"))
    assert model.expert_offload.form.kind == "float"
    _assert_equal(_run(model), want)


def test_int8_inputs_follow_offloaded_experts_into_every_bank_and_address_table():
    """``int8_inputs`` (the daemon's ``gguf_int8_inputs``) is the bank's, so the offloaded experts keep it: the
    layer's form, its hot device bank, the staging banks the cold ones are copied into and the address tables
    decode steps read them through all take their GEMVs on int8 inputs; without it none does."""
    for int8 in (True, False):
        probe = _load(KEPT, _options())
        budget = probe.expert_offload.device_expert_bytes * 3 + probe.expert_offload.staging_bytes
        offload = _load(KEPT, _options(budget, placement="static"), int8_inputs=int8).expert_offload
        assert offload.form.gguf_int8 == int8 and offload.zero_copy
        matrices = [m for bank in offload.banks for m in (bank.gate_up, bank.down)]
        matrices += [m for bank in offload.staged.stages_of(offload.form) for m in (bank.gate_up, bank.down)]
        matrices += [m for table in offload.zero_copy_experts.addressed if table for m in table]
        assert matrices and all(m.int8_inputs == int8 for m in matrices)
