"""The Triton sources of ``ds4d.cuda.hc_triton`` (imported on first use, so that module loads where
Triton is missing).

A token's hyper-connection weights come from ``(2 + m) * m`` mixing logits: ``m`` for ``pre``,
``m`` for ``post``, ``m * m`` for ``comb`` (``ds4d.models.deepseek_v4.hyper`` is the reference).
:func:`mixing_weights` turns logits into weights for a block of tokens and is shared by the
kernels that need it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ds4d.cuda.pdl_kernels import wait_then_release


@triton.jit
def pre_weights(pre, base, scale, hc_eps):
    """Logits ``pre`` (float32, before scale and base; ``base`` broadcast against them) -> the ``pre``
    weights (sigmoids)."""
    return tl.sigmoid(pre * scale + base) + hc_eps


@triton.jit
def post_comb_weights(post, comb, base_ptr, scale_ptr, hc_eps, iters: tl.constexpr, m: tl.constexpr):
    """Logits ``post [B, m]``, ``comb [B, m, m]`` -> (post, comb) weights: sigmoids, and a softmax over each
    row of ``comb`` then Sinkhorn iterations (columns, rows, ..., columns), each matrix a tile whose sums
    stay inside a warp."""
    i = tl.arange(0, m)
    cell = i[:, None] * m + i[None, :]
    post = 2.0 * tl.sigmoid(post * tl.load(scale_ptr + 1) + tl.load(base_ptr + m + i)[None, :])
    c = comb * tl.load(scale_ptr + 2) + tl.load(base_ptr + 2 * m + cell)[None, :, :]
    c = tl.exp(c - tl.max(c, axis=2)[:, :, None])
    c = c / tl.sum(c, axis=2)[:, :, None] + hc_eps  # softmax over each row
    c = c / (tl.sum(c, axis=1)[:, None, :] + hc_eps)  # then columns
    for _ in range(iters - 1):
        c = c / (tl.sum(c, axis=2)[:, :, None] + hc_eps)
        c = c / (tl.sum(c, axis=1)[:, None, :] + hc_eps)
    return post, c


@triton.jit
def mixing_weights(pre, post, comb, base_ptr, scale_ptr, hc_eps, iters: tl.constexpr, m: tl.constexpr):
    """Logits ``pre [B, m]``, ``post [B, m]``, ``comb [B, m, m]`` -> (pre, post, comb) weights
    (:func:`pre_weights`, :func:`post_comb_weights`)."""
    post, comb = post_comb_weights(post, comb, base_ptr, scale_ptr, hc_eps, iters, m)
    base = tl.load(base_ptr + tl.arange(0, m))[None, :]
    return pre_weights(pre, base, tl.load(scale_ptr), hc_eps), post, comb


@triton.jit
def mixes_kernel(x_ptr, w_ptr, out_ptr, k: tl.constexpr, eps, sx, sw, so, block_k: tl.constexpr):
    """One (token, logit): the flattened streams times a row of ``fn``, the sum of squares taken in the
    same pass and the RMS norm applied to the dot product."""
    token = tl.program_id(0)
    col = tl.program_id(1)
    dot = tl.zeros([block_k], dtype=tl.float32)
    squares = tl.zeros([block_k], dtype=tl.float32)
    for k0 in range(0, k, block_k):
        ks = k0 + tl.arange(0, block_k)
        x = tl.load(x_ptr + token * sx + ks, mask=ks < k, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + col * sw + ks, mask=ks < k, other=0.0).to(tl.float32)
        dot += x * w
        squares += x * x
    norm = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / k + eps)
    tl.store(out_ptr + token * so + col, tl.sum(dot, axis=0) * norm)


@triton.jit(do_not_specialize=["tokens"])
def weights_kernel(mix_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, tokens, hc_eps,
                   iters: tl.constexpr, m: tl.constexpr, block_t: tl.constexpr):
    """``block_t`` tokens' weights from their stored logits."""
    t = tl.program_id(0) * block_t + tl.arange(0, block_t)
    live = t < tokens
    i = tl.arange(0, m)
    width = (2 + m) * m
    row = mix_ptr + t[:, None] * width + i[None, :]
    cell = i[:, None] * m + i[None, :]
    pre, post, c = mixing_weights(tl.load(row, mask=live[:, None], other=0.0),
                                  tl.load(row + m, mask=live[:, None], other=0.0),
                                  tl.load(mix_ptr + t[:, None, None] * width + 2 * m + cell[None, :, :],
                                          mask=live[:, None, None], other=0.0),
                                  base_ptr, scale_ptr, hc_eps, iters, m)
    out = t[:, None] * m + i[None, :]
    tl.store(pre_ptr + out, pre, mask=live[:, None])
    tl.store(post_ptr + out, post, mask=live[:, None])
    tl.store(comb_ptr + t[:, None, None] * (m * m) + cell[None, :, :], c, mask=live[:, None, None])


