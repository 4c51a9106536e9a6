"""Triton kernels that multiply GGUF blocks (the ds4 q2 recipe's Q8_0, Q2_K, IQ2_XXS) by inputs quantised to
int8, four byte products at a time (``dp4a``), as llama.cpp's CUDA GEMVs do.

``gguf_blockwise``'s GEMV turns every weight value into a float32 and multiplies it by a float32 input: 7 to
12 instructions a value, and a decode step's GEMV is bound by them, not by the bytes it reads.  Here the
inputs are first rounded to int8 in runs of 32, each run with a float32 scale (:func:`quantize_kernel`:
``q = floor(x * 127 / amax + 0.5)``, ``d = amax / 127``, and the sums of ``q`` over each 16), and a weight's
values are never floats: a block's codes become words of four signed bytes (IQ2_XXS's grid bytes with their
signs applied byte by byte, Q2_K's 2-bit fields masked out of the word they sit in, Q8_0's bytes as they are),
and one ``dp4a`` adds four products to an int32 sum.  What a group of values shares (its scale, and Q2_K's
minimum times the inputs' sum) is applied once, in float32, to that group's integer sum.

The result is the product with the quantised inputs: exact integer sums, scaled and added in float32; against
float32 inputs it differs by the inputs' rounding to 8 bits (a relative error of about 1/254 of a run's largest
input per value), as llama.cpp's GPU GEMVs do.

Each GEMV kernel is written as one thread's work on one (weight row, group of values) pair: every tensor is 1-D,
so nothing crosses threads until the row's sum after the loop (compiled for sm_90 at the default launches:
1.8-3.3 instructions a weight value and 32-40 registers, against the float GEMV's 7.0-12.4 instructions;
``tests/gpu/gguf_sass_count.py --dot``).  A program takes ``block_n`` weight rows, ``groups`` groups
of each a trip, and one input row (``program_id(1)``); with ``by_expert`` that row's matrix is
``expert_ptr[row]``'s of a bank, ``expert_bytes`` apart; with ``gated`` the matrix is gate rows over up rows and
the program stores their SwiGLU (a feed-forward's first product and its activation in one launch).
:func:`q8_0_rows_kernel` takes up to eight input rows of
one matrix a program (a batch's linears), each weight word read once for all of them.

``native`` (a GPU): ``dp4a`` by inline PTX; else (Triton's interpreter) the same sum by shifts and multiplies,
which gives the same int32 bit for bit, since both are exact.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ds4d.cuda.gguf_blockwise import half_word, small_int_float
from ds4d.cuda.gguf_kernels import stored_as
from ds4d.cuda.quant_kernels import swiglu_pairs


@triton.jit
def dot4(a, b, c, native: tl.constexpr):
    """``c`` plus the products of ``a``'s and ``b``'s four signed bytes (int32 words of one shape)."""
    if native:
        return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                         is_pure=True, pack=1)
    else:
        return (c + ((a << 24) >> 24) * ((b << 24) >> 24) + ((a << 16) >> 24) * ((b << 16) >> 24)
                + ((a << 8) >> 24) * ((b << 8) >> 24) + (a >> 24) * (b >> 24))


@triton.jit
def input_words(inputs, at, wide: tl.constexpr):
    """The int64 words ``at`` and ``at + 1`` of ``inputs`` (``at`` even: 16 bytes apart from the start of a row):
    ``wide``, as one 16-byte load (a warp's load whose lanes are 32 bytes apart touches the same cache lines
    either way, so half the loads touch half the lines); else as two."""
    if wide:
        both = tl.load(inputs + tl.multiple_of(at, 2)[:, None] + tl.arange(0, 2)[None, :])
        return tl.split(both)
    else:
        return tl.load(inputs + at), tl.load(inputs + at + 1)


@triton.jit
def sign_bytes(pattern, native: tl.constexpr):
    """IQ2_XXS's 7-bit sign ``pattern`` (int32) -> two words of four bytes, byte ``i`` of the first 1 where value ``i``
    of the eight is negative, of the second value ``4 + i``: bit ``i`` of the pattern, the eighth bit its parity (so
    that the count of minus signs is even: the ``gguf`` package's ``ksigns``).  Each 4-bit half becomes four
    bytes by one multiply, bit ``i`` moved by ``7 i`` to bit ``8 i``, no two moved bits meeting; no table read."""
    if native:
        ones = tl.inline_asm_elementwise("popc.b32 $0, $1;", "=r,r", [pattern], dtype=tl.int32, is_pure=True, pack=1)
    else:
        ones = pattern ^ (pattern >> 4)
        ones = ones ^ (ones >> 2)
        ones = ones ^ (ones >> 1)
    bits = pattern | ((ones & 1) << 7)
    return ((bits & 15) * 0x204081) & 0x01010101, ((bits >> 4) * 0x204081) & 0x01010101


@triton.jit
def grid_bytes(selectors, native: tl.constexpr):
    """Four IQ2_XXS grid magnitudes as the bytes of a word, from four selectors in the low nibbles of ``selectors``
    (int32; nibble ``i`` 0, 1 or 2 for 8, 25 or 43: the ``gguf`` package's ``grid_map``), by one byte permute
    (``prmt``) of the word holding those three bytes."""
    if native:
        table = tl.zeros_like(selectors) + 0x002B1908
        return tl.inline_asm_elementwise("prmt.b32 $0, $2, 0, $1;", "=r,r,r", [selectors, table], dtype=tl.int32,
                                         is_pure=True, pack=1)
    else:
        word = tl.zeros_like(selectors)
        for i in tl.static_range(4):
            word = word | (((0x002B1908 >> (8 * ((selectors >> (4 * i)) & 15))) & 255) << (8 * i))
        return word


@triton.jit
def quantize_kernel(x_ptr, q_ptr, d_ptr, s_ptr, k, sxm, runs: tl.constexpr):
    """Row ``program_id(0)``, runs of 32 inputs ``program_id(1) * runs`` on: ``q = floor(x * (127 / amax) + 0.5)``
    (int8), the run's scale ``amax / 127`` (float32; 0 for a run of zeros) and the sums of ``q`` over each 16."""
    m = tl.program_id(0).to(tl.int64)
    run = tl.program_id(1) * runs + tl.arange(0, runs)
    live = run < k // 32
    cols = run[:, None] * 32 + tl.arange(0, 32)[None, :]
    x = tl.load(x_ptr + m * sxm + cols, mask=live[:, None], other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.where(amax > 0, 127.0 / tl.where(amax > 0, amax, 1.0), 0.0)
    q = tl.floor(x * scale[:, None] + 0.5).to(tl.int32)
    tl.store(q_ptr + m * k + cols, q.to(tl.int8), mask=live[:, None])
    tl.store(d_ptr + m * (k // 32) + run, amax / 127.0, mask=live)
    halves = tl.sum(tl.reshape(q, (runs, 2, 16)), axis=2)  # [runs, 2]
    at = run[:, None] * 2 + tl.arange(0, 2)[None, :]
    tl.store(s_ptr + m * (k // 16) + at, halves, mask=live[:, None])


@triton.jit
def _program(raw_ptr, expert_ptr, n, row_bytes, expert_bytes, by_expert: tl.constexpr, block_n: tl.constexpr,
             groups: tl.constexpr, gated: tl.constexpr = False):
    """(input row, each element's weight row pointer and group within a trip): element ``e`` is weight row
    ``e // groups`` of the program's ``block_n``, group ``e % groups``.  ``gated``: the matrix is ``n`` gate rows
    over their ``n`` up rows, and the program's rows alternate a gate row and its up row (``block_n / 2``
    outputs, :func:`_store`)."""
    r = tl.program_id(1)
    base = raw_ptr
    if by_expert:
        base = raw_ptr + tl.load(expert_ptr + r).to(tl.int64) * expert_bytes
    e = tl.arange(0, block_n * groups)
    tile = e // groups
    if gated:
        out = tl.program_id(0) * (block_n // 2) + tile // 2
        weight = tl.where(out < n, out + (tile % 2) * n, 0)
    else:
        weight = tl.program_id(0) * block_n + tile
        weight = tl.where(weight < n, weight, 0)
    return r, base + weight.to(tl.int64) * row_bytes, e % groups


@triton.jit
def _store(acc, out_ptr, r, n, m, block_n: tl.constexpr, groups: tl.constexpr, gated: tl.constexpr = False,
           limit=0.0, clamp: tl.constexpr = False):
    """Each weight row's groups summed, stored in row ``r`` of ``out [m, n]`` (rounded to its dtype); ``gated``
    (:func:`_program`): each gate row's and up row's sums rounded to it, and their SwiGLU stored
    (``quant_kernels.swiglu_pairs``, the rounding of the model's SwiGLU kernel)."""
    sums = tl.sum(tl.reshape(acc, (block_n, groups)), axis=1)
    if gated:
        values = swiglu_pairs(stored_as(sums, out_ptr).to(tl.float32), block_n, limit, clamp, out_ptr.dtype.element_ty)
        rows = tl.program_id(0) * (block_n // 2) + tl.arange(0, block_n // 2)
    else:
        values = stored_as(sums, out_ptr)
        rows = tl.program_id(0) * block_n + tl.arange(0, block_n)
    tl.store(out_ptr + r.to(tl.int64) * n + rows, values, mask=(rows < n) & (tl.zeros_like(rows) + r < m))


@triton.jit
def q8_0_kernel(q_ptr, d_ptr, raw_ptr, out_ptr, expert_ptr, n, m, k: tl.constexpr, row_bytes, expert_bytes,
                by_expert: tl.constexpr, block_n: tl.constexpr, groups: tl.constexpr, native: tl.constexpr,
                gated: tl.constexpr = False, limit=0.0, clamp: tl.constexpr = False, wide_inputs: tl.constexpr = False):
    """Q8_0: 34-byte blocks of 32 (``d``, then 32 int8 codes at 2-byte alignment, read as 16-bit halves of the
    words of four); a group is a block, its inputs read as four 64-bit words (``wide_inputs``: two loads of two,
    :func:`input_words`)."""
    r, row, g = _program(raw_ptr, expert_ptr, n, row_bytes, expert_bytes, by_expert, block_n, groups, gated)
    inputs = q_ptr.to(tl.pointer_type(tl.int64)) + r.to(tl.int64) * (k // 8)
    scales = d_ptr + r.to(tl.int64) * (k // 32)
    acc = tl.zeros((block_n * groups,), dtype=tl.float32)
    for trip in range(k // (32 * groups)):
        b = trip * groups + g
        block = row + b * 34
        halves = (block + 2).to(tl.pointer_type(tl.uint16))
        total = tl.zeros_like(b)
        x0, x1 = input_words(inputs, b * 4, wide_inputs)
        x2, x3 = input_words(inputs, b * 4 + 2, wide_inputs)
        for part in tl.static_range(4):
            x = x0 if part == 0 else (x1 if part == 1 else (x2 if part == 2 else x3))
            for half in tl.static_range(2):
                at = halves + 4 * part + 2 * half
                word = tl.load(at).to(tl.int32) | (tl.load(at + 1).to(tl.int32) << 16)
                total = dot4(word, (x >> (32 * half)).to(tl.int32), total, native)
        d = half_word(tl.load(block.to(tl.pointer_type(tl.uint16))).to(tl.int32))
        acc += total.to(tl.float32) * (d * tl.load(scales + b))
    _store(acc, out_ptr, r, n, m, block_n, groups, gated, limit, clamp)


@triton.jit
def iq2_xxs_kernel(q_ptr, d_ptr, raw_ptr, out_ptr, grid_ptr, signs_ptr, expert_ptr, n, m, k: tl.constexpr,
                   row_bytes, expert_bytes, by_expert: tl.constexpr, block_n: tl.constexpr, groups: tl.constexpr,
                   native: tl.constexpr, computed_signs: tl.constexpr = False, selector_grid: tl.constexpr = False,
                   gated: tl.constexpr = False, limit=0.0, clamp: tl.constexpr = False, wide_inputs: tl.constexpr = False):
    """IQ2_XXS: 66-byte blocks of 256 (``d``, then eight groups of 32 values in 8 bytes: four grid indices, a word
    of four 7-bit sign patterns over a 4-bit scale).  A group is four parts of 8 values; a part's grid entry and
    sign bytes are read as one 64-bit word each (``grid_ptr``: int64 ``[256]``, the entry's eight magnitudes as
    bytes; ``signs_ptr``: int64 ``[128]``, bytes ``t``, 1 where the pattern's value is negative, the eighth sign by
    parity), its inputs as another.  The sign is applied in the byte as ``(g ^ 255 t) + t``, which never carries
    into the next byte since no magnitude is 0.

    ``computed_signs``: the sign bytes made from the pattern's bits (:func:`sign_bytes`) instead of read from
    ``signs_ptr``: the same words, so the same sums bit for bit.  A warp's table reads each gather from up to 32
    addresses, a cache wavefront per line touched; the computed bytes cost a few integer instructions instead.
    ``selector_grid``: ``grid_ptr`` is int32 ``[256]``, each entry's eight magnitudes as selectors (4 bits each,
    :func:`grid_bytes`): half the table's bytes, so a warp's gathers touch about half the lines, and the same
    words again.  ``wide_inputs``: a group's inputs in two 16-byte loads, not four of 8 (:func:`input_words`)."""
    r, row, g = _program(raw_ptr, expert_ptr, n, row_bytes, expert_bytes, by_expert, block_n, groups, gated)
    inputs = q_ptr.to(tl.pointer_type(tl.int64)) + r.to(tl.int64) * (k // 8)
    scales = d_ptr + r.to(tl.int64) * (k // 32)
    acc = tl.zeros((block_n * groups,), dtype=tl.float32)
    for trip in range(k // (32 * groups)):
        group = trip * groups + g  # the group's index in the row: 8 a block
        block = row + (group // 8) * 66
        at = (block + 2 + (group % 8) * 8).to(tl.pointer_type(tl.uint16))
        indices = tl.load(at).to(tl.int32) | (tl.load(at + 1).to(tl.int32) << 16)
        aux = tl.load(at + 2).to(tl.int32) | (tl.load(at + 3).to(tl.int32) << 16)
        total = tl.zeros_like(indices)
        x0, x1 = input_words(inputs, group * 4, wide_inputs)
        x2, x3 = input_words(inputs, group * 4 + 2, wide_inputs)
        for part in tl.static_range(4):
            entry = tl.load(grid_ptr + ((indices >> (8 * part)) & 255))
            if selector_grid:
                magnitudes = (grid_bytes(entry, native), grid_bytes(entry >> 16, native))
            else:
                magnitudes = (entry.to(tl.int32), (entry >> 32).to(tl.int32))
            pattern = (aux >> (7 * part)) & 127
            if computed_signs:
                low, high = sign_bytes(pattern, native)
            else:
                minus = tl.load(signs_ptr + pattern)
                low, high = minus.to(tl.int32), (minus >> 32).to(tl.int32)
            x = x0 if part == 0 else (x1 if part == 1 else (x2 if part == 2 else x3))
            for half in tl.static_range(2):
                t = low if half == 0 else high
                word = (magnitudes[half] ^ (t * 255)) + t
                total = dot4(word, (x >> (32 * half)).to(tl.int32), total, native)
        d = half_word(tl.load(block.to(tl.pointer_type(tl.uint16))).to(tl.int32))
        scale = d * (0.5 + small_int_float((aux >> 28) & 15)) * 0.25
        acc += total.to(tl.float32) * (scale * tl.load(scales + group))
    _store(acc, out_ptr, r, n, m, block_n, groups, gated, limit, clamp)


@triton.jit
def q2_k_kernel(q_ptr, d_ptr, s_ptr, raw_ptr, out_ptr, expert_ptr, n, m, k: tl.constexpr, row_bytes, expert_bytes,
                by_expert: tl.constexpr, block_n: tl.constexpr, groups: tl.constexpr, native: tl.constexpr,
                gated: tl.constexpr = False, limit=0.0, clamp: tl.constexpr = False, wide_inputs: tl.constexpr = False):
    """Q2_K: 84-byte blocks of 256 (16 scale bytes, 64 code bytes, ``d``, ``dmin``).  A group is a run (half
    ``h``, sub-block ``e`` of a block) of 16 code bytes, four words, whose 2-bit fields ``s`` are four runs of
    16 values, ``h * 128 + 32 s + 16 e`` on, each with its scale byte ``8 h + 2 s + e`` (low nibble the scale,
    high the minimum): ``d * scale * sum(q x) - dmin * minimum * sum(x)`` with the quantised inputs (a field's 16
    read as two 64-bit words: ``wide_inputs``, one 16-byte load, :func:`input_words`)."""
    r, row, g = _program(raw_ptr, expert_ptr, n, row_bytes, expert_bytes, by_expert, block_n, groups, gated)
    inputs = q_ptr.to(tl.pointer_type(tl.int64)) + r.to(tl.int64) * (k // 8)
    scales = d_ptr + r.to(tl.int64) * (k // 32)
    sums = s_ptr + r.to(tl.int64) * (k // 16)
    acc = tl.zeros((block_n * groups,), dtype=tl.float32)
    for trip in range(k // (64 * groups)):
        run = trip * groups + g  # the run's index in the row: 4 a block
        block = row + (run // 4) * 84
        h = (run >> 1) & 1
        sub = run & 1
        dm = tl.load((block + 80).to(tl.pointer_type(tl.uint32)))
        d = half_word(dm)
        dmin = half_word(dm >> 16)
        codes = (block + 16 + 32 * h + 16 * sub).to(tl.pointer_type(tl.int32))
        first = (run // 4) * 256 + 128 * h + 16 * sub  # the column of field s = 0
        c0 = tl.load(codes)
        c1 = tl.load(codes + 1)
        c2 = tl.load(codes + 2)
        c3 = tl.load(codes + 3)
        for s in tl.static_range(4):
            col = first + 32 * s
            x01, x23 = input_words(inputs, col // 8, wide_inputs)
            total = dot4((c0 >> (2 * s)) & 0x03030303, x01.to(tl.int32), tl.zeros_like(c0), native)
            total = dot4((c1 >> (2 * s)) & 0x03030303, (x01 >> 32).to(tl.int32), total, native)
            total = dot4((c2 >> (2 * s)) & 0x03030303, x23.to(tl.int32), total, native)
            total = dot4((c3 >> (2 * s)) & 0x03030303, (x23 >> 32).to(tl.int32), total, native)
            sc = tl.load(block + 8 * h + 2 * s + sub).to(tl.int32)
            dx = tl.load(scales + col // 32)
            xs = tl.load(sums + col // 16)
            acc += (total.to(tl.float32) * ((d * small_int_float(sc & 15)) * dx)
                    - (dmin * small_int_float(sc >> 4)) * (dx * xs.to(tl.float32)))
    _store(acc, out_ptr, r, n, m, block_n, groups, gated, limit, clamp)


@triton.jit
def q8_0_rows_kernel(q_ptr, d_ptr, raw_ptr, out_ptr, n, m, k: tl.constexpr, row_bytes, block_n: tl.constexpr,
                     groups: tl.constexpr, rows_per: tl.constexpr, native: tl.constexpr):
    """:func:`q8_0_kernel` for up to ``rows_per`` input rows of one matrix (a batch's linear): a thread reads each
    weight word of its (weight row, group) once and adds its products with every row's inputs, so the rows share
    the weight's loads (``[rows_per, block_n * groups]`` tensors, each thread holding its element's column: the
    rows never cross threads until the sums)."""
    first = tl.program_id(1) * rows_per
    which = first + tl.arange(0, rows_per)
    live = which < m
    e = tl.arange(0, block_n * groups)
    weight = tl.program_id(0) * block_n + e // groups
    row = raw_ptr + tl.where(weight < n, weight, 0).to(tl.int64) * row_bytes
    g = e % groups
    safe = tl.where(live, which, 0).to(tl.int64)[:, None]
    inputs = q_ptr.to(tl.pointer_type(tl.int64)) + safe * (k // 8)
    scales = d_ptr + safe * (k // 32)
    acc = tl.zeros((rows_per, block_n * groups), dtype=tl.float32)
    for trip in range(k // (32 * groups)):
        b = trip * groups + g
        block = row + b * 34
        halves = (block + 2).to(tl.pointer_type(tl.uint16))
        total = tl.zeros((rows_per, block_n * groups), dtype=tl.int32)
        for part in tl.static_range(4):
            x = tl.load(inputs + (b * 4 + part)[None, :])
            for half in tl.static_range(2):
                at = halves + 4 * part + 2 * half
                word = tl.load(at).to(tl.int32) | (tl.load(at + 1).to(tl.int32) << 16)
                word = tl.broadcast_to(word[None, :], (rows_per, block_n * groups))
                total = dot4(word, (x >> (32 * half)).to(tl.int32), total, native)
        d = half_word(tl.load(block.to(tl.pointer_type(tl.uint16))).to(tl.int32))
        acc += total.to(tl.float32) * (d[None, :] * tl.load(scales + b[None, :]))
    sums = tl.sum(tl.reshape(acc, (rows_per, block_n, groups)), axis=2)
    rows = tl.program_id(0) * block_n + tl.arange(0, block_n)
    tl.store(out_ptr + which.to(tl.int64)[:, None] * n + rows[None, :], stored_as(sums, out_ptr),
             mask=live[:, None] & (rows < n)[None, :])
