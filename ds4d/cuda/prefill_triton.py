"""Triton kernels for the token-wise work of a V4 prefill step, one pass over memory each.

Between its matmuls a prefill chunk's tokens go through hyper-connection
mixing, norms, RoPE, SwiGLU and the routed experts' weighted sum.  In torch
each of those is several elementwise kernels that read and write tensors of
tens to hundreds of MB (the streams of 2K tokens at V4-Flash widths are 64 MB
in bf16, twice that as the float32 copies the reference makes).  Here:

* :func:`hc_update` -- the hyper-connection update after a sub-layer
  (``post * output + comb^T streams``) with each token's sum of squares (for
  the next sub-layer's RMS-normalised mixing logits) in the same pass;
* :func:`hc_collapse_norm` -- the streams weighted by ``pre`` and summed, then
  the sub-layer's RMS norm, one program per token;
* :func:`head_norm_rope` -- the queries' per-head RMS norm and RoPE, in place;
  with ``norm=False`` and ``inverse=True`` the attention output's inverse RoPE,
  touching only the rotated channels;
* :func:`swiglu` -- the clamped SwiGLU of gate and up projections;
* :func:`combine` -- each token's ``k`` expert outputs (rows sorted by expert)
  weighted and summed.

Every kernel rounds where the torch reference (``hyper.py``, ``ops.py``,
``moe.py`` in ``ds4d.models.deepseek_v4``) rounds, so the two agree up to the
order of float32 sums.  Triton is imported on first use; with
``TRITON_INTERPRET=1`` the kernels run on CPU tensors (how the tests compare
them with the reference).
"""

from __future__ import annotations

import torch

from ds4d.cuda.devices import triton_can_launch, triton_launches_on

TUNING = {"hc_block_t": 8, "hc_block_d": 128, "hc_splits": 8, "hc_warps": 4, "rope_block_h": 4, "block_cols": 1024}
"""Tokens and stream columns per step of a :func:`hc_update` program, the column ranges a
block of tokens is split into, and its warps; heads per
:func:`head_norm_rope` program; columns per :func:`swiglu` / :func:`combine` program
(``tests/gpu/prefill_sweep.py`` on an H200)."""
_state: dict[str, object] = {}


