"""The Triton kernels of a DeepSeek-V4 decode step's attention layer (``ds4d.cuda.decode_triton`` holds their host
wrappers and contracts; this module imports Triton, so it is imported only when a kernel is first launched).

* :func:`decode_attention_kernel`: a part of a row's attention over its window ring and its compressed entries,
  read where they sit in the cache; :func:`combine_kernel` merges the parts (a decode row has few queries, so
  its keys are split over programs for the GPU to have work enough, as flash-decoding does).  V4's heads are
  512 wide, so a program that held a block of queries and its output rows whole would hold them in every warp
  (a ``tl.dot`` operand is replicated across the warps that share it): 255 registers a thread and spills at
  sm_90.  Here a program writes ``d_out`` of the 512 output columns of ``block_h`` heads: it sums each score
  over the head width ``block_d`` columns at a time, in a loop (so only one piece of the query and of the keys
  is in registers at once), and multiplies the probabilities by its own columns of the keys only.  The
  programs of one row, head block and part compute the same scores and softmax, each for its columns.
* :func:`qkv_norms_kernel`: the query's and the KV's RMS norms after their low-rank projections, the KV's RoPE and
  its write into the window ring (the queries' own norm and RoPE happen as the attention kernel reads them);
* :func:`compress_kernel`: a compressor's decode step for one row: the token's projections into its tail ring
  and, when the token closes a window, the window's entry pooled from the ring, normed, rotated and written
  into the row's block.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _query_norm(q_row, eps, d: tl.constexpr, block_h: tl.constexpr, block_d: tl.constexpr):
    """``[block_h, 1]``: each query's inverse RMS over its ``d`` columns, rounded to the queries' dtype (as
    ``ops.unweighted_rms_norm`` rounds it)."""
    cols = tl.arange(0, block_d)
    squares = tl.zeros([block_h], dtype=tl.float32)
    for c in range(d // block_d):
        part = tl.load(q_row + c * block_d + cols[None, :]).to(tl.float32)
        squares += tl.sum(part * part, axis=1)
    return (1.0 / tl.sqrt(squares / d + eps)).to(q_row.dtype.element_ty).to(tl.float32)[:, None]


@triton.jit
def _rotated_piece(q_row, r, cos_row, sin_row, d: tl.constexpr, block_d: tl.constexpr, rope_pairs: tl.constexpr):
    """The queries' last ``block_d`` columns (which hold the ``2 * rope_pairs`` rotated ones) normed by ``r`` and
    rotated by ``cos_row``/``sin_row``, each rounded to the queries' dtype (as ``prefill_triton.head_norm_rope``
    writes them): each column meets its pair's other, read a second time."""
    dtype = q_row.dtype.element_ty
    cols = d - block_d + tl.arange(0, block_d)
    x = (tl.load(q_row + cols[None, :]).to(tl.float32) * r).to(dtype).to(tl.float32)
    partner = (tl.load(q_row + (cols ^ 1)[None, :]).to(tl.float32) * r).to(dtype).to(tl.float32)
    rotated = cols >= d - 2 * rope_pairs
    pair = cols // 2 - (d // 2 - rope_pairs)
    cos = tl.load(cos_row + pair, mask=rotated, other=1.0)[None, :]
    sin = tl.load(sin_row + pair, mask=rotated, other=0.0)[None, :]
    turned = tl.where((cols % 2 == 0)[None, :], x * cos - partner * sin, x * cos + partner * sin)
    return tl.where(rotated[None, :], turned, x).to(dtype)


