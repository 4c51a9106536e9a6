"""The V4.1 feed-forward: a learned router over the routed experts plus one shared expert.

The router scores every expert with ``sqrt(softplus(logit / gate_temp))`` (or
sigmoid / softmax, as configured); the selection bias is added only to choose
the top ``num_experts_per_tok`` experts, their weights are the unbiased scores,
normalised to sum to one and scaled by ``routed_scaling_factor``.  No layer
routes by a token table (V4's hash layers are gone).  Each expert is a SwiGLU
whose up branch is clamped to ``[-limit, limit]`` and gate branch to
``<= limit``; the routing weight multiplies the activation before ``w2``.

Banks of FP4 as stored (``ExpertBanks.stored``) go through V4's MXFP4 kernels
(``ds4d.cuda.quant_matmul``: a GEMV per (row, expert) pair, tensor-core tiles per
expert), which decode the codes in registers: the same products as the decoded
banks, summed in another order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ds4d.cuda import moe_gemv, quant_matmul, route_triton
from ds4d.models.deepseek_v4.offload import ExpertOffload
from ds4d.models.deepseek_v4.ops import linear
from ds4d.models.deepseek_v4.stored import Mxfp4Matrices
from ds4d.models.deepseek_v41.config import DeepseekV41Config
from ds4d.models.deepseek_v41.weights import ExpertBanks, ExpertWeights, MoEWeights


def gated(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(gate) * up`` in float32, up clamped to ``[-limit, limit]`` and gate to ``<= limit`` (limit > 0)."""
    gate, up = gate.float(), up.float()
    if limit > 0:
        up = up.clamp(-limit, limit)
        gate = gate.clamp(max=limit)
    return F.silu(gate) * up


def expert_forward(x: torch.Tensor, w: ExpertWeights, limit: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    hidden = gated(linear(x, w.w1), linear(x, w.w3), limit)
    if weight is not None:
        hidden = weight * hidden
    return linear(hidden.to(x.dtype), w.w2)


def route(x: torch.Tensor, w: MoEWeights, cfg: DeepseekV41Config, kernel: bool = False,
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights ``[N, k]``, expert ids ``[N, k]``) for the rows ``x [N, D]``; ``kernel``: what follows the
    router's product in one Triton launch (``route_triton.route``, V4's, the logits divided by ``gate_temp``
    there)."""
    k = cfg.num_experts_per_tok
    logits = F.linear(x.float(), w.gate)
    if kernel and route_triton.usable(logits, cfg.scoring_func):
        return route_triton.route(logits, k, cfg.scoring_func, cfg.routed_scaling_factor,
                                  cfg.norm_topk_prob and k > 1, w.bias, temperature=cfg.gate_temp)
    logits = logits / cfg.gate_temp
    if cfg.scoring_func == "sqrtsoftplus":
        scores = F.softplus(logits).sqrt()
    elif cfg.scoring_func == "sigmoid":
        scores = logits.sigmoid()
    else:
        scores = logits.softmax(dim=-1)
    experts = (scores + w.bias).topk(k, dim=-1)[1]
    weights = scores.gather(1, experts)
    if cfg.norm_topk_prob and k > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, experts


def predicted_experts(x: torch.Tensor, w: MoEWeights, cfg: DeepseekV41Config) -> torch.Tensor:
    """The expert ids ``[N, k]`` :func:`route` gives ``x``: a guess at a layer's routing from another input
    (``ExpertOffload.fetch_ahead``)."""
    return route(x, w, cfg)[1]


_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
GROUPED_MM_AVAILABLE = _GROUPED_MM is not None


def grouped_available(x: torch.Tensor, banks: ExpertBanks | None = None) -> bool:
    """Whether :func:`grouped_rows` runs on rows like ``x`` over ``banks``: FP4 banks need the MXFP4
    kernels; decoded ones torch's ``grouped_mm``, and on CUDA bf16 rows (the dtype its CUDA kernel
    is used with here)."""
    if banks is not None and banks.stored:
        return quant_matmul.available()
    return _GROUPED_MM is not None and (x.dtype == torch.bfloat16 or not x.is_cuda)


def moe_forward(x: torch.Tensor, w: MoEWeights, cfg: DeepseekV41Config, expert_rows: bool = False,
                grouped: bool = False, route_kernel: bool = False) -> torch.Tensor:
    """The feed-forward of the rows ``x [N, D]``: by default one routed expert at a time over its rows.

    ``expert_rows``: while the (row, expert) pairs fit the kernel, each pair as an expert-indexed GEMV
    (:func:`routed_rows`); ``grouped``: otherwise the pairs sorted by expert, each projection one
    grouped matmul over the bank (:func:`grouped_rows`).  Neither waits for the host.  ``route_kernel``:
    the routing in one launch (:func:`route`)."""
    weights, experts = route(x, w, cfg, route_kernel)
    if expert_rows and experts.numel() <= moe_gemv.MAX_ROWS:
        out = routed_rows(x, w, cfg, weights, experts)
    elif grouped and grouped_available(x, w.banks):
        out = grouped_rows(x, w, cfg, weights, experts)
    else:
        out = torch.zeros_like(x, dtype=torch.float32)
        for expert in torch.unique(experts).tolist():
            rows, slot = torch.where(experts == expert)
            out[rows] += expert_forward(x[rows], w.banks.expert(expert), cfg.swiglu_limit,
                                        weights[rows, slot, None]).float()
    out += expert_forward(x, w.shared, cfg.swiglu_limit).float()
    return out.to(x.dtype)


def offloaded_forward(x: torch.Tensor, w: MoEWeights, cfg: DeepseekV41Config, offload: ExpertOffload, layer: int,
                      decode: bool = False, route_kernel: bool = False) -> torch.Tensor:
    """:func:`moe_forward` with ``layer``'s routed experts wherever ``offload`` keeps them (device bank,
    staging, host threads; ``offload.py``); the same arithmetic per (row, expert) pair."""
    weights, experts = route(x, w, cfg, route_kernel)
    out = offload.routed(layer, x, weights, experts, limit=cfg.swiglu_limit, decode=decode)
    out += expert_forward(x, w.shared, cfg.swiglu_limit).float()
    return out.to(x.dtype)


def _pairs_forward(pairs: torch.Tensor, pair_weights: torch.Tensor, w: MoEWeights, limit: float,
                   project: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Float32 output of each (row, expert) pair: ``project(inputs, bank)`` multiplies every pair's
    inputs by its own expert's matrix in ``bank``.  The same roundings as :func:`expert_forward` (each
    projection's output in the inputs' dtype, the SwiGLU and the routing weight in float32)."""
    hidden = pair_weights[:, None] * gated(project(pairs, w.banks.w1), project(pairs, w.banks.w3), limit)
    return project(hidden.to(pairs.dtype), w.banks.w2).float()


