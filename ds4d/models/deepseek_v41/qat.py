"""The roundings V4.1 was trained with (quantisation-aware training), applied in the forward.

Even a float32 run rounds three things exactly as the trained model saw them:

* each layer's sliding-window KV (after RoPE, all channels): FP8 e4m3 with one
  power-of-two (ue8m0) scale per 32 channels -- :func:`round_fp8_blocks`;
* the compressed KV entries (after RoPE): FP4 e2m1 with one FP8 e4m3 scale per
  16 channels -- ``round_fp4_blocks(x, 16, e4m3_scales=True)``;
* the indexer's queries and keys (after RoPE): FP4 e2m1 with one ue8m0 scale
  per 32 channels -- ``round_fp4_blocks(x, 32)``.

A last dimension that does not split into whole blocks is left as it is (only
tiny test shapes do that).  Values come back dequantised, in the input dtype.

Activations before FP8/FP4 matmuls are *not* rounded here: the reference
forward does that only inside its quantised GEMM kernels, i.e. only when the
weights themselves are stored quantised; with float weights (this module's
input) neither the official float path nor the HF model rounds them.

With :data:`FUSED` on, each of the three runs on CUDA as one Triton kernel
(``ds4d.cuda.qat_triton``) that computes the same float32 steps bit for bit.
"""

from __future__ import annotations

import torch

from ds4d.cuda import qat_triton
from ds4d.models.deepseek_v4.quant import E2M1_MAX, FP8_E4M3_MAX

FUSED = False
"""True: on a CUDA device each rounding runs as one Triton kernel (``ds4d.cuda.qat_triton``, the same
bits as the torch operations below, which run everywhere else and inside ``torch.compile``).  Off by
default: on an H200 it gave the same bits in float32 and bfloat16 but no measured speed-up
(docs/BENCHMARKS.md)."""


def _fused(x: torch.Tensor, block: int, mode: int) -> torch.Tensor | None:
    if FUSED and x.is_cuda and not torch.compiler.is_compiling() and qat_triton.usable(x, block):
        return qat_triton.round_blocks(x, block, mode)
    return None


def pow2_ceil(t: torch.Tensor) -> torch.Tensor:
    """``2 ** ceil(log2(t))`` for positive normal float32 ``t``, exactly (a ue8m0 scale)."""
    mantissa, exponent = torch.frexp(t)  # t = mantissa * 2**exponent, mantissa in [0.5, 1)
    exponent = exponent - (mantissa == 0.5).to(exponent.dtype)
    return torch.ldexp(torch.ones_like(t), exponent)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor | None:
    width = x.shape[-1]
    if width % block:
        return None
    return x.float().reshape(*x.shape[:-1], width // block, block)


def round_fp8_blocks(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """FP8 e4m3 with a ue8m0 scale per ``block`` channels, dequantised."""
    fused = _fused(x, block, qat_triton.FP8)
    if fused is not None:
        return fused
    blocks = _blocks(x, block)
    if blocks is None:
        return x
    amax = blocks.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    scale = pow2_ceil(amax * (1.0 / FP8_E4M3_MAX))
    codes = (blocks / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return (codes.float() * scale).reshape(x.shape).to(x.dtype)


def round_e2m1(q: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 value (ties to the even code) of values already inside [-6, 6].

    The e2m1 magnitudes are spaced 0.5 below 2, 1 from 2 to 4 and 2 from 4 to 6, and within each
    range an even code is an even multiple of the spacing: so the nearest value is the magnitude
    over its range's spacing rounded half to even, times the spacing (all exact in float32).  No
    table: nothing to copy to the device, in a graph or out of it."""
    magnitude = q.abs()
    step = torch.where(magnitude < 2, 0.5, torch.where(magnitude < 4, 1.0, 2.0))
    return torch.copysign(torch.round(magnitude / step) * step, q)


def round_fp4_blocks(x: torch.Tensor, block: int, *, e4m3_scales: bool = False) -> torch.Tensor:
    """FP4 e2m1 with one scale per ``block`` channels (ue8m0, or FP8 e4m3 with ``e4m3_scales``), dequantised."""
    fused = _fused(x, block, qat_triton.FP4_E4M3_SCALES if e4m3_scales else qat_triton.FP4)
    if fused is not None:
        return fused
    blocks = _blocks(x, block)
    if blocks is None:
        return x
    amax = blocks.abs().amax(-1, keepdim=True)
    if e4m3_scales:
        scale = (amax.clamp_min(E2M1_MAX * 2.0**-9) / E2M1_MAX).to(torch.float8_e4m3fn).float()
    else:
        scale = pow2_ceil(amax.clamp_min(E2M1_MAX * 2.0**-126) * (1.0 / E2M1_MAX))
    values = round_e2m1((blocks / scale).clamp(-E2M1_MAX, E2M1_MAX))
    return (values * scale).reshape(x.shape).to(x.dtype)
