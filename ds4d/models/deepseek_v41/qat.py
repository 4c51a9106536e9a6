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
"""

from __future__ import annotations

from functools import lru_cache

import torch

from ds4d.models.deepseek_v4.quant import E2M1_MAX, E2M1_TABLE, FP8_E4M3_MAX

_E2M1_MAGNITUDES = E2M1_TABLE[:8]
# Midpoints between neighbouring e2m1 magnitudes.  Round-to-nearest-even: a value exactly on a
# midpoint goes to the neighbour with the even code, i.e. down at 0.25, 1.25, 2.5, 5 (codes 0, 2,
# 4, 6 below them) and up at 0.75, 1.75, 3.5 (codes 2, 4, 6 above them).
_ROUND_DOWN_AT_TIE = torch.tensor([0.25, 1.25, 2.5, 5.0])
_ROUND_UP_AT_TIE = torch.tensor([0.75, 1.75, 3.5])


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
    blocks = _blocks(x, block)
    if blocks is None:
        return x
    amax = blocks.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    scale = pow2_ceil(amax * (1.0 / FP8_E4M3_MAX))
    codes = (blocks / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return (codes.float() * scale).reshape(x.shape).to(x.dtype)


@lru_cache(maxsize=8)
def _e2m1_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tie points rounding down, tie points rounding up, magnitudes) on ``device``, copied there once
    (a copy from host memory per call would wait for the device, and cannot be captured in a graph)."""
    return tuple(t.to(device) for t in (_ROUND_DOWN_AT_TIE, _ROUND_UP_AT_TIE, _E2M1_MAGNITUDES))


def round_e2m1(q: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 value (ties to the even code) of values already inside [-6, 6]."""
    magnitude = q.abs().unsqueeze(-1)
    down, up, magnitudes = _e2m1_tables(q.device)
    code = (magnitude > down).sum(-1) + (magnitude >= up).sum(-1)
    return torch.copysign(magnitudes[code], q)


def round_fp4_blocks(x: torch.Tensor, block: int, *, e4m3_scales: bool = False) -> torch.Tensor:
    """FP4 e2m1 with one scale per ``block`` channels (ue8m0, or FP8 e4m3 with ``e4m3_scales``), dequantised."""
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
