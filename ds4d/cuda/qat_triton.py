"""V4.1's QAT roundings (``ds4d.models.deepseek_v41.qat``) in one Triton kernel each.

The torch functions take about twenty small kernels per call (the block maxima,
the power-of-two scale through ``frexp`` and ``ldexp``, the division, the clamp,
the e4m3 cast or the e2m1 grid, the product), and a V4.1 decode step calls them
a dozen times.  Here one program takes a few blocks, and every step is the same
float32 arithmetic, so the result is the torch function's bit for bit (on CUDA
it takes float32 and bfloat16 only: float16 did not match there on an H200):

* the block maximum of ``|x|``, clamped below as there;
* a ue8m0 scale ``2 ** ceil(log2(amax / max))`` from the float32 bits (the
  exponent, one more unless the mantissa is zero), or an e4m3 scale (the
  correctly rounded ``amax / 6``, rounded to e4m3);
* ``x / scale`` correctly rounded (``div_rn``), clamped to the format's range;
* rounding to e4m3 or e2m1 as arithmetic: the spacing of the value's binade
  (e4m3: ``2 ** (exponent - 3)``, at least ``2 ** -9``; e2m1: 0.5, 1 or 2) and
  round-half-to-even of ``value / spacing`` by the ``1.5 * 2 ** 23`` trick, then
  the product with the spacing (all exact in float32), saturating at 448 as
  torch's e4m3 cast does;
* the product with the scale, in the output's dtype.

The kernel is in ``qat_kernels.py`` (imported on first use, so this module loads where Triton is
missing); it is launched without fused multiply-adds. With ``TRITON_INTERPRET=1`` the kernel runs on
CPU tensors: the tests compare it with the torch functions there and on the GPU.
"""

from __future__ import annotations

import torch

from ds4d.cuda.devices import triton_can_launch, triton_launches_on

FP8 = 0
"""e4m3 codes, a ue8m0 scale per block (the window KV)."""
FP4 = 1
"""e2m1 codes, a ue8m0 scale per block (the indexer's queries and keys)."""
FP4_E4M3_SCALES = 2
"""e2m1 codes, an e4m3 scale per block (the compressed KV)."""

BLOCKS_PER_PROGRAM = 16
_CONSTANTS = {FP8: (1e-4, 1.0 / 448.0), FP4: (6.0 * 2.0**-126, 1.0 / 6.0), FP4_E4M3_SCALES: (6.0 * 2.0**-9, 0.0)}
"""Per mode: the floor of a block's maximum and the reciprocal it is scaled by (float32 once passed), as in qat.py."""
_state: dict[str, object] = {}


def _kernels():
    if "kernel" not in _state:
        from ds4d.cuda import qat_kernels

        _state["kernel"] = qat_kernels.qat_kernel
    return _state["kernel"]


def available() -> bool:
    """Triton is importable and can launch here (a CUDA device, or the interpreter)."""
    if "available" not in _state:
        _state["available"] = triton_can_launch(_kernels)
    return bool(_state["available"])


def usable(x: torch.Tensor, block: int) -> bool:
    """Whether :func:`round_blocks` takes ``x``: whole blocks in its last dimension, a float dtype (on
    CUDA float32 or bfloat16: float16 there did not give the torch functions' bits on an H200), a
    device Triton launches on."""
    dtypes = (torch.float32, torch.bfloat16) if x.is_cuda else (torch.float32, torch.bfloat16, torch.float16)
    return (x.dim() > 0 and x.shape[-1] % block == 0 and x.dtype in dtypes and x.numel() > 0
            and triton_launches_on(x) and available())


def round_blocks(x: torch.Tensor, block: int, mode: int) -> torch.Tensor:
    """``x`` rounded per ``block`` channels in ``mode`` (:data:`FP8`, :data:`FP4`,
    :data:`FP4_E4M3_SCALES`), dequantised, in ``x``'s dtype and shape."""
    x = x if x.is_contiguous() else x.contiguous()
    out = torch.empty_like(x)
    n_blocks = x.numel() // block
    grid = (-(-n_blocks // BLOCKS_PER_PROGRAM),)
    floor, inverse = _CONSTANTS[mode]
    _kernels()[grid](x, out, n_blocks, floor, inverse, block=block, per_program=BLOCKS_PER_PROGRAM, mode=mode,
                     enable_fp_fusion=False)
    return out