def _kernels():
    if "kernels" not in _state:
        import triton
        import triton.language as tl

        global swiglu_rounded  # a module global, where the kernels' compiler looks their helpers up
        from ds4d.cuda.quant_kernels import swiglu_rounded  # the SwiGLU the expert GEMV's epilogue rounds alike

        @triton.jit(do_not_specialize=["tokens"])
        def update_kernel(s_ptr, o_ptr, post_ptr, comb_ptr, new_ptr, sq_ptr, tokens, d: tl.constexpr,
                          m: tl.constexpr, update: tl.constexpr, span: tl.constexpr, block_t: tl.constexpr,
                          block_d: tl.constexpr):
            t = (tl.program_id(0) * block_t + tl.arange(0, block_t)).to(tl.int64)
            split = tl.program_id(1)  # this program's ``span`` columns of every stream
            live_t = t < tokens
            squares = tl.zeros([block_t], dtype=tl.float32)
            dtype = new_ptr.dtype.element_ty
            rows = s_ptr + t[:, None] * (m * d)
            for d0 in range(0, span, block_d):
                cols = split * span + d0 + tl.arange(0, block_d)
                live = live_t[:, None] & (cols < d)[None, :]
                if update:
                    o = tl.load(o_ptr + t[:, None] * d + cols[None, :], mask=live, other=0.0).to(tl.float32)
                for i in tl.static_range(m):
                    if update:  # new stream i: post[i] * output + sum over j of comb[j, i] * old stream j
                        # (post, comb, each product and the sum rounded to the streams' dtype, as the reference)
                        p_i = tl.load(post_ptr + t * m + i, mask=live_t, other=0.0).to(dtype).to(tl.float32)
                        mixed = tl.zeros([block_t, block_d], dtype=tl.float32)
                        for j in tl.static_range(m):
                            c = tl.load(comb_ptr + t * (m * m) + j * m + i, mask=live_t, other=0.0)
                            s_j = tl.load(rows + j * d + cols[None, :], mask=live, other=0.0).to(tl.float32)
                            mixed += c.to(dtype).to(tl.float32)[:, None] * s_j
                        new = ((p_i[:, None] * o).to(dtype).to(tl.float32) + mixed.to(dtype).to(tl.float32)).to(dtype)
                        tl.store(new_ptr + t[:, None] * (m * d) + i * d + cols[None, :], new, mask=live)
                        new = new.to(tl.float32)
                    else:
                        new = tl.load(rows + i * d + cols[None, :], mask=live, other=0.0).to(tl.float32)
                    squares += tl.sum(new * new, axis=1)
            tl.store(sq_ptr + split * tokens + t, squares, mask=live_t)

        @triton.jit
        def collapse_norm_kernel(s_ptr, pre_ptr, w_ptr, out_ptr, eps, d: tl.constexpr, m: tl.constexpr,
                                 block_d: tl.constexpr):
            t = tl.program_id(0).to(tl.int64)
            cols = tl.arange(0, block_d)
            live = cols < d
            x = tl.zeros([block_d], dtype=tl.float32)
            for j in tl.static_range(m):
                s_j = tl.load(s_ptr + t * (m * d) + j * d + cols, mask=live, other=0.0).to(tl.float32)
                x += tl.load(pre_ptr + t * m + j) * s_j
            x = x.to(s_ptr.dtype.element_ty).to(tl.float32)  # the collapsed input, in the streams' dtype
            r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / d + eps)
            y = tl.load(w_ptr + cols, mask=live, other=0.0).to(tl.float32) * (x * r)
            tl.store(out_ptr + t * d + cols, y.to(out_ptr.dtype.element_ty), mask=live)

        @triton.jit
        def norm_rope_kernel(x_ptr, cos_ptr, sin_ptr, heads, sx, sh, sc, eps, d: tl.constexpr, half: tl.constexpr,
                             norm: tl.constexpr, inverse: tl.constexpr, block_h: tl.constexpr):
            t = tl.program_id(0).to(tl.int64)
            h = tl.program_id(1) * block_h + tl.arange(0, block_h)
            live_h = h < heads
            base = x_ptr + t * sx + h[:, None] * sh
            dtype = x_ptr.dtype.element_ty
            r = tl.full([block_h, 1], 1.0, tl.float32)
            if norm:  # the reference rounds the scale to the input's dtype, then the product
                cols = tl.arange(0, d)
                x = tl.load(base + cols[None, :], mask=live_h[:, None], other=0.0).to(tl.float32)
                r = (1.0 / tl.sqrt(tl.sum(x * x, axis=1) / d + eps)).to(dtype).to(tl.float32)[:, None]
                nope = cols[None, :] < d - 2 * half
                tl.store(base + cols[None, :], (x * r).to(dtype), mask=live_h[:, None] & nope)
            p = tl.arange(0, half)
            even_at = base + (d - 2 * half) + 2 * p[None, :]
            even = (tl.load(even_at, mask=live_h[:, None], other=0.0).to(tl.float32) * r).to(dtype).to(tl.float32)
            odd = (tl.load(even_at + 1, mask=live_h[:, None], other=0.0).to(tl.float32) * r).to(dtype).to(tl.float32)
            cos = tl.load(cos_ptr + t * sc + p)[None, :]
            sin = tl.load(sin_ptr + t * sc + p)[None, :]
            if inverse:
                sin = -sin
            tl.store(even_at, (even * cos - odd * sin).to(dtype), mask=live_h[:, None])
            tl.store(even_at + 1, (odd * cos + even * sin).to(dtype), mask=live_h[:, None])

        @triton.jit
        def swiglu_kernel(g_ptr, u_ptr, out_ptr, cols, sg, su, so, limit, clamp: tl.constexpr, block: tl.constexpr):
            row = tl.program_id(0).to(tl.int64)
            c = tl.program_id(1) * block + tl.arange(0, block)
            live = c < cols
            dtype = out_ptr.dtype.element_ty
            g = tl.load(g_ptr + row * sg + c, mask=live, other=0.0).to(tl.float32)
            u = tl.load(u_ptr + row * su + c, mask=live, other=0.0).to(tl.float32)
            tl.store(out_ptr + row * so + c, swiglu_rounded(g, u, limit, clamp, dtype), mask=live)

        @triton.jit
        def combine_kernel(rows_ptr, slot_ptr, w_ptr, add_ptr, out_ptr, d, k: tl.constexpr, block: tl.constexpr,
                           in_order: tl.constexpr, add: tl.constexpr):
            t = tl.program_id(0).to(tl.int64)
            c = tl.program_id(1) * block + tl.arange(0, block)
            live = c < d
            acc = tl.zeros([block], dtype=tl.float32)
            for j in tl.static_range(k):
                row = t * k + j if in_order else tl.load(slot_ptr + t * k + j).to(tl.int64)
                value = tl.load(rows_ptr + row * d + c, mask=live, other=0.0).to(tl.float32)
                acc += value * tl.load(w_ptr + t * k + j)
            dtype = out_ptr.dtype.element_ty
            if add:  # the sum rounded to the output's dtype, then the other term added
                acc = acc.to(dtype).to(tl.float32) + tl.load(add_ptr + t * d + c, mask=live, other=0.0).to(tl.float32)
            tl.store(out_ptr + t * d + c, acc.to(dtype), mask=live)

        _state["kernels"] = {"update": update_kernel, "collapse_norm": collapse_norm_kernel,
                             "norm_rope": norm_rope_kernel, "swiglu": swiglu_kernel, "combine": combine_kernel}
    return _state["kernels"]


