"""A DeepSeek-V4 GGUF file with its linears and routed experts kept in their blocks (``weight_format =
native``) against the same file decoded to float.

llama.cpp's own tiny quantised files (tests/fixtures/gguf_v4): the converter's Q8_0 linears with MXFP4
experts, and llama-quantize's Q2_K, IQ2_XXS and Q6_K files, whose down projections (and some attention
linears) are of types no kernel reads (Q4_0, IQ4_NL) or narrower than a block of 256, so they stay decoded
beside the kept ones: banks mixing blocks and decoded matrices run too.  Here the kernels run in Triton's
interpreter in float32, inside the whole model: a 150-token prefill (each kept linear decoded for one dense
product, the experts on grouped tiles) and decode steps (a GEMV per row; per (row, expert) pair in the
experts).  Decoding is exact, so the two models differ only in the order of float32 sums.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("gguf")

from ds4d.models.deepseek_v4.gguf_loader import (
    GGUFSet,
    GGUFWeightReader,
    gguf_native,
    kept_summary,
    load_gguf_model,
    read_config,
)
from ds4d.models.deepseek_v4.model import DeepseekV4Model
from ds4d.models.deepseek_v4.paths import ForwardPaths
from ds4d.models.deepseek_v4.stored import GgufMatrices, GgufWeight
from ds4d.models.deepseek_v4.weights import read_weights
from tests.parity.make_gguf_v4_fixtures import OUT as FIXTURES
from tests.unit.test_dsv4_model import Driver

pytestmark = [pytest.mark.usefixtures("one_torch_thread", "wide_gguf_gemv_programs"),
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="the GPU tests run the compiled kernels")]

PROMPT = [(i * 7919) % 500 + 3 for i in range(150)]


def _load(name: str, native: bool, int8_inputs: bool = False) -> DeepseekV4Model:
    files = GGUFSet(FIXTURES / name)
    try:
        cfg = read_config(files)
        weights = read_weights(GGUFWeightReader(files, cfg, dtype=torch.float32, native=native,
                                                int8_inputs=int8_inputs))
    finally:
        files.close()
    return DeepseekV4Model(cfg, weights, tokenizer=None, dtype=torch.float32,
                           paths=ForwardPaths(fast_path=True, decode_graphs="off"))


def _run(model: DeepseekV4Model) -> tuple[torch.Tensor, list[int]]:
    driver = Driver(model)
    driver.start("a")
    logits = [driver.prefill("a", PROMPT, chunk=150)]
    ids = [int(logits[0][-1].argmax())]
    for _ in range(3):
        logits.append(driver.step([("a", ids[-1:], 1)])[0])
        ids.append(int(logits[-1][-1].argmax()))
    return torch.cat(logits), ids


_NATIVE: dict[str, tuple[torch.Tensor, list[int]]] = {}


def _native_run(name: str, model: DeepseekV4Model) -> tuple[torch.Tensor, list[int]]:
    """``_run`` of ``model``, the file as ``_load(name, native=True)`` gives it, once per file: the tests of one
    file share it."""
    if name not in _NATIVE:
        _NATIVE[name] = _run(model)
    return _NATIVE[name]


@pytest.mark.parametrize("name, linear_type, kept_experts", [
    ("converted.gguf", "Q8_0", {"w1": "MXFP4", "w2": "MXFP4", "w3": "MXFP4"}),
    ("quant-Q2_K.gguf", "Q2_K", {"w1": "Q2_K", "w3": "Q2_K"}),
    ("quant-IQ2_XXS.gguf", "IQ2_XXS", {"w1": "IQ2_XXS", "w3": "IQ2_XXS"}),
    ("quant-Q6_K.gguf", "Q6_K", {"w1": "Q6_K", "w2": "Q8_0", "w3": "Q6_K"}),
])
def test_blocks_as_stored_give_the_decoded_models_logits(name, linear_type, kept_experts):
    native = _load(name, native=True)
    assert native.native_weights and native.info.extra["weights"] == "native"
    attn, ffn = native.weights.layers[1].attn, native.weights.layers[1].ffn
    assert isinstance(attn.wq_a, GgufWeight) and attn.wq_a.qtype == linear_type
    assert attn.wq_a.raw.dtype == torch.uint8
    assert {which: m.qtype for which, m in ffn.experts.gguf.items()} == kept_experts
    gate_up, down = ffn.experts.native
    assert isinstance(gate_up, GgufMatrices) and gate_up.raw.shape[1] == 2 * native.cfg.moe_intermediate_size
    assert isinstance(down, GgufMatrices) == ("w2" in kept_experts)
    head = native.weights.head  # llama-quantize's Q5_K/Q6_K output heads stay in blocks; the converter's is BF16
    assert isinstance(head, GgufWeight) == name.startswith("quant-") and (head.dtype == torch.float32)
    decoded = _load(name, native=False)
    assert not decoded.native_weights
    assert native.info.parameter_bytes < decoded.info.parameter_bytes
    for which in ("w1", "w2", "w3"):  # the reference path's matrices: the decoded ones, bit for bit
        assert torch.equal(ffn.experts.weight(which, 3), decoded.weights.layers[1].ffn.experts.weight(which, 3))
    assert torch.equal(attn.wq_a.dense(), decoded.weights.layers[1].attn.wq_a)
    (got, got_ids), (want, want_ids) = _native_run(name, native), _run(decoded)
    assert (got - want).abs().max().item() < 1e-4 * want.abs().max().item()
    assert torch.equal(got.argmax(-1), want.argmax(-1)) and got_ids == want_ids


def test_linears_of_one_input_multiply_in_one_gemv_and_give_the_same_logits_bit_for_bit():
    """``wq_a`` with ``wkv``, and the shared expert's ``w1`` with ``w3``: one weight of both's rows (the two are
    views of it: no memory more), multiplied in one GEMV where the rows take the GEMV (decode steps), each alone
    otherwise (the prefill).  A GEMV's row sums do not depend on the rows beside them, so the model's prefill and
    decode logits are those of the unfused model bit for bit."""
    fused = _load("converted.gguf", native=True)
    attn, ffn = fused.weights.layers[1].attn, fused.weights.layers[1].ffn
    assert attn.wq_a_wkv is not None and ffn.shared_w13 is not None
    assert attn.wq_a.raw.data_ptr() == attn.wq_a_wkv.raw.data_ptr()  # wq_a, then wkv: views of the fused rows
    assert attn.wkv.raw.data_ptr() == attn.wq_a_wkv.raw[attn.wq_a.raw.shape[0]:].data_ptr()
    apart = _load("converted.gguf", native=True)
    for layer in apart.weights.layers:
        layer.attn.wq_a_wkv = layer.ffn.shared_w13 = None
    assert fused.info.parameter_bytes == apart.info.parameter_bytes
    (got, got_ids), (want, want_ids) = _native_run("converted.gguf", fused), _run(apart)
    assert torch.equal(got, want) and got_ids == want_ids


def test_int8_inputs_reach_every_kept_linear_and_expert_bank_but_the_head():
    """``int8_inputs`` (the daemon's ``gguf_int8_inputs``): every linear and routed bank kept in blocks takes its
    decode GEMVs on int8 inputs, fused pairs too; the output head stays float.  Off, none does."""
    for int8 in (True, False):
        model = _load("quant-IQ2_XXS.gguf", native=True, int8_inputs=int8)
        kept = [w for layer in model.weights.layers for record in (layer.attn, layer.ffn)
                for w in vars(record).values() if isinstance(w, GgufWeight)]
        banks = [m for layer in model.weights.layers for m in layer.ffn.experts.native if isinstance(m, GgufMatrices)]
        assert len(kept) > 4 * len(model.weights.layers) and banks
        assert all(w.int8_inputs == int8 for w in kept + banks)
        assert isinstance(model.weights.head, GgufWeight) and not model.weights.head.int8_inputs


def test_the_knob_rounds_inputs_to_int8_on_cuda_only():
    """``gguf_int8_inputs`` (on by default) applies where the kernels are compiled: on the CPU they run only in
    Triton's interpreter (a test mode), which keeps float32 products."""
    from ds4d.config import Config
    from ds4d.models.deepseek_v4.family import gguf_int8_inputs

    assert gguf_int8_inputs(Config(), "cuda") and gguf_int8_inputs(Config(), "cuda:1")
    assert not gguf_int8_inputs(Config(), "cpu")
    assert not gguf_int8_inputs(Config(gguf_int8_inputs=False), "cuda")


def test_the_summary_names_what_stays_in_blocks():
    model = _load("quant-Q2_K.gguf", native=True)
    summary = kept_summary(model.weights)
    assert "Q2_K experts" in summary and "1 Q6_K head" in summary and "decoded:" in summary


def test_weight_format_choice_for_gguf_files():
    assert not gguf_native("auto", "cpu")
    assert not gguf_native("dense", "cpu")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        gguf_native("native", "cpu")
    with pytest.raises(ValueError, match="auto, dense or native"):
        gguf_native("int4", "cpu")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        load_gguf_model(FIXTURES / "converted.gguf", weight_format="native")


def test_decode_kernels_take_the_swiglus_in_the_int8_gate_up_gemvs_with_the_same_logits(monkeypatch):
    """The q2 recipe on int8 inputs (its default on CUDA), with the decode kernels: a batch-1 step's SwiGLUs run in the
    epilogues of the routed experts' IQ2_XXS gate/up GEMV and of the shared expert's fused Q8_0 ``w1 + w3`` GEMV
    (``gated``), the routed experts' reading the token's row in place for each of them; the logits of prefill and
    decode are bit for bit those of the GEMVs followed by ``prefill_triton.swiglu``."""
    from ds4d.bench.random_v4 import base_config
    from ds4d.cuda import gguf_matmul
    from ds4d.models.deepseek_v4 import moe
    from ds4d.models.deepseek_v4.config import DeepseekV4Config
    from ds4d.models.deepseek_v4.random_init import RandomGgufReader

    cfg = DeepseekV4Config.from_dict({**base_config(tiny=True), "num_hidden_layers": 1, "compress_ratios": [4],
                                      "vocab_size": 512}, name="random-q2")
    weights = read_weights(RandomGgufReader(cfg, dtype=torch.float32, device="cpu", recipe="q2", int8_inputs=False))
    ffn = weights.layers[0].ffn
    gate_up = ffn.experts.native[0]
    assert isinstance(ffn.shared_w13, GgufWeight) and isinstance(gate_up, GgufMatrices)
    ffn.shared_w13.int8_inputs = gate_up.int8_inputs = True  # int8 GEMVs are slow in the interpreter: these only,
    for qtype in ("Q8_0", "IQ2_XXS"):  # and in few programs
        monkeypatch.setitem(gguf_matmul.DOT, qtype, {"block_n": 64, "groups": 8, "warps": 4})
    model = DeepseekV4Model(cfg, weights, tokenizer=None, dtype=torch.float32,
                            paths=ForwardPaths(fast_path=True, decode_graphs="off", decode_kernel=True))
    gated, strides = [], []
    plain = gguf_matmul.dot_gemv

    def recorded(*args, **kwargs):
        if kwargs.get("gated") is not None:
            gated.append(args[2])
            strides.append(args[0].stride(0))
        return plain(*args, **kwargs)

    monkeypatch.setattr(gguf_matmul, "dot_gemv", recorded)

    def run(model: DeepseekV4Model) -> torch.Tensor:
        driver = Driver(model)
        driver.start("a")
        out = [driver.prefill("a", PROMPT[:40], chunk=40)]
        for _ in range(2):
            out.append(driver.step([("a", [int(out[-1][-1].argmax())], 1)])[0])
        return torch.cat(out)

    fused = run(model)
    assert sorted(gated) == ["IQ2_XXS", "IQ2_XXS", "Q8_0", "Q8_0"]  # each decode step's two gate/up GEMVs
    # the token's row read by every one of its experts' rows (a view, no copy)
    assert [st for name, st in zip(gated, strides) if name == "IQ2_XXS"] == [0, 0]
    monkeypatch.setattr(moe, "_gated_product", lambda *args: None)
    monkeypatch.setattr(GgufWeight, "gated", lambda self, x, limit: None)
    assert torch.equal(fused, run(model.with_paths()))
    assert len(gated) == 4


def test_random_q2_blocks_take_the_recipes_types_where_they_fit():
    """``RandomGgufReader`` (``bench model --gguf q2``, ``load_format = random-q2``) at 256-wide experts of
    128: gate/up IQ2_XXS, the down projection (128 inputs: not a block of 256) Q8_0, the linears Q8_0; the
    model runs, its random blocks decode to values of about the linear's spread."""
    from ds4d.bench.random_v4 import base_config
    from ds4d.models.deepseek_v4.config import DeepseekV4Config
    from ds4d.models.deepseek_v4.random_init import RandomGgufReader

    cfg = DeepseekV4Config.from_dict({**base_config(tiny=True), "num_hidden_layers": 2, "compress_ratios": [0, 4],
                                      "vocab_size": 512}, name="random-q2")
    weights = read_weights(RandomGgufReader(cfg, dtype=torch.float32, device="cpu", recipe="q2"))
    attn, ffn = weights.layers[1].attn, weights.layers[1].ffn
    assert isinstance(attn.wq_a, GgufWeight) and attn.wq_a.qtype == "Q8_0"
    assert {which: m.qtype for which, m in ffn.experts.gguf.items()} == {"w1": "IQ2_XXS", "w2": "Q8_0", "w3": "IQ2_XXS"}
    std = float(ffn.experts.weight("w1", 0).std())
    assert 0.3 < std * cfg.hidden_size ** 0.5 < 3
    model = DeepseekV4Model(cfg, weights, tokenizer=None, dtype=torch.float32,
                            paths=ForwardPaths(fast_path=True, decode_graphs="off"))
    driver = Driver(model)
    driver.start("a")
    logits = driver.prefill("a", PROMPT[:40], chunk=40)
    assert logits.shape == (40, 512) and torch.isfinite(logits).all()
