"""Triton kernels that multiply GGUF blocks (the ds4 q2 recipe's Q8_0, Q2_K, IQ2_XXS) by inputs quantised to
int8, four byte products at a time (``dp4a``), as llama.cpp's CUDA GEMVs do.

``gguf_blockwise``'s GEMV turns every weight value into a float32 and multiplies it by a float32 input: about
seven instructions a value, and a decode step's GEMV is bound by them, not by the bytes it reads.  Here the
inputs are first rounded to int8 in runs of 32, each run with a float32 scale (:func:`quantize_kernel`:
``q = floor(x * 127 / amax + 0.5)``, ``d = amax / 127``, and the sums of ``q`` over each 16), and a weight's
values are never floats: a block's codes become words of four signed bytes (IQ2_XXS's grid bytes with their
signs applied byte by byte, Q2_K's 2-bit fields masked out of the word they sit in, Q8_0's bytes as they are),
and one ``dp4a`` adds four products to an int32 sum.  What a group of values shares (its scale, and Q2_K's
minimum times the inputs' sum) is applied once, in float32, to that group's integer sum.

The result is the product with the quantised inputs: exact integer sums, scaled and added in float32; against
float32 inputs it differs by the inputs' rounding to 8 bits (a relative error of about 1/254 of a run's largest
input per value), as llama.cpp's GPU GEMVs do.

* :func:`quantize_kernel`: ``x [M, K]`` -> int8 ``[M, K]``, float32 scales ``[M, K / 32]``, int32 sums
  ``[M, K / 16]``;
* :func:`gemv_kernel`: ``block_n`` weight rows times ``rows_per`` quantised input rows; with ``by_expert`` (one
  input row a program) the row's matrix is ``expert_ptr[row]``'s of a bank, ``expert_bytes`` apart.

``native`` (a GPU): ``dp4a`` by inline PTX; else (Triton's interpreter) the same sum by shifts and multiplies,
which gives the same int32 bit for bit, since both are exact.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ds4d.cuda.gguf_blockwise import _fours, half_word, small_int_float
from ds4d.cuda.gguf_kernels import Q2_K, Q8_0


@triton.jit
def dot4(a, b, native: tl.constexpr):
    """The sum of the products of ``a``'s and ``b``'s four signed bytes (int32 words of the same shape)."""
    if native:
        return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, 0;", "=r,r,r", [a, b], dtype=tl.int32,
                                         is_pure=True, pack=1)
    else:
        return (((a << 24) >> 24) * ((b << 24) >> 24) + ((a << 16) >> 24) * ((b << 16) >> 24)
                + ((a << 8) >> 24) * ((b << 8) >> 24) + (a >> 24) * (b >> 24))


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
def _eights(base, step_a: tl.constexpr, step_b: tl.constexpr, step_c: tl.constexpr):
    """``base`` on three new inner axes ``[..., a, b, c]``: ``base + step_a a + step_b b + step_c c`` (a thread
    keeps the eight in its own registers, as ``tl.join`` places them)."""
    return tl.join(_fours(base, base + step_b, base + step_a, base + step_a + step_b),
                   _fours(base + step_c, base + step_b + step_c, base + step_a + step_c,
                          base + step_a + step_b + step_c))


@triton.jit
def _inputs(q_row, cols, live):
    """The quantised inputs' words at first columns ``cols`` (0 where not ``live``)."""
    return tl.load(q_row + cols // 4, mask=live, other=0)


@triton.jit
def q8_0_sums(row, trip, k: tl.constexpr, supers: tl.constexpr, q_row, d_row, left, native: tl.constexpr):
    """34-byte blocks of 32 (``d``, 32 int8 codes at 2-byte alignment, read as 16-bit halves of the words of
    four): ``[block_n, blocks]``, each block's product with the quantised inputs."""
    per_trip: tl.constexpr = supers * 8
    index = trip * per_trip + tl.arange(0, per_trip)
    live = (index < k // 32) & (tl.zeros_like(index) < left)
    at = row[:, None] + (tl.where(index < k // 32, index, 0) * 34)[None, :]  # [block_n, blocks]
    d = half_word(tl.load(at.to(tl.pointer_type(tl.uint16))).to(tl.int32))
    half = _eights(at + 2, 16, 8, 4)  # word p = 4 a + 2 b + c at 2 + 4 p
    words = (tl.load(half.to(tl.pointer_type(tl.uint16))).to(tl.int32)
             | (tl.load((half + 2).to(tl.pointer_type(tl.uint16))).to(tl.int32) << 16))
    cols = _eights(index * 32, 16, 8, 4)
    x = _inputs(q_row, cols, live[:, None, None, None] & (cols >= 0))
    total = tl.sum(tl.sum(tl.sum(dot4(words, x[None, :, :, :, :], native), axis=4), axis=3), axis=2)
    return total.to(tl.float32) * (d * tl.load(d_row + index, mask=live, other=0.0)[None, :])


@triton.jit
def q2_k_sums(row, trip, k: tl.constexpr, supers: tl.constexpr, q_row, d_row, s_row, left, native: tl.constexpr):
    """84-byte blocks of 256 (16 scale bytes, 64 code bytes, ``d``, ``dmin``).  A block is four runs ``u`` (half
    ``h``, sub-block ``e``) of 16 code bytes, four 32-bit words; a word's four 2-bit fields ``s`` are values
    ``h * 128 + 32 s + 16 e`` on, a group of 16 with a scale byte ``8 h + 2 s + e`` (scale, minimum).  Returns
    ``[block_n, runs, 2, 2]`` (``s`` = 2 i + j): each group's ``d * scale * sum(q x) - dmin * minimum * sum(x)``
    with the quantised inputs."""
    runs: tl.constexpr = supers * 4
    u = tl.arange(0, runs)
    index = trip * supers + u // 4
    live = (index < k // 256) & (tl.zeros_like(index) < left)
    base = index * 256 + 128 * ((u >> 1) & 1) + 16 * (u & 1)  # the run's first column, s = 0
    block = row[:, None] + (tl.where(index < k // 256, index, 0) * 84)[None, :]  # [block_n, runs]
    dm = tl.load((block + 80).to(tl.pointer_type(tl.uint32)))
    at = block + (8 * ((u >> 1) & 1) + (u & 1))[None, :]
    sc = _fours(tl.load(at).to(tl.int32), tl.load(at + 2).to(tl.int32), tl.load(at + 4).to(tl.int32),
                tl.load(at + 6).to(tl.int32))  # [block_n, runs, 2, 2]: s = 2 i + j
    scale = half_word(dm)[:, :, None, None] * small_int_float(sc & 15)
    least = half_word(dm >> 16)[:, :, None, None] * small_int_float(sc >> 4)
    code_at = block + 16 + (32 * ((u >> 1) & 1) + 16 * (u & 1))[None, :]
    word = _fours(code_at, code_at + 4, code_at + 8, code_at + 12)  # [block_n, runs, 2, 2]: word w = 2 a + b
    codes = tl.load(word.to(tl.pointer_type(tl.int32)))
    fields = _fours(codes & 0x03030303, (codes >> 2) & 0x03030303, (codes >> 4) & 0x03030303,
                    (codes >> 6) & 0x03030303)  # [block_n, runs, 2, 2 (word), 2, 2 (s)]
    first = _fours(base, base + 32, base + 64, base + 96)  # [runs, 2, 2 (s)]
    cols = first[:, None, None, :, :] + _fours(tl.zeros_like(base), tl.zeros_like(base) + 4, tl.zeros_like(base) + 8,
                                               tl.zeros_like(base) + 12)[:, :, :, None, None]
    x = _inputs(q_row, cols, live[:, None, None, None, None] & (cols >= 0))
    total = tl.sum(tl.sum(dot4(fields, x[None, :, :, :, :, :], native), axis=2), axis=2)  # [block_n, runs, 2, 2]
    ok_s = live[:, None, None] & (first >= 0)
    d = tl.load(d_row + first // 32, mask=ok_s, other=0.0)
    s = tl.load(s_row + first // 16, mask=ok_s, other=0)
    return total.to(tl.float32) * (scale * d[None, :, :, :]) - least * (d * s.to(tl.float32))[None, :, :, :]


@triton.jit
def iq2_xxs_sums(row, trip, k: tl.constexpr, supers: tl.constexpr, grid_ptr, signs_ptr, q_row, d_row, left,
                 native: tl.constexpr):
    """66-byte blocks of 256: ``d``, then eight groups of 32 values in 8 bytes (four grid indices, a word of
    four 7-bit sign patterns over a 4-bit scale).  A value's magnitude is a byte of its grid entry
    (``grid_ptr``: int32 ``[256, 2]``); its sign is applied in the byte as ``(g ^ 255 t) + t``, ``t`` 1 where
    the value is negative (``signs_ptr``: int32 ``[128, 2]``, the bytes ``t`` of each pattern's eight signs, the
    eighth by parity), which never carries into the next byte since no magnitude is 0.  Returns
    ``[block_n, groups]``, each group's product with the quantised inputs."""
    groups: tl.constexpr = supers * 8
    g = tl.arange(0, groups)
    index = trip * supers + g // 8
    live = (index < k // 256) & (tl.zeros_like(index) < left)
    block = row[:, None] + (tl.where(index < k // 256, index, 0) * 66)[None, :]  # [block_n, groups]
    group = (block + 2 + (g % 8)[None, :] * 8).to(tl.pointer_type(tl.uint16))
    aux = tl.load(group + 2).to(tl.int32) | (tl.load(group + 3).to(tl.int32) << 16)
    d = half_word(tl.load(block.to(tl.pointer_type(tl.uint16))).to(tl.int32))
    scale = d * (0.5 + small_int_float((aux >> 28) & 15)) * 0.25
    first = tl.load(group).to(tl.int32)
    second = tl.load(group + 1).to(tl.int32)
    entry = _fours(first & 255, first >> 8, second & 255, second >> 8)  # [block_n, groups, 2, 2]: part 2 i + j
    signs = _fours(aux & 127, (aux >> 7) & 127, (aux >> 14) & 127, (aux >> 21) & 127)
    grid = tl.join(tl.load(grid_ptr + entry * 2), tl.load(grid_ptr + entry * 2 + 1))  # [..., 2 (word)]
    minus = tl.join(tl.load(signs_ptr + signs * 2), tl.load(signs_ptr + signs * 2 + 1))
    words = (grid ^ (minus * 255)) + minus
    start = index * 256 + (g % 8) * 32
    cols = _eights(start, 16, 8, 4)  # part 2 i + j, word c: 8 (2 i + j) + 4 c
    x = _inputs(q_row, cols, live[:, None, None, None] & (cols >= 0))
    total = tl.sum(tl.sum(tl.sum(dot4(words, x[None, :, :, :, :], native), axis=4), axis=3), axis=2)
    return total.to(tl.float32) * (scale * tl.load(d_row + start // 32, mask=live, other=0.0)[None, :])


@triton.jit
def trip_sums(row, trip, k: tl.constexpr, supers: tl.constexpr, grid_ptr, signs_ptr, q_row, d_row, s_row, left,
              qtype: tl.constexpr, native: tl.constexpr):
    """Trip ``trip`` of the weight rows at byte pointers ``row [block_n]`` times quantised input row ``q_row``
    (int32 words; ``d_row``, ``s_row``: its scales and sums; ``left``: rows from it on, none past 0): each group's product,
    ``[block_n, ...]`` float32."""
    if qtype == Q8_0:
        return q8_0_sums(row, trip, k, supers, q_row, d_row, left, native)
    elif qtype == Q2_K:
        return q2_k_sums(row, trip, k, supers, q_row, d_row, s_row, left, native)
    else:
        return iq2_xxs_sums(row, trip, k, supers, grid_ptr, signs_ptr, q_row, d_row, left, native)


@triton.jit
def _all(t):
    """``t [block_n, ...]`` (two to four axes) summed to ``[block_n]``."""
    if len(t.shape) == 4:
        t = tl.sum(t, axis=3)
    if len(t.shape) == 3:
        t = tl.sum(t, axis=2)
    return tl.sum(t, axis=1)


@triton.jit
def gemv_kernel(q_ptr, d_ptr, s_ptr, raw_ptr, out_ptr, grid_ptr, signs_ptr, expert_ptr, n, m, k: tl.constexpr,
                row_bytes, expert_bytes, qtype: tl.constexpr, by_expert: tl.constexpr, block_n: tl.constexpr,
                supers: tl.constexpr, rows_per: tl.constexpr, native: tl.constexpr):
    """``out[rows, weights]`` float32: quantised input rows ``program_id(1) * rows_per`` on (``q``, ``d``, ``s``
    from :func:`quantize_kernel`) times weight rows ``program_id(0) * block_n`` on, ``supers`` x 256 values a
    trip.  One input row: the groups' products are added element by element and summed once, after the loop;
    more: each row's are summed every trip."""
    first_row = tl.program_id(1) * rows_per
    base = raw_ptr
    if by_expert:
        base = raw_ptr + tl.load(expert_ptr + tl.program_id(1)).to(tl.int64) * expert_bytes
    rows = tl.program_id(0) * block_n + tl.arange(0, block_n)
    row = base + tl.where(rows < n, rows, 0).to(tl.int64) * row_bytes
    words = q_ptr.to(tl.pointer_type(tl.int32))
    trips = tl.cdiv(k, 256 * supers)
    which = tl.arange(0, rows_per)
    if rows_per == 1:
        r = first_row.to(tl.int64)
        acc = trip_sums(row, 0, k, supers, grid_ptr, signs_ptr, words + r * (k // 4), d_ptr + r * (k // 32),
                        s_ptr + r * (k // 16), m - first_row, qtype, native)
        for trip in range(1, trips):
            acc += trip_sums(row, trip, k, supers, grid_ptr, signs_ptr, words + r * (k // 4), d_ptr + r * (k // 32),
                             s_ptr + r * (k // 16), m - first_row, qtype, native)
        total = _all(acc)[None, :]
    else:
        total = tl.zeros((rows_per, block_n), dtype=tl.float32)
        for trip in range(trips):
            for i in tl.static_range(rows_per):
                r = (first_row + i).to(tl.int64)
                part = _all(trip_sums(row, trip, k, supers, grid_ptr, signs_ptr, words + r * (k // 4),
                                      d_ptr + r * (k // 32), s_ptr + r * (k // 16), m - first_row - i, qtype, native))
                total = tl.where(which[:, None] == i, total + part[None, :], total)
    out_rows = first_row + which
    tl.store(out_ptr + out_rows.to(tl.int64)[:, None] * n + rows[None, :], total,
             mask=(out_rows[:, None] < m) & (rows[None, :] < n))


@triton.jit
def iq2_xxs_flat_kernel(q_ptr, d_ptr, raw_ptr, out_ptr, grid_ptr, signs_ptr, expert_ptr, n, m, k: tl.constexpr,
                        row_bytes, expert_bytes, by_expert: tl.constexpr, block_n: tl.constexpr,
                        groups: tl.constexpr, native: tl.constexpr):
    """IQ2_XXS times one quantised input row a program, written as one thread's work on one (weight row, group
    of 32) pair: every tensor is 1-D, so no value crosses threads until the sum after the loop.  A trip takes
    ``groups`` groups of each of ``block_n`` weight rows; a group is four parts of 8 values, each part's grid
    entry and sign bytes read as one 64-bit word (``grid_ptr``, ``signs_ptr``: int64 ``[256]`` and ``[128]``),
    its inputs as another, and two ``dp4a`` chained into the group's int32 sum."""
    r = tl.program_id(1)
    base = raw_ptr
    if by_expert:
        base = raw_ptr + tl.load(expert_ptr + r).to(tl.int64) * expert_bytes
    e = tl.arange(0, block_n * groups)
    weight = tl.program_id(0) * block_n + e // groups
    g = e % groups
    row = base + tl.where(weight < n, weight, 0).to(tl.int64) * row_bytes
    inputs = q_ptr.to(tl.pointer_type(tl.int64)) + r.to(tl.int64) * (k // 8)
    scales = d_ptr + r.to(tl.int64) * (k // 32)
    acc = tl.zeros((block_n * groups,), dtype=tl.float32)
    for trip in range(k // (32 * groups)):
        group_index = trip * groups + g  # the group's index in the row: 8 a block
        block = row + (group_index // 8) * 66
        at = (block + 2 + (group_index % 8) * 8).to(tl.pointer_type(tl.uint16))
        indices = tl.load(at).to(tl.int32) | (tl.load(at + 1).to(tl.int32) << 16)
        aux = tl.load(at + 2).to(tl.int32) | (tl.load(at + 3).to(tl.int32) << 16)
        total = tl.zeros_like(indices)
        for part in tl.static_range(4):
            entry = tl.load(grid_ptr + ((indices >> (8 * part)) & 255))
            minus = tl.load(signs_ptr + ((aux >> (7 * part)) & 127))
            x = tl.load(inputs + group_index * 4 + part)
            for half in tl.static_range(2):
                grid_word = (entry >> (32 * half)).to(tl.int32)
                t = (minus >> (32 * half)).to(tl.int32)
                total += dot4((grid_word ^ (t * 255)) + t, (x >> (32 * half)).to(tl.int32), native)
        d = half_word(tl.load(block.to(tl.pointer_type(tl.uint16))).to(tl.int32))
        scale = d * (0.5 + small_int_float((aux >> 28) & 15)) * 0.25
        acc += total.to(tl.float32) * (scale * tl.load(scales + group_index))
    sums = tl.sum(tl.reshape(acc, (block_n, groups)), axis=1)
    rows = tl.program_id(0) * block_n + tl.arange(0, block_n)
    tl.store(out_ptr + r.to(tl.int64) * n + rows, sums, mask=(rows < n) & (tl.zeros_like(rows) + r < m))


@triton.jit
def q2_k_flat_kernel(q_ptr, d_ptr, s_ptr, raw_ptr, out_ptr, expert_ptr, n, m, k: tl.constexpr, row_bytes, expert_bytes,
                     by_expert: tl.constexpr, block_n: tl.constexpr, runs: tl.constexpr, native: tl.constexpr):
    """Q2_K times one quantised input row a program, one thread's work on one (weight row, run) pair, as
    :func:`iq2_xxs_flat_kernel`: a run (half ``h``, sub-block ``e`` of a block) is 16 code bytes, four words,
    whose 2-bit fields ``s`` are four groups of 16 values, ``h * 128 + 32 s + 16 e`` on, each with its scale
    byte ``8 h + 2 s + e``; a trip takes ``runs`` runs of each of ``block_n`` weight rows."""
    r = tl.program_id(1)
    base = raw_ptr
    if by_expert:
        base = raw_ptr + tl.load(expert_ptr + r).to(tl.int64) * expert_bytes
    e = tl.arange(0, block_n * runs)
    weight = tl.program_id(0) * block_n + e // runs
    u = e % runs
    row = base + tl.where(weight < n, weight, 0).to(tl.int64) * row_bytes
    inputs = q_ptr.to(tl.pointer_type(tl.int64)) + r.to(tl.int64) * (k // 8)
    scales = d_ptr + r.to(tl.int64) * (k // 32)
    sums = s_ptr + r.to(tl.int64) * (k // 16)
    acc = tl.zeros((block_n * runs,), dtype=tl.float32)
    for trip in range(k // (64 * runs)):
        run = trip * runs + u  # the run's index in the row: 4 a block
        block = row + (run // 4) * 84
        h = (run >> 1) & 1
        sub = run & 1
        dm = tl.load((block + 80).to(tl.pointer_type(tl.uint32)))
        d = half_word(dm)
        dmin = half_word(dm >> 16)
        codes = (block + 16 + 32 * h + 16 * sub).to(tl.pointer_type(tl.int32))
        first = (run // 4) * 256 + 128 * h + 16 * sub  # column of field s = 0
        c0 = tl.load(codes)
        c1 = tl.load(codes + 1)
        c2 = tl.load(codes + 2)
        c3 = tl.load(codes + 3)
        for s in tl.static_range(4):
            col = first + 32 * s
            x01 = tl.load(inputs + col // 8)
            x23 = tl.load(inputs + col // 8 + 1)
            total = dot4((c0 >> (2 * s)) & 0x03030303, x01.to(tl.int32), native)
            total += dot4((c1 >> (2 * s)) & 0x03030303, (x01 >> 32).to(tl.int32), native)
            total += dot4((c2 >> (2 * s)) & 0x03030303, x23.to(tl.int32), native)
            total += dot4((c3 >> (2 * s)) & 0x03030303, (x23 >> 32).to(tl.int32), native)
            sc = tl.load(block + 8 * h + 2 * s + sub).to(tl.int32)
            dx = tl.load(scales + col // 32)
            xs = tl.load(sums + col // 16)
            acc += (total.to(tl.float32) * ((d * small_int_float(sc & 15)) * dx)
                    - (dmin * small_int_float(sc >> 4)) * (dx * xs.to(tl.float32)))
    out = tl.sum(tl.reshape(acc, (block_n, runs)), axis=1)
    rows = tl.program_id(0) * block_n + tl.arange(0, block_n)
    tl.store(out_ptr + r.to(tl.int64) * n + rows, out, mask=(rows < n) & (tl.zeros_like(rows) + r < m))