@triton.jit(do_not_specialize=["tokens"])
def boundary_mixes_kernel(s_ptr, o_ptr, post_ptr, comb_ptr, new_ptr, fn_ptr, dot_ptr, sq_ptr, tokens,
                          d: tl.constexpr, m: tl.constexpr, update: tl.constexpr, span: tl.constexpr,
                          block_d: tl.constexpr, block_mix: tl.constexpr, pdl: tl.constexpr):
    """One token's ``span`` columns of every stream (the second grid axis picks which): with ``update``
    the new streams ``post * output + comb^T streams`` (rounded where ``hyper.hc_post`` rounds) are
    written; then the partial sums of their squares and of their products with every row of ``fn``
    (the mixing logits before the norm) go to ``sq[split, t]`` and ``dot[split, t, :]``.  ``pdl``
    (a programmatic dependent launch): first waits for the kernel before, then lets the next one launch."""
    wait_then_release(pdl)
    t = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    dtype = s_ptr.dtype.element_ty
    width = (2 + m) * m
    mix = tl.arange(0, block_mix)
    live_mix = mix < width
    acc = tl.zeros([block_mix, block_d], dtype=tl.float32)
    squares = tl.zeros([block_d], dtype=tl.float32)
    for d0 in range(0, span, block_d):
        cols = split * span + d0 + tl.arange(0, block_d)
        live = cols < d
        if update:
            o = tl.load(o_ptr + t * d + cols, mask=live, other=0.0).to(tl.float32)
        for i in tl.static_range(m):
            if update:  # new stream i: post[i] * output + sum over j of comb[j, i] * old stream j
                p_i = tl.load(post_ptr + t * m + i).to(dtype).to(tl.float32)
                mixed = tl.zeros([block_d], dtype=tl.float32)
                for j in tl.static_range(m):
                    c = tl.load(comb_ptr + t * (m * m) + j * m + i).to(dtype).to(tl.float32)
                    mixed += c * tl.load(s_ptr + t * (m * d) + j * d + cols, mask=live, other=0.0).to(tl.float32)
                new = ((p_i * o).to(dtype).to(tl.float32) + mixed.to(dtype).to(tl.float32)).to(dtype)
                tl.store(new_ptr + t * (m * d) + i * d + cols, new, mask=live)
                new = new.to(tl.float32)
            else:
                new = tl.load(s_ptr + t * (m * d) + i * d + cols, mask=live, other=0.0).to(tl.float32)
            squares += new * new
            w = tl.load(fn_ptr + mix[:, None] * (m * d) + i * d + cols[None, :],
                        mask=live_mix[:, None] & live[None, :], other=0.0).to(tl.float32)
            acc += w * new[None, :]
    tl.store(dot_ptr + (split * tokens + t) * width + mix, tl.sum(acc, axis=1), mask=live_mix)
    tl.store(sq_ptr + split * tokens + t, tl.sum(squares, axis=0))


@triton.jit(do_not_specialize=["tokens"])
def boundary_collapse_kernel(s_ptr, dot_ptr, sq_ptr, base_ptr, scale_ptr, w_ptr, out_ptr, post_ptr, comb_ptr,
                             tokens, hc_eps, norm_eps, iters: tl.constexpr, d: tl.constexpr, m: tl.constexpr,
                             splits: tl.constexpr, block_s: tl.constexpr, block_d: tl.constexpr, pdl: tl.constexpr):
    """Two programs a token (the second grid axis), each adding up the partial sums of
    :func:`boundary_mixes_kernel` it needs into normed mixing logits.  The first collapses the streams
    by ``pre`` and RMS-norms them with ``w`` into the sub-layer's input; the second makes ``post`` and
    ``comb`` (the Sinkhorn iterations, a chain of small sums) for the update after the sub-layer, on
    another SM at the same time.  ``pdl``: as in :func:`boundary_mixes_kernel`."""
    wait_then_release(pdl)
    t = tl.program_id(0).to(tl.int64)
    width = (2 + m) * m
    s = tl.arange(0, block_s)
    live_s = s < splits
    i = tl.arange(0, m)
    parts = dot_ptr + (s * tokens + t) * width
    squares = sq_ptr + s * tokens + t
    if tl.program_id(1) == 0:  # every load first, so that their latencies overlap
        cols = tl.arange(0, block_d)
        live = cols < d
        streams = tl.load(s_ptr + t * (m * d) + i[:, None] * d + cols[None, :], mask=live[None, :], other=0.0)
        w = tl.load(w_ptr + cols, mask=live, other=0.0)
        pre_l = tl.load(parts[:, None] + i[None, :], mask=live_s[:, None], other=0.0)
        sq = tl.load(squares, mask=live_s, other=0.0)
        base, scale = tl.load(base_ptr + i), tl.load(scale_ptr)
        r = 1.0 / tl.sqrt(tl.sum(sq, axis=0) / (m * d) + norm_eps)
        pre = pre_weights(tl.sum(pre_l, axis=0) * r, base, scale, hc_eps)
        x = tl.sum(pre[:, None] * streams.to(tl.float32), axis=0)
        x = x.to(s_ptr.dtype.element_ty).to(tl.float32)  # the collapsed input, in the streams' dtype
        rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / d + norm_eps)
        tl.store(out_ptr + t * d + cols, (w.to(tl.float32) * (x * rms)).to(out_ptr.dtype.element_ty), mask=live)
    else:
        cell = i[:, None] * m + i[None, :]
        post_l = tl.load(parts[:, None] + m + i[None, :], mask=live_s[:, None], other=0.0)
        comb_l = tl.load(parts[:, None, None] + 2 * m + cell[None, :, :], mask=live_s[:, None, None], other=0.0)
        sq = tl.load(squares, mask=live_s, other=0.0)
        r = 1.0 / tl.sqrt(tl.sum(sq, axis=0) / (m * d) + norm_eps)
        post, comb = post_comb_weights(tl.sum(post_l, axis=0)[None, :] * r, tl.sum(comb_l, axis=0)[None, :, :] * r,
                                       base_ptr, scale_ptr, hc_eps, iters, m)
        tl.store(post_ptr + t * m + i[None, :], post)
        tl.store(comb_ptr + t * (m * m) + cell[None, :, :], comb)
