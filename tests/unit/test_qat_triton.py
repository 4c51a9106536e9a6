"""V4.1's QAT roundings in one Triton kernel each (``ds4d.cuda.qat_triton``) against the torch
functions of ``ds4d.models.deepseek_v41.qat``: the same bits, for every mode, dtype and scale.

Inputs span the cases the arithmetic treats apart: blocks of zeros (the clamped maximum), values
far below and above the formats' ranges (e4m3 subnormal codes, a saturated e4m3 scale), exact
ties between codes (round half to even), and the shapes the model rounds (``[rows, width]`` and
``[rows, heads, width]``, non-contiguous).  Triton's interpreter runs the kernel here; on a CUDA
machine the compiled kernel runs on the device against the torch operations on the device (float32
and bfloat16 there: float16 did not give their bits on an H200, so the kernel refuses it on CUDA).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from ds4d.cuda import qat_triton  # noqa: E402
from ds4d.models.deepseek_v41 import qat  # noqa: E402

pytestmark = pytest.mark.skipif(not qat_triton.available(), reason="the Triton kernel cannot run here")

MODES = {"fp8": (qat_triton.FP8, 32, lambda x: qat.round_fp8_blocks(x, 32)),
         "fp4": (qat_triton.FP4, 32, lambda x: qat.round_fp4_blocks(x, 32)),
         "fp4-e4m3-scales": (qat_triton.FP4_E4M3_SCALES, 16, lambda x: qat.round_fp4_blocks(x, 16, e4m3_scales=True))}


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def torch_rounding(fn, x: torch.Tensor, monkeypatch) -> torch.Tensor:
    with monkeypatch.context() as patch:
        patch.setattr(qat, "FUSED", False)
        return fn(x)


def inputs(dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    out = []
    for scale in (1e-7, 1e-3, 1.0, 37.0, 3e4):
        x = torch.randn(9, 128, generator=gen) * scale
        x[0, :32] = 0.0
        x[1, 32:64] *= 1e-9
        out.append(x)
    ties = torch.tensor([0.25, 0.75, 1.25, 2.5, 3.5, 5.0, -0.25, -2.5, 6.0, -6.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0] * 8)
    out.append(ties.view(1, 128))  # e2m1 ties at scale 1 (block max 6)
    e4m3_ties = torch.tensor([448.0, 1.0625, 1.1875, 2.0 ** -10, 3 * 2.0 ** -10, 17.0, 19.0, -208.0] * 16)
    out.append(e4m3_ties.view(1, 128))  # e4m3 ties at scale 1 (block max 448)
    out.append(torch.randn(5, 4, 64, generator=gen).transpose(0, 1))  # [rows, heads, width], not contiguous
    limit = torch.finfo(dtype).max / 2  # finite inputs (a float16 holds less than 3e4 * randn)
    return [x.clamp(-limit, limit).to(dtype).to(device()) for x in out]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_the_kernel_rounds_as_the_torch_functions(mode, dtype, monkeypatch):
    kind, block, fn = MODES[mode]
    if dtype == torch.float16 and device() == "cuda":  # not its bits on an H200: refused there
        assert not qat_triton.usable(inputs(dtype)[0], block)
        return
    for x in inputs(dtype):
        assert qat_triton.usable(x, block)
        want = torch_rounding(fn, x, monkeypatch)
        got = qat_triton.round_blocks(x, block, kind)
        assert got.shape == x.shape and got.dtype == x.dtype
        assert torch.equal(got, want), (mode, dtype, x.abs().max().item())


def test_the_model_takes_the_kernel_on_cuda_only(monkeypatch):
    """With the kernel turned on: off CUDA the torch functions still run (the goldens' path); a width
    that is not whole blocks is left alone."""
    calls = []
    monkeypatch.setattr(qat, "FUSED", True)
    monkeypatch.setattr(qat_triton, "round_blocks", lambda *args: calls.append(args) or args[0])
    x = torch.randn(3, 64)
    qat.round_fp8_blocks(x)
    qat.round_fp4_blocks(x, 32)
    assert calls == []
    assert torch.equal(qat.round_fp8_blocks(x[:, :40]), x[:, :40]) and not qat_triton.usable(x[:, :40], 32)
    if torch.cuda.is_available():
        qat.round_fp8_blocks(x.cuda())
        assert len(calls) == 1
