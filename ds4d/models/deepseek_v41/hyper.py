"""Single-pass manifold-constrained hyper-connections (mHC).

The residual stream is ``hc_mult`` copies of the hidden state.  At each
sub-layer site (attention, then feed-forward, in every layer) one projection of
the RMS-normalised flattened copies gives three sets of weights: ``pre``
(collapse the copies into one input), ``post`` (spread an output over the
copies) and ``comb`` (mix the old copies, made doubly stochastic by Sinkhorn).

"Single pass": a site's own ``post`` and ``comb`` take its sub-layer's output
back in, but its ``pre`` is used by the *next* site.  So the attention of layer
``L`` reads the copies collapsed with the ``pre`` of layer ``L - 1``'s
feed-forward site (a one-hot on copy 0 before layer 0), the feed-forward reads
them collapsed with its own layer's attention ``pre``, and the final norm reads
them collapsed with the last feed-forward ``pre``.  There is no separate head
mix as in V4.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ds4d.cuda import hc_triton
from ds4d.models.deepseek_v4.ops import unweighted_rms_norm
from ds4d.models.deepseek_v41.weights import HyperWeights


def sinkhorn(logits: torch.Tensor, iterations: int, eps: float) -> torch.Tensor:
    """Row softmax, then alternate column and row normalisation: ``iterations`` column passes in all."""
    comb = torch.softmax(logits, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iterations - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def site_weights(streams: torch.Tensor, weights: HyperWeights, iterations: int, hc_eps: float,
                 norm_eps: float, fused: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``streams [S, m, D]`` -> (pre ``[S, m]``, post ``[S, m]``, comb ``[S, m, m]``), all float32.

    ``fused``: the same values from V4's Triton kernels (``ds4d.cuda.hc_triton``: a few rows take the
    norm inside the mixing dot products, more rows one matmul; then one kernel for the rest)."""
    m = streams.shape[-2]
    if fused and hc_triton.usable(streams.shape[0], m):
        return hc_triton.hc_mix(streams, weights.fn, weights.base, weights.scale, hc_eps, iterations, norm_eps)
    mixes = F.linear(unweighted_rms_norm(streams.flatten(-2).float(), norm_eps), weights.fn)
    if fused:
        return hc_triton.hc_weights(mixes, weights.base, weights.scale, hc_eps, iterations, m)
    scale, base = weights.scale, weights.base
    pre = torch.sigmoid(mixes[..., :m] * scale[0] + base[:m]) + hc_eps
    post = 2 * torch.sigmoid(mixes[..., m: 2 * m] * scale[1] + base[m: 2 * m])
    comb_logits = (mixes[..., 2 * m:] * scale[2] + base[2 * m:]).unflatten(-1, (m, m))
    return pre, post, sinkhorn(comb_logits, iterations, hc_eps)


def collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """``[S, m, D]`` weighted by ``pre [S, m]`` and summed over the copies."""
    return (pre.unsqueeze(-1) * streams.float()).sum(dim=-2).to(streams.dtype)


def expand(output: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New copies ``k``: ``post[k] * output + sum_j comb[j, k] * streams[j]``."""
    mixed = torch.einsum("sjk,sjd->skd", comb, streams.float())
    return (post.unsqueeze(-1) * output.float().unsqueeze(-2) + mixed).to(streams.dtype)
