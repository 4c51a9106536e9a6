"""V4 attention: shared-KV MQA over a sliding window plus compressed entries.

Per token: a low-rank query (``wq_a`` -> RMS norm -> ``wq_b``, then a per-head
unweighted RMS norm) and one shared 512-wide KV vector that serves as both key
and value, RoPE'd on its trailing 64 channels.  Each query sees

* the KVs of the last ``sliding_window`` positions (itself included), and
* on compressed layers, the compressed entries whose windows have closed:
  all of them for HCA (ratio 128); for CSA (ratio 4) only the ``index_topk``
  entries the lightning indexer scores highest for this query.

A learned per-head sink logit joins the softmax (it takes probability mass but
contributes no value).  Because values carry RoPE too, the output's rope
channels are rotated back by the query position, then a grouped low-rank
projection (``wo_a`` per head group, ``wo_b`` across groups) returns to the
model width.

Projections run over all tokens of the step at once; the attention itself runs
per sequence chunk against that sequence's window ring and compressed blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ds4d.cuda import attention_triton, prefill_triton
from ds4d.models.deepseek_v4.cache import LayerCache
from ds4d.models.deepseek_v4.compressor import compress_chunk, gather_entries, project, store_entries
from ds4d.models.deepseek_v4.config import DeepseekV4Config
from ds4d.models.deepseek_v4.ops import Rope, apply_rope, linear, linear_pair, rms_norm, unweighted_rms_norm
from ds4d.models.deepseek_v4.weights import AttentionWeights, IndexerWeights


@dataclass(frozen=True)
class ChunkRows:
    """One sequence's rows in the step's flattened token tensor."""

    begin: int
    end: int
    start_pos: int
    slot: int
    block_ids: torch.Tensor  # long, on the model device


@dataclass
class StepInputs:
    """Per-step facts shared by every layer."""

    chunks: list[ChunkRows]
    positions: torch.Tensor  # [T] long
    rope_main: tuple[torch.Tensor, torch.Tensor]
    rope_compress: tuple[torch.Tensor, torch.Tensor]


def _window_keys(
    cache: LayerCache, chunk: ChunkRows, kv: torch.Tensor, window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys visible through the window for this chunk, with their positions; updates the ring."""
    start, count = chunk.start_pos, chunk.end - chunk.begin
    ring = cache.window[chunk.slot]
    first = max(0, start - window + 1)
    device = kv.device
    held_pos = torch.arange(first, start, device=device)
    keys = torch.cat([ring[held_pos % window], kv]) if start > first else kv
    key_pos = torch.arange(first, start + count, device=device)
    keep = torch.arange(max(start, start + count - window), start + count, device=device)
    ring[keep % window] = kv[keep - start].to(ring.dtype)
    return keys, key_pos


SCORE_BLOCK_BYTES = 1 << 30
"""Largest float32 ``[queries, index heads, entries]`` indexer score block; longer contexts go in query blocks."""
ATTEND_BLOCK_BYTES = 1 << 30
"""Largest float32-sized ``[queries, heads, keys + entries]`` score block of a prefill chunk's attention;
longer chunks over more keys attend in query blocks (each query's result is the same either way)."""
SPARSE_FROM = 4096
"""CSA chunks over more compressed entries than this attend to each query's picked entries (gathered)
instead of all entries through a ``[queries, entries]`` mask, whose memory grows with the context."""


