"""The Triton sources of ``ds4d.cuda.gguf_matmul`` (imported on first use, so that module loads
where Triton is missing).

Every decoder takes the raw bytes of a row of GGUF blocks and an element index ``k`` and computes
that element's value in float32 by the same operations, in the same order, as the ``gguf``
package's numpy dequantiser of its type (``gguf/quants.py``); fused multiply-adds are turned off
at launch (``enable_fp_fusion=False``), so the values are those bits exactly.  Halves and
32-bit words are assembled from their little-endian bytes, so no load needs an alignment the
block layout does not have.
"""

from __future__ import annotations

import triton
import triton.language as tl

Q8_0: tl.constexpr = tl.constexpr(0)
Q2_K: tl.constexpr = tl.constexpr(1)
IQ2_XXS: tl.constexpr = tl.constexpr(2)
Q4_K: tl.constexpr = tl.constexpr(3)
Q6_K: tl.constexpr = tl.constexpr(4)
Q5_K: tl.constexpr = tl.constexpr(5)
Q3_K: tl.constexpr = tl.constexpr(6)
IQ4_XS: tl.constexpr = tl.constexpr(7)
IQ3_XXS: tl.constexpr = tl.constexpr(8)
IQ2_XS: tl.constexpr = tl.constexpr(9)
MXFP4: tl.constexpr = tl.constexpr(10)


@triton.jit
def stored_as(value, out_ptr):
    """float32 ``value`` in ``out_ptr``'s element type, rounded to nearest, ties to even, as torch's ``.to``
    rounds it.  bfloat16 is rounded by its bits (Triton's interpreter truncates a float32 it converts to
    bfloat16; a NaN stays a NaN)."""
    if out_ptr.dtype.element_ty == tl.bfloat16:
        bits = value.to(tl.uint32, bitcast=True)
        up = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return tl.where((bits & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, up).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return value.to(out_ptr.dtype.element_ty)


@triton.jit
def half_at(ptr):
    """The little-endian float16 at the byte pointers ``ptr``, as float32."""
    lo = tl.load(ptr).to(tl.uint16)
    hi = tl.load(ptr + 1).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def word_at(ptr):
    """The little-endian uint32 at the byte pointers ``ptr``."""
    b0 = tl.load(ptr).to(tl.uint32)
    b1 = tl.load(ptr + 1).to(tl.uint32)
    b2 = tl.load(ptr + 2).to(tl.uint32)
    b3 = tl.load(ptr + 3).to(tl.uint32)
    return b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)


