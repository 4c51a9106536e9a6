"""V4.1 attention of one sequence chunk: a sliding window plus, by layer mode, the group's compressed KV.

Every layer attends over its own window of the last ``sliding_window``
positions (one shared K=V latent head, FP8-rounded after RoPE) with a per-head
sink that only enlarges the softmax denominator; the output's RoPE channels
are rotated back before the grouped low-rank output projection.

Layers with a compress ratio also attend to the compressed KV of their group:

* the group's KV source runs the compressor on its attention input: at ratio 1
  one normed latent per token, at ratio 2 pairs of tokens pooled with a
  softmax gate (float32; an odd token waits in the state's tail).  Entry ``j``
  stands at position ``j * ratio``: its index key (``wk``, ``k_norm``) is taken
  from the latent before RoPE, then the latent is rotated and FP4-rounded into
  the group's entries;
* an index source scores the entries visible to each query (entry ``j`` once
  the query is at position ``>= (j + 1) * ratio - 1``) with its own FP4 queries
  and head weights and keeps the best ``index_topk``; the candidate source
  first keeps its best ``candidate_topk_blocks`` blocks of entries (the block
  of the query's newest entry always), and the index sources after it choose
  only inside those blocks;
* the other compressed layers of the group attend to the entries picked by the
  last index source before them.

The per-step hand-over between layers (:class:`StepShared`) is reset every
step; what outlives a step is in :class:`~ds4d.models.deepseek_v41.state.SequenceState`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ds4d.cuda import attention_triton
from ds4d.models.deepseek_v4.ops import Rope, apply_rope, linear, rms_norm
from ds4d.models.deepseek_v41.config import DeepseekV41Config, LayerPlan
from ds4d.models.deepseek_v41.qat import round_fp4_blocks, round_fp8_blocks
from ds4d.models.deepseek_v41.state import GroupState, SequenceState
from ds4d.models.deepseek_v41.weights import AttentionWeights, CompressorWeights, IndexerWeights

NEG_INF = float("-inf")


@dataclass
class StepShared:
    """What a source layer hands to the later layers of its group within one step.

    The per-query tensors have a row per query of the layer that made them, the last rows of the step;
    a later layer with fewer query rows (the triangular prefill) takes their last rows."""

    entries: torch.Tensor | None = None
    """The current group's compressed KV ``[T, head_dim]`` (None: no entry yet)."""
    index_keys: torch.Tensor | None = None
    topk_bias: torch.Tensor | None = None
    """``[queries, T]``: 0 on the entries each query attends to, -inf elsewhere."""
    candidates: torch.Tensor | None = None
    """``[1, queries, T]`` bool: the candidate source's blocks, per query."""


@dataclass(frozen=True)
class StepRows:
    """The chunk's positions and their rotary tables."""

    positions: torch.Tensor
    main: tuple[torch.Tensor, torch.Tensor]
    compress: tuple[torch.Tensor, torch.Tensor]
    compress_rope: Rope
    """For the compressed entries and index keys, which sit at multiples of the ratio."""
    host: Sequence[int]
    """The same positions on the host (a ``range`` for one sequence's rows), so no step reads them back."""

    @classmethod
    def make(cls, positions: torch.Tensor, host: Sequence[int], rope_main: Rope, rope_compress: Rope) -> StepRows:
        return cls(positions, rope_main.cos_sin(positions), rope_compress.cos_sin(positions), rope_compress, host)

    def tail(self, count: int) -> StepRows:
        """The last ``count`` rows."""
        if count == self.positions.shape[0]:
            return self
        return self.part(slice(self.positions.shape[0] - count, None))

    def part(self, cut: slice) -> StepRows:
        """The rows ``cut``."""
        return StepRows(self.positions[cut], (self.main[0][cut], self.main[1][cut]),
                        (self.compress[0][cut], self.compress[1][cut]), self.compress_rope, self.host[cut])


def compress(x: torch.Tensor, w: CompressorWeights, ratio: int, group: GroupState,
             eps: float) -> tuple[torch.Tensor | None, int]:
    """(latents of the groups this chunk completes, before RoPE, or None; position of the first one)."""
    first = group.entries.count * ratio
    if ratio == 1:
        return rms_norm(F.linear(x, w.wkv), w.norm, eps), first
    kv = torch.cat([group.tail_kv, F.linear(x.float(), w.wkv)])
    gate = torch.cat([group.tail_gate, F.linear(x.float(), w.wgate)])
    whole = kv.shape[0] // ratio * ratio
    group.tail_kv, group.tail_gate = kv[whole:].clone(), gate[whole:].clone()
    if whole == 0:
        return None, first
    kv = kv[:whole].unflatten(0, (-1, ratio))
    gate = gate[:whole].unflatten(0, (-1, ratio))
    pooled = (kv * gate.softmax(dim=1)).sum(dim=1)
    return rms_norm(pooled.to(x.dtype), w.norm, eps), first


