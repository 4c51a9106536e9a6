"""Triton kernels that decode the GGUF types of the ds4 q2 recipe (Q8_0, Q2_K, IQ2_XXS) block by block.

``gguf_kernels`` decodes every weight element on its own, loading its block's float16 fields, scale
bytes and code bytes once per element.  Here a "trip" decodes a tile of whole blocks of ``block_n``
weight rows at once (``supers`` x 256 values a row; Q8_0: eight blocks of 32 per 256), and a decode
step is bound by the instructions a value costs, so each value gets as few as it can:

* the fields a block or a group shares (``d``, ``dmin``, the sub-block scales, IQ2_XXS's grid indices
  and scale-and-signs word) are read once, as 16- or 32-bit words, and turned into what the values need
  (IQ2_XXS's sign bytes by parity, not a table);
* the values a word holds go onto new innermost axes (``tl.join``), which a thread keeps in its own
  registers, so a word is split there and never broadcast across threads;
* small integers become float32 by integer ``or`` and a float add (``small_int_float``), not by a
  conversion instruction, which issues at an eighth of the rate.

The values are the ``gguf`` package's numpy dequantiser's bit for bit (fused multiply-adds off at launch;
the one ``tl.fma`` of Q2_K adds to a product that is exact, so it rounds once, as numpy does).

* :func:`gemv_kernel`: ``block_n`` weight rows times ``rows_per`` input rows (each tile decoded once for
  all of them), summed in float32; with ``by_expert`` (one input row a program) the row's matrix is
  ``expert_ptr[row]``'s, ``expert_bytes`` apart in a bank;
* :func:`tiles_kernel`: a tile of input rows of one expert times ``block_n`` weight rows on tensor cores,
  each trip's values decoded once for the whole tile and handed to ``tl.dot`` in the inputs' dtype
  (a prefill's rows grouped by expert);
* :func:`dequant_kernel`: the values, as float32.

The blocks are read in 16-bit words (and 32-bit for Q2_K), so a matrix must start at a multiple of 2
bytes (4 for Q2_K; ``gguf_matmul.WORD_BYTES``, checked where the host can see the address).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ds4d.cuda.gguf_kernels import Q2_K, Q8_0, stored_as


@triton.jit
def small_int_float(bits):
    """Integers ``bits`` in [0, 2^23) -> float32, exactly: the bits of 2^23 + ``bits``, less 2^23."""
    return (bits | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def half_word(word):
    """The float16 in the low 16 bits of ``word``, as float32."""
    return (word & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _fours(a0, a1, a2, a3):
    """``a0`` .. ``a3`` on two new inner axes: ``[..., i, j]`` is ``a(2 * i + j)``."""
    return tl.join(tl.join(a0, a2), tl.join(a1, a3))


@triton.jit
def q8_0_trip(row, trip, k: tl.constexpr, supers: tl.constexpr):
    """34-byte blocks of 32: ``d``, then 32 int8 codes, read as sixteen 16-bit words (the blocks are
    2-byte aligned); a code ``c`` is ``(c ^ 128) + 2^23`` in float32, less 2^23 + 128."""
    per_trip: tl.constexpr = supers * 8
    index = trip * per_trip + tl.arange(0, per_trip)
    at = row[:, None] + (tl.where(index < k // 32, index, 0) * 34)[None, :]  # [block_n, blocks]
    d = half_word(tl.load(at.to(tl.pointer_type(tl.uint16))).to(tl.int32))
    pair = tl.arange(0, 16)
    words = tl.load((at[:, :, None] + 2 + 2 * pair[None, None, :]).to(tl.pointer_type(tl.uint16))).to(tl.int32)
    code = tl.join(words & 255, words >> 8)  # [block_n, blocks, 16, 2]
    q = ((code ^ 128) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
    w = tl.reshape(q * d[:, :, None, None], (row.shape[0], per_trip, 32))
    cols = index[:, None] * 32 + tl.arange(0, 32)[None, :]
    return w, cols, cols < k


@triton.jit
def q2_k_trip(row, trip, k: tl.constexpr, supers: tl.constexpr):
    """84-byte blocks of 256: 16 scale bytes, 64 code bytes, ``d`` and ``dmin``.  A block's two halves
    of 128 values each read 32 code bytes, whose four 2-bit fields are four runs of 32 values (shift
    ``s``: values ``32 s`` on), each run two sub-blocks of 16 (``e``) with a scale byte of their own."""
    halves: tl.constexpr = supers * 2
    hh = tl.arange(0, halves)
    e = tl.arange(0, 2)
    v = tl.arange(0, 16)
    half = hh % 2
    index = trip * supers + hh // 2
    block = row[:, None] + (tl.where(index < k // 256, index, 0) * 84)[None, :]  # [block_n, halves]
    dm = tl.load((block + 80).to(tl.pointer_type(tl.uint32)))
    scale_at = block[:, :, None] + (half * 8)[None, :, None] + e[None, None, :]  # sub-block 8 half + 2 s + e
    sc = _fours(tl.load(scale_at).to(tl.int32), tl.load(scale_at + 2).to(tl.int32),
                tl.load(scale_at + 4).to(tl.int32), tl.load(scale_at + 6).to(tl.int32))  # [bn, halves, e, 2, 2]
    dl = half_word(dm)[:, :, None, None, None] * small_int_float(sc & 15)
    ml = half_word(dm >> 16)[:, :, None, None, None] * small_int_float(sc >> 4)
    code = tl.load(block[:, :, None, None] + 16 + (half * 32)[None, :, None, None] + (e * 16)[None, None, :, None]
                   + v[None, None, None, :]).to(tl.int32)  # [bn, halves, e, 16]
    q = small_int_float(_fours(code & 3, (code >> 2) & 3, (code >> 4) & 3, (code >> 6) & 3))  # [..., 16, 2, 2]
    w = tl.fma(dl[:, :, :, None, :, :], q, -ml[:, :, :, None, :, :])  # dl * q is exact: one rounding, as numpy's
    w = tl.reshape(w, (row.shape[0], halves * 32, 4))
    shift = tl.arange(0, 2)[:, None] * 2 + tl.arange(0, 2)[None, :]
    cols = ((index * 256 + half * 128)[:, None, None, None, None] + (e * 16)[None, :, None, None, None]
            + v[None, None, :, None, None] + (shift * 32)[None, None, None, :, :])
    cols = tl.reshape(cols, (halves * 32, 4))
    return w, cols, cols < k


@triton.jit
def iq2_xxs_trip(row, trip, k: tl.constexpr, supers: tl.constexpr, grid_ptr):
    """66-byte blocks of 256: ``d``, then eight groups of 32 values in 8 bytes: four grid indices (a part
    of 8 values each) and a word of four 7-bit sign patterns (the eighth sign makes the count of minus
    signs even) over a 4-bit scale.  ``grid_ptr``: the grid as int32 ``[256, 2]`` (``_grid_words``), an
    entry's eight magnitudes as bytes."""
    groups: tl.constexpr = supers * 8
    g = tl.arange(0, groups)
    index = trip * supers + g // 8
    block = row[:, None] + (tl.where(index < k // 256, index, 0) * 66)[None, :]  # [block_n, groups]
    group = (block + 2 + (g % 8)[None, :] * 8).to(tl.pointer_type(tl.uint16))
    aux = tl.load(group + 2).to(tl.uint32) | (tl.load(group + 3).to(tl.uint32) << 16)
    db = half_word(tl.load(block.to(tl.pointer_type(tl.uint16))).to(tl.int32))
    db = db * (0.5 + (aux >> 28).to(tl.float32)) * 0.25
    first = tl.load(group).to(tl.int32)
    second = tl.load(group + 1).to(tl.int32)
    entry = _fours(first & 255, first >> 8, second & 255, second >> 8)  # [bn, groups, 2, 2]: part 2 i + j
    signs = _fours(aux & 127, (aux >> 7) & 127, (aux >> 14) & 127, (aux >> 21) & 127)
    parity = signs ^ (signs >> 4)
    parity = parity ^ (parity >> 2)
    parity = parity ^ (parity >> 1)
    signs = signs | ((parity & 1) << 7)
    words = tl.join(tl.load(grid_ptr + entry * 2), tl.load(grid_ptr + entry * 2 + 1))  # [..., 2 (word)]
    magnitude = small_int_float(_fours(words & 255, (words >> 8) & 255, (words >> 16) & 255, words >> 24))
    nibbles = tl.join(signs, signs >> 4)  # [..., 2 (word)]
    minus = _fours(nibbles & 1, (nibbles >> 1) & 1, (nibbles >> 2) & 1, (nibbles >> 3) & 1)  # as the magnitudes
    value = db[:, :, None, None, None, None, None] * magnitude  # exact: d, the scale and a grid byte
    w = (value.to(tl.uint32, bitcast=True) ^ (minus.to(tl.uint32) << 31)).to(tl.float32, bitcast=True)
    w = tl.reshape(w, (row.shape[0], groups * 4, 8))
    cols = index[:, None] * 256 + (g % 8)[:, None] * 32 + tl.arange(0, 32)[None, :]
    cols = tl.reshape(cols, (groups * 4, 8))
    return w, cols, cols < k


@triton.jit
def trip_values(row, trip, k: tl.constexpr, supers: tl.constexpr, table_ptr, qtype: tl.constexpr):
    """Trip ``trip`` of the weight rows at byte pointers ``row [block_n]``: (values ``[block_n, A, B]``
    float32, their columns ``[A, B]``, which of those exist; past the last block of a row the values are
    its first block's again, to be multiplied by inputs read as 0); ``table_ptr``: IQ2_XXS's grid words."""
    if qtype == Q8_0:
        return q8_0_trip(row, trip, k, supers)
    elif qtype == Q2_K:
        return q2_k_trip(row, trip, k, supers)
    else:
        return iq2_xxs_trip(row, trip, k, supers, table_ptr)


@triton.jit
def _times_rows(acc, w, x_ptr, first, m, sxm, cols, live, rows_per: tl.constexpr):
    """``acc`` plus the tile ``w [block_n, A, B]`` times input rows ``first`` .. ``first + rows_per`` (of
    ``m``) at columns ``cols [A, B]`` (``live``: those that exist; the others' inputs are read as 0), in
    float32.  One row: ``acc`` is ``[block_n, A, B]``, the products added element by element (summed once,
    at the end); more: ``acc`` is ``[rows_per, block_n, A]``, each row's products summed over ``B`` each
    trip."""
    if rows_per == 1:
        mask = live & (tl.zeros_like(cols) + first < m)
        x = tl.load(x_ptr + first.to(tl.int64) * sxm + cols, mask=mask, other=0.0).to(tl.float32)
        acc = tl.fma(w, x[None, :, :], acc)
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
def gemv_kernel(x_ptr, raw_ptr, out_ptr, table_ptr, expert_ptr, n, m, k: tl.constexpr, row_bytes, expert_bytes,
                sxm, som, qtype: tl.constexpr, by_expert: tl.constexpr, block_n: tl.constexpr, supers: tl.constexpr,
                rows_per: tl.constexpr, stages: tl.constexpr):
    """``stages``: the software pipeline of the loop over trips (each trip's block bytes copied that many
    trips ahead, asynchronously, into shared memory; 1: none; 0: no loop, every trip written out, so the
    compiler may issue a later trip's loads before an earlier trip's arithmetic)."""
    tile_a: tl.constexpr = supers * 8 if qtype == Q8_0 else (supers * 64 if qtype == Q2_K else supers * 32)
    tile_b: tl.constexpr = 256 * supers // tile_a  # a trip's tile: [block_n, tile_a, tile_b]
    first = tl.program_id(1) * rows_per
    base = raw_ptr
    if by_expert:
        base = raw_ptr + tl.load(expert_ptr + tl.program_id(1)).to(tl.int64) * expert_bytes
    rows = tl.program_id(0) * block_n + tl.arange(0, block_n)
    row = base + tl.where(rows < n, rows, 0).to(tl.int64) * row_bytes
    if rows_per == 1:
        acc = tl.zeros((block_n, tile_a, tile_b), dtype=tl.float32)
    else:
        acc = tl.zeros((rows_per, block_n, tile_a), dtype=tl.float32)
    if stages == 0:  # every trip written out: the compiler may issue a later trip's loads early
        for trip in tl.static_range((k + 256 * supers - 1) // (256 * supers)):
            w, cols, live = trip_values(row, trip, k, supers, table_ptr, qtype)
            acc = _times_rows(acc, w, x_ptr, first, m, sxm, cols, live, rows_per)
    else:
        for trip in tl.range(tl.cdiv(k, 256 * supers), num_stages=stages):
            w, cols, live = trip_values(row, trip, k, supers, table_ptr, qtype)
            acc = _times_rows(acc, w, x_ptr, first, m, sxm, cols, live, rows_per)
    if rows_per == 1:
        total = tl.sum(tl.sum(acc, axis=2), axis=1)[None, :]
    else:
        total = tl.sum(acc, axis=2)
    which = first + tl.arange(0, rows_per)
    tl.store(out_ptr + which.to(tl.int64)[:, None] * som + rows[None, :], stored_as(total, out_ptr),
             mask=(which[:, None] < m) & (rows[None, :] < n))


@triton.jit
def tiles_kernel(x_ptr, raw_ptr, out_ptr, table_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr, n,
                 k: tl.constexpr, row_bytes, expert_bytes, sxm, som, qtype: tl.constexpr, block_m: tl.constexpr,
                 block_n: tl.constexpr, supers: tl.constexpr, precision: tl.constexpr, stages: tl.constexpr):
    """Input rows ``tile_start .. tile_end`` of tile ``program_id(0)`` (rows sorted by expert, all of the
    tile's expert ``tile_expert``; one matrix: expert 0) times ``block_n`` weight rows of that expert's
    matrix.  A trip decodes ``supers`` x 256 values of each weight row once, in float32, puts them in
    column order (Q2_K's come in runs of 32 by shift), reads the tile's inputs there (rows of contiguous
    columns) and adds their product on tensor cores (``precision`` as in
    ``quant_kernels.fp8_tiles_kernel``), in float32.  A spare tile (start == end) runs no trip."""
    span: tl.constexpr = 256 * supers
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    start = tl.load(tile_start_ptr + tile)
    end = tl.load(tile_end_ptr + tile)
    rows = start + tl.arange(0, block_m)
    live_rows = rows < end
    weights = tl.program_id(1) * block_n + tl.arange(0, block_n)
    row = raw_ptr + expert * expert_bytes + tl.where(weights < n, weights, 0).to(tl.int64) * row_bytes
    acc = tl.zeros((block_m, block_n), dtype=tl.float32)
    trips = tl.where(start < end, tl.cdiv(k, span), 0)
    for trip in tl.range(0, trips, num_stages=stages):
        w, _, _ = trip_values(row, trip, k, supers, table_ptr, qtype)
        if qtype == Q2_K:  # [block_n, halves * 32, 4 (shift)]: the shifts' runs of 32 put back in column order
            w = tl.permute(tl.reshape(w, (block_n, 2 * supers, 32, 4)), (0, 1, 3, 2))
        w = tl.reshape(w, (block_n, span))  # Q8_0's and IQ2_XXS's values come in column order
        cols = trip * span + tl.arange(0, span)
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * sxm + cols[None, :],
                    mask=live_rows[:, None] & (cols < k)[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=precision)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * som + weights[None, :], stored_as(acc, out_ptr),
             mask=live_rows[:, None] & (weights[None, :] < n))


@triton.jit
def dequant_kernel(raw_ptr, out_ptr, table_ptr, n, k: tl.constexpr, row_bytes, som, qtype: tl.constexpr,
                   block_n: tl.constexpr):
    """``out[n, k]`` float32: trip ``program_id(1)`` (256 values) of ``block_n`` weight rows."""
    rows = tl.program_id(0) * block_n + tl.arange(0, block_n)
    row = raw_ptr + tl.where(rows < n, rows, 0).to(tl.int64) * row_bytes
    w, cols, live = trip_values(row, tl.program_id(1), k, 1, table_ptr, qtype)
    mask = (rows[:, None, None] < n) & live[None, :, :]
    tl.store(out_ptr + rows.to(tl.int64)[:, None, None] * som + cols[None, :, :], w, mask=mask)
