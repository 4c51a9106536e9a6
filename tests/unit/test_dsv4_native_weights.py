"""DeepSeek-V4 with its weights kept as stored (FP8 linears, MXFP4 experts) against decoded weights.

On a GPU, ``weight_format = native`` keeps the checkpoint's FP8 linears and MXFP4
routed experts as they are and multiplies them with ``ds4d.cuda.quant_matmul``.
Here the same kernels run in Triton's CPU interpreter, in float32, inside the
whole model: a prefill (grouped MXFP4 tiles, FP8 tiles of many rows) and decode
steps (one MXFP4 GEMV per row, FP8 tiles of one row), against the model loaded
with every weight decoded.  Decoding is exact, so the two differ only in the
order of float32 sums.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

pytest.importorskip("triton")

from ds4d.contracts import ForwardBatch, SeqChunk
from ds4d.models.deepseek_v4 import write_tiny_checkpoint
from ds4d.models.deepseek_v4.config import DeepseekV4Config
from ds4d.models.deepseek_v4.knobs import native_weights
from ds4d.models.deepseek_v4.loader import SafetensorsCheckpoint, WeightReader
from ds4d.models.deepseek_v4.model import DeepseekV4Model
from ds4d.models.deepseek_v4.offload import ExpertOffload, OffloadOptions
from ds4d.models.deepseek_v4.paths import ForwardPaths
from ds4d.models.deepseek_v4.stored import Fp8Weight, Mxfp4Matrices
from ds4d.models.deepseek_v4.weights import read_weights
from tests.unit.test_dsv4_model import Driver

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=11, layers=[0, 4, 128])


def _load(path, native: bool, padded: bool = False) -> DeepseekV4Model:
    cfg = DeepseekV4Config.from_file(path)
    checkpoint = SafetensorsCheckpoint(path)
    try:
        weights = read_weights(WeightReader(checkpoint, cfg, dtype=torch.float32, native=native))
    finally:
        checkpoint.close()
    # grouped experts and batched decode (padded to buckets as the graphs run them: ``padded``)
    return DeepseekV4Model(cfg, weights, tokenizer=None, dtype=torch.float32,
                           paths=ForwardPaths(fast_path=True, decode_graphs="padded" if padded else "off"))


def _prefill_then_steps(model: DeepseekV4Model, prompt: list[int], steps: int = 3) -> list[torch.Tensor]:
    """The prompt's logits as one chunk, then those of ``steps`` greedy decode steps of one row each."""
    driver = Driver(model)
    driver.start("a")
    out = [driver.prefill("a", prompt, chunk=len(prompt))]
    for _ in range(steps):
        out.append(driver.step([("a", [int(out[-1][-1].argmax())], 1)])[0])
    return out


def test_native_layout(checkpoint):
    model = _load(checkpoint, native=True)
    assert model.native_weights and model.info.extra["weights"] == "native"
    attn, ffn = model.weights.layers[1].attn, model.weights.layers[1].ffn
    assert isinstance(attn.wq_b, Fp8Weight) and attn.wq_b.data.dtype == torch.float8_e4m3fn
    assert isinstance(attn.indexer.wq_b, Fp8Weight) and isinstance(attn.wo_a, torch.Tensor)  # wo_a: bf16 as stored
    assert isinstance(ffn.shared_w2, Fp8Weight)
    gate_up, down = ffn.experts.native
    assert isinstance(gate_up, Mxfp4Matrices) and gate_up.packed.shape == (8, 128, 32)
    assert down.scales.shape == (8, 64, 2)
    # the per-matrix views read the restacked storage
    assert torch.equal(ffn.experts.weights["w3"], gate_up.packed[:, 64:])
    dense = _load(checkpoint, native=False)
    assert not dense.native_weights
    assert torch.equal(attn.wq_b.dense(), dense.weights.layers[1].attn.wq_b)
    assert model.info.parameter_bytes < dense.info.parameter_bytes


PROMPT = [(i * 7919) % 5000 + 10 for i in range(150)]  # 150 x 2 expert rows: the grouped kernel


@pytest.fixture(scope="module")
def native_steps(checkpoint) -> list[torch.Tensor]:
    """``_prefill_then_steps`` of the native model, all on the device, over ``PROMPT``."""
    return _prefill_then_steps(_load(checkpoint, native=True), PROMPT)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the GPU tests run the compiled kernels")
