"""Triton kernels for a decode step's hyper-connections: the work between two sub-layers in two launches.

Between two sub-layers every token's ``m`` streams take in the output of the
one before (``hc_post``: ``post * output + comb^T streams``), are RMS-normalised
and projected (``m * D`` values) to ``(2 + m) * m`` mixing logits, which become
``pre``, ``post`` and the Sinkhorn-normalised ``comb``; the streams weighted by
``pre`` and RMS-normed are the next sub-layer's input
(``ds4d.models.deepseek_v4.hyper`` is the reference).  In torch, at batch 1,
that is a batched matmul, a few elementwise kernels, cuBLAS's GEMV for an
output of 24 values over 16K inputs and the mixing kernel.  Here:

* :func:`hc_boundary_step` -- the whole boundary for a few tokens in two
  launches: programs over (token, column range) update the streams and take
  the partial dot products of every ``fn`` row and the partial sums of squares
  in the same pass; then two programs a token add them up, one collapsing the
  streams and norming them, the other making ``post`` and ``comb`` at the same
  time.
* :func:`hc_mixes` -- one program per (token, output): the dot product of the
  flattened streams with one row of ``fn``, with the sum of squares taken in
  the same pass and the norm applied to the dot product (the same value as
  normalising first, up to float32 rounding).  Meant for a few tokens
  (``MAX_TOKENS``); a prefill's many tokens are a matmul.
* :func:`hc_weights` -- ``pre``, ``post`` and ``comb`` of a block of tokens,
  the ``m x m`` matrices held as one ``[tokens, m, m]`` tile whose row and
  column sums are reductions inside a warp (no shared-memory barriers); a
  prefill step's many tokens use it too (``hyper.hc_boundary``).

All of them round where the reference rounds and sum in float32, so they agree
with it up to the order of float32 sums.  Triton is imported on first use; with
``TRITON_INTERPRET=1`` the kernels run on CPU tensors (that is how the tests
compare them with the torch reference).
"""

from __future__ import annotations

import torch

from ds4d.cuda.devices import pdl_launch, pdl_options, triton_can_launch

MAX_TOKENS = 64
""":func:`hc_mixes` is used up to this many tokens (decode batches)."""
_BLOCK_K = 2048
_BLOCK_T = 16
TUNING = {"boundary_block_d": 64, "boundary_programs": 64, "boundary_warps": 4, "collapse_warps": 1}
""":func:`hc_boundary_step`: columns a step of its first kernel's programs, about how many programs a
token (column ranges of every stream), and the warps of its two kernels (``tests/gpu/decode_fusions_time.py``
on an H100, with the second kernel still one program a token: 11.7 us for one token and 12.2 for eight at
V4-Flash widths; 128 columns a step and 2 warps 11.6 and 11.9; 32 columns a step with 32 programs a token
23 us).  The second kernel in two programs a token, on an H100 (``--quick``): one warp 7.7 us for one token and
9.0 for eight, against 9.1 and 10.0 with eight warps (2 and 4: 10.0-10.4); with one Sinkhorn iteration instead of
20, 6.4 and 6.9."""
MAX_BOUNDARY_D = 8192
""":func:`hc_boundary_step` takes streams of up to this width (its second kernel holds a token's streams)."""
_state: dict[str, object] = {}


def _kernels():
    if "kernels" not in _state:
        from ds4d.cuda import hc_triton_kernels

        _state["kernels"] = hc_triton_kernels
    return _state["kernels"]


def available() -> bool:
    """Triton is importable and can launch here (a CUDA device, or the interpreter)."""
    if "available" not in _state:
        _state["available"] = triton_can_launch(_kernels)
    return bool(_state["available"])


def usable(tokens: int, m: int) -> bool:
    """Whether :func:`hc_mix` takes ``tokens`` tokens of ``m`` streams (a power of two)."""
    return 0 < tokens <= MAX_TOKENS and m & (m - 1) == 0 and available()


