"""Manifold-constrained hyper-connections (mHC) around every sub-layer.

The residual stream is ``hc_mult`` parallel copies of the hidden state.  Before
a sub-layer a small projection of the (RMS-normalised, flattened) streams gives
three things per token: ``pre`` weights that collapse the streams into the
sub-layer input, ``post`` weights that spread the sub-layer output back over the
streams, and a ``comb`` matrix that mixes the old streams into the new ones.
``comb`` is pushed towards a doubly-stochastic matrix by Sinkhorn iterations
so that stacking many layers cannot blow the residual up.  Everything here runs
in float32 whatever the model dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ds4d.cuda.rows import padded_product
from ds4d.models.deepseek_v4.ops import linear_f32, rms_norm, unweighted_rms_norm
from ds4d.models.deepseek_v4.weights import HyperWeights


def _mixes(streams: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    flat = unweighted_rms_norm(streams.flatten(-2).float(), norm_eps)
    return padded_product(flat, lambda rows: F.linear(rows, fn.float()))


def _collapse(pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """The streams ``[T, m, D]`` weighted by ``pre [T, m]`` and summed: ``[T, D]`` in the streams' dtype."""
    return (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)


def hc_pre(
    streams: torch.Tensor,
    weights: HyperWeights,
    iterations: int,
    hc_eps: float,
    norm_eps: float,
    *,
    fused: bool | str = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``streams [T, m, D]`` -> (sub-layer input ``[T, D]``, post ``[T, m]``, comb ``[T, m, m]``).

    ``fused``: on CUDA, the mixing weights come from kernels: with ``"triton"`` and a few tokens
    the two Triton kernels of ``ds4d.cuda.hc_triton``, otherwise the norm and projection in torch
    and the Numba kernel of ``ds4d.cuda.hc_kernels``."""
    m = streams.shape[-2]
    if fused == "triton" and streams.is_cuda:
        from ds4d.cuda import hc_triton

        if hc_triton.usable(streams.shape[0], m):
            pre, post, comb = hc_triton.hc_mix(streams, weights.fn, weights.base, weights.scale, hc_eps, iterations,
                                               norm_eps)
            return _collapse(pre, streams), post, comb
    mixes = _mixes(streams, weights.fn, norm_eps)
    if fused and streams.is_cuda:
        from ds4d.cuda.hc_kernels import hc_mix_torch

        pre, post, comb = hc_mix_torch(mixes, weights.base, weights.scale, hc_eps, iterations, m)
        return _collapse(pre, streams), post, comb
    pre_w, post_w, comb_w = mixes.split([m, m, m * m], dim=-1)
    pre_b, post_b, comb_b = weights.base.split([m, m, m * m])
    pre_scale, post_scale, comb_scale = weights.scale.unbind(0)

    pre = torch.sigmoid(pre_w * pre_scale + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * post_scale + post_b)
    comb_w = comb_w.view(*comb_w.shape[:-1], m, m)
    comb = torch.softmax(comb_w * comb_scale + comb_b.view(m, m), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(iterations - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)

    return _collapse(pre, streams), post, comb


def hc_post(output: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams: ``post * output`` plus the old streams mixed by ``comb`` (as ``comb^T @ streams``)."""
    dtype = streams.dtype
    spread = post.to(dtype).unsqueeze(-1) * output.unsqueeze(-2)
    return spread + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


def hc_boundary(
    output: torch.Tensor | None,
    streams: torch.Tensor,
    post: torch.Tensor | None,
    comb: torch.Tensor | None,
    weights: HyperWeights,
    norm: torch.Tensor,
    iterations: int,
    hc_eps: float,
    norm_eps: float,
    *,
    fused: bool | str = False,
    kernels: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The hyper-connection work between two sub-layers: the streams take in ``output`` of the one
    before (:func:`hc_post` with its ``post`` and ``comb``; None before the first sub-layer), then
    the next one's input is collapsed from them (:func:`hc_pre`) and RMS-normed with ``norm``.

    Returns (the sub-layer input ``[T, D]``, the streams, its post, its comb).  ``fused``: as for
    :func:`hc_pre`, and ``"boundary"``: on CUDA, a few tokens' boundary in the two Triton launches of
    ``hc_triton.hc_boundary_step`` (otherwise as ``"triton"``); ``kernels``: Triton kernels instead
    (``ds4d.cuda.prefill_triton``'s update, which also sums squares, and collapse-and-norm around
    ``hc_triton.hc_weights``), the mixing
    logits from one matmul of the streams as stored (``weights.fn_split`` where set), about two
    passes over the streams where torch makes a dozen (many tokens: a prefill step)."""
    m = streams.shape[-2]
    if fused == "boundary":
        fused = "triton"
        if not kernels and streams.is_cuda:
            from ds4d.cuda import hc_triton

            if hc_triton.boundary_usable(streams.shape[0], m, streams.shape[-1]):
                return hc_triton.hc_boundary_step(streams, output, post, comb, weights.fn, weights.base, weights.scale,
                                                  norm, hc_eps, iterations, norm_eps)
    if kernels and m & (m - 1) == 0:
        from ds4d.cuda import hc_triton, prefill_triton

        streams, squares = prefill_triton.hc_update(streams, output, post, comb)
        flat = streams.view(streams.shape[0], -1)
        mixes = linear_f32(flat, weights.fn, weights.fn_split) * torch.rsqrt(squares / flat.shape[1] + norm_eps)[:, None]
        pre, post, comb = hc_triton.hc_weights(mixes, weights.base, weights.scale, hc_eps, iterations, m)
        return prefill_triton.hc_collapse_norm(streams, pre, norm, norm_eps), streams, post, comb
    if output is not None:
        streams = hc_post(output, streams, post, comb)
    x, post, comb = hc_pre(streams, weights, iterations, hc_eps, norm_eps, fused=fused)
    return rms_norm(x, norm, norm_eps), streams, post, comb


def hc_head(streams: torch.Tensor, weights: HyperWeights, hc_eps: float, norm_eps: float,
            *, fused: bool | str = False) -> torch.Tensor:
    """Final collapse of the streams before the output norm (pre weights only); ``fused`` ``"triton"``
    or ``"boundary"``: on CUDA, a few tokens' mixing logits from the Triton kernel."""
    mixes = None
    if fused in ("triton", "boundary") and streams.is_cuda:
        from ds4d.cuda import hc_triton

        if hc_triton.usable(streams.shape[0], streams.shape[-2]):
            mixes = hc_triton.hc_mixes(streams, weights.fn, norm_eps)
    if mixes is None:
        mixes = _mixes(streams, weights.fn, norm_eps)
    pre = torch.sigmoid(mixes * weights.scale.float() + weights.base.float()) + hc_eps
    return _collapse(pre, streams)