def test_native_equals_decoded_prefill_and_decode(checkpoint, native_steps):
    dense_steps = _prefill_then_steps(_load(checkpoint, native=False), PROMPT)  # one token a step: the per-row kernels
    (got, got_ids), (want, want_ids) = ((torch.cat(steps), [int(step[-1].argmax()) for step in steps])
                                        for steps in (native_steps, dense_steps))
    assert (got - want).abs().max().item() < 1e-4 * want.abs().max().item()
    assert torch.equal(got.argmax(-1), want.argmax(-1)) and got_ids == want_ids


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the GPU tests run the compiled kernels")
def test_fp8_linears_of_one_input_multiply_in_one_gemv_and_give_the_same_logits_bit_for_bit(tmp_path):
    """``wq_a`` with ``wkv`` and the shared expert's ``w1`` with ``w3``, FP8 as stored: one weight of both's rows
    and scales (each a view of it: no memory more), one GEMV launch in a batch-1 decode step.  The first
    weight ends on a scale block (128 rows here), so every row keeps its scales; a GEMV's row sums do not
    depend on the rows beside them, so prefill and decode logits are those of the unfused model bit for bit.
    The default tiny widths (32 rows of ``wq_a``, 64 inputs) are not fused: their rows straddle a block."""
    path = write_tiny_checkpoint(tmp_path / "wide", seed=5, layers=[4], hidden_size=512, q_lora_rank=128,
                                 head_dim=128, moe_intermediate_size=128)
    prompt = [(i * 7919) % 5000 + 10 for i in range(40)]

    fused = _load(path, native=True)
    attn, ffn = fused.weights.layers[0].attn, fused.weights.layers[0].ffn
    assert isinstance(attn.wq_a_wkv, Fp8Weight) and isinstance(ffn.shared_w13, Fp8Weight)
    assert attn.wq_a_wkv.data.shape == (256, 512) and attn.wq_a_wkv.scale.shape == (2, 4)
    assert attn.wq_a.data.data_ptr() == attn.wq_a_wkv.data.data_ptr()
    assert attn.wkv.scale.data_ptr() == attn.wq_a_wkv.scale[1:].data_ptr()
    x = torch.randn(1, 512)
    assert attn.wq_a_wkv.takes_gemv(x) and not attn.wq_a_wkv.takes_gemv(torch.randn(2, 512))
    apart = _load(path, native=True)
    for layer in apart.weights.layers:
        layer.attn.wq_a_wkv = layer.ffn.shared_w13 = None
    assert fused.info.parameter_bytes == apart.info.parameter_bytes
    assert torch.equal(torch.cat(_prefill_then_steps(fused, prompt)), torch.cat(_prefill_then_steps(apart, prompt)))
    narrow = _load(write_tiny_checkpoint(tmp_path / "narrow", seed=5, layers=[0]), native=True).weights.layers[0]
    assert narrow.attn.wq_a_wkv is None and narrow.ffn.shared_w13 is None


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the GPU tests run the compiled kernels")
def test_decode_kernels_take_the_swiglus_in_the_gate_up_gemvs_with_the_same_logits(tmp_path, monkeypatch):
    """With the decode kernels, a batch-1 step's SwiGLUs run in the epilogues of the routed experts' MXFP4 gate/up
    GEMV and of the shared expert's fused FP8 ``w1 + w3`` GEMV (``gated``): the logits of prefill and decode are
    bit for bit those of the GEMVs followed by ``prefill_triton.swiglu``."""
    from ds4d.cuda import quant_matmul
    from ds4d.models.deepseek_v4 import moe

    path = write_tiny_checkpoint(tmp_path / "wide", seed=5, layers=[4], hidden_size=512, q_lora_rank=128,
                                 head_dim=128, moe_intermediate_size=128)
    prompt = [(i * 7919) % 5000 + 10 for i in range(40)]
    model = _load(path, native=True)
    model = model.with_paths(model.paths.replace(decode_kernel=True))
    gated = []
    for name in ("mxfp4_rows_at", "fp8_linear"):
        plain = getattr(quant_matmul, name)

        def recorded(*args, plain=plain, name=name, **kwargs):
            if kwargs.get("gated") is not None:
                gated.append(name)
            return plain(*args, **kwargs)

        monkeypatch.setattr(quant_matmul, name, recorded)
    fused = torch.cat(_prefill_then_steps(model, prompt))
    assert gated.count("mxfp4_rows_at") == 3 and gated.count("fp8_linear") == 3  # each decode step's one layer
    monkeypatch.setattr(moe, "_gated_product", lambda *args: None)
    monkeypatch.setattr(Fp8Weight, "gated", lambda self, x, limit: None)
    assert torch.equal(fused, torch.cat(_prefill_then_steps(model.with_paths(), prompt)))
    assert len(gated) == 6