@triton.jit
def decode_q8_0(row, k):
    """34-byte blocks of 32: a float16 scale, 32 int8 values."""
    block = row + (k // 32) * 34
    d = half_at(block)
    q = tl.load(block + 2 + k % 32).to(tl.int8, bitcast=True).to(tl.float32)
    return q * d


@triton.jit
def decode_q2_k(row, k):
    """84-byte blocks of 256: 16 scale bytes (low nibble scale, high nibble min), 64 bytes of 2-bit
    values (four 32-value planes per 32 bytes), float16 ``d`` and ``dmin``."""
    block = row + (k // 256) * 84
    j = k % 256
    sc = tl.load(block + j // 16).to(tl.int32)
    byte = tl.load(block + 16 + (j // 128) * 32 + j % 32).to(tl.int32)
    q = ((byte >> (((j % 128) // 32) * 2)) & 3).to(tl.float32)
    dl = half_at(block + 80) * (sc & 15).to(tl.float32)
    ml = half_at(block + 82) * (sc >> 4).to(tl.float32)
    return dl * q - ml


@triton.jit
def decode_iq2_xxs(row, k, grid_ptr, signs_ptr):
    """66-byte blocks of 256: a float16 ``d``, then per 32 values two 32-bit words: four grid indices
    (8 values each, from ``grid_ptr`` ``[256, 8]`` float32) and four 7-bit sign indices (into
    ``signs_ptr``'s 128 sign bytes) under a 4-bit scale."""
    block = row + (k // 256) * 66
    j = k % 256
    sub = block + 2 + (j // 32) * 8
    part = (j % 32) // 8
    lane = j % 8
    index = tl.load(sub + part).to(tl.int32)
    aux = word_at(sub + 4)
    db = half_at(block) * (0.5 + (aux >> 28).to(tl.float32)) * 0.25
    sign_byte = tl.load(signs_ptr + ((aux >> (7 * part)) & 127).to(tl.int32)).to(tl.int32)
    value = db * tl.load(grid_ptr + index * 8 + lane)
    return tl.where(((sign_byte >> lane) & 1) == 0, value, -value)


@triton.jit
def decode_q4_k(row, k):
    """144-byte blocks of 256: float16 ``d`` and ``dmin``, 12 bytes of eight 6-bit scales and mins,
    128 bytes of 4-bit values (two 32-value planes per 32 bytes)."""
    block = row + (k // 256) * 144
    j = k % 256
    sub = j // 32
    sc, mn = k_scale_min(block + 4, sub)
    byte = tl.load(block + 16 + (sub // 2) * 32 + j % 32).to(tl.int32)
    q = ((byte >> ((sub % 2) * 4)) & 15).to(tl.float32)
    d = half_at(block) * sc.to(tl.float32)
    dm = half_at(block + 2) * mn.to(tl.float32)
    return d * q - dm


@triton.jit
def decode_q6_k(row, k):
    """210-byte blocks of 256: 128 bytes of low 4 bits, 64 bytes of high 2 bits, 16 int8 scales, a
    float16 ``d``; values are 6-bit minus 32."""
    block = row + (k // 256) * 210
    j = k % 256
    half = j // 128
    low = tl.load(block + half * 64 + j % 64).to(tl.int32)
    low = (low >> (((j % 128) // 64) * 4)) & 15
    high = tl.load(block + 128 + half * 32 + j % 32).to(tl.int32)
    high = (high >> (((j % 128) // 32) * 2)) & 3
    q = ((low | (high << 4)) - 32).to(tl.float32)
    scale = tl.load(block + 192 + j // 16).to(tl.int8, bitcast=True).to(tl.float32)
    return (half_at(block + 208) * scale) * q


@triton.jit
def k_scale_min(scales, sub):
    """The 6-bit scale and min of sub-block ``sub`` (0..7) from the 12 packed bytes at ``scales``
    (Q4_K and Q5_K)."""
    low = sub < 4
    first = tl.load(scales + sub % 4).to(tl.int32)
    second = tl.load(scales + 4 + sub % 4).to(tl.int32)
    third = tl.load(scales + 8 + sub % 4).to(tl.int32)
    sc = tl.where(low, first & 63, (third & 15) | ((first >> 2) & 48))
    mn = tl.where(low, second & 63, (third >> 4) | ((second >> 2) & 48))
    return sc, mn


@triton.jit
def decode_q5_k(row, k):
    """176-byte blocks of 256: as Q4_K (``d``, ``dmin``, 12 scale bytes), then 32 bytes of fifth
    bits (one 32-value plane per bit) and 128 bytes of low 4 bits."""
    block = row + (k // 256) * 176
    j = k % 256
    sub = j // 32
    sc, mn = k_scale_min(block + 4, sub)
    low = tl.load(block + 48 + (sub // 2) * 32 + j % 32).to(tl.int32)
    high = tl.load(block + 16 + j % 32).to(tl.int32)
    q = (((low >> ((sub % 2) * 4)) & 15) | (((high >> sub) & 1) << 4)).to(tl.float32)
    return (half_at(block) * sc.to(tl.float32)) * q - half_at(block + 2) * mn.to(tl.float32)


@triton.jit
def decode_q3_k(row, k):
    """110-byte blocks of 256: 32 bytes of high-bit masks, 64 bytes of low 2 bits, 12 bytes of sixteen
    6-bit scales (minus 32), a float16 ``d``; a value is its 2 bits minus 4 where its mask bit is 0."""
    block = row + (k // 256) * 110
    j = k % 256
    s16 = j // 16
    scales = block + 96
    low_scale = (tl.load(scales + s16 % 8).to(tl.int32) >> ((s16 // 8) * 4)) & 15
    high_scale = (tl.load(scales + 8 + s16 % 4).to(tl.int32) >> ((s16 // 4) * 2)) & 3
    scale = ((low_scale | (high_scale << 4)) - 32).to(tl.float32)
    low = (tl.load(block + 32 + (j // 128) * 32 + j % 32).to(tl.int32) >> (((j % 128) // 32) * 2)) & 3
    mask = (tl.load(block + j % 32).to(tl.int32) >> (j // 32)) & 1
    q = (low - ((mask ^ 1) << 2)).to(tl.float32)
    return (half_at(block + 108) * scale) * q


@triton.jit
def decode_iq4_xs(row, k, values_ptr):
    """136-byte blocks of 256: a float16 ``d``, eight 6-bit scales (minus 32; high 2 bits in a 16-bit
    word, low 4 in four bytes), 128 bytes of 4-bit indices into ``values_ptr``'s 16 values."""
    block = row + (k // 256) * 136
    j = k % 256
    sub = j // 32
    high = ((tl.load(block + 2).to(tl.int32) | (tl.load(block + 3).to(tl.int32) << 8)) >> (2 * sub)) & 3
    low = (tl.load(block + 4 + sub // 2).to(tl.int32) >> ((sub % 2) * 4)) & 15
    dl = half_at(block) * ((low | (high << 4)) - 32).to(tl.float32)
    within = j % 32
    index = (tl.load(block + 8 + sub * 16 + within % 16).to(tl.int32) >> ((within // 16) * 4)) & 15
    return dl * tl.load(values_ptr + index)


@triton.jit
def decode_iq3_xxs(row, k, grid_ptr, signs_ptr):
    """98-byte blocks of 256: a float16 ``d``, 64 grid indices (4 values each, ``grid_ptr`` ``[256, 4]``),
    then per 32 values a 32-bit word: four 7-bit sign indices under a 4-bit scale."""
    block = row + (k // 256) * 98
    j = k % 256
    index = tl.load(block + 2 + j // 4).to(tl.int32)
    aux = word_at(block + 66 + (j // 32) * 4)
    db = half_at(block) * (0.5 + (aux >> 28).to(tl.float32)) * 0.5
    part = (j % 32) // 8
    sign_byte = tl.load(signs_ptr + ((aux >> (7 * part)) & 127).to(tl.int32)).to(tl.int32)
    value = db * tl.load(grid_ptr + index * 4 + j % 4)
    return tl.where(((sign_byte >> (j % 8)) & 1) == 0, value, -value)


@triton.jit
def decode_iq2_xs(row, k, grid_ptr, signs_ptr):
    """74-byte blocks of 256: a float16 ``d``, 32 16-bit words (a 9-bit index into ``grid_ptr``
    ``[512, 8]`` and a 7-bit sign index, 8 values each), 16 4-bit scales."""
    block = row + (k // 256) * 74
    j = k % 256
    at = block + 2 + (j // 8) * 2
    word = tl.load(at).to(tl.int32) | (tl.load(at + 1).to(tl.int32) << 8)
    scale = (tl.load(block + 66 + j // 32).to(tl.int32) >> (((j // 16) % 2) * 4)) & 15
    db = half_at(block) * (0.5 + scale.to(tl.float32)) * 0.25
    sign_byte = tl.load(signs_ptr + (word >> 9)).to(tl.int32)
    value = db * tl.load(grid_ptr + (word & 511) * 8 + j % 8)
    return tl.where(((sign_byte >> (j % 8)) & 1) == 0, value, -value)


@triton.jit
def decode_mxfp4(row, k, values_ptr):
    """17-byte blocks of 32 (llama.cpp's MXFP4): a ue8m0 byte (half its power of two), 16 bytes of
    e2m1 codes (the first 16 values in the low nibbles); ``values_ptr``: the 16 doubled e2m1 values."""
    block = row + (k // 32) * 17
    j = k % 32
    e = tl.load(block).to(tl.uint32)
    bits = tl.where(e < 2, tl.full(e.shape, 0x00200000, tl.uint32) << e, (e - 1) << 23)
    d = bits.to(tl.float32, bitcast=True)
    index = (tl.load(block + 1 + j % 16).to(tl.int32) >> ((j // 16) * 4)) & 15
    return d * tl.load(values_ptr + index)


@triton.jit
def decode(row, k, grid_ptr, signs_ptr, qtype: tl.constexpr):
    """``grid_ptr``: the type's lookup table (IQ grids, IQ4/MXFP4 values), ``signs_ptr``: the IQ sign bytes."""
    if qtype == Q8_0:
        return decode_q8_0(row, k)
    elif qtype == Q2_K:
        return decode_q2_k(row, k)
    elif qtype == IQ2_XXS:
        return decode_iq2_xxs(row, k, grid_ptr, signs_ptr)
    elif qtype == Q4_K:
        return decode_q4_k(row, k)
    elif qtype == Q6_K:
        return decode_q6_k(row, k)
    elif qtype == Q5_K:
        return decode_q5_k(row, k)
    elif qtype == Q3_K:
        return decode_q3_k(row, k)
    elif qtype == IQ4_XS:
        return decode_iq4_xs(row, k, grid_ptr)
    elif qtype == IQ3_XXS:
        return decode_iq3_xxs(row, k, grid_ptr, signs_ptr)
    elif qtype == IQ2_XS:
        return decode_iq2_xs(row, k, grid_ptr, signs_ptr)
    else:
        return decode_mxfp4(row, k, grid_ptr)


@triton.jit
def dequant_kernel(raw_ptr, out_ptr, grid_ptr, signs_ptr, n, k: tl.constexpr, row_bytes, som,
                   qtype: tl.constexpr, block_n: tl.constexpr, block_k: tl.constexpr):
    """``out[n, k]`` float32: every element of ``block_n`` rows by ``block_k`` columns decoded."""
    rows = tl.program_id(0) * block_n + tl.arange(0, block_n)
    cols = tl.program_id(1) * block_k + tl.arange(0, block_k)
    mask = (rows[:, None] < n) & (cols[None, :] < k)
    row = raw_ptr + tl.where(rows < n, rows, 0).to(tl.int64)[:, None] * row_bytes
    values = decode(row, tl.where(cols < k, cols, 0)[None, :], grid_ptr, signs_ptr, qtype)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * som + cols[None, :], values, mask=mask)


@triton.jit
def gemv_kernel(x_ptr, raw_ptr, out_ptr, grid_ptr, signs_ptr, expert_ptr, n, k: tl.constexpr, row_bytes,
                expert_bytes, sxm, som, qtype: tl.constexpr, by_expert: tl.constexpr, block_n: tl.constexpr,
                block_k: tl.constexpr):
    """One row of ``x`` times ``block_n`` weight rows decoded from their blocks in registers, summed
    in float32 ``block_k`` inputs at a time (``k`` a multiple of ``block_k``); ``by_expert``: the row's
    matrix is ``expert_ptr[row]``'s of a bank, ``expert_bytes`` apart."""
    m = tl.program_id(1)
    base = raw_ptr
    if by_expert:
        base = raw_ptr + tl.load(expert_ptr + m).to(tl.int64) * expert_bytes
    rows = tl.program_id(0) * block_n + tl.arange(0, block_n)
    row = base + tl.where(rows < n, rows, 0).to(tl.int64)[:, None] * row_bytes
    acc = tl.zeros((block_n,), dtype=tl.float32)
    for start in range(0, k, block_k):
        cols = start + tl.arange(0, block_k)
        w = decode(row, cols[None, :], grid_ptr, signs_ptr, qtype)
        x = tl.load(x_ptr + m.to(tl.int64) * sxm + cols).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
    tl.store(out_ptr + m.to(tl.int64) * som + rows, stored_as(acc, out_ptr), mask=rows < n)


@triton.jit
def tiles_kernel(x_ptr, raw_ptr, out_ptr, grid_ptr, signs_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr,
                 n, k: tl.constexpr, row_bytes, expert_bytes, sxm, som, qtype: tl.constexpr,
                 block_m: tl.constexpr, block_n: tl.constexpr, block_k: tl.constexpr, precision: tl.constexpr):
    """A tile of rows of one expert (rows sorted by expert; one matrix: expert 0) times ``block_n``
    rows of its matrix, decoded ``block_k`` inputs at a time into ``x``'s dtype, on tensor cores
    (``precision`` as in ``quant_kernels.fp8_tiles_kernel``), accumulated in float32."""
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    start = tl.load(tile_start_ptr + tile)
    end = tl.load(tile_end_ptr + tile)  # start == end: a spare tile, no loop trip, its store masked off
    rows = start + tl.arange(0, block_m)
    cols = tl.program_id(1) * block_n + tl.arange(0, block_n)
    live_rows = rows < end
    live_cols = cols < n
    base = raw_ptr + expert * expert_bytes + tl.where(live_cols, cols, 0).to(tl.int64)[None, :] * row_bytes
    acc = tl.zeros([block_m, block_n], dtype=tl.float32)
    for k0 in range(0, tl.where(start < end, k, 0), block_k):  # a spare tile decodes nothing
        inputs = k0 + tl.arange(0, block_k)
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * sxm + inputs[None, :], mask=live_rows[:, None], other=0.0)
        w = decode(base, inputs[:, None], grid_ptr, signs_ptr, qtype)
        acc += tl.dot(x, w.to(x.dtype), input_precision=precision)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * som + cols[None, :], stored_as(acc, out_ptr),
             mask=live_rows[:, None] & live_cols[None, :])