def top_k(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the ``k`` largest scores on the last dim; among equal scores the lower index wins.

    The model leaves ties open (they happen: a score is exactly 0 wherever every indexer head is
    rectified away), and ``torch.topk`` breaks them by the shape of the whole tensor, so a prompt fed in
    other chunks could pick other entries.  A stable sort makes the pick a function of the row alone."""
    values, indices = torch.sort(scores, dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]


def candidate_blocks(scores: torch.Tensor, visible: torch.Tensor, keep: int, block: int) -> torch.Tensor:
    """Bool ``[..., T]``: entries in the ``keep`` best blocks (by their best entry) of each query, the
    block of its newest visible entry always among them; unreachable blocks (all -inf) never."""
    width = scores.shape[-1]
    per_block = F.pad(scores, (0, -width % block), value=NEG_INF).unflatten(-1, (-1, block)).amax(-1)
    count = per_block.shape[-1]
    newest = (visible - 1) // block
    per_block = per_block.masked_fill(torch.arange(count, device=scores.device) == newest, float("inf"))
    values, indices = top_k(per_block, min(keep, count))
    chosen = torch.zeros_like(per_block, dtype=torch.bool).scatter_(-1, indices, values > NEG_INF)
    return chosen.repeat_interleave(block, dim=-1)[..., :width]


INDEX_SCORE_BYTES = 1 << 30
"""The most the indexer's per-head scores ``[queries, heads, entries]`` (float32) take at once: a step
whose scores would take more scores its queries in slices (at 1M positions the entries of a ratio-2
group are 512K: 128 MiB a query at 64 heads)."""


def index_scores(q: torch.Tensor, keys: torch.Tensor, head_weights: torch.Tensor) -> torch.Tensor:
    """``q [S, H, width]`` over the index keys ``[T, width]``: each query's sum over heads of its head
    weight ``[S, H]`` times the rectified, scaled dot products, ``[1, S, T]`` float32.  The queries go in
    slices of at most :data:`INDEX_SCORE_BYTES` of per-head scores; each query's arithmetic is the same."""
    queries, heads, width = q.shape
    step = max(1, INDEX_SCORE_BYTES // (heads * max(1, keys.shape[0]) * 4))
    parts = []
    for start in range(0, queries, step):
        part = slice(start, start + step)
        # [1, s, H, T] like a batch of one, so the reductions group the same way as the reference's
        scores = torch.einsum("bshd,btd->bsht", q[part].unsqueeze(0).float(), keys.unsqueeze(0).float())
        scores = scores.relu_() * width**-0.5
        parts.append((scores * head_weights[part].unsqueeze(0).unsqueeze(-1)).sum(dim=2))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def index_step(x: torch.Tensor, q_residual: torch.Tensor, latent: torch.Tensor | None, first: int,
               plan: LayerPlan, w: IndexerWeights, cfg: DeepseekV41Config, group: GroupState,
               shared: StepShared, rows: StepRows) -> None:
    """Publish the group's index keys (at its KV source) and this index source's top-k bias.

    ``x``, ``q_residual`` and ``rows`` are the query rows; they are the last rows of the step (the
    candidate blocks of an earlier layer may cover more rows, and are cut to these)."""
    ratio, eps = plan.ratio, cfg.rms_norm_eps
    if plan.is_kv_source:
        if latent is not None:
            keys = rms_norm(F.linear(latent, w.wk), w.k_norm, eps)
            key_positions = first + ratio * torch.arange(latent.shape[0], device=latent.device)
            keys = apply_rope(keys, *rows.compress_rope.cos_sin(key_positions))
            group.index_keys.append(round_fp4_blocks(keys, 32))
        shared.index_keys = group.index_keys.view() if group.index_keys.count else None
    keys = shared.index_keys
    if keys is None:
        return
    count, heads, width = keys.shape[0], cfg.index_n_heads, cfg.index_head_dim
    q = linear(q_residual, w.wq_b).unflatten(-1, (heads, width))
    q = round_fp4_blocks(apply_rope(q, *rows.compress), 32)
    head_weights = F.linear(x, w.weights_proj).float() * heads**-0.5
    scores = index_scores(q, keys, head_weights)
    visible = (rows.positions.long() + 1).div(ratio, rounding_mode="floor").view(1, -1, 1)
    scores = scores.masked_fill(torch.arange(count, device=scores.device).view(1, 1, -1) >= visible, NEG_INF)
    if plan.is_candidate_source:
        shared.candidates = candidate_blocks(scores, visible, cfg.candidate_topk_blocks, cfg.candidate_block_size)
    elif plan.uses_candidates and shared.candidates is not None:
        scores = scores.masked_fill(~shared.candidates[:, -scores.shape[1]:], NEG_INF)
    values, indices = top_k(scores, min(cfg.index_topk, count))
    # picks with a -inf score (fewer visible entries than index_topk) go to a dropped extra column
    columns = torch.where(values > NEG_INF, indices, torch.full_like(indices, count))
    bias = scores.new_full((1, scores.shape[1], count + 1), NEG_INF).scatter_(-1, columns, 0.0)
    shared.topk_bias = bias[0, :, :count]


def compressed_branch(x: torch.Tensor, q_residual: torch.Tensor, plan: LayerPlan, w: AttentionWeights,
                      cfg: DeepseekV41Config, state: SequenceState, shared: StepShared,
                      rows: StepRows) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(the group's entries ``[T, D]`` or None, this layer's bias over them ``[queries, T]``).

    ``x`` holds every row of the step (a KV source compresses them all), ``q_residual`` the query rows,
    the last of the step."""
    group = state.groups[plan.kv_source]
    queries = q_residual.shape[0]
    latent, first = None, 0
    if plan.is_kv_source:
        if rows.host[0] != state.position:
            raise ValueError("a KV source compresses every row of the step")
        latent, first = compress(x, w.compressor, plan.ratio, group, cfg.rms_norm_eps)
    if plan.is_index_source:
        index_step(x[x.shape[0] - queries:], q_residual, latent, first, plan, w.indexer, cfg, group, shared,
                   rows.tail(queries))
    if latent is not None:
        entry_positions = first + plan.ratio * torch.arange(latent.shape[0], device=latent.device)
        rotated = apply_rope(latent, *rows.compress_rope.cos_sin(entry_positions))
        group.entries.append(round_fp4_blocks(rotated, 16, e4m3_scales=True))
    if plan.is_kv_source:
        shared.entries = group.entries.view() if group.entries.count else None
    bias = shared.topk_bias
    return shared.entries, None if bias is None else bias[bias.shape[0] - queries:]


def attend(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, sink: torch.Tensor, scale: float) -> torch.Tensor:
    """``q [S, H, D]`` over the shared K=V rows ``keys [T, D]`` with ``mask [S, T]`` and a sink logit per head."""
    heads, rows = q.shape[1], q.shape[0]
    q4 = q.transpose(0, 1).unsqueeze(0)  # [1, H, S, D]
    kv4 = keys.view(1, 1, *keys.shape)
    # scores, sink and softmax in float32 as in the release's kernel; only the probabilities and the
    # output take the input dtype (bf16 scores are off by up to 2**-8 of their size: 0.125 at 50)
    logits = torch.matmul(q4.float(), kv4.float().transpose(2, 3)) * scale + mask.view(1, 1, *mask.shape)
    sinks = sink.view(1, heads, 1, 1).expand(1, heads, rows, 1)
    logits = torch.cat([logits, sinks], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    return torch.matmul(probs.to(keys.dtype), kv4).transpose(1, 2)[0]  # [S, H, D]


@dataclass(frozen=True)
class Projected:
    """A step's attention projections: the query rows' ``q_residual`` and rotated ``q``, every row's
    FP8-rounded window KV."""

    q_residual: torch.Tensor
    q: torch.Tensor
    """``[queries, heads, head_dim]``."""
    kv: torch.Tensor
    """``[rows, head_dim]``."""

    def rows(self, index: slice) -> Projected:
        return Projected(self.q_residual[index], self.q[index], self.kv[index])


def project(x: torch.Tensor, plan: LayerPlan, w: AttentionWeights, cfg: DeepseekV41Config, rows: StepRows,
            queries: int) -> Projected:
    """The projections of ``x [n, hidden]`` (positions ``rows.positions``); queries for the last ``queries``.
    Row by row: the rows may belong to different sequences."""
    count, eps = x.shape[0], cfg.rms_norm_eps
    query_rows = rows.tail(queries)
    cos, sin = rows.compress if plan.ratio else rows.main
    cos_q, sin_q = query_rows.compress if plan.ratio else query_rows.main
    q_residual = rms_norm(linear(x[count - queries:], w.wq_a), w.q_norm, eps)
    q = linear(q_residual, w.wq_b).unflatten(-1, (cfg.num_attention_heads, cfg.head_dim))
    q = apply_rope(q, cos_q, sin_q)
    kv = round_fp8_blocks(apply_rope(rms_norm(linear(x, w.wkv), w.kv_norm, eps), cos, sin))
    return Projected(q_residual, q, kv)


def attention_core(x: torch.Tensor, projected: Projected, plan: LayerPlan, w: AttentionWeights,
                   cfg: DeepseekV41Config, state: SequenceState, shared: StepShared,
                   rows: StepRows, window_kernel: bool = False) -> torch.Tensor:
    """One sequence's attention over its window and (by mode) its group's compressed KV: the query rows'
    output ``[queries, heads, head_dim]``, RoPE channels still rotated.  Writes the window ring (and at a
    KV source the group's entries and index keys).

    ``window_kernel``: more than one query attends in V4's Triton kernel (``attention_triton``: each
    query walks its window and the entries its bias lets through, no ``[queries, keys]`` scores in
    memory; the same result up to rounding) instead of through a dense mask."""
    window, queries = cfg.sliding_window, projected.q.shape[0]
    query_rows = rows.tail(queries)
    kv = projected.kv
    past = min(state.position, window - 1)
    first = state.position - past  # the position of keys[0]
    keys = torch.cat([state.window_history(plan.layer, past), kv])
    # the kernel takes keys at consecutive positions: on the triangle's later layers the rows start after
    # the state's position, and then only if no query's window reaches back past them
    contiguous = rows.host[0] == state.position
    fused = (window_kernel and queries > 1 and attention_triton.usable(projected.q)
             and (contiguous or query_rows.host[0] - window + 1 >= rows.host[0]))
    mask = None if fused else window_mask(first, past, rows.positions, query_rows.positions, window)
    state.write_window(plan.layer, kv, rows.host[0])

    entries, bias = compressed_branch(x, projected.q_residual, plan, w, cfg, state, shared, rows) \
        if plan.ratio else (None, None)
    extra = None
    if entries is not None:
        extra = bias if bias is not None else torch.full((queries, entries.shape[0]), NEG_INF, device=x.device)
    if fused:
        entry_part = None if extra is None else (entries.to(keys.dtype), extra.float())
        keys, first = (keys, first) if contiguous else (kv, rows.host[0])
        return attention_triton.window_attention(projected.q, keys, first, query_rows.host[0], window, w.sink,
                                                 cfg.head_dim**-0.5, entry_part)
    if entries is not None:
        keys = torch.cat([keys, entries.to(keys.dtype)])
        mask = torch.cat([mask, extra.to(mask.dtype)], dim=-1)
    return attend(projected.q, keys, mask, w.sink, cfg.head_dim**-0.5)


def window_mask(first: int, past: int, positions: torch.Tensor, query_positions: torch.Tensor,
                window: int) -> torch.Tensor:
    """The additive mask ``[queries, past + rows]`` (0 or -inf) of the queries over the ``past`` window
    keys from position ``first`` and the step's rows at ``positions``: each query sees the keys at most
    ``window - 1`` before it and none after (one row sees itself and all its window)."""
    device = query_positions.device
    if positions.shape[0] == 1:
        return torch.zeros(1, past + 1, dtype=torch.float32, device=device)
    key_positions = torch.cat([torch.arange(first, first + past, device=device), positions])
    distance = query_positions.view(-1, 1) - key_positions.view(1, -1)
    mask = torch.zeros(distance.shape, dtype=torch.float32, device=device)
    return mask.masked_fill((distance < 0) | (distance >= window), NEG_INF)


def output_projection(out: torch.Tensor, plan: LayerPlan, w: AttentionWeights, cfg: DeepseekV41Config,
                      query_rows: StepRows) -> torch.Tensor:
    """``out [queries, heads, head_dim]`` with its RoPE channels rotated back, through the grouped
    low-rank output projection: ``[queries, hidden]``.  Row by row."""
    queries = out.shape[0]
    cos_q, sin_q = query_rows.compress if plan.ratio else query_rows.main
    out = apply_rope(out, cos_q, -sin_q)
    groups = cfg.o_groups
    per_group = out.reshape(queries, groups, -1).transpose(0, 1)  # [G, queries, heads * D / G]
    wo_a = w.wo_a.view(groups, -1, per_group.shape[-1]).transpose(1, 2)  # [G, in, o_lora]
    low_rank = torch.bmm(per_group, wo_a).transpose(0, 1).flatten(1)  # [queries, G * o_lora]
    return linear(low_rank, w.wo_b)


def attention_forward(x: torch.Tensor, plan: LayerPlan, w: AttentionWeights, cfg: DeepseekV41Config,
                      state: SequenceState, shared: StepShared, rows: StepRows,
                      queries: int | None = None, window_kernel: bool = False) -> torch.Tensor:
    """``x [n, hidden]``: the normed attention input of the step's positions ``rows.positions`` (the last
    ``n`` of the step) -> the output ``[queries, hidden]`` of the last ``queries`` of them (all by default).

    Every row's window KV is computed (and the ring keeps the last ones); only the query rows attend
    (``window_kernel``: as :func:`attention_core`)."""
    queries = x.shape[0] if queries is None else queries
    projected = project(x, plan, w, cfg, rows, queries)
    out = attention_core(x, projected, plan, w, cfg, state, shared, rows, window_kernel)
    return output_projection(out, plan, w, cfg, rows.tail(queries))