def _indexer_topk(
    x: torch.Tensor,
    q_residual: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    keys: torch.Tensor,
    indexer: IndexerWeights,
    cfg: DeepseekV4Config,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The entries each query picks ``[n, k]`` and whether each pick is a real, causal entry."""
    n, count = x.shape[0], keys.shape[0]
    q = linear(q_residual, indexer.wq_b).view(n, cfg.index_n_heads, cfg.index_head_dim)
    q = apply_rope(q, *cos_sin).float()
    head_weights = linear(x, indexer.weights_proj).float() * cfg.index_n_heads**-0.5
    visible = (positions + 1) // indexer.compressor.ratio
    keys = keys.float()
    rows = max(1, SCORE_BLOCK_BYTES // (4 * cfg.index_n_heads * max(1, count)))
    picked = []
    for begin in range(0, n, rows):
        block = slice(begin, begin + rows)
        scores = torch.relu(torch.einsum("nhd,ed->nhe", q[block], keys)) * cfg.index_head_dim**-0.5
        scores = (scores * head_weights[block].unsqueeze(-1)).sum(dim=1)
        future = torch.arange(count, device=x.device)[None, :] >= visible[block, None]
        picked.append(scores.masked_fill(future, float("-inf")).topk(min(cfg.index_topk, count), dim=-1).indices)
    picked = torch.cat(picked)
    return picked, picked < visible[:, None]


def _indexer_mask(picked: torch.Tensor, valid: torch.Tensor, count: int) -> torch.Tensor:
    """Additive mask ``[n, count]``: 0 on the entries each query picked, -inf elsewhere."""
    mask = torch.full((picked.shape[0], count + 1), float("-inf"), device=picked.device)
    mask.scatter_(1, torch.where(valid, picked, count), 0.0)
    return mask[:, :count]


def _extra_logits(q: torch.Tensor, extra: tuple[torch.Tensor, torch.Tensor], scale: float) -> torch.Tensor:
    """Scores of the compressed entries: shared ``[E, d]`` with mask ``[n, E]``, or per query ``[n, k, d]``."""
    entries, mask = extra[0].to(q.dtype), extra[1].to(q.dtype)
    equation = "nhd,nkd->nhk" if entries.dim() == 3 else "nhd,ed->nhe"
    return torch.einsum(equation, q, entries) * scale + mask[:, None, :]


def _extra_values(probs: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
    return torch.einsum("nhk,nkd->nhd" if entries.dim() == 3 else "nhe,ed->nhd", probs, entries.to(probs.dtype))


def _attend(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, sink: torch.Tensor, scale: float,
            extra: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``q [n, H, d]``, shared ``keys [K, d]`` (also the values), ``mask [n, K]`` -> ``[n, H, d]``;
    per-query compressed entries ``extra = ([n, k, d], mask [n, k])`` join the same softmax."""
    logits = torch.einsum("nhd,kd->nhk", q, keys) * scale + mask[:, None, :]
    parts = [logits] if extra is None else [logits, _extra_logits(q, extra, scale)]
    parts.append(sink.view(1, -1, 1).expand(q.shape[0], -1, 1).to(logits.dtype))
    combined = torch.cat(parts, dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1)[..., :-1]
    out = torch.einsum("nhk,kd->nhd", probs[..., : keys.shape[0]].to(keys.dtype), keys)
    if extra is not None:
        out = out + _extra_values(probs[..., keys.shape[0]:].to(keys.dtype), extra[0])
    return out


def _attend_local(
    q: torch.Tensor,
    keys: torch.Tensor,
    first: int,
    start: int,
    extra: tuple[torch.Tensor, torch.Tensor] | None,
    sink: torch.Tensor,
    scale: float,
    window: int,
) -> torch.Tensor:
    """:func:`_attend` for a long chunk without the ``[n, n]`` window mask.

    Queries go in blocks of ``window``; a block reads only the ``2 * window``
    keys before and inside it (its window reaches all but the first) (``keys`` are positions ``first ..``, queries
    ``start ..``).  Compressed entries ``extra = (entries, mask)`` join the same
    softmax as a separate score block."""
    n, heads, dim = q.shape
    blocks = -(-n // window)
    pad = blocks * window - n
    span = 2 * window  # the 2 * window - 1 reachable keys plus one always masked: aligned matmul shapes
    device = q.device
    base = start - first - window + window * torch.arange(blocks, device=device)
    index = base[:, None] + torch.arange(span, device=device)[None, :]  # [blocks, span] into keys
    block_keys = keys[index.clamp(0, keys.shape[0] - 1)]
    query = start + torch.arange(blocks * window, device=device).view(blocks, window)
    offset = query[:, :, None] - (first + index)[:, None, :]
    valid = (index >= 0)[:, None, :] & (index < keys.shape[0])[:, None, :] & (offset >= 0) & (offset < window)
    mask = torch.zeros(valid.shape, dtype=q.dtype, device=device).masked_fill_(~valid, float("-inf"))
    q_blocks = F.pad(q, (0, 0, 0, 0, 0, pad)).view(blocks, window, heads, dim)
    local = torch.einsum("bqhd,bkd->bqhk", q_blocks, block_keys) * scale + mask[:, :, None, :]
    parts = [local.reshape(blocks * window, heads, span)[:n]]
    if extra is not None:
        parts.append(_extra_logits(q, extra, scale))
    parts.append(sink.view(1, -1, 1).expand(n, -1, 1).to(q.dtype))
    combined = torch.cat(parts, dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1).to(keys.dtype)
    local_probs = F.pad(probs[..., :span], (0, 0, 0, 0, 0, pad)).view(blocks, window, heads, span)
    out = torch.einsum("bqhk,bkd->bqhd", local_probs, block_keys).reshape(blocks * window, heads, dim)[:n]
    if extra is not None:
        out = out + _extra_values(probs[..., span:-1], extra[0])
    return out


def _query_blocks(n: int, heads: int, width: int, unit: int = 1) -> list[slice]:
    """Rows of a chunk's queries in blocks whose ``[rows, heads, width]`` scores stay within
    ``ATTEND_BLOCK_BYTES`` (as float32), each a multiple of ``unit`` rows (but the last)."""
    rows = max(unit, ATTEND_BLOCK_BYTES // (4 * heads * max(width, 1)) // unit * unit)
    return [slice(begin, min(n, begin + rows)) for begin in range(0, n, rows)]


def _extra_rows(extra: tuple[torch.Tensor, torch.Tensor] | None, rows: slice):
    """The compressed entries of some queries: shared entries stay, per-query ones and the mask are cut."""
    if extra is None:
        return None
    entries, mask = extra
    return (entries[rows] if entries.dim() == 3 else entries), mask[rows]


def _compressed_keys(
    x: torch.Tensor,
    q_residual: torch.Tensor,
    projections: dict[str, tuple[torch.Tensor, torch.Tensor]],
    chunk: ChunkRows,
    positions: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    weights: AttentionWeights,
    cache: LayerCache,
    cfg: DeepseekV4Config,
    rope_compress: Rope,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Feed the chunk to the compressor(s); return the closed entries and their mask, if any."""
    comp, eps = weights.compressor, cfg.rms_norm_eps
    first, entries = compress_chunk(
        *projections["main"], chunk.start_pos, chunk.slot, comp, cache.compressor, rope_compress, eps
    )
    store_entries(cache.compressor.pool, chunk.block_ids, first, entries)
    if weights.indexer is not None:
        first, entries = compress_chunk(
            *projections["indexer"],
            chunk.start_pos,
            chunk.slot,
            weights.indexer.compressor,
            cache.indexer,
            rope_compress,
            eps,
        )
        store_entries(cache.indexer.pool, chunk.block_ids, first, entries)
    count = (chunk.start_pos + chunk.end - chunk.begin) // comp.ratio
    if count == 0:
        return None
    compressed = gather_entries(cache.compressor.pool, chunk.block_ids, count)
    if weights.indexer is not None and count > cfg.index_topk:  # fewer entries: the indexer would keep them all
        index_keys = gather_entries(cache.indexer.pool, chunk.block_ids, count)
        picked, valid = _indexer_topk(x, q_residual, positions, cos_sin, index_keys, weights.indexer, cfg)
        if count > SPARSE_FROM:  # each query's picks only: memory independent of the context
            gathered = compressed[picked]
            return gathered, torch.zeros(valid.shape, device=x.device).masked_fill_(~valid, float("-inf"))
        mask = _indexer_mask(picked, valid, count)
    else:
        closed = torch.arange(count, device=x.device)[None, :] < ((positions + 1) // comp.ratio)[:, None]
        mask = torch.zeros(closed.shape, device=x.device).masked_fill_(~closed, float("-inf"))
    return compressed, mask


def attention_forward(
    x: torch.Tensor,
    step: StepInputs,
    weights: AttentionWeights,
    cache: LayerCache,
    cfg: DeepseekV4Config,
    rope_compress: Rope,
    *,
    local_window: bool = False,
    fused: bool = False,
    kernels: bool = False,
) -> torch.Tensor:
    """``x [T, D]`` (normed sub-layer input) -> attention output ``[T, D]``.

    ``local_window``: chunks longer than the window attend block by block
    (:func:`_attend_local`) instead of through a dense ``[n, n]`` mask; with ``fused``, such a chunk
    attends in one Triton kernel (``ds4d.cuda.attention_triton``, the same result up to rounding);
    ``kernels``: the queries' norm and RoPE and the output's inverse RoPE in place, in Triton, and
    the compressors' projections as one bf16 matmul each (``compressor.project``'s ``split``)."""
    head_dim = cfg.head_dim
    cos, sin = step.rope_compress if weights.ratio else step.rope_main
    q_residual, q, kv = project_qkv(x, weights, cos, sin, cfg, kernels=kernels)
    projections = {}
    if weights.compressor is not None:
        projections["main"] = project(x, step.positions, weights.compressor, split=kernels)
    if weights.indexer is not None:
        projections["indexer"] = project(x, step.positions, weights.indexer.compressor, split=kernels)

    out = torch.empty_like(q)
    for chunk in step.chunks:
        rows = slice(chunk.begin, chunk.end)
        positions = step.positions[rows]
        keys, key_pos = _window_keys(cache, chunk, kv[rows], cfg.sliding_window)
        if local_window and chunk.end - chunk.begin > cfg.sliding_window:
            extra = None
            if projections:
                chunk_projections = {name: (kv_[rows], score[rows]) for name, (kv_, score) in projections.items()}
                extra = _compressed_keys(x[rows], q_residual[rows], chunk_projections, chunk, positions,
                                         (cos[rows], sin[rows]), weights, cache, cfg, rope_compress)
            first = chunk.start_pos - (keys.shape[0] - (chunk.end - chunk.begin))
            window, n = cfg.sliding_window, chunk.end - chunk.begin
            if fused and attention_triton.usable(q):
                attention_triton.window_attention(q[rows], keys, first, chunk.start_pos, window, weights.sink,
                                                  head_dim**-0.5, extra, out=out[rows])
                continue
            width = 2 * window + (0 if extra is None else extra[1].shape[-1]) + 1
            for part in _query_blocks(n, cfg.num_attention_heads, width, unit=window):
                out[chunk.begin + part.start:chunk.begin + part.stop] = _attend_local(
                    q[rows][part], keys, first, chunk.start_pos + part.start, _extra_rows(extra, part),
                    weights.sink, head_dim**-0.5, window)
            continue
        offset = positions[:, None] - key_pos[None, :]
        mask = torch.zeros(offset.shape, dtype=q.dtype, device=x.device)
        mask.masked_fill_((offset < 0) | (offset >= cfg.sliding_window), float("-inf"))
        if projections:
            chunk_projections = {name: (kv_[rows], score[rows]) for name, (kv_, score) in projections.items()}
            extra = _compressed_keys(
                x[rows],
                q_residual[rows],
                chunk_projections,
                chunk,
                positions,
                (cos[rows], sin[rows]),
                weights,
                cache,
                cfg,
                rope_compress,
            )
            if extra is not None and extra[0].dim() != 3:  # shared entries: more keys
                keys = torch.cat([keys, extra[0].to(keys.dtype)])
                mask = torch.cat([mask, extra[1].to(mask.dtype)], dim=-1)
                extra = None
        else:
            extra = None
        width = keys.shape[0] + (0 if extra is None else extra[1].shape[-1]) + 1
        for part in _query_blocks(chunk.end - chunk.begin, cfg.num_attention_heads, width):
            # per-query entries (sparse CSA) join the softmax as a part of their own
            out[chunk.begin + part.start:chunk.begin + part.stop] = _attend(
                q[rows][part], keys, mask[part], weights.sink, head_dim**-0.5, _extra_rows(extra, part))
    return project_out(out, weights, cos, sin, cfg, kernels=kernels)


def project_qkv(
    x: torch.Tensor, weights: AttentionWeights, cos: torch.Tensor, sin: torch.Tensor, cfg: DeepseekV4Config,
    *, kernels: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [T, D]`` -> (query residual ``[T, q_lora_rank]``, roped queries ``[T, H, d]``, roped KV ``[T, d]``);
    ``kernels``: norms and RoPE of the fresh projections in place (``prefill_triton.head_norm_rope``)."""
    eps = cfg.rms_norm_eps
    q_low, kv_low = linear_pair(x, weights.wq_a, weights.wkv, weights.wq_a_wkv)
    q_residual = rms_norm(q_low, weights.q_norm, eps)
    q = linear(q_residual, weights.wq_b).view(x.shape[0], cfg.num_attention_heads, cfg.head_dim)
    kv = rms_norm(kv_low, weights.kv_norm, eps)
    if kernels and prefill_triton.rope_usable(q, 2 * cos.shape[-1]):
        prefill_triton.head_norm_rope(q, cos, sin, eps)
        return q_residual, q, prefill_triton.head_norm_rope(kv.unsqueeze(1), cos, sin, norm=False).squeeze(1)
    return q_residual, apply_rope(unweighted_rms_norm(q, eps), cos, sin), apply_rope(kv, cos, sin)


def project_out(
    out: torch.Tensor, weights: AttentionWeights, cos: torch.Tensor, sin: torch.Tensor, cfg: DeepseekV4Config,
    *, kernels: bool = False, unrotated: bool = False,
) -> torch.Tensor:
    """Per-head attention output ``[T, H, d]``: undo the value RoPE, then the grouped low-rank projection;
    ``kernels``: the inverse RoPE in place, on the rotated channels only (``out`` is spent); ``unrotated``: the
    RoPE is undone already (``decode_triton.decode_attention(unrotate=...)``)."""
    if not unrotated:
        if kernels and prefill_triton.rope_usable(out, 2 * cos.shape[-1]):
            prefill_triton.head_norm_rope(out, cos, sin, norm=False, inverse=True)
        else:
            out = apply_rope(out, cos, -sin)
    groups = cfg.o_groups
    grouped = out.reshape(out.shape[0], groups, -1).transpose(0, 1)  # [G, T, k]
    wo_a = weights.wo_a.view(groups, cfg.o_lora_rank, -1).transpose(1, 2)  # [G, k, r]
    low_rank = torch.bmm(grouped, wo_a).transpose(0, 1).flatten(1)
    return linear(low_rank, weights.wo_b)