def available() -> bool:
    """Triton is importable and can launch here (a CUDA device, or the interpreter)."""
    if "available" not in _state:
        _state["available"] = triton_can_launch(_kernels)
    return bool(_state["available"])


def usable(x: torch.Tensor) -> bool:
    """Whether the kernels take tensors like ``x``: on a CUDA device (or on the CPU in Triton's
    interpreter), and Triton can launch."""
    return triton_launches_on(x) and available()


def rope_usable(x: torch.Tensor, rope_dim: int) -> bool:
    """Whether :func:`head_norm_rope` takes ``x [T, heads, d]`` with ``rope_dim`` rotated channels:
    :func:`usable`, rows of ``d`` contiguous values, ``d`` and ``rope_dim`` powers of two."""
    d = x.shape[-1]
    return x.stride(-1) == 1 and d & (d - 1) == 0 and rope_dim & (rope_dim - 1) == 0 and 2 <= rope_dim <= d \
        and usable(x)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _contiguous(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t if t.is_contiguous() else t.contiguous() for t in tensors]


def hc_update(streams: torch.Tensor, output: torch.Tensor | None = None, post: torch.Tensor | None = None,
              comb: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(new streams ``[T, m, D]``, each token's sum of their squares ``[T]`` float32).

    With ``output [T, D]``, ``post [T, m]`` and ``comb [T, m, m]`` (the sub-layer just run and
    its hyper-connection weights) the new streams are ``hyper.hc_post(output, streams, post, comb)``;
    without, ``streams`` themselves (then only read).  Programs take a block of tokens and one of
    ``hc_splits`` column ranges of every stream; their partial sums then add up in torch."""
    tokens, m, d = streams.shape
    update = output is not None
    streams = streams if streams.is_contiguous() else streams.contiguous()
    if update:
        output, post, comb = _contiguous(output, post.float(), comb.float())
        new = torch.empty_like(streams)
    else:
        output = post = comb = new = streams  # unread
    t = TUNING
    block_t, block_d = t["hc_block_t"], min(t["hc_block_d"], _pow2(d))
    splits = max(1, min(t["hc_splits"], -(-d // block_d)))
    span = -(-d // (splits * block_d)) * block_d
    splits = -(-d // span)
    squares = torch.empty(splits, tokens, dtype=torch.float32, device=streams.device)
    if tokens:
        _kernels()["update"][(-(-tokens // block_t), splits)](
            streams, output, post, comb, new, squares, tokens, d=d, m=m, update=update, span=span, block_t=block_t,
            block_d=block_d, num_warps=t["hc_warps"])
    return new, squares.sum(0)


def hc_collapse_norm(streams: torch.Tensor, pre: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms_norm(collapse of streams [T, m, D] by pre [T, m], weight, eps)``, ``[T, D]`` in the streams' dtype."""
    tokens, m, d = streams.shape
    streams, pre, weight = _contiguous(streams, pre.float(), weight)
    out = torch.empty(tokens, d, dtype=streams.dtype, device=streams.device)
    if tokens:
        block_d = _pow2(d)
        _kernels()["collapse_norm"][(tokens,)](streams, pre, weight, out, float(eps), d=d, m=m, block_d=block_d,
                                               num_warps=max(1, min(8, block_d // 512)))
    return out


def head_norm_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float = 0.0, *, norm: bool = True,
                   inverse: bool = False) -> torch.Tensor:
    """In place on ``x [T, heads, d]`` (rows of ``d`` contiguous values, ``d`` a power of two):
    ``ops.apply_rope(ops.unweighted_rms_norm(x, eps), cos, sin)`` with ``norm``, else
    ``ops.apply_rope(x, cos, -sin if inverse else sin)`` (only the rotated channels are touched).
    ``cos``/``sin``: ``[T, r / 2]`` float32.  Returns ``x``."""
    tokens, heads, d = x.shape
    if x.stride(2) != 1 or d & (d - 1):
        raise ValueError("head_norm_rope takes rows of a power-of-two number of contiguous values")
    cos, sin = _contiguous(cos.float(), sin.float())
    if tokens:
        block_h = min(TUNING["rope_block_h"], _pow2(heads))
        _kernels()["norm_rope"][(tokens, -(-heads // block_h))](
            x, cos, sin, heads, x.stride(0), x.stride(1), cos.stride(0), float(eps), d=d, half=cos.shape[-1],
            norm=norm, inverse=inverse, block_h=block_h, num_warps=4)
    return x


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)`` (no clamp when ``limit <= 0``) of two
    ``[R, C]`` tensors whose rows may be strided (such as the halves of one ``[R, 2C]`` product)."""
    rows, cols = gate.shape
    if gate.stride(1) != 1 or up.stride(1) != 1:
        raise ValueError("swiglu takes rows of contiguous values")
    out = torch.empty(rows, cols, dtype=gate.dtype, device=gate.device)
    if rows:
        block = min(TUNING["block_cols"], _pow2(cols))
        _kernels()["swiglu"][(rows, -(-cols // block))](gate, up, out, cols, gate.stride(0), up.stride(0),
                                                        out.stride(0), float(limit), clamp=limit > 0, block=block,
                                                        num_warps=4)
    return out


def combine(rows: torch.Tensor, order: torch.Tensor | None, expert_weights: torch.Tensor, dtype: torch.dtype,
            add: torch.Tensor | None = None) -> torch.Tensor:
    """``moe.combine_sorted``: ``rows [T * k, D]`` are the experts' outputs of the (token, slot) pairs
    in ``order`` (None: row ``t * k + j`` is token ``t``'s slot ``j``); each token's ``k`` of them weighted by
    ``expert_weights [T, k]`` and summed, ``[T, D]`` in ``dtype``; ``add`` (``[T, D]``): plus it, as
    ``combine(...) + add`` would."""
    tokens, k = expert_weights.shape
    d = rows.shape[1]
    slot = rows  # unread with the rows in order
    if order is not None:
        slot = torch.empty_like(order)
        slot[order] = torch.arange(order.shape[0], device=order.device, dtype=order.dtype)
    rows, weights = _contiguous(rows, expert_weights.float())
    out = torch.empty(tokens, d, dtype=dtype, device=rows.device)
    if add is not None and (add.shape != out.shape or add.dtype != dtype):
        raise ValueError(f"combine: add {tuple(add.shape)} {add.dtype} to {tuple(out.shape)} {dtype}")
    if tokens:
        block = min(TUNING["block_cols"], _pow2(d))
        _kernels()["combine"][(tokens, -(-d // block))](
            rows, slot, weights, out if add is None else add.contiguous(), out, d, k=k, block=block,
            in_order=order is None, add=add is not None, num_warps=4)
    return out