@torch.compiler.disable  # launched as is; torch.compile and CUDA graph capture see the kernels
def hc_mixes(streams: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """``[T, N]`` float32: the RMS-normalised flattened ``streams [T, m, D]`` times ``fn [N, m * D]``."""
    flat = streams.reshape(streams.shape[0], -1)
    if flat.stride(-1) != 1 or fn.stride(-1) != 1:
        raise ValueError("hc_mixes needs the streams and fn contiguous in their last dimension")
    tokens, k = flat.shape
    out = torch.empty(tokens, fn.shape[0], dtype=torch.float32, device=streams.device)
    if tokens:
        _kernels().mixes_kernel[(tokens, fn.shape[0])](flat, fn, out, k, norm_eps, flat.stride(0), fn.stride(0),
                                                       out.stride(0), block_k=_BLOCK_K, num_warps=4)
    return out


@torch.compiler.disable
def hc_weights(mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float, iters: int, m: int):
    """(pre ``[T, m]``, post ``[T, m]``, comb ``[T, m, m]``) from float32 ``mixes [T, (2 + m) * m]``."""
    import triton

    mixes = mixes.contiguous()
    tokens = mixes.shape[0]
    pre = torch.empty(tokens, m, dtype=torch.float32, device=mixes.device)
    post = torch.empty_like(pre)
    comb = torch.empty(tokens, m, m, dtype=torch.float32, device=mixes.device)
    if tokens:
        grid = (triton.cdiv(tokens, _BLOCK_T),)
        _kernels().weights_kernel[grid](mixes, base.float().contiguous(), scale.float().contiguous(), pre, post,
                                        comb, tokens, hc_eps, iters, m=m, block_t=_BLOCK_T, num_warps=1)
    return pre, post, comb


@torch.compiler.disable
def hc_mix(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float,
           iters: int, norm_eps: float):
    """(pre, post, comb) of a few tokens' ``streams [T, m, D]``: :func:`hc_mixes`, then :func:`hc_weights`."""
    m = streams.shape[-2]
    return hc_weights(hc_mixes(streams, fn, norm_eps), base, scale, hc_eps, iters, m)


def boundary_usable(tokens: int, m: int, d: int) -> bool:
    """Whether :func:`hc_boundary_step` takes ``tokens`` tokens of ``m`` streams of width ``d``."""
    return usable(tokens, m) and 0 < d <= MAX_BOUNDARY_D


@torch.compiler.disable
def hc_boundary_step(streams: torch.Tensor, output: torch.Tensor | None, post: torch.Tensor | None,
                     comb: torch.Tensor | None, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                     norm: torch.Tensor, hc_eps: float, iters: int, norm_eps: float):
    """``hyper.hc_boundary`` for a few tokens: (the sub-layer input ``[T, D]`` in the streams' dtype, the
    streams after taking in ``output``, post ``[T, m]``, comb ``[T, m, m]``), with ``output``, ``post``
    and ``comb`` those of the sub-layer before (None before the first)."""
    import triton

    tokens, m, d = streams.shape
    if fn.shape != ((2 + m) * m, m * d):
        raise ValueError(f"hc_boundary_step: fn {tuple(fn.shape)} for {m} streams of {d}")
    update = output is not None
    streams = streams.contiguous()
    if update:
        output, post, comb = output.contiguous(), post.float().contiguous(), comb.float().contiguous()
        new = torch.empty_like(streams)
    else:
        output = post = comb = new = streams  # unread
    t, width = TUNING, (2 + m) * m
    block_d = min(t["boundary_block_d"], triton.next_power_of_2(d))
    span = triton.cdiv(triton.cdiv(d, t["boundary_programs"]), block_d) * block_d
    splits = triton.cdiv(d, span)
    dots = torch.empty(splits, tokens, width, dtype=torch.float32, device=streams.device)
    squares = torch.empty(splits, tokens, dtype=torch.float32, device=streams.device)
    x = torch.empty(tokens, d, dtype=streams.dtype, device=streams.device)
    post_out = torch.empty(tokens, m, dtype=torch.float32, device=streams.device)
    comb_out = torch.empty(tokens, m, m, dtype=torch.float32, device=streams.device)
    if tokens:
        kernels, fn, pdl = _kernels(), fn.contiguous(), pdl_launch(streams)
        kernels.boundary_mixes_kernel[(tokens, splits)](
            streams, output, post, comb, new, fn, dots, squares, tokens, d=d, m=m, update=update, span=span,
            block_d=block_d, block_mix=triton.next_power_of_2(width), pdl=pdl, num_warps=t["boundary_warps"],
            **pdl_options(pdl))
        kernels.boundary_collapse_kernel[(tokens, 2)](
            new, dots, squares, base.float().contiguous(), scale.float().contiguous(), norm.contiguous(), x, post_out,
            comb_out, tokens, hc_eps, norm_eps, iters, d=d, m=m, splits=splits,
            block_s=triton.next_power_of_2(splits), block_d=triton.next_power_of_2(d), pdl=pdl,
            num_warps=t["collapse_warps"], **pdl_options(pdl))
    return x, new, post_out, comb_out