def routed_rows(x: torch.Tensor, w: MoEWeights, cfg: DeepseekV41Config, weights: torch.Tensor,
                experts: torch.Tensor) -> torch.Tensor:
    """Float32 ``[N, D]``: the weighted routed experts of every row, one (row, expert) pair per kernel row
    (``moe_gemv.expert_rows``); the pairs of a row are summed in float32."""
    rows, k = experts.shape
    ids = experts.reshape(-1)

    def project(inputs: torch.Tensor, bank) -> torch.Tensor:
        if isinstance(bank, Mxfp4Matrices):
            return quant_matmul.mxfp4_rows(inputs, bank.packed, bank.scales, ids)
        return moe_gemv.expert_rows(inputs, bank, ids)

    out = _pairs_forward(x.repeat_interleave(k, dim=0), weights.reshape(-1), w, cfg.swiglu_limit, project)
    return out.view(rows, k, -1).sum(dim=1)


def grouped_rows(x: torch.Tensor, w: MoEWeights, cfg: DeepseekV41Config, weights: torch.Tensor,
                 experts: torch.Tensor) -> torch.Tensor:
    """Float32 ``[N, D]``: the weighted routed experts of every row, the (row, expert) pairs sorted by
    expert and each projection one grouped matmul over the layer's bank; the pairs of a row are summed
    in float32."""
    rows, k = experts.shape
    flat = experts.reshape(-1)
    _, order = torch.sort(flat, stable=True)
    offsets = torch.cumsum(torch.bincount(flat, minlength=w.banks.experts), 0).to(torch.int32)

    def project(inputs: torch.Tensor, bank) -> torch.Tensor:
        if isinstance(bank, Mxfp4Matrices):
            return quant_matmul.mxfp4_grouped(inputs, bank.packed, bank.scales, offsets)
        return _GROUPED_MM(inputs, bank.transpose(-2, -1), offs=offsets)

    out = _pairs_forward(x[order // k], weights.reshape(-1)[order], w, cfg.swiglu_limit, project)
    unsorted = torch.empty_like(out)
    unsorted[order] = out
    return unsorted.view(rows, k, -1).sum(dim=1)
