"""DeepSeek-V4 GGUF files on a CUDA GPU with their blocks kept as stored (``weight_format = native``: the
compiled kernels of ``gguf_matmul`` inside the model, decode steps in CUDA graphs) against the same file
decoded to float (``dense``), in float32 on the same GPU: llama.cpp's tiny Q8_0/MXFP4, Q2_K, IQ2_XXS and
Q6_K files (tests/fixtures/gguf_v4).  Decoding is exact, so logits agree within float32 summation order
(1e-4 of the largest) and greedy tokens are the same; with ``int8_inputs`` the decode GEMVs' inputs are rounded
to int8 (llama.cpp's numerics), within 3e-2; bfloat16 native decodes with the float32 model's tokens wherever its
top-2 margin is clear.
"""

from __future__ import annotations

import pytest
import torch

from ds4d.models.deepseek_v4.gguf_loader import load_gguf_model
from tests.parity.make_gguf_v4_fixtures import OUT as FIXTURES
from tests.unit.test_dsv4_model import Driver

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
pytest.importorskip("gguf")

PROMPT = [(i * 7919) % 500 + 3 for i in range(150)]
FILES = ["converted.gguf", "quant-Q2_K.gguf", "quant-IQ2_XXS.gguf", "quant-Q6_K.gguf"]


def _run(model, steps: int = 8, fed: list[int] | None = None) -> tuple[torch.Tensor, list[int]]:
    """The prompt's logits and ``steps`` decode steps', each step fed the greedy token before it (or ``fed``'s)."""
    driver = Driver(model)
    driver.start("a")
    logits = [driver.prefill("a", PROMPT, chunk=150).float()]
    ids = [int(logits[0][-1].argmax())]
    for step in range(steps):
        logits.append(driver.step([("a", [fed[step] if fed else ids[-1]], 1)])[0].float())
        ids.append(int(logits[-1][-1].argmax()))
    return torch.cat(logits), ids


@pytest.mark.parametrize("name", FILES)
def test_native_blocks_give_the_decoded_models_logits_on_cuda(name):
    native = load_gguf_model(FIXTURES / name, dtype=torch.float32, device="cuda", weight_format="native")
    assert native.native_weights and native.paths.decode_graphs == "cuda"
    dense = load_gguf_model(FIXTURES / name, dtype=torch.float32, device="cuda", weight_format="dense")
    assert not dense.native_weights
    (got, got_ids), (want, want_ids) = _run(native), _run(dense)
    assert (got - want).abs().max().item() < 1e-4 * want.abs().max().item()
    assert got_ids == want_ids


@pytest.mark.parametrize("name", ["converted.gguf", "quant-Q2_K.gguf", "quant-IQ2_XXS.gguf"])
def test_int8_inputs_stay_near_the_decoded_models_logits_on_cuda(name):
    """``int8_inputs`` (the daemon's ``gguf_int8_inputs``): a decode step's Q8_0, Q2_K and IQ2_XXS GEMVs on inputs
    rounded to int8 (``dp4a`` compiled for the device).  Fed the decoded float32 model's tokens, the prompt's logits
    are the float GEMVs' (a prompt step takes no GEMV: within 1e-4) and each decode step's within 3e-2 of the
    largest logit (Triton's interpreter gave 1.0e-2 to 1.2e-2 on these files, ``gguf_int8_model_check.py``; llama.cpp's
    own logits differ from the float model's by 1-2%), with its greedy token wherever the top-2 margin is clear."""
    native = load_gguf_model(FIXTURES / name, dtype=torch.float32, device="cuda", weight_format="native",
                             int8_inputs=True)
    assert native.weights.layers[1].attn.wq_a.int8_inputs
    want, want_ids = _run(load_gguf_model(FIXTURES / name, dtype=torch.float32, device="cuda", weight_format="dense"))
    got, _ = _run(native, fed=want_ids[:-1])
    n, largest = len(PROMPT), want.abs().max().item()
    assert (got[:n] - want[:n]).abs().max().item() < 1e-4 * largest
    difference = (got[n:] - want[n:]).abs().max().item()
    assert 0 < difference < 3e-2 * largest
    top2 = want[n:].topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.05 * largest
    assert clear.any() and torch.equal(got[n:].argmax(-1)[clear], want[n:].argmax(-1)[clear])


@pytest.mark.parametrize("name", FILES)
def test_auto_keeps_blocks_in_bfloat16(name):
    model = load_gguf_model(FIXTURES / name, dtype=torch.bfloat16, device="cuda")
    assert model.native_weights
    got, _ = _run(model, steps=2)
    want, _ = _run(load_gguf_model(FIXTURES / name, dtype=torch.float32, device="cuda", weight_format="dense"), 2)
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.05 * want.abs().amax(dim=-1)
    assert torch.isfinite(got).all()
    assert (got.argmax(-1) == want.argmax(-1))[clear].float().mean().item() >= 0.95


@pytest.mark.parametrize(("name", "share", "ahead"), [
    *[(name, share, 0) for name in ("quant-IQ2_XXS.gguf", "quant-Q6_K.gguf", "quant-Q4_K_M.gguf") for share in (0.0, 0.5)],
    ("quant-Q6_K.gguf", 0.5, 8)])
def test_experts_offloaded_in_their_blocks_give_the_on_device_logits(name, share, ahead):
    """Routed experts in page-locked host RAM as stored (none, or half of them, in the device banks), copied
    for the steps that use them and read where they land by the same kernels, or (Q6_K: gate/up and down
    in blocks) read by address inside the decode graphs: in float32, the logits of every expert on the
    device within 1e-4 of the largest (the prefill's weighted sum of the experts is torch's, not the fused
    kernel's) and the same greedy tokens (Q4_K_M: its layers' down projections differ in type, so its
    forms have host slots of their own).  ``ahead``: decode steps fetch predicted cold experts a layer ahead
    (``fetch_ahead``) on a side stream."""
    from ds4d.models.deepseek_v4.offload import OffloadOptions

    def load(offload=None):
        return load_gguf_model(FIXTURES / name, dtype=torch.float32, device="cuda", weight_format="native",
                               offload=offload)

    want, want_ids = _run(load())
    probe = load(OffloadOptions(vram_bytes=1, stage_experts=2, decode_cold="copy", fetch_ahead=ahead))
    cfg, per_expert = probe.cfg, probe.expert_offload.device_expert_bytes  # the largest layer's
    hot = int(share * cfg.n_routed_experts) * cfg.num_hidden_layers
    options = OffloadOptions(vram_bytes=hot * per_expert + probe.expert_offload.staging_bytes + 1,
                             stage_experts=2, decode_cold="copy", placement="static",
                             fetch_ahead=ahead)
    model = load(options)
    offload = model.expert_offload
    assert offload.expert_stats()["gpu_experts"] == hot
    assert offload.zero_copy == (name == "quant-Q6_K.gguf")
    got, got_ids = _run(model)
    assert (got - want).abs().max().item() < 1e-4 * want.abs().max().item()
    assert got_ids == want_ids and offload.expert_stats()["bytes_copied"] > 0
    assert (offload.expert_stats()["fetched_ahead_pairs"] > 0) == bool(ahead)