@triton.jit
def _scores(q_row, k_rows, live, scale, d: tl.constexpr, block_h: tl.constexpr, block_k: tl.constexpr,
            block_d: tl.constexpr, precision: tl.constexpr, r, last, rope_pairs: tl.constexpr):
    """``[block_h, block_k]`` float32 scores of the queries at ``q_row [block_h, 1]`` (pointers to their rows;
    with ``rope_pairs`` normed by ``r`` as read, their last ``block_d`` columns ``last``, normed and rotated:
    :func:`_rotated_piece`) against the keys at ``k_rows [block_k, 1]``, over ``d`` columns ``block_d`` at a
    time; -inf where not live."""
    cols = tl.arange(0, block_d)
    logits = tl.zeros([block_h, block_k], dtype=tl.float32)
    for c in range(d // block_d):  # a loop, not unrolled: one piece's loads live at a time
        q_part = tl.load(q_row + c * block_d + cols[None, :])
        if rope_pairs > 0:
            if c == d // block_d - 1:
                q_part = last
            else:
                q_part = (q_part.to(tl.float32) * r).to(q_part.dtype)
        k_part = tl.load(k_rows + c * block_d + cols[None, :], mask=live[:, None], other=0.0).to(q_part.dtype)
        logits = tl.dot(q_part, tl.trans(k_part), logits, input_precision=precision)
    # float32 whatever ``scale`` came as: torch.compile hands a Python float to a user kernel as float64
    return tl.where(live[None, :], (logits * scale).to(tl.float32), float("-inf"))


@triton.jit
def _online(logits, v_tile, m, s_sum, acc, precision: tl.constexpr):
    """One tile's scores and value columns into the running softmax: maximum ``m``, sum, weighted output."""
    top = tl.maximum(m, tl.max(logits, axis=1))
    p = tl.exp(logits - top[:, None])
    alpha = tl.exp(m - top)
    s_sum = s_sum * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v_tile.dtype), v_tile, input_precision=precision)
    return top, s_sum, acc


