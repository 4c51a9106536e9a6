"""The V4.1 feed-forward: a learned router over the routed experts plus one shared expert.

The router scores every expert with ``sqrt(softplus(logit / gate_temp))`` (or
sigmoid / softmax, as configured); the selection bias is added only to choose
the top ``num_experts_per_tok`` experts, their weights are the unbiased scores,
normalised to sum to one and scaled by ``routed_scaling_factor``.  No layer
routes by a token table (V4's hash layers are gone).  Each expert is a SwiGLU
whose up branch is clamped to ``[-limit, limit]`` and gate branch to
``<= limit``; the routing weight multiplies the activation before ``w2``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ds4d.models.deepseek_v41.config import DeepseekV41Config
from ds4d.models.deepseek_v41.weights import ExpertWeights, MoEWeights


def expert_forward(x: torch.Tensor, w: ExpertWeights, limit: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    gate = F.linear(x, w.w1).float()
    up = F.linear(x, w.w3).float()
    if limit > 0:
        up = up.clamp(-limit, limit)
        gate = gate.clamp(max=limit)
    hidden = F.silu(gate) * up
    if weight is not None:
        hidden = weight * hidden
    return F.linear(hidden.to(x.dtype), w.w2)


def route(x: torch.Tensor, w: MoEWeights, cfg: DeepseekV41Config) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights ``[N, k]``, expert ids ``[N, k]``) for the rows ``x [N, D]``."""
    logits = F.linear(x.float(), w.gate) / cfg.gate_temp
    if cfg.scoring_func == "sqrtsoftplus":
        scores = F.softplus(logits).sqrt()
    elif cfg.scoring_func == "sigmoid":
        scores = logits.sigmoid()
    else:
        scores = logits.softmax(dim=-1)
    experts = (scores + w.bias).topk(cfg.num_experts_per_tok, dim=-1)[1]
    weights = scores.gather(1, experts)
    if cfg.norm_topk_prob and cfg.num_experts_per_tok > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, experts


_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
GROUPED_MM_AVAILABLE = _GROUPED_MM is not None


def grouped_available(x: torch.Tensor) -> bool:
    """Whether :func:`grouped_rows` runs on rows like ``x``: torch has ``grouped_mm``, and on CUDA the
    rows are bf16 (the dtype its CUDA kernel is used with here)."""
    return _GROUPED_MM is not None and (x.dtype == torch.bfloat16 or not x.is_cuda)


def moe_forward(x: torch.Tensor, w: MoEWeights, cfg: DeepseekV41Config, expert_rows: bool = False,
                grouped: bool = False) -> torch.Tensor:
    """The feed-forward of the rows ``x [N, D]``: by default one routed expert at a time over its rows.

    ``expert_rows``: while the (row, expert) pairs fit the kernel, each pair as an expert-indexed GEMV
    (:func:`routed_rows`); ``grouped``: otherwise the pairs sorted by expert, each projection one
    grouped matmul over the bank (:func:`grouped_rows`).  Neither waits for the host."""
    weights, experts = route(x, w, cfg)
    routed = None
    if expert_rows:
        from ds4d.cuda import moe_gemv

        if experts.numel() <= moe_gemv.MAX_ROWS:
            routed = routed_rows(x, w, cfg, weights, experts)
    if routed is None and grouped and grouped_available(x):
        routed = grouped_rows(x, w, cfg, weights, experts)
    if routed is not None:
        routed += expert_forward(x, w.shared, cfg.swiglu_limit).float()
        return routed.to(x.dtype)
    out = torch.zeros_like(x, dtype=torch.float32)
    for expert in torch.unique(experts).tolist():
        rows, slot = torch.where(experts == expert)
        out[rows] += expert_forward(x[rows], w.experts[expert], cfg.swiglu_limit, weights[rows, slot, None]).float()
    out += expert_forward(x, w.shared, cfg.swiglu_limit).float()
    return out.to(x.dtype)


def routed_rows(x: torch.Tensor, w: MoEWeights, cfg: DeepseekV41Config, weights: torch.Tensor,
                experts: torch.Tensor) -> torch.Tensor:
    """Float32 ``[N, D]``: the weighted routed experts of every row, one (row, expert) pair per kernel row.

    The same roundings as :func:`expert_forward` (each projection's output in ``x``'s dtype, the
    SwiGLU and the routing weight in float32); the pairs of a row are summed in float32."""
    from ds4d.cuda.moe_gemv import expert_rows

    rows, k = experts.shape
    ids = experts.reshape(-1)
    pairs = x.repeat_interleave(k, dim=0)
    gate = expert_rows(pairs, w.banks.w1, ids).float()
    up = expert_rows(pairs, w.banks.w3, ids).float()
    limit = cfg.swiglu_limit
    if limit > 0:
        up = up.clamp(-limit, limit)
        gate = gate.clamp(max=limit)
    hidden = weights.reshape(-1, 1) * (F.silu(gate) * up)
    out = expert_rows(hidden.to(x.dtype), w.banks.w2, ids).float()
    return out.view(rows, k, -1).sum(dim=1)


def grouped_rows(x: torch.Tensor, w: MoEWeights, cfg: DeepseekV41Config, weights: torch.Tensor,
                 experts: torch.Tensor) -> torch.Tensor:
    """Float32 ``[N, D]``: the weighted routed experts of every row, the (row, expert) pairs sorted by
    expert and each projection one grouped matmul over the layer's bank (the same roundings as
    :func:`expert_forward`); the pairs of a row are summed in float32."""
    rows, k = experts.shape
    flat = experts.reshape(-1)
    _, order = torch.sort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w.banks.w1.shape[0])
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    pairs = x[order // k]
    gate = _GROUPED_MM(pairs, w.banks.w1.transpose(-2, -1), offs=offsets).float()
    up = _GROUPED_MM(pairs, w.banks.w3.transpose(-2, -1), offs=offsets).float()
    limit = cfg.swiglu_limit
    if limit > 0:
        up = up.clamp(-limit, limit)
        gate = gate.clamp(max=limit)
    hidden = weights.reshape(-1)[order, None] * (F.silu(gate) * up)
    out = _GROUPED_MM(hidden.to(x.dtype), w.banks.w2.transpose(-2, -1), offs=offsets).float()
    unsorted = torch.empty_like(out)
    unsorted[order] = out
    return unsorted.view(rows, k, -1).sum(dim=1)
