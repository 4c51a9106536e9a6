"""The mixture-of-experts feed-forward: routed experts plus one shared expert.

Routing scores are ``sqrt(softplus(logits))`` (the published configs; sigmoid
and softmax are accepted too).  Score-routed layers pick the top-k experts by
score + a per-expert bias, but weight them by the unbiased scores; the first
``num_hash_layers`` layers take their experts from a fixed token -> experts
table (``tid2eid``) instead.  Selected weights are normalised to sum to one and
scaled by ``routed_scaling_factor``.  Experts are SwiGLU with the gate clamped
from above and the up projection clamped on both sides at ``swiglu_limit``.

Two ways to run the routed experts, with the same arithmetic per expert:

* ``grouped=False`` (the reference): one expert at a time over the tokens routed
  to it, decoded from its stored format just before use; an expert that got no
  token costs nothing.  The loop needs the routing on the host.
* ``grouped=True`` (the GPU path): the (token, expert) pairs are sorted by
  expert and both projections run as one grouped matmul each over the whole
  bank, the kernel reading each used expert's weights by offset; up to
  ``moe_gemv.MAX_ROWS`` pairs (small-batch decode) a Triton GEMV per pair
  reads its expert by index instead (``ds4d.cuda.moe_gemv``), and the pairs
  are then not sorted at all (row ``t * k + j``: token ``t``'s ``j``-th
  expert).  Nothing waits for the host, so a step can be captured in a CUDA
  graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ds4d.cuda import gguf_matmul, moe_gemv, prefill_triton, quant_matmul, route_triton, streams
from ds4d.models.deepseek_v4.config import DeepseekV4Config
from ds4d.models.deepseek_v4.ops import linear, linear_f32, linear_pair
from ds4d.models.deepseek_v4.stored import (
    Fp8Weight,
    GgufAddresses,
    GgufMatrices,
    GgufWeight,
    Linear,
    Mxfp4Addresses,
    Mxfp4Matrices,
    gguf_values,
)
from ds4d.models.deepseek_v4.weights import MoEWeights


def _gated(gate: torch.Tensor, up: torch.Tensor, limit: float, kernels: bool = False) -> torch.Tensor:
    """``silu(gate) * up`` with the gate clamped from above and up on both sides at ``limit`` (if > 0);
    ``kernels``: in one Triton kernel (``prefill_triton.swiglu``) where it launches."""
    if kernels and prefill_triton.usable(gate):
        return prefill_triton.swiglu(gate, up, limit)
    if limit > 0:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


def _swiglu(x: torch.Tensor, w1: Linear, w3: Linear, w2: Linear, limit: float, kernels: bool = False,
            w13: GgufWeight | Fp8Weight | None = None) -> torch.Tensor:
    """``w13``: ``w1`` and ``w3`` as one weight (``ops.linear_pair``); with ``kernels``, its SwiGLU in its GEMV's
    launch where the rows take it (``Fp8Weight.gated``, ``GgufWeight.gated``: bit for bit the product, then
    :func:`_gated`)."""
    act = w13.gated(x, limit) if kernels and isinstance(w13, (Fp8Weight, GgufWeight)) else None
    if act is None:
        act = _gated(*linear_pair(x, w1, w3, w13), limit, kernels)
    return linear(act, w2)


def _scores(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    if scoring_func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if scoring_func == "sigmoid":
        return logits.sigmoid()
    return logits.softmax(dim=-1)


def route(
    x: torch.Tensor, token_ids: torch.Tensor, weights: MoEWeights, cfg: DeepseekV4Config, *, split: bool = False,
    kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, D]`` -> (expert weights ``[T, k]`` float32, expert ids ``[T, k]``); ``split``: the
    router's logits from ``weights.gate_split`` where set (``ops.linear_f32``); ``kernel``: what follows the
    logits in one Triton launch (``route_triton.route``: the ids in the order picked, largest first)."""
    logits = linear_f32(x, weights.gate, weights.gate_split if split else None)
    if kernel and route_triton.usable(logits, cfg.scoring_func):
        return route_triton.route(logits, cfg.num_experts_per_tok, cfg.scoring_func, cfg.routed_scaling_factor,
                                  cfg.norm_topk_prob, weights.bias, weights.tid2eid, token_ids)
    scores = _scores(logits, cfg.scoring_func)
    if weights.tid2eid is not None:
        indices = weights.tid2eid[token_ids]
    else:
        biased = scores + weights.bias if weights.bias is not None else scores
        indices = torch.topk(biased, cfg.num_experts_per_tok, dim=-1, sorted=False).indices
    chosen = scores.gather(1, indices)
    if cfg.norm_topk_prob:
        chosen = chosen / (chosen.sum(dim=-1, keepdim=True) + 1e-20)
    return chosen * cfg.routed_scaling_factor, indices