@triton.jit
def decode_attention_kernel(q_ptr, ring_ptr, slots_ptr, pos_ptr, pool_ptr, table_ptr, picks_ptr, o_ptr, m_ptr,
                            l_ptr, cos_ptr, sin_ptr, heads, window, ratio, per_block, n_slots, n_picks, window_parts,
                            scale, q_eps, sqb, sqh, sps, sss, srs, srw, spb, spp, stb, spk, sc, d: tl.constexpr,
                            block_h: tl.constexpr, block_k: tl.constexpr, block_d: tl.constexpr, d_out: tl.constexpr,
                            chunk: tl.constexpr, entries: tl.constexpr, precision: tl.constexpr,
                            rope_pairs: tl.constexpr):
    """Row ``program_id(0)``; heads ``(program_id(1) // (d / d_out)) * block_h ..`` and output columns
    ``(program_id(1) % (d / d_out)) * d_out ..``; part ``program_id(2)`` of the row's keys, ``chunk`` of them:
    parts ``0 .. window_parts - 1`` are the window ring's slots, the rest the entries (``entries`` 1: every
    visible one of the row's blocks in id order; 2: the picked ones).  Writes the part's softmax state, its
    largest score ``m``, sum ``l`` of exp(score - m) and weighted sum ``o`` of the values' columns, to
    ``[rows, parts, heads(, d)]`` float32 (a part with no live key: m = -1e30, l = 0, o = 0); ``combine_kernel``
    merges the parts and the sink.  Heads past ``heads`` read head 0's query and are not stored.  With
    ``rope_pairs`` the queries are read as stored before their norm and RoPE: each is RMS-normed (``q_eps``) and
    its last ``2 * rope_pairs`` columns rotated by the row's ``cos``/``sin`` as it is read (:func:`_rotated_piece`:
    the rotated columns must lie in the last ``block_d``)."""
    row = tl.program_id(0)
    col_blocks: tl.constexpr = d // d_out
    part = tl.program_id(2)
    parts = tl.num_programs(2)
    h = (tl.program_id(1) // col_blocks) * block_h + tl.arange(0, block_h)
    live_h = h < heads
    cols = (tl.program_id(1) % col_blocks) * d_out + tl.arange(0, d_out)
    q_row = q_ptr + row * sqb + tl.where(live_h, h, 0)[:, None] * sqh
    r = tl.full([block_h, 1], 1.0, tl.float32)
    last = tl.zeros([block_h, block_d], dtype=q_ptr.dtype.element_ty)  # unread without ``rope_pairs``
    if rope_pairs > 0:
        r = _query_norm(q_row, q_eps, d, block_h, block_d)
        last = _rotated_piece(q_row, r, cos_ptr + row * sc, sin_ptr + row * sc, d, block_d, rope_pairs)
    m = tl.full([block_h], -1e30, tl.float32)  # finite: a part whose keys are all masked stays at l = 0
    s_sum = tl.zeros([block_h], dtype=tl.float32)
    acc = tl.zeros([block_h, d_out], dtype=tl.float32)
    pos = tl.load(pos_ptr + row * sps)
    if part < window_parts:  # ring slot j holds position pos - ((pos - j) mod window), if not negative
        ring = ring_ptr + tl.load(slots_ptr + row * sss) * srs
        for tile in range(chunk // block_k):
            j = part * chunk + tile * block_k + tl.arange(0, block_k)
            held = pos - ((pos - j) % window + window) % window
            live = (j < window) & (held >= 0)
            k_rows = ring + tl.where(live, j, 0)[:, None] * srw
            logits = _scores(q_row, k_rows, live, scale, d, block_h, block_k, block_d, precision, r, last,
                              rope_pairs)
            v_tile = tl.load(k_rows + cols[None, :], mask=live[:, None], other=0.0)
            m, s_sum, acc = _online(logits, v_tile.to(q_ptr.dtype.element_ty), m, s_sum, acc, precision)
    if entries != 0:
        visible = (pos + 1) // ratio  # entries 0 .. visible - 1 are closed
        count = tl.minimum(visible, n_slots) if entries == 1 else n_picks
        first = (part - window_parts) * chunk
        if (part >= window_parts) & (first < count):
            for tile in range(chunk // block_k):
                i = first + tile * block_k + tl.arange(0, block_k)
                live = i < count
                entry = i
                if entries == 2:
                    entry = tl.load(picks_ptr + row * spk + i, mask=live, other=0)
                    live = live & (entry < visible)
                block = tl.load(table_ptr + row * stb + entry // per_block, mask=live, other=0)
                e_rows = pool_ptr + block[:, None] * spb + (entry % per_block)[:, None] * spp
                logits = _scores(q_row, e_rows, live, scale, d, block_h, block_k, block_d, precision, r, last,
                                  rope_pairs)
                v_tile = tl.load(e_rows + cols[None, :], mask=live[:, None], other=0.0)
                m, s_sum, acc = _online(logits, v_tile.to(q_ptr.dtype.element_ty), m, s_sum, acc, precision)
    state = (row * parts + part) * heads + h  # [block_h] offsets into m and l; times d into o
    tl.store(o_ptr + state.to(tl.int64)[:, None] * d + cols[None, :], acc, mask=live_h[:, None])
    if tl.program_id(1) % col_blocks == 0:  # every column block computed the same m and l
        tl.store(m_ptr + state, m, mask=live_h)
        tl.store(l_ptr + state, s_sum, mask=live_h)


@triton.jit
def combine_kernel(o_ptr, m_ptr, l_ptr, sink_ptr, out_ptr, cos_ptr, sin_ptr, heads, parts, sob, soh, sc,
                   d: tl.constexpr, block_h: tl.constexpr, d_out: tl.constexpr, block_p: tl.constexpr,
                   rope_pairs: tl.constexpr):
    """Row ``program_id(0)``, heads ``program_id(1) * block_h ..``, columns ``program_id(2) * d_out ..``: the
    parts' softmax states (``block_p`` parts a load) and the sink (a key whose value is zero) merged into the
    attention output.  The columns are held as (even, odd) pairs, so that with ``rope_pairs`` a pair's two values
    meet in registers: the output's last ``2 * rope_pairs`` columns, rounded to its dtype, are then rotated back
    pairwise by the row's ``cos``/``sin`` (``ops.apply_rope(out, cos, -sin)``)."""
    row = tl.program_id(0)
    h = tl.program_id(1) * block_h + tl.arange(0, block_h)
    live_h = h < heads
    cols = tl.program_id(2) * d_out + tl.arange(0, d_out // 2)[:, None] * 2 + tl.arange(0, 2)[None, :]
    top = tl.load(sink_ptr + h, mask=live_h, other=0.0).to(tl.float32)
    sink = top
    for first in range(0, parts, block_p):
        p = first + tl.arange(0, block_p)
        live = (p < parts)[:, None] & live_h[None, :]
        m = tl.load(m_ptr + (row * parts + p)[:, None] * heads + h[None, :], mask=live, other=-1e30)
        top = tl.maximum(top, tl.max(m, axis=0))
    total = tl.exp(sink - top)
    acc = tl.zeros([block_h, d_out // 2, 2], dtype=tl.float32)
    for first in range(0, parts, block_p):
        p = first + tl.arange(0, block_p)
        live = (p < parts)[:, None] & live_h[None, :]
        state = (row * parts + p)[:, None] * heads + h[None, :]  # [block_p, block_h]
        weight = tl.exp(tl.load(m_ptr + state, mask=live, other=-1e30) - top[None, :])
        total += tl.sum(tl.load(l_ptr + state, mask=live, other=0.0) * weight, axis=0)
        o = tl.load(o_ptr + state.to(tl.int64)[:, :, None, None] * d + cols[None, None, :, :],
                    mask=live[:, :, None, None], other=0.0)
        acc += tl.sum(o * weight[:, :, None, None], axis=0)
    dtype = out_ptr.dtype.element_ty
    out = (acc / total[:, None, None]).to(dtype)
    if rope_pairs > 0:
        even, odd = tl.split(out.to(tl.float32))  # [block_h, d_out / 2]
        pair = tl.program_id(2) * (d_out // 2) + tl.arange(0, d_out // 2)
        rotated = pair >= d // 2 - rope_pairs
        cos = tl.load(cos_ptr + row * sc + pair - (d // 2 - rope_pairs), mask=rotated, other=1.0)[None, :]
        sin = -tl.load(sin_ptr + row * sc + pair - (d // 2 - rope_pairs), mask=rotated, other=0.0)[None, :]
        out = tl.join(tl.where(rotated[None, :], even * cos - odd * sin, even),
                      tl.where(rotated[None, :], odd * cos + even * sin, odd)).to(dtype)
    tl.store(out_ptr + row * sob + h[:, None, None] * soh + cols[None, :, :], out, mask=live_h[:, None, None])


@triton.jit
def qkv_norms_kernel(ql_ptr, kvl_ptr, qn_ptr, kvn_ptr, cos_ptr, sin_ptr, ring_ptr, slots_ptr, pos_ptr, qr_ptr,
                     window, eps, sqb, skb, sc, srb, srs, srw, sps, sss, rank: tl.constexpr, block_r: tl.constexpr,
                     d: tl.constexpr, rope_pairs: tl.constexpr):
    """Row ``program_id(0)``; ``program_id(1)`` 0: the query's low-rank projection RMS-normed with ``qn`` into
    ``qr``; 1: the KV RMS-normed with ``kvn``, rounded, its last ``2 * rope_pairs`` columns rotated pairwise by
    the row's ``cos``/``sin`` and written to its slot ``pos % window`` of its ring ``slots[row]``
    (``ops.rms_norm`` and ``ops.apply_rope``, rounded where they round)."""
    row = tl.program_id(0).to(tl.int64)
    dtype = qr_ptr.dtype.element_ty
    if tl.program_id(1) == 0:
        cols = tl.arange(0, block_r)
        live = cols < rank
        q = tl.load(ql_ptr + row * sqb + cols, mask=live, other=0.0).to(tl.float32)
        q = q * (1.0 / tl.sqrt(tl.sum(q * q, axis=0) / rank + eps))
        w = tl.load(qn_ptr + cols, mask=live, other=0.0).to(tl.float32)
        tl.store(qr_ptr + row * srb + cols, (w * q).to(dtype), mask=live)
    else:
        pairs = tl.arange(0, d // 2)[:, None] * 2 + tl.arange(0, 2)[None, :]  # [d / 2, 2]: (even, odd)
        x = tl.load(kvl_ptr + row * skb + pairs).to(tl.float32)
        x = x * (1.0 / tl.sqrt(tl.sum(tl.sum(x * x, axis=1), axis=0) / d + eps))
        x = (tl.load(kvn_ptr + pairs).to(tl.float32) * x).to(dtype).to(tl.float32)
        even, odd = tl.split(x)
        pair = tl.arange(0, d // 2)
        rotated = pair >= d // 2 - rope_pairs
        cos = tl.load(cos_ptr + row * sc + pair - (d // 2 - rope_pairs), mask=rotated, other=1.0)
        sin = tl.load(sin_ptr + row * sc + pair - (d // 2 - rope_pairs), mask=rotated, other=0.0)
        x = tl.join(tl.where(rotated, even * cos - odd * sin, even), tl.where(rotated, odd * cos + even * sin, odd))
        slot = tl.load(slots_ptr + row * sss)
        at = ring_ptr + slot * srs + (tl.load(pos_ptr + row * sps) % window) * srw
        tl.store(at + pairs, x.to(dtype).to(ring_ptr.dtype.element_ty))


@triton.jit
def _pool_rows(tail_kv_ptr, tail_score_ptr, rows, cols, open_, top, total, entry):
    """Slots ``rows [n, 1, 1]`` (offsets of ring rows) at columns ``cols`` into the running softmax pool: per
    column, the largest score so far, the sum of the weights and the weighted sum of the projections.  Scores
    of a window that does not exist (``open_`` false) count as -inf."""
    kv = tl.load(tail_kv_ptr + rows + cols[None, :, :])
    score = tl.where(open_, tl.load(tail_score_ptr + rows + cols[None, :, :]), float("-inf"))
    new_top = tl.maximum(top, tl.max(score, axis=0))
    scale = tl.exp(top - new_top)
    weight = tl.exp(score - new_top[None, :, :])
    return new_top, total * scale + tl.sum(weight, axis=0), entry * scale + tl.sum(kv * weight, axis=0)


@triton.jit
def compress_kernel(kv_ptr, score_ptr, tail_kv_ptr, tail_score_ptr, slots_ptr, pos_ptr, table_ptr, pool_ptr,
                    norm_ptr, inv_freq_ptr, ring, per_block, table_width, eps, skb, ssb, sts, str_, sps, sss, stb,
                    spb, spp, ratio: tl.constexpr, dim: tl.constexpr, overlap: tl.constexpr,
                    rope_pairs: tl.constexpr, chunk: tl.constexpr):
    """Row ``program_id(0)``: write its projections (``kv``, ``score``: ``(1 + overlap) * dim`` columns) at ring
    slot ``pos % ring``; if ``pos`` closes window ``w = pos // ratio``, pool the window's ``ratio`` slots (their
    last ``dim`` columns; with ``overlap`` also the window before's first ``dim`` columns, none before window
    0) by a softmax of their scores over the slots, column by column, ``chunk`` slots at a time; RMS-norm the
    entry, rotate its last ``2 * rope_pairs`` columns pairwise by position ``w * ratio``, and write it to entry
    ``w`` of the row's blocks.  Float32 throughout; the pool takes the entry in its own dtype."""
    row = tl.program_id(0)
    width: tl.constexpr = dim * (1 + overlap)
    slot = tl.load(slots_ptr + row * sss)
    pos = tl.load(pos_ptr + row * sps)
    every = tl.arange(0, width)
    at = slot * sts + (pos % ring) * str_ + every
    tl.store(tail_kv_ptr + at, tl.load(kv_ptr + row * skb + every))
    tl.store(tail_score_ptr + at, tl.load(score_ptr + row * ssb + every))
    if (pos + 1) % ratio == 0:
        tl.debug_barrier()  # the token's own slot, just written, is read back below by other threads
        window = pos // ratio
        pairs = tl.arange(0, dim // 2)[:, None] * 2 + tl.arange(0, 2)[None, :]  # [dim / 2, 2]: (even, odd)
        top = tl.full([dim // 2, 2], float("-inf"), tl.float32)
        total = tl.zeros([dim // 2, 2], dtype=tl.float32)
        entry = tl.zeros([dim // 2, 2], dtype=tl.float32)
        base = slot * sts  # the row's ring, as an offset into either ring
        for first in range(0, ratio, chunk):  # the window itself first: its scores are finite
            offsets = first + tl.arange(0, chunk)
            rows = (base + ((window * ratio + offsets) % ring) * str_)[:, None, None]
            top, total, entry = _pool_rows(tail_kv_ptr, tail_score_ptr, rows, pairs + overlap * dim, True, top,
                                           total, entry)
        if overlap:
            for first in range(0, ratio, chunk):
                offsets = first + tl.arange(0, chunk)
                rows = (base + ((((window - 1) * ratio + offsets) % ring + ring) % ring) * str_)[:, None, None]
                top, total, entry = _pool_rows(tail_kv_ptr, tail_score_ptr, rows, pairs, window > 0, top, total,
                                               entry)
        entry = entry / total  # [dim / 2, 2]
        entry = entry * tl.rsqrt(tl.sum(tl.sum(entry * entry, axis=1), axis=0) / dim + eps).to(tl.float32)
        entry = entry * tl.load(norm_ptr + pairs).to(tl.float32)
        even, odd = tl.split(entry)
        pair = tl.arange(0, dim // 2)
        rotated = pair >= dim // 2 - rope_pairs
        freq = tl.load(inv_freq_ptr + pair - (dim // 2 - rope_pairs), mask=rotated, other=0.0)
        angle = (window * ratio).to(tl.float32) * freq
        cos = tl.where(rotated, tl.cos(angle), 1.0)
        sin = tl.where(rotated, tl.sin(angle), 0.0)
        entry = tl.join(even * cos - odd * sin, odd * cos + even * sin)
        block = tl.load(table_ptr + row * stb + tl.minimum(window // per_block, table_width - 1))
        tl.store(pool_ptr + block * spb + (window % per_block) * spp + pairs, entry.to(pool_ptr.dtype.element_ty))
