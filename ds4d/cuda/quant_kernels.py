"""The Triton sources of ``ds4d.cuda.quant_matmul`` (imported on first use, so that
module loads where Triton is missing).

Decoding tricks, both exact:

* e2m1 code ``c`` -> the fp16 whose bits are ``(c & 7) << 9`` plus the sign:
  exponent field ``(c >> 1) & 3``, top mantissa bit ``c & 1``, so its value is
  the e2m1 value times 2^-14 (code 1, 0.5, lands on the fp16 subnormal 2^-15);
* a ue8m0 scale byte ``s`` -> the float32 with exponent field ``s + 14``, i.e.
  2^(s - 127) times the 2^14 that the codes lack.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ds4d.cuda.pdl_kernels import wait_then_release


@triton.jit
def e2m1_scaled(code):
    """4-bit codes (int32, bit 3 the sign) -> their values times 2^-14, as float32."""
    bits = ((code & 7) << 9) | ((code & 8) << 12)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def e2m1_pairs_scaled(packed):
    """uint8 bytes -> (low-nibble value, high-nibble value), each times 2^-14, as float16.

    The same values as :func:`e2m1_scaled`, made four bytes at a time by PTX on packed 32-bit
    registers: each pair of bytes is spread into the high bytes of two 16-bit lanes
    (``prmt``), where the high nibble already holds the sign bit at bit 15 and only its 3
    magnitude bits move (right by 3); the low nibble's sign moves left by 4, its magnitude left
    by 1.  About 2.5 integer instructions a value against 6; the rows kernel gained about 4% on an
    H200 (docs/BENCHMARKS.md), so decoding is not what bounds it.  CUDA only (no interpreter)."""
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 lanes, zero, t, u;
        mov.b32 zero, 0;
        prmt.b32 lanes, $4, zero, 0x1404;
        shl.b32 t, lanes, 4;
        and.b32 t, t, 0x80008000;
        shl.b32 u, lanes, 1;
        and.b32 u, u, 0x0E000E00;
        or.b32 $0, t, u;
        shr.b32 t, lanes, 3;
        and.b32 t, t, 0x0E000E00;
        and.b32 u, lanes, 0x80008000;
        or.b32 $2, t, u;
        prmt.b32 lanes, $4, zero, 0x3424;
        shl.b32 t, lanes, 4;
        and.b32 t, t, 0x80008000;
        shl.b32 u, lanes, 1;
        and.b32 u, u, 0x0E000E00;
        or.b32 $1, t, u;
        shr.b32 t, lanes, 3;
        and.b32 t, t, 0x0E000E00;
        and.b32 u, lanes, 0x80008000;
        or.b32 $3, t, u;
        }
        """,
        constraints="=r,=r,=r,=r,r",
        args=[packed],
        dtype=(tl.float16, tl.float16),
        is_pure=True,
        pack=4,
    )


@triton.jit
def swiglu_rounded(gate, up, limit, clamp: tl.constexpr, dtype: tl.constexpr):
    """``silu(gate) * up`` (float32 inputs holding values of ``dtype``) in ``dtype``, rounded where the
    model's SwiGLU rounds (``prefill_triton.swiglu``: the SiLU, then the product); ``clamp``: the gate
    clamped from above and up on both sides at ``limit`` first."""
    if clamp:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (silu * up).to(dtype)