def test_weight_format_choice():
    assert not native_weights("auto", torch.float32, "cpu")
    assert not native_weights("dense", torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        native_weights("native", torch.float32, "cpu")
    with pytest.raises(ValueError, match="auto, dense or native"):
        native_weights("int4", torch.float32, "cpu")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the GPU tests run the compiled kernels")
@pytest.mark.parametrize("gather_cold", [True, False], ids=["gathered", "in-place"])
def test_offload_with_native_banks_equals_all_on_device(checkpoint, native_steps, gather_cold):
    """Expert offload with MXFP4 device banks and staging (``OffloadOptions.native``): the hot bank,
    the staged cold experts (prefill), the experts read through address tables (decode: in place,
    or first gathered into device scratch) and the all-on-device model run the same kernels, so
    every step's logits are equal bit for bit."""
    want = native_steps
    model = _load(checkpoint, native=True)
    offload = ExpertOffload(model.weights, model.cfg, device="cpu", dtype=model.dtype,
                            options=OffloadOptions(vram_bytes=0, stage_experts=2, decode_cold="copy", native=True,
                                                   gather_cold=gather_cold))
    model.expert_offload = offload
    offload.set_placement([[e for e in range(8) if (e + layer) % 2] for layer in range(model.cfg.num_hidden_layers)])
    assert offload.native and isinstance(offload.banks[1].gate_up, Mxfp4Matrices)
    assert offload.gather == gather_cold
    assert offload.device_expert_bytes == offload.host_expert_bytes  # stored bytes, not decoded ones
    assert all(layer.ffn.experts.native is None for layer in model.weights.layers)  # moved to the host copy
    assert offload.zero_copy  # a CPU "device" reads the host copies directly
    got = _prefill_then_steps(model, PROMPT)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    stats = offload.expert_stats()
    assert stats["bytes_copied"] > 0  # the prefill staged its cold experts
    assert stats["host_read_bytes"] > 0  # decode read cold experts in place
    assert sum(row["zero_copy_pairs"] for row in stats["layers"]) == 3 * 2 * model.cfg.num_hidden_layers
    offload.close()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the GPU tests run the compiled kernels")
def test_zero_copy_counts_leave_out_bucket_padding(checkpoint):
    """Decode steps padded to a bucket (as the CUDA graphs run them): three sequences fill a bucket of
    four, and the padding row (scratch slot) is computed but neither counted nor read from the host."""
    model = _load(checkpoint, native=True, padded=True)
    offload = ExpertOffload(model.weights, model.cfg, device="cpu", dtype=model.dtype,
                            options=OffloadOptions(vram_bytes=0, stage_experts=2, decode_cold="copy", native=True))
    model.expert_offload = offload
    offload.set_placement([[e for e in range(8) if (e + layer) % 2] for layer in range(model.cfg.num_hidden_layers)])
    driver = Driver(model)
    names = ("a", "b", "c")
    tokens = {}
    for i, name in enumerate(names):
        driver.start(name)
        tokens[name] = int(driver.prefill(name, [(j * 7919 + i) % 5000 + 10 for j in range(4)], chunk=4)[-1].argmax())
    steps, k, layers = 1, model.cfg.num_experts_per_tok, model.cfg.num_hidden_layers
    for _ in range(steps):
        for name, logits in zip(names, driver.step([(name, [tokens[name]], 1) for name in names])):
            tokens[name] = int(logits[-1].argmax())
    stats = offload.expert_stats()
    assert sum(row["zero_copy_pairs"] for row in stats["layers"]) == steps * len(names) * k * layers
    assert 0 < sum(row["host_read_pairs"] for row in stats["layers"]) <= steps * len(names) * k * layers
    offload.close()


def _offloaded(checkpoint, padded: bool = False, **options) -> tuple[DeepseekV4Model, ExpertOffload]:
    """The tiny native model with half of every layer's experts in host slots, decode reading them zero-copy."""
    model = _load(checkpoint, native=True, padded=padded)
    offload = ExpertOffload(model.weights, model.cfg, device="cpu", dtype=model.dtype,
                            options=OffloadOptions(vram_bytes=0, stage_experts=2, decode_cold="copy", native=True,
                                                   **options))
    model.expert_offload = offload
    offload.set_placement([[e for e in range(8) if (e + layer) % 2] for layer in range(model.cfg.num_hidden_layers)])
    return model, offload


@pytest.fixture(scope="module")
def gathered_runs() -> dict[bool, list[torch.Tensor]]:
    """Per ``padded``: the steps of gathering every cold expert at its layer (filled by the first test to ask)."""
    return {}


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the GPU tests run the compiled kernels")
@pytest.mark.parametrize("case", ["predicted", "padded", "mispredicted", "too many rows"])
def test_cold_experts_fetched_ahead_give_the_logits_of_gathering_them(checkpoint, case, monkeypatch, gathered_runs):
    """``fetch_ahead``: each decode layer's cold experts are copied before its routing is known, as its router
    predicts them from the feed-forward input of the layer before (hash layers: their table, so always
    right); the rows whose expert was fetched read that copy, the others gather theirs as without it.  Every
    step's logits equal those of gathering every cold expert at its layer, bit for bit, whether the
    prediction is right, padded to a bucket, wrong (a cold expert other than the predicted ones), or
    skipped (a step of more rows than ``fetch_ahead``): one sequence, so no row can use another's fetch."""
    prompt = [(i * 7919) % 5000 + 10 for i in range(150)]
    padded = case == "padded"
    if padded not in gathered_runs:
        gathered_runs[padded] = _prefill_then_steps(_offloaded(checkpoint, padded=padded)[0], prompt)
    want = gathered_runs[padded]
    model, offload = _offloaded(checkpoint, padded=padded, fetch_ahead=1 if case == "too many rows" else 4)
    assert offload.gather and offload.zero_copy_experts.ahead_rows == offload.options.fetch_ahead
    if case == "mispredicted":  # each row's prediction: a cold expert it was not predicted to use
        zero_copy = offload.zero_copy_experts
        fetch = zero_copy.fetch_ahead

        def wrong(layer: int, predict):
            chosen = predict()
            unused = torch.ones(chosen.shape[0], model.cfg.n_routed_experts, dtype=torch.bool)
            unused[torch.arange(chosen.shape[0])[:, None], chosen] = False
            other = (unused & zero_copy.on_host[layer].bool()).int().argmax(dim=1)
            return other[:, None].expand_as(chosen)

        monkeypatch.setattr(zero_copy, "fetch_ahead",
                            lambda layer, x, predict: fetch(layer, x, lambda: wrong(layer, predict)))
    got = _prefill_then_steps(model, prompt)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    stats = offload.expert_stats()
    host_reads = sum(row["host_read_pairs"] for row in stats["layers"])
    assert host_reads > 0
    hashed = stats["layers"][:model.cfg.num_hash_layers]  # their experts are known ahead, from the token
    assert sum(row["host_read_pairs"] for row in hashed) > 0
    if case in ("predicted", "padded"):
        assert 0 < stats["fetched_ahead_pairs"] <= host_reads
        assert all(row["fetched_ahead_pairs"] == row["host_read_pairs"] for row in hashed)  # every cold one fetched
    elif case == "mispredicted":  # a later layer's prediction may still name the expert its routing picks
        assert all(row["fetched_ahead_pairs"] == 0 for row in hashed)
    else:
        assert stats["fetched_ahead_pairs"] == 0
    assert not offload.zero_copy_experts._pending  # no fetch left for a later step
    offload.close()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the GPU tests run the compiled kernels")
@pytest.mark.skipif(shutil.which("g++") is None, reason="torch.compile's CPU code needs a C++ compiler")
def test_a_compiled_decode_step_fetches_ahead_and_gives_the_logits_of_gathering(checkpoint):
    """The decode step through ``torch.compile`` (``compile_decode``; inductor's CPU code here) with cold experts
    fetched ahead: the side stream's work, its events and the pending fetches stay outside the compiled graphs
    (``torch.compiler.disable``), the step gives the compiled step without fetching ahead bit for bit, and it
    leaves no fetch pending."""
    from ds4d.cuda.graphs import compiled
    from ds4d.models.deepseek_v4.model import pack_decode_rows

    logits, hits = [], []
    for ahead in (0, 4):
        model, offload = _offloaded(checkpoint, fetch_ahead=ahead)
        model.allocate_cache(8, 2)
        prompt = tuple((i * 7919) % 5000 + 10 for i in range(150))
        model.forward(ForwardBatch((SeqChunk(0, prompt, 0, (0, 1), 1),)))
        packed = pack_decode_rows([SeqChunk(0, (77,), 150, (0, 1), 1)], model.cache, 1, 8)
        logits.append(compiled(model._decode_step)(packed))
        hits.append(offload.expert_stats()["fetched_ahead_pairs"])
        assert not offload.zero_copy_experts._pending
        offload.close()
    assert torch.equal(logits[0], logits[1])
    assert hits[0] == 0 < hits[1]
