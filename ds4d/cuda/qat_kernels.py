"""The Triton source of ``ds4d.cuda.qat_triton`` (imported on first use, so that module loads where
Triton is missing)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rne(x):
    """Round half to even to an integer, for |x| < 2**22 (float32 addition rounds to even)."""
    return (x + 12582912.0) - 12582912.0


@triton.jit
def pow2_ceil(t):
    """2 ** ceil(log2(t)) for positive normal float32 t."""
    bits = t.to(tl.int32, bitcast=True)
    exponent = bits & 0x7F800000
    up = tl.where((bits & 0x7FFFFF) != 0, exponent + 0x800000, exponent)
    return up.to(tl.float32, bitcast=True)


@triton.jit
def round_e4m3(v):
    """Nearest e4m3 value of float32 v, ties to even, saturating at 448."""
    a = tl.abs(v)
    exponent = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    spacing = ((tl.maximum(exponent, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)
    r = tl.minimum(rne(tl.div_rn(a, spacing)) * spacing, 448.0)  # a power of two: exact
    return tl.where(v < 0, -r, r)


@triton.jit
def round_e2m1(v):
    """Nearest e2m1 value of v in [-6, 6], ties to even."""
    a = tl.abs(v)
    step = tl.where(a < 2.0, 0.5, tl.where(a < 4.0, 1.0, 2.0))
    r = rne(tl.div_rn(a, step)) * step
    return tl.where(v < 0, -r, r)


@triton.jit
def qat_kernel(x_ptr, out_ptr, n_blocks, floor, inverse, block: tl.constexpr, per_program: tl.constexpr,
               mode: tl.constexpr):
    rows = tl.program_id(0) * per_program + tl.arange(0, per_program)
    live = rows < n_blocks
    offsets = rows[:, None] * block + tl.arange(0, block)[None, :]
    x = tl.load(x_ptr + offsets, mask=live[:, None], other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), floor)
    if mode == 0:
        scale = pow2_ceil(amax * inverse)
        codes = round_e4m3(tl.minimum(tl.maximum(tl.div_rn(x, scale[:, None]), -448.0), 448.0))
    else:
        if mode == 1:
            scale = pow2_ceil(amax * inverse)
        else:
            scale = round_e4m3(tl.div_rn(amax, tl.zeros_like(amax) + 6.0))
        codes = round_e2m1(tl.minimum(tl.maximum(tl.div_rn(x, scale[:, None]), -6.0), 6.0))
    out = codes * scale[:, None]
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=live[:, None])
