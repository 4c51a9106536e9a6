"""DeepSeek-V4 split over two (or four) GPUs through NCCL equals the model on one GPU.

The scenario of tests/parity/test_dsv4_sharded.py (whole prompt, chunked
prompt batched with a second sequence, 16 greedy decode steps of both, a state
snapshot continued in another slot, a refused batch) is played by a sharded
model whose ranks are one process per GPU, and by the single-process model on
GPU 0 with the same (dense) weights.

Tolerances:

* float32: as on the CPU (max |logit diff| <= 1e-4 x max |logit|, every greedy
  token identical);
* bfloat16: the routed-expert output is summed in another order (each rank's
  experts, then the all-reduce), so values move by bf16 rounding.  Logits must
  be within 3e-2 x max |logit|, and the argmax must agree wherever the
  reference's top-2 margin exceeds 2% of its max logit; greedy decoding is
  compared up to the first step where the reference was that close to a tie.
"""

from __future__ import annotations

import pytest
import torch

from ds4d.models.deepseek_v4 import load_model, write_tiny_checkpoint
from tests.parity.test_dsv4_sharded import DECODE_STEPS, _assert_close, _prompt, run_rank0, scenario

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]

BF16_RELATIVE = 3e-2
TIE_MARGIN = 2e-2

LAYOUTS = [("ep", 2), ("pp", 2), ("2x2", 4), ("ep", 4)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=5, layers=[0, 4, 128, 4])


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def reference(request, checkpoint):
    dtype = getattr(torch, request.param)
    model = load_model(checkpoint, dtype=dtype, device="cuda:0", weight_format="dense")
    out = scenario(model)
    out["after_refusal"] = model.logits_for(_prompt(200, 1)[:5])
    del model
    torch.cuda.empty_cache()
    return request.param, {key: value.cpu() for key, value in out.items()}


def _margin_ok(reference_logits: torch.Tensor) -> torch.Tensor:
    """Rows whose top-2 margin exceeds TIE_MARGIN of the row's max |logit| (argmax must agree there)."""
    top = reference_logits.float().topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]) > TIE_MARGIN * reference_logits.abs().max(dim=-1).values


def _assert_bf16_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape, what
    tolerance = BF16_RELATIVE * expected.abs().max().item()
    worst = (actual.float() - expected.float()).abs().max().item()
    assert worst <= tolerance, f"{what}: max |diff| {worst:.3g} > {tolerance:.3g}"
    clear = _margin_ok(expected)
    agree = actual.argmax(-1) == expected.argmax(-1)
    assert bool(agree[clear].all()), f"{what}: argmax differs at a clear margin ({int((~agree[clear]).sum())} rows)"


def _compare_bf16(got: dict, ref: dict) -> None:
    for key in ("whole", "chunked", "after_refusal"):
        _assert_bf16_close(got[key], ref[key], key)
    for name in ("b", "c"):
        tokens, expected = got[f"tokens_{name}"], ref[f"tokens_{name}"]
        same = int((tokens == expected).cumprod(0).sum())  # leading tokens in common
        if same < len(expected):
            # the first differing token follows a decode step whose reference was near a tie
            step = same - 1
            assert step >= 0 and not bool(_margin_ok(ref[f"decode_{name}"][step : step + 1])[0]), (
                f"decode {name}: tokens part at step {step} with a clear reference margin"
            )
        steps = max(0, min(same, DECODE_STEPS))
        _assert_bf16_close(got[f"decode_{name}"][:steps], ref[f"decode_{name}"][:steps], f"decode_{name}")


@pytest.mark.parametrize(("layout", "gpus"), LAYOUTS, ids=[f"{layout}-{gpus}" for layout, gpus in LAYOUTS])
def test_split_over_gpus_equals_one_gpu(checkpoint, reference, tmp_path, layout, gpus):
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} CUDA GPUs")
    dtype, ref = reference
    got = run_rank0(checkpoint, list(range(gpus)), layout, None, tmp_path, dtype)

    stages, ep = {"ep": (1, gpus), "pp": (gpus, 1), "2x2": (2, 2)}[layout]
    assert got["parallel"].tolist() == [stages, ep]
    assert bool(got["refused"])
    if dtype == "float32":
        for key in ("whole", "chunked", "decode_b", "decode_c", "resumed", "after_refusal"):
            _assert_close(got[key], ref[key], key)
        for key in ("whole_argmax", "chunked_argmax", "tokens_b", "tokens_c"):
            assert torch.equal(got[key], ref[key]), key
    else:
        _compare_bf16(got, ref)
    # the resumed slot reproduces this model's own first decode steps of b
    relative = 1e-4 if dtype == "float32" else BF16_RELATIVE
    worst = (got["resumed"].float() - got["decode_b"][:4].float()).abs().max().item()
    assert worst <= relative * got["decode_b"][:4].abs().max().item()