def predicted_experts(x: torch.Tensor, token_ids: torch.Tensor, weights: MoEWeights, cfg: DeepseekV4Config,
                      ) -> torch.Tensor:
    """The expert ids ``[T, k]`` :func:`route` gives ``x``: a guess at a layer's routing from another input
    (``ExpertOffload.fetch_ahead``); exact for a hash layer, whose experts follow the token."""
    return route(x, token_ids, weights, cfg)[1]


def _grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, expert_of_row: torch.Tensor,
                    step_rows: int):
    """Rows of ``x`` (sorted by expert, group ends ``offsets``) times their expert's ``weight [E, out, in]``
    (decoded values, MXFP4 or GGUF blocks as stored, or MXFP4 found by address).

    ``step_rows``: the (token, expert) rows of the whole MoE call this is part of; the kernel is
    chosen by it, so every bank of one call (device, staging) uses the same arithmetic."""
    if isinstance(weight, Mxfp4Addresses):  # small-batch decode only (``ExpertOffload.capturable``)
        return quant_matmul.mxfp4_rows_at(x, weight.packed, weight.scales, expert_of_row, weight.rows,
                                          weight.inputs // 2, weight.inputs // 32, aligned=weight.aligned)
    if isinstance(weight, GgufAddresses):  # the same, GGUF blocks
        return gguf_matmul.gemv_at(x, weight.table[expert_of_row], weight.qtype, weight.rows,
                                   aligned=weight.aligned, out_dtype=x.dtype, int8_inputs=weight.int8_inputs)
    if isinstance(weight, GgufMatrices) and not gguf_matmul.available():  # no kernel here: the decoded bank
        weight = gguf_values(weight.raw, weight.qtype, weight.cols).to(x.dtype)
    per_row = _per_row_kernel(x, weight, step_rows)
    if isinstance(weight, GgufMatrices):
        return gguf_matmul.expert_rows(x, weight.raw, weight.qtype, expert_of_row,
                                       None if per_row or offsets is None else offsets,
                                       int8_inputs=weight.int8_inputs)
    if isinstance(weight, Mxfp4Matrices):
        if per_row:
            return quant_matmul.mxfp4_rows(x, weight.packed, weight.scales, expert_of_row)
        return quant_matmul.mxfp4_grouped(x, weight.packed, weight.scales, offsets)
    if x.is_cuda and x.dtype == torch.bfloat16:
        if per_row:  # a few rows: one GEMV per row
            return moe_gemv.expert_rows(x, weight, expert_of_row)
        return _GROUPED_MM(x, weight.transpose(-2, -1), offs=offsets)
    # no grouped kernel for this device or dtype: one batched product over per-row weights
    if x.shape[0] == 1:  # bmm rounds a lone product differently; two keep each row's result independent of the batch
        return torch.bmm(weight[expert_of_row].expand(2, -1, -1), x.expand(2, -1).unsqueeze(-1))[:1].squeeze(-1)
    return torch.bmm(weight[expert_of_row], x.unsqueeze(-1)).squeeze(-1)


_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def expert_ffn(
    rows: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, offsets: torch.Tensor,
    expert_of_row: torch.Tensor, limit: float, *, step_rows: int | None = None, kernels: bool = False,
    pair_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """SwiGLU of ``rows`` (sorted by expert; group ends ``offsets``) through a bank's experts.

    Each row's result depends only on that row, its expert's weights and ``step_rows``
    (all rows of the MoE call; default: these rows), so any split of one call's rows
    into banks (device, staging) gives the same rows back.  ``kernels``: see :func:`_gated`; rows on the per-row
    MXFP4 or int8 GGUF GEMVs then take the SwiGLU in their gate/up GEMV's launch (:func:`_gated_product`, the same
    values).

    ``pair_weights`` (one routing weight per row; DeepSeek-V4.1's arithmetic): the SwiGLU runs in
    float32 and is multiplied by the row's weight before ``down``, and the float32 output is already
    weighted (:func:`combine_sorted` without weights).  Without them the output is unweighted."""
    step_rows = rows.shape[0] if step_rows is None else step_rows
    if pair_weights is None:
        act = _gated_product(rows, gate_up, expert_of_row, step_rows, limit) if kernels else None
        if act is None:
            act = _gated(*_grouped_linear(rows, gate_up, offsets, expert_of_row, step_rows).chunk(2, dim=-1), limit,
                         kernels)
        return _grouped_linear(act, down, offsets, expert_of_row, step_rows)
    gate, up = _grouped_linear(rows, gate_up, offsets, expert_of_row, step_rows).chunk(2, dim=-1)
    act = (pair_weights.float()[:, None] * _gated(gate.float(), up.float(), limit)).to(rows.dtype)
    return _grouped_linear(act, down, offsets, expert_of_row, step_rows).float()


def _gated_product(x: torch.Tensor, gate_up, expert_of_row: torch.Tensor, step_rows: int,
                   limit: float) -> torch.Tensor | None:
    """The SwiGLU of each row's gate and up products in the GEMV's own launch (``gated``: bit for bit
    :func:`_grouped_linear` then :func:`_gated` with its kernel) where the rows take the per-row MXFP4 kernel
    (``quant_matmul.mxfp4_rows_at``) or the per-row int8-input GGUF GEMV (``gguf_matmul.dot_gemv``); else None."""
    if isinstance(gate_up, Mxfp4Addresses):
        return quant_matmul.mxfp4_rows_at(x, gate_up.packed, gate_up.scales, expert_of_row, gate_up.rows,
                                          gate_up.inputs // 2, gate_up.inputs // 32, aligned=gate_up.aligned,
                                          gated=limit)
    if isinstance(gate_up, Mxfp4Matrices) and _per_row_kernel(x, gate_up, step_rows):
        return quant_matmul.mxfp4_rows(x, gate_up.packed, gate_up.scales, expert_of_row, gated=limit)
    if isinstance(gate_up, GgufAddresses) and gguf_matmul.gated_fits(gate_up.qtype, gate_up.int8_inputs):
        return gguf_matmul.gemv_at(x, gate_up.table[expert_of_row], gate_up.qtype, gate_up.rows,
                                   aligned=gate_up.aligned, out_dtype=x.dtype, int8_inputs=True, gated=limit)
    if (isinstance(gate_up, GgufMatrices) and gguf_matmul.available() and _per_row_kernel(x, gate_up, step_rows)
            and gguf_matmul.gated_fits(gate_up.qtype, gate_up.int8_inputs)):
        return gguf_matmul.expert_rows(x, gate_up.raw, gate_up.qtype, expert_of_row, None, int8_inputs=True,
                                       gated=limit)
    return None


def combine_sorted(
    out: torch.Tensor, order: torch.Tensor, expert_weights: torch.Tensor | None, tokens: int, k: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Expert outputs of the (token, slot) pairs in ``order`` -> the weighted sum per token ``[T, D]``
    (``expert_weights`` None: the outputs are weighted already, ``expert_ffn(pair_weights=...)``)."""
    weighted = out.float() if expert_weights is None else out.float() * expert_weights.reshape(-1)[order, None]
    unsorted = torch.empty_like(weighted)
    unsorted[order] = weighted
    return unsorted.view(tokens, k, -1).sum(dim=1).to(dtype)


def _per_row_kernel(x: torch.Tensor, weight, step_rows: int) -> bool:
    """Whether :func:`_grouped_linear` takes each row on its own (a GEMV or batched product per row,
    by its expert index) rather than groups of rows sorted by expert (the grouped kernels: MXFP4
    or GGUF blocks as stored, or bf16 on CUDA, past ``moe_gemv.MAX_ROWS`` rows)."""
    if isinstance(weight, (Mxfp4Matrices, GgufMatrices)):
        return step_rows <= moe_gemv.MAX_ROWS
    if x.is_cuda and x.dtype == torch.bfloat16:
        return step_rows <= moe_gemv.MAX_ROWS and moe_gemv.available()
    return True


def _row_by_row(x: torch.Tensor, weight, step_rows: int) -> bool:
    """The route's choice: the (token, expert) rows go unsorted exactly where the kernel takes each
    row on its own (a seam of its own, so a test can route sorted rows through the same kernels)."""
    return _per_row_kernel(x, weight, step_rows)


def _routed_grouped(
    x: torch.Tensor, expert_weights: torch.Tensor, indices: torch.Tensor, weights: MoEWeights, limit: float,
    kernels: bool = False, plus: torch.Tensor | None = None,
) -> torch.Tensor:
    """The routed experts' weighted sum ``[T, D]`` in ``x``'s dtype (``plus``: then plus it); ``kernels``: the
    SwiGLU, the sum and ``plus`` in Triton (``prefill_triton``) where it launches."""
    tokens, k = indices.shape
    bank = weights.experts
    gate_up, down = bank.native if bank.native is not None else bank.dense()
    flat = indices.reshape(-1)
    if _row_by_row(x, gate_up, flat.shape[0]):  # no sort, no group ends: row t * k + j is token t's j-th expert
        out = expert_ffn(_pair_rows(x, k, gate_up), gate_up, down, None, flat, limit, kernels=kernels)
        if kernels and prefill_triton.usable(out):
            return prefill_triton.combine(out, None, expert_weights, x.dtype, add=plus)
        weighted = out.float() * expert_weights.reshape(-1, 1)
        routed = weighted.view(tokens, k, -1).sum(dim=1).to(x.dtype)  # the sum of combine_sorted, in slot order
        return routed if plus is None else routed + plus
    expert_of_row, order = torch.sort(flat, stable=True)
    counts = torch.zeros(bank.weights["w2"].shape[0], dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat.to(torch.int64), torch.ones_like(flat, dtype=torch.int32))
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    out = expert_ffn(x[order // k], gate_up, down, offsets, expert_of_row, limit, kernels=kernels)
    if kernels and prefill_triton.usable(out):
        return prefill_triton.combine(out, order, expert_weights, x.dtype, add=plus)
    routed = combine_sorted(out, order, expert_weights, tokens, k, x.dtype)
    return routed if plus is None else routed + plus


def _pair_rows(x: torch.Tensor, k: int, gate_up) -> torch.Tensor:
    """Row ``t * k + j`` is token ``t``'s row of ``x``: for one token and experts as stored, MXFP4 or GGUF blocks
    (whose GEMVs read their input rows by stride; the int8 one quantises each row it is given), a view of ``x``'s
    row, nothing copied; else ``x``'s rows repeated."""
    if x.shape[0] == 1 and isinstance(gate_up, (Mxfp4Matrices, Mxfp4Addresses, GgufMatrices, GgufAddresses)):
        return x.expand(k, -1)
    return x.repeat_interleave(k, dim=0)


class RoutingTally:
    """Per layer and routed expert, the (token, expert) pairs a model's steps routed (``calibrate.py``).

    A model given one adds every routed pair of every layer to it, and runs every row through the
    last layer (so the counts do not depend on which rows want logits)."""

    def __init__(self, layers: int, experts: int, device: str | torch.device = "cpu") -> None:
        self.counts = torch.zeros(layers, experts, dtype=torch.float32, device=device)

    def layer(self, index: int) -> torch.Tensor:
        """Layer ``index``'s float32 ``[experts]`` row, which :func:`tally_routing` adds to."""
        return self.counts[index]

    def as_lists(self) -> list[list[float]]:
        return self.counts.cpu().tolist()


def tally_routing(tally: torch.Tensor | None, indices: torch.Tensor) -> None:
    """Add one to ``tally[e]`` (a float ``[E]`` tensor) per (token, expert ``e``) pair; None: nothing."""
    if tally is not None:
        flat = indices.reshape(-1).to(tally.device)
        tally.index_add_(0, flat, torch.ones(flat.shape[0], dtype=tally.dtype, device=tally.device))


def _shared(x: torch.Tensor, weights: MoEWeights, limit: float, kernels: bool) -> torch.Tensor:
    return _swiglu(x, weights.shared_w1, weights.shared_w3, weights.shared_w2, limit, kernels, weights.shared_w13)


def moe_forward(
    x: torch.Tensor, token_ids: torch.Tensor, weights: MoEWeights, cfg: DeepseekV4Config, *, grouped: bool = False,
    kernels: bool = False, tally: torch.Tensor | None = None, beside: bool = False, route_kernel: bool = False,
    decode_kernels: bool = False,
) -> torch.Tensor:
    """``kernels`` (with ``grouped``): SwiGLU and the routed experts' weighted sum in Triton
    (``ds4d.cuda.prefill_triton``) and the router's logits from its split weight, for steps of many tokens.
    ``decode_kernels`` (with ``grouped``): the SwiGLUs, and the routed experts' weighted sum with the shared
    expert's output added, in Triton, for a decode step's few rows (the router as without).
    ``beside`` (with ``grouped``): the shared expert on a second stream (``ds4d.cuda.streams``), its SwiGLU
    in Triton, while the routing and the routed experts run on the current one.  ``route_kernel``: the
    routing after the router's logits in one Triton launch (:func:`route`)."""
    limit = cfg.swiglu_limit
    beside = beside and grouped
    if beside:  # queued first, so it starts with the router
        shared = streams.beside(_shared, x.device, x, weights, limit, True)
    expert_weights, indices = route(x, token_ids, weights, cfg, split=kernels and grouped, kernel=route_kernel)
    tally_routing(tally, indices)
    if beside:
        routed = _routed_grouped(x, expert_weights, indices, weights, limit, kernels)
        return routed + streams.rejoin(shared, x.device)
    if grouped:
        tail = kernels or decode_kernels
        return _routed_grouped(x, expert_weights, indices, weights, limit, tail, plus=_shared(x, weights, limit, tail))
    routed = torch.zeros_like(x)
    for expert in torch.unique(indices).tolist():
        token_idx, slot = torch.where(indices == expert)
        bank = weights.experts
        out = _swiglu(
            x[token_idx], bank.weight("w1", expert), bank.weight("w3", expert), bank.weight("w2", expert), limit
        )
        routed.index_add_(0, token_idx, out * expert_weights[token_idx, slot, None].to(out.dtype))
    shared = _swiglu(x, weights.shared_w1, weights.shared_w3, weights.shared_w2, limit, w13=weights.shared_w13)
    return routed + shared
