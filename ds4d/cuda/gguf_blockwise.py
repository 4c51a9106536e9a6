"""Triton kernels that decode the GGUF types of the ds4 q2 recipe (Q8_0, Q2_K, IQ2_XXS) block by block.

``gguf_kernels`` decodes every weight element on its own, loading its block's float16 fields, scale
bytes and code bytes once per element.  Here a "trip" decodes a tile of whole blocks of ``block_n``
weight rows at once (``supers`` x 256 values a row; Q8_0: eight blocks of 32 per 256): the fields a
block shares (``d``, ``dmin``, the sub-block scales, IQ2_XXS's scale-and-signs words) are loaded once per
block or sub-block and broadcast over its values, so a value costs about one byte load.  The values are
the ``gguf`` package's numpy dequantiser's, by the same operations in the same order (fused multiply-adds
off at launch).

* :func:`gemv_kernel`: ``block_n`` weight rows times ``rows_per`` input rows (each tile decoded once for
  all of them), summed in float32; with ``by_expert`` (one input row a program) the row's matrix is
  ``expert_ptr[row]``'s, ``expert_bytes`` apart in a bank;
* :func:`dequant_kernel`: the values, as float32.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ds4d.cuda.gguf_kernels import Q2_K, Q8_0, half_at, word_at


@triton.jit
def q8_0_trip(row, trip, k: tl.constexpr, supers: tl.constexpr):
    """34-byte blocks of 32: ``d`` once per block, the 32 int8 codes as a row of the tile."""
    per_trip: tl.constexpr = supers * 8
    index = trip * per_trip + tl.arange(0, per_trip)
    v = tl.arange(0, 32)
    live = index < k // 32
    at = row[:, None] + (tl.where(live, index, 0) * 34)[None, :]
    d = half_at(at)
    q = tl.load(at[:, :, None] + 2 + v[None, None, :]).to(tl.int8, bitcast=True).to(tl.float32)
    w = tl.where(live[None, :, None], q * d[:, :, None], 0.0)
    cols = index[:, None] * 32 + v[None, :]
    return w, cols, cols < k


@triton.jit
def q2_k_trip(row, trip, k: tl.constexpr, supers: tl.constexpr):
    """84-byte blocks of 256 as eight groups of 32 (two sub-blocks of 16 each): the two sub-blocks' scale
    bytes (and the block's ``d``, ``dmin``) once, then the 32 two-bit codes."""
    g = tl.arange(0, supers * 8)  # group of the trip
    v = tl.arange(0, 32)
    j = (g % 8)[:, None] * 32 + v[None, :]  # value within its block, [groups, 32]
    index = trip * supers + g // 8
    live = index < k // 256
    block = row[:, None] + (tl.where(live, index, 0) * 84)[None, :]  # [block_n, groups]
    first = tl.load(block + (g % 8)[None, :] * 2).to(tl.int32)  # the group's two sub-block scale bytes
    second = tl.load(block + (g % 8)[None, :] * 2 + 1).to(tl.int32)
    sc = tl.where((v < 16)[None, None, :], first[:, :, None], second[:, :, None])
    dl = half_at(block + 80)[:, :, None] * (sc & 15).to(tl.float32)
    ml = half_at(block + 82)[:, :, None] * (sc >> 4).to(tl.float32)
    byte = tl.load(block[:, :, None] + 16 + ((j // 128) * 32 + j % 32)[None, :, :]).to(tl.int32)
    q = ((byte >> (((j % 128) // 32) * 2)[None, :, :]) & 3).to(tl.float32)
    w = tl.where(live[None, :, None], dl * q - ml, 0.0)
    cols = index[:, None] * 256 + j
    return w, cols, cols < k


@triton.jit
def iq2_xxs_trip(row, trip, k: tl.constexpr, supers: tl.constexpr, codes_ptr, signs_ptr):
    """66-byte blocks of 256 as eight groups of 32: each group's scale-and-signs word once; per 8 values
    a grid index, its sign byte and its grid entry's 16-bit code (``codes_ptr``: eight 2-bit fields, one a
    value, each 0, 1, 2 for the grid's 8, 25, 43), loaded once for the 8 lanes (from L1)."""
    groups: tl.constexpr = supers * 8
    g = tl.arange(0, groups)  # group of the trip
    v = tl.arange(0, 32)
    part = v // 8
    lane = v % 8
    index = trip * supers + g // 8
    live = index < k // 256
    block = row[:, None] + (tl.where(live, index, 0) * 66)[None, :]  # [block_n, groups]
    group = block + 2 + (g % 8)[None, :] * 8
    aux = word_at(group + 4)
    db = half_at(block) * (0.5 + (aux >> 28).to(tl.float32)) * 0.25
    grid_index = tl.load(group[:, :, None] + part[None, None, :]).to(tl.int32)  # [block_n, groups, 32]
    sign_index = ((aux[:, :, None] >> (7 * part)[None, None, :]) & 127).to(tl.int32)
    sign_byte = tl.load(signs_ptr + sign_index).to(tl.int32)
    field = (tl.load(codes_ptr + grid_index) >> (2 * lane)[None, None, :]) & 3
    grid = tl.where(field == 0, 8.0, tl.where(field == 1, 25.0, 43.0))
    value = db[:, :, None] * grid
    w = tl.where(((sign_byte >> lane[None, None, :]) & 1) != 0, -value, value)
    w = tl.where(live[None, :, None], w, 0.0)
    cols = index[:, None] * 256 + (g % 8)[:, None] * 32 + v[None, :]
    return w, cols, cols < k


@triton.jit
def trip_values(row, trip, k: tl.constexpr, supers: tl.constexpr, table_ptr, signs_ptr, qtype: tl.constexpr):
    """Trip ``trip`` of the weight rows at byte pointers ``row [block_n]``: (values ``[block_n, A, B]``
    float32 (0 past the last block), their columns ``[A, B]``, which of those exist), ``A = 8 * supers`` groups of
    ``B = 32`` values;
    ``table_ptr``: IQ2_XXS's grid codes (``gguf_matmul._grid_codes``), ``signs_ptr``: its 128 sign bytes."""
    if qtype == Q8_0:
        return q8_0_trip(row, trip, k, supers)
    elif qtype == Q2_K:
        return q2_k_trip(row, trip, k, supers)
    else:
        return iq2_xxs_trip(row, trip, k, supers, table_ptr, signs_ptr)


@triton.jit
def _times_rows(acc, w, x_ptr, first, m, sxm, cols, live, rows_per: tl.constexpr):
    """``acc`` plus the tile ``w [block_n, A, B]`` times input rows ``first`` .. ``first + rows_per`` (of
    ``m``) at columns ``cols [A, B]`` (``live``: those that exist), in float32.  One row: ``acc`` is
    ``[block_n, A, B]``, the products added element by element (summed once, at the end); more: ``acc`` is
    ``[rows_per, block_n, A]``, each row's products summed over ``B`` each trip."""
    if rows_per == 1:
        mask = live & (tl.zeros_like(cols) + first < m)
        x = tl.load(x_ptr + first.to(tl.int64) * sxm + cols, mask=mask, other=0.0).to(tl.float32)
        acc = acc + w * x[None, :, :]
    else:
        which = tl.arange(0, rows_per)
        for r in tl.static_range(rows_per):
            row = first + r
            mask = live & (tl.zeros_like(cols) + row < m)
            x = tl.load(x_ptr + row.to(tl.int64) * sxm + cols, mask=mask, other=0.0).to(tl.float32)
            part = tl.sum(w * x[None, :, :], axis=2)
            acc = tl.where(which[:, None, None] == r, acc + part[None, :, :], acc)
    return acc


@triton.jit
def gemv_kernel(x_ptr, raw_ptr, out_ptr, table_ptr, signs_ptr, expert_ptr, n, m, k: tl.constexpr, row_bytes,
                expert_bytes, sxm, som, qtype: tl.constexpr, by_expert: tl.constexpr, block_n: tl.constexpr,
                supers: tl.constexpr, rows_per: tl.constexpr):
    first = tl.program_id(1) * rows_per
    base = raw_ptr
    if by_expert:
        base = raw_ptr + tl.load(expert_ptr + tl.program_id(1)).to(tl.int64) * expert_bytes
    rows = tl.program_id(0) * block_n + tl.arange(0, block_n)
    row = base + tl.where(rows < n, rows, 0).to(tl.int64) * row_bytes
    if rows_per == 1:  # a trip's tile: [block_n, supers * 8, 32]
        acc = tl.zeros((block_n, supers * 8, 32), dtype=tl.float32)
    else:
        acc = tl.zeros((rows_per, block_n, supers * 8), dtype=tl.float32)
    for trip in range(tl.cdiv(k, 256 * supers)):
        w, cols, live = trip_values(row, trip, k, supers, table_ptr, signs_ptr, qtype)
        acc = _times_rows(acc, w, x_ptr, first, m, sxm, cols, live, rows_per)
    if rows_per == 1:
        total = tl.sum(tl.sum(acc, axis=2), axis=1)[None, :]
    else:
        total = tl.sum(acc, axis=2)
    which = first + tl.arange(0, rows_per)
    tl.store(out_ptr + which.to(tl.int64)[:, None] * som + rows[None, :], total,
             mask=(which[:, None] < m) & (rows[None, :] < n))


@triton.jit
def dequant_kernel(raw_ptr, out_ptr, table_ptr, signs_ptr, n, k: tl.constexpr, row_bytes, som, qtype: tl.constexpr,
                   block_n: tl.constexpr):
    """``out[n, k]`` float32: trip ``program_id(1)`` (256 values) of ``block_n`` weight rows."""
    rows = tl.program_id(0) * block_n + tl.arange(0, block_n)
    row = raw_ptr + tl.where(rows < n, rows, 0).to(tl.int64) * row_bytes
    w, cols, live = trip_values(row, tl.program_id(1), k, 1, table_ptr, signs_ptr, qtype)
    mask = (rows[:, None, None] < n) & live[None, :, :]
    tl.store(out_ptr + rows.to(tl.int64)[:, None, None] * som + cols[None, :, :], w, mask=mask)