@triton.jit
def swiglu_pairs(rounded, block_n: tl.constexpr, limit, clamp: tl.constexpr, dtype: tl.constexpr):
    """A gated tile's ``block_n`` sums (float32 holding values of ``dtype``; gate and up rows alternating) ->
    the ``block_n / 2`` SwiGLUs of its pairs (:func:`swiglu_rounded`)."""
    gate, up = tl.split(tl.reshape(rounded, [block_n // 2, 2]))
    return swiglu_rounded(gate, up, limit, clamp, dtype)


@triton.jit
def _tile_rows(n, block_n: tl.constexpr, gated: tl.constexpr):
    """(the weight rows of this program's tile, which of them are live) for ``n`` outputs; ``gated``: tile row
    ``2i`` is the gate row of output ``c_i`` and row ``2i + 1`` its up row, ``c_i + n``."""
    if gated:
        tile = tl.arange(0, block_n)
        outs = tl.program_id(1) * (block_n // 2) + tile // 2
        return outs + (tile % 2) * n, outs < n
    cols = tl.program_id(1) * block_n + tl.arange(0, block_n)
    return cols, cols < n


@triton.jit
def _store_rows(out_row, acc, cols, live_cols, n, block_n: tl.constexpr, gated: tl.constexpr, limit,
                clamp: tl.constexpr):
    """The tile's float32 sums into the output row, in its dtype; ``gated`` (:func:`_tile_rows`): each pair of
    sums rounded to it and put through :func:`swiglu_pairs`."""
    dtype = out_row.dtype.element_ty
    if gated:
        outs = tl.program_id(1) * (block_n // 2) + tl.arange(0, block_n // 2)
        tl.store(out_row + outs, swiglu_pairs(acc.to(dtype).to(tl.float32), block_n, limit, clamp, dtype),
                 mask=outs < n)
    else:
        tl.store(out_row + cols, acc.to(dtype), mask=live_cols)


@triton.jit
def e8m0_scaled(byte):
    """ue8m0 scale bytes -> 2^(byte - 127) * 2^14 as float32."""
    return ((byte.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _fp8_rows_tile(w_ptr, s_ptr, cols, live_cols, k0, k: tl.constexpr, swn, ssn, block_k: tl.constexpr,
                   block: tl.constexpr):
    """The ``block_n`` x ``block_k`` weight tile at input ``k0`` and its scales (one per ``block`` inputs)."""
    ks = k0 + tl.arange(0, block_k)
    ws = tl.load(w_ptr + cols[:, None] * swn + ks[None, :], mask=live_cols[:, None] & (ks[None, :] < k), other=0.0)
    blocks = k0 // block + tl.arange(0, block_k // block)
    scale = tl.load(s_ptr + (cols // block)[:, None] * ssn + blocks[None, :],
                    mask=live_cols[:, None] & (blocks[None, :] * block < k), other=0.0)
    return ws, scale


@triton.jit
def _fp8_rows_add(acc, x_ptr, row, sxm, ws, scale, k0, k: tl.constexpr, block_n: tl.constexpr,
                  block_k: tl.constexpr, block: tl.constexpr):
    """``acc`` plus the tile's products with the row's inputs from ``k0``, summed per scale block, scaled."""
    ks = k0 + tl.arange(0, block_k)
    xs = tl.load(x_ptr + row * sxm + ks, mask=ks < k, other=0.0).to(tl.float32)
    part = tl.sum(tl.reshape(ws.to(tl.float32) * xs[None, :], [block_n, block_k // block, block]), axis=2)
    return acc + tl.sum(part * scale, axis=1)


@triton.jit
def fp8_rows_kernel(x_ptr, w_ptr, s_ptr, out_ptr, n, k: tl.constexpr, sxm, swn, ssn, som,
                    block_n: tl.constexpr, block_k: tl.constexpr, block: tl.constexpr, pdl: tl.constexpr,
                    gated: tl.constexpr = False, limit=0.0, clamp: tl.constexpr = False):
    """One row of x times ``block_n`` FP8 weight rows, with one scale per ``block`` x ``block`` weights
    (a divisor of ``block_k``); consecutive programs take the same weight rows for the next row of x,
    so a few rows share each weight read through the cache.

    ``pdl`` (launched as a programmatic dependent launch): the first weight tile, which no earlier kernel
    writes, is read before waiting for the kernel before to finish; nothing else is read or written
    before that wait.  The next kernel may launch once every program is past it.

    ``gated``: gate rows over up rows, their SwiGLU out (``n`` wide), as in :func:`mxfp4_rows_kernel`."""
    row = tl.program_id(0)
    cols, live_cols = _tile_rows(n, block_n, gated)
    ws, scale = _fp8_rows_tile(w_ptr, s_ptr, cols, live_cols, 0, k, swn, ssn, block_k, block)
    wait_then_release(pdl)
    acc = _fp8_rows_add(tl.zeros([block_n], dtype=tl.float32), x_ptr, row, sxm, ws, scale, 0, k, block_n, block_k,
                        block)
    for k0 in range(block_k, k, block_k):
        ws, scale = _fp8_rows_tile(w_ptr, s_ptr, cols, live_cols, k0, k, swn, ssn, block_k, block)
        acc = _fp8_rows_add(acc, x_ptr, row, sxm, ws, scale, k0, k, block_n, block_k, block)
    _store_rows(out_ptr + row * som, acc, cols, live_cols, n, block_n, gated, limit, clamp)


@triton.jit(do_not_specialize=["m"])
def fp8_tiles_kernel(x_ptr, w_ptr, s_ptr, out_ptr, m, n, k: tl.constexpr, sxm, swn, ssn, sos, som,
                     block_m: tl.constexpr, block_n: tl.constexpr, steps: tl.constexpr, block: tl.constexpr,
                     precision: tl.constexpr):
    """``block_m`` rows times ``block_n`` FP8 weight rows on tensor cores over ``steps`` scale blocks
    of ``block`` inputs (the third grid axis picks which), each step scaled per output column; the
    float32 partial sum goes to ``out[split]`` (the caller adds the splits).  ``precision``: the
    products' input precision (``ieee`` for float32 rows, so they are not rounded to TF32)."""
    rows = tl.program_id(0) * block_m + tl.arange(0, block_m)
    cols = tl.program_id(1) * block_n + tl.arange(0, block_n)
    split = tl.program_id(2)
    s_base = s_ptr + (cols // block) * ssn
    acc = tl.zeros([block_m, block_n], dtype=tl.float32)
    for i in range(steps):
        step = split * steps + i
        ks = step * block + tl.arange(0, block)
        xs = tl.load(x_ptr + rows[:, None] * sxm + ks[None, :], mask=(rows[:, None] < m) & (ks[None, :] < k),
                     other=0.0)
        ws = tl.load(w_ptr + cols[:, None] * swn + ks[None, :], mask=(cols[:, None] < n) & (ks[None, :] < k),
                     other=0.0)
        scale = tl.load(s_base + step, mask=(cols < n) & (cols * 0 + step * block < k), other=0.0)
        acc += tl.dot(xs, tl.trans(ws.to(xs.dtype)), input_precision=precision) * scale[None, :]
    tl.store(out_ptr + split * sos + rows[:, None] * som + cols[None, :], acc,
             mask=(rows[:, None] < m) & (cols[None, :] < n))


@triton.jit
def fp8_dequant_kernel(w_ptr, s_ptr, out_ptr, n, k, swn, ssn, son, block: tl.constexpr):
    """A 128 x 128 tile of an FP8 weight times its scales (one per ``block`` x ``block``, a divisor of
    128), stored in ``out``'s dtype."""
    rows = tl.program_id(0) * 128 + tl.arange(0, 128)
    cols = tl.program_id(1) * 128 + tl.arange(0, 128)
    mask = (rows[:, None] < n) & (cols[None, :] < k)
    scale = tl.load(s_ptr + (rows // block)[:, None] * ssn + (cols // block)[None, :], mask=mask, other=0.0)
    ws = tl.load(w_ptr + rows[:, None] * swn + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * son + cols[None, :], (ws * scale).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def mxfp4_rows_kernel(x_ptr, w_table, s_table, out_ptr, anchor_ptr, anchor, expert_ptr, n, k: tl.constexpr,
                      sxr, swn, ssn, sor, block_n: tl.constexpr, block_b: tl.constexpr, ptx_decode: tl.constexpr,
                      aligned: tl.constexpr, pdl: tl.constexpr, gated: tl.constexpr = False, limit=0.0,
                      clamp: tl.constexpr = False):
    """One row times ``block_n`` rows of its expert's MXFP4 matrix, ``block_b`` bytes (2 x as many
    inputs) a step; byte j holds inputs 2j (low nibble) and 2j + 1, 16 bytes share a scale.  Each
    expert's packed bytes and scales are found through address tables (``w_table[e]``,
    ``s_table[e]``), so an expert may sit in device memory or in mapped host memory.
    ``ptx_decode``: codes decoded by :func:`e2m1_pairs_scaled` (CUDA) instead of :func:`e2m1_scaled`.

    Addresses are taken as offsets from ``anchor_ptr`` (a uint8 view of 16-byte aligned memory at
    address ``anchor``): the compiler tracks the alignment of a pointer argument plus an offset
    declared a multiple of 16 (``aligned``: the caller promises every address in the tables is
    one), and then reads the bytes in 16-byte vectors.  An address loaded from memory and turned
    into a pointer is read one byte at a time (half the bandwidth, ``tests/gpu/mxfp4_ablation.py``).

    ``pdl`` (launched as a programmatic dependent launch): waits for the kernel before first (the experts
    it reads are chosen by it); the next kernel may launch once every program is past that wait.

    ``gated``: the matrix is an expert's gate rows over its up rows (``2 n`` rows) and the output is their
    SwiGLU, ``n`` wide: the tile's rows alternate a gate row and its up row (``block_n / 2`` outputs a
    program, each row summed as in a plain launch of the same ``block_n``), both products rounded to the
    output's dtype and then put through :func:`swiglu_rounded` (``clamp``: at ``limit``)."""
    wait_then_release(pdl)
    row = tl.program_id(0)
    cols, live_cols = _tile_rows(n, block_n, gated)
    expert = tl.load(expert_ptr + row)
    w_offset = tl.load(w_table + expert) - anchor
    s_offset = tl.load(s_table + expert) - anchor
    if aligned:
        w_offset = tl.multiple_of(w_offset, 16)
        s_offset = tl.multiple_of(s_offset, 16)
    w_base = anchor_ptr + w_offset + cols[:, None] * swn
    s_base = anchor_ptr + s_offset + cols[:, None] * ssn
    acc = tl.zeros([block_n], dtype=tl.float32)
    for k0 in range(0, k // 2, block_b):
        byte = k0 + tl.arange(0, block_b)
        live = byte < k // 2
        # inputs 2j and 2j + 1 in one contiguous load, then split (two stride-2 loads cost more)
        pairs = tl.load(x_ptr + row * sxr + 2 * byte[:, None] + tl.arange(0, 2)[None, :], mask=live[:, None],
                        other=0.0)
        even, odd = tl.split(pairs.to(tl.float32))
        packed = tl.load(w_base + byte[None, :], mask=live_cols[:, None] & live[None, :], other=0)
        if ptx_decode:
            low, high = e2m1_pairs_scaled(packed)
            part = low.to(tl.float32) * even[None, :] + high.to(tl.float32) * odd[None, :]
        else:
            codes = packed.to(tl.int32)
            part = e2m1_scaled(codes & 15) * even[None, :] + e2m1_scaled(codes >> 4) * odd[None, :]
        groups = k0 // 16 + tl.arange(0, block_b // 16)
        scale = e8m0_scaled(tl.load(s_base + groups[None, :], mask=live_cols[:, None] & (groups[None, :] < k // 32),
                                    other=0))
        acc += tl.sum(tl.sum(tl.reshape(part, [block_n, block_b // 16, 16]), axis=2) * scale, axis=1)
    _store_rows(out_ptr + row * sor, acc, cols, live_cols, n, block_n, gated, limit, clamp)


@triton.jit
def mxfp4_grouped_kernel(even_ptr, odd_ptr, w_ptr, s_ptr, out_ptr, tile_expert_ptr, tile_start_ptr,
                         tile_end_ptr, n, k: tl.constexpr, sxr, swe, swn, sse, ssn, sor,
                         block_m: tl.constexpr, block_n: tl.constexpr, block_b: tl.constexpr,
                         precision: tl.constexpr):
    """A tile of rows of one expert times ``block_n`` rows of its MXFP4 matrix on tensor cores:
    the even and odd inputs (split by the caller) against the low and high nibbles (``precision``:
    as in :func:`fp8_tiles_kernel`)."""
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    start = tl.load(tile_start_ptr + tile)
    end = tl.load(tile_end_ptr + tile)  # start == end: a spare tile, every load and store masked off
    rows = start + tl.arange(0, block_m)
    cols = tl.program_id(1) * block_n + tl.arange(0, block_n)
    live_rows = rows < end
    live_cols = cols < n
    w_base = w_ptr + expert * swe + cols[None, :] * swn
    s_base = s_ptr + expert * sse + cols[None, :] * ssn
    acc = tl.zeros([block_m, block_n], dtype=tl.float32)
    for k0 in range(0, k // 2, block_b):
        byte = k0 + tl.arange(0, block_b)
        live = byte < k // 2
        xmask = live_rows[:, None] & live[None, :]
        even = tl.load(even_ptr + rows[:, None] * sxr + byte[None, :], mask=xmask, other=0.0)
        odd = tl.load(odd_ptr + rows[:, None] * sxr + byte[None, :], mask=xmask, other=0.0)
        packed = tl.load(w_base + byte[:, None], mask=live_cols[None, :] & live[:, None], other=0).to(tl.int32)
        groups = k0 // 16 + tl.arange(0, block_b // 16)
        scale = e8m0_scaled(tl.load(s_base + groups[:, None], mask=live_cols[None, :] & (groups[:, None] < k // 32),
                                    other=0))[:, None, :]
        low = tl.reshape(tl.reshape(e2m1_scaled(packed & 15), [block_b // 16, 16, block_n]) * scale,
                         [block_b, block_n])
        high = tl.reshape(tl.reshape(e2m1_scaled(packed >> 4), [block_b // 16, 16, block_n]) * scale,
                          [block_b, block_n])
        acc += tl.dot(even, low.to(even.dtype), input_precision=precision)
        acc += tl.dot(odd, high.to(odd.dtype), input_precision=precision)
    tl.store(out_ptr + rows[:, None] * sor + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=live_rows[:, None] & live_cols[None, :])


@triton.jit
def gather_cold_kernel(src_table, on_host_ptr, expert_ptr, dst_ptr, words, dst_row_words, block: tl.constexpr):
    """Row ``r``'s expert, when it sits in host memory: its ``words`` int64 words from address
    ``src_table[expert]`` into ``dst[r]``, ``block`` words a program (large contiguous reads, which
    a PCIe link serves far better than the scattered small reads of a GEMV).  Hot rows do nothing."""
    row = tl.program_id(0)
    expert = tl.load(expert_ptr + row)
    if tl.load(on_host_ptr + expert) != 0:
        src = tl.load(src_table + expert).to(tl.pointer_type(tl.int64))
        at = tl.program_id(1) * block + tl.arange(0, block)
        live = at < words
        tl.store(dst_ptr + row * dst_row_words + at, tl.load(src + at, mask=live, other=0), mask=live)


@triton.jit
def fetch_rows_kernel(src_table, need_ptr, expert_ptr, dst_ptr, words, dst_row_words, span, block: tl.constexpr):
    """Row ``r`` with ``need[r] != 0``: ``words`` int64 words from address ``src_table[expert[r]]`` into
    ``dst[r]``.  Program ``(r, p)`` copies words ``[p * span, (p + 1) * span)`` of its row, ``block`` at a time:
    few programs a row keep the copy from taking the device's every SM while other work runs beside it."""
    row = tl.program_id(0)
    if tl.load(need_ptr + row) != 0:
        src = tl.load(src_table + tl.load(expert_ptr + row)).to(tl.pointer_type(tl.int64))
        dst = dst_ptr + row.to(tl.int64) * dst_row_words
        begin = tl.program_id(1).to(tl.int64) * span
        end = tl.minimum(begin + span, words)
        for first in range(begin, end, block):
            at = first + tl.arange(0, block)
            live = at < end
            tl.store(dst + at, tl.load(src + at, mask=live, other=0), mask=live)
