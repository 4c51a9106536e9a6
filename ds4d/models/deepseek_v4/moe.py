"""The mixture-of-experts feed-forward: routed experts plus one shared expert.

Routing scores are ``sqrt(softplus(logits))`` (the published configs; sigmoid
and softmax are accepted too).  Score-routed layers pick the top-k experts by
score + a per-expert bias, but weight them by the unbiased scores; the first
``num_hash_layers`` layers take their experts from a fixed token -> experts
table (``tid2eid``) instead.  Selected weights are normalised to sum to one and
scaled by ``routed_scaling_factor``.  Experts are SwiGLU with the gate clamped
from above and the up projection clamped on both sides at ``swiglu_limit``.

Experts run one at a time over the tokens routed to them, decoded from their
stored format just before use; an expert that got no token costs nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ds4d.models.deepseek_v4.config import DeepseekV4Config
from ds4d.models.deepseek_v4.weights import MoEWeights


def _swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, limit: float) -> torch.Tensor:
    gate = F.linear(x, w1)
    up = F.linear(x, w3)
    if limit > 0:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.linear(F.silu(gate) * up, w2)


def _scores(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    if scoring_func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if scoring_func == "sigmoid":
        return logits.sigmoid()
    return logits.softmax(dim=-1)


def route(
    x: torch.Tensor, token_ids: torch.Tensor, weights: MoEWeights, cfg: DeepseekV4Config
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, D]`` -> (expert weights ``[T, k]`` float32, expert ids ``[T, k]``)."""
    scores = _scores(F.linear(x.float(), weights.gate), cfg.scoring_func)
    if weights.tid2eid is not None:
        indices = weights.tid2eid[token_ids]
    else:
        biased = scores + weights.bias if weights.bias is not None else scores
        indices = torch.topk(biased, cfg.num_experts_per_tok, dim=-1, sorted=False).indices
    chosen = scores.gather(1, indices)
    if cfg.norm_topk_prob:
        chosen = chosen / (chosen.sum(dim=-1, keepdim=True) + 1e-20)
    return chosen * cfg.routed_scaling_factor, indices


def moe_forward(x: torch.Tensor, token_ids: torch.Tensor, weights: MoEWeights, cfg: DeepseekV4Config) -> torch.Tensor:
    expert_weights, indices = route(x, token_ids, weights, cfg)
    limit = cfg.swiglu_limit
    routed = torch.zeros_like(x)
    for expert in torch.unique(indices).tolist():
        token_idx, slot = torch.where(indices == expert)
        bank = weights.experts
        out = _swiglu(
            x[token_idx], bank.weight("w1", expert), bank.weight("w3", expert), bank.weight("w2", expert), limit
        )
        routed.index_add_(0, token_idx, out * expert_weights[token_idx, slot, None].to(out.dtype))
    shared = _swiglu(x, weights.shared_w1, weights.shared_w3, weights.shared_w2, limit)
    return routed + shared
