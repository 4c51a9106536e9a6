"""Batched decode attention: one new token for each of B sequences, with shapes fixed by (B, blocks).

The general path (``attention.py``) loops over chunks with host-side positions.
A decode step has one token per sequence, so everything can be indexed by
device tensors instead: the positions ``[B]``, state slots ``[B]`` and a block
table ``[B, MB]`` padded with the cache's trash block.  Nothing here reads a
value back to the host and no shape depends on the data, which is what lets a
decode step be captured once per (batch, block-table width) bucket and replayed.

The state it reads and writes is the same as the general path's, so a sequence
can move between the two paths at any step:

* the window ring keeps token ``p``'s KV at ``p % sliding_window``; a ring slot
  ``j`` holds position ``p - ((p - j) mod W)``, visible when that is ``>= 0``;
* a compressor's tail ring keeps token ``p``'s projections at ``p % (c * r)``;
  when ``p`` closes window ``w = p // r`` the entry is pooled from the ring and
  written to entry ``w`` of the sequence's blocks; rows whose window is still
  open write the same arithmetic to the trash block instead;
* compressed entries ``0 .. (p + 1) // r - 1`` are visible: all of them on HCA
  layers, the lightning indexer's top-k of them on CSA layers (all of them while
  the block table holds no more entry slots than the indexer keeps).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ds4d.cuda import decode_triton
from ds4d.models.deepseek_v4.attention import project_out, project_qkv
from ds4d.models.deepseek_v4.cache import CompressorState, LayerCache
from ds4d.models.deepseek_v4.compressor import project
from ds4d.models.deepseek_v4.config import DeepseekV4Config
from ds4d.models.deepseek_v4.ops import Rope, apply_rope, linear, linear_pair, rms_norm
from ds4d.models.deepseek_v4.weights import AttentionWeights, CompressorWeights, IndexerWeights


@dataclass
class DecodeInputs:
    """Per-step device tensors of a decode batch (B rows, padding included)."""

    positions: torch.Tensor  # [B] long: the new token's position
    slots: torch.Tensor  # [B] long: state slot (padding rows: the scratch slot)
    block_table: torch.Tensor  # [B, MB] long: block ids, padded with the trash block
    trash_block: int
    rope_main: tuple[torch.Tensor, torch.Tensor]
    rope_compress: tuple[torch.Tensor, torch.Tensor]


def _window(ring: torch.Tensor, kv: torch.Tensor, dec: DecodeInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Write the new KVs into their rings; return every ring's keys ``[B, W, d]`` and additive mask ``[B, W]``."""
    window = ring.shape[1]
    ring[dec.slots, dec.positions % window] = kv.to(ring.dtype)
    keys = ring[dec.slots]
    slot_index = torch.arange(window, device=kv.device)
    held = dec.positions[:, None] - (dec.positions[:, None] - slot_index) % window
    mask = torch.zeros(held.shape, dtype=torch.float32, device=kv.device).masked_fill_(held < 0, float("-inf"))
    return keys, mask


def _compress(
    kv: torch.Tensor,
    score: torch.Tensor,
    dec: DecodeInputs,
    weights: CompressorWeights,
    state: CompressorState,
    rope: Rope,
    eps: float,
) -> None:
    """Feed one token per row; write the entry of every window this token closes."""
    ratio, dim = weights.ratio, weights.head_dim
    ring = state.tail_kv.shape[1]
    pos, slots = dec.positions, dec.slots
    state.tail_kv[slots, pos % ring] = kv
    state.tail_score[slots, pos % ring] = score
    window = pos // ratio
    offsets = torch.arange(ratio, device=kv.device)
    current = (window[:, None] * ratio + offsets) % ring  # [B, r], position order
    rows = slots[:, None]
    pooled_kv, pooled_score = state.tail_kv[rows, current], state.tail_score[rows, current]
    if weights.overlap:
        previous = ((window[:, None] - 1) * ratio + offsets) % ring
        prev_kv, prev_score = state.tail_kv[rows, previous, :dim], state.tail_score[rows, previous, :dim]
        prev_score = prev_score.masked_fill((window == 0)[:, None, None], float("-inf"))
        pooled_kv = torch.cat([prev_kv, pooled_kv[..., dim:]], dim=1)
        pooled_score = torch.cat([prev_score, pooled_score[..., dim:]], dim=1)
    entries = (pooled_kv * pooled_score.softmax(dim=1)).sum(dim=1)
    entries = apply_rope(rms_norm(entries, weights.norm, eps), *rope.cos_sin(window * ratio))
    per_block = state.pool.shape[1]
    closes = (pos + 1) % ratio == 0
    block = dec.block_table.gather(1, (window // per_block).clamp(max=dec.block_table.shape[1] - 1)[:, None])[:, 0]
    block = torch.where(closes, block, torch.full_like(block, dec.trash_block))
    state.pool[block, window % per_block] = entries.to(state.pool.dtype)


def _gather(pool: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """Every entry slot the block table covers, ``[B, MB * per_block, d]``."""
    return pool[block_table].flatten(1, 2)


def _indexer_pick(
    x: torch.Tensor,
    q_residual: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    index_keys: torch.Tensor,
    visible: torch.Tensor,
    indexer: IndexerWeights,
    cfg: DeepseekV4Config,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The lightning indexer's top-k entry ids ``[B, k]`` and whether each is a real, visible entry."""
    batch, count = x.shape[0], index_keys.shape[1]
    q = linear(q_residual, indexer.wq_b).view(batch, cfg.index_n_heads, cfg.index_head_dim)
    q = apply_rope(q, *cos_sin)
    scores = torch.relu(torch.bmm(q.float(), index_keys.float().transpose(1, 2))) * cfg.index_head_dim**-0.5
    head_weights = F.linear(x, indexer.weights_proj).float() * cfg.index_n_heads**-0.5
    scores = torch.bmm(head_weights.unsqueeze(1), scores).squeeze(1)  # [B, E]
    future = torch.arange(count, device=x.device)[None, :] >= visible[:, None]
    scores = scores.masked_fill(future, float("-inf"))
    picked = scores.topk(min(cfg.index_topk, count), dim=-1).indices
    return picked, picked < visible[:, None]


def _attend(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, sink: torch.Tensor, scale: float) -> torch.Tensor:
    """``q [B, H, d]``, per-row keys (also the values) ``[B, K, d]``, ``mask [B, K]`` -> ``[B, H, d]``."""
    logits = torch.bmm(q, keys.transpose(1, 2)) * scale + mask[:, None, :].to(q.dtype)
    sinks = sink.view(1, -1, 1).expand(q.shape[0], -1, 1).to(logits.dtype)
    combined = torch.cat([logits, sinks], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1)[..., :-1]
    return torch.bmm(probs.to(keys.dtype), keys)


def decode_attention(
    x: torch.Tensor,
    dec: DecodeInputs,
    weights: AttentionWeights,
    cache: LayerCache,
    cfg: DeepseekV4Config,
    rope_compress: Rope,
    kernel: bool = False,
) -> torch.Tensor:
    """``x [B, D]`` (normed sub-layer input, one token per sequence) -> attention output ``[B, D]``.
    ``kernel``: the step's work between its projections in Triton kernels instead of torch's operators,
    indexing, gathers, concatenations and batched matmuls: the query's and KV's norms, the KV's RoPE and its
    ring write in one (``decode_triton.decode_qkv_norms``), each compressor's step in one
    (``decode_triton.decode_compress``), the queries' norm and RoPE, the scores, softmax, weighted sum and the
    output's inverse RoPE in two (``decode_triton.decode_attention``: the queries normed and rotated as read, the
    rings and entry blocks read where they sit, no gathered keys, masks or scores in memory); the indexer's
    pick is the same either way."""
    cos, sin = dec.rope_compress if weights.ratio else dec.rope_main
    if kernel:
        return project_out(_attend_in_kernel(x, dec, weights, cache, cfg, rope_compress, cos, sin), weights, cos,
                           sin, cfg, unrotated=True)
    q_residual, q, kv = project_qkv(x, weights, cos, sin, cfg)
    keys, mask = _window(cache.window, kv, dec)
    if weights.compressor is not None:
        picked, valid = _compressors(x, q_residual, dec, weights, cache, cfg, rope_compress, kernel=False)
        entries = _gather(cache.compressor.pool, dec.block_table)
        if picked is not None:
            entries = entries.gather(1, picked[..., None].expand(-1, -1, entries.shape[-1]))
        else:
            visible = (dec.positions + 1) // weights.ratio
            valid = torch.arange(entries.shape[1], device=x.device)[None, :] < visible[:, None]
        extra = torch.zeros(valid.shape, dtype=torch.float32, device=x.device).masked_fill_(~valid, float("-inf"))
        keys = torch.cat([keys, entries.to(keys.dtype)], dim=1)
        mask = torch.cat([mask, extra], dim=1)
    out = _attend(q, keys, mask, weights.sink, cfg.head_dim**-0.5)
    return project_out(out, weights, cos, sin, cfg)


def _attend_in_kernel(x: torch.Tensor, dec: DecodeInputs, weights: AttentionWeights, cache: LayerCache,
                      cfg: DeepseekV4Config, rope_compress: Rope, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """:func:`decode_attention` up to the output's projection with its norms, RoPE (the layer's ``cos``/``sin``),
    compressors' steps and attention in ``decode_triton``'s kernels: the per-head output ``[B, H, d]`` with its
    RoPE already undone."""
    eps, ring = cfg.rms_norm_eps, cache.window
    q_low, kv_low = linear_pair(x, weights.wq_a, weights.wkv, weights.wq_a_wkv)
    q_residual = decode_triton.decode_qkv_norms(q_low, kv_low, weights.q_norm, weights.kv_norm, cos, sin, ring,
                                                dec.slots, dec.positions, eps)
    q = linear(q_residual, weights.wq_b).view(x.shape[0], cfg.num_attention_heads, cfg.head_dim)
    pool = table = picks = None
    if weights.compressor is not None:
        picks, _ = _compressors(x, q_residual, dec, weights, cache, cfg, rope_compress, kernel=True)
        pool, table = cache.compressor.pool, dec.block_table
    return decode_triton.decode_attention(q, ring, dec.slots, dec.positions, weights.sink, cfg.head_dim**-0.5,
                                          pool=pool, table=table, ratio=weights.ratio, picks=picks,
                                          unrotate=(cos, sin), norm_rope=(cos, sin, eps))


def _compressors(x: torch.Tensor, q_residual: torch.Tensor, dec: DecodeInputs, weights: AttentionWeights,
                 cache: LayerCache, cfg: DeepseekV4Config, rope_compress: Rope,
                 kernel: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Feed the step's token to the layer's compressor and its indexer's (``kernel``: in ``decode_triton``'s
    kernel); the indexer's picks ``[B, k]`` and whether each is a visible entry where the block table holds more
    entry slots than it keeps, else (None, None): every visible entry is attended."""
    eps = cfg.rms_norm_eps
    feed = _compress_in_kernel if kernel else _compress_in_torch
    feed(x, dec, weights.compressor, cache.compressor, rope_compress, eps)
    if weights.indexer is None:
        return None, None
    feed(x, dec, weights.indexer.compressor, cache.indexer, rope_compress, eps)
    if dec.block_table.shape[1] * cache.compressor.pool.shape[1] <= cfg.index_topk:
        return None, None  # fewer entry slots than the indexer keeps: it would keep them all
    index_keys = _gather(cache.indexer.pool, dec.block_table)
    visible = (dec.positions + 1) // weights.ratio
    return _indexer_pick(x, q_residual, dec.rope_compress, index_keys, visible, weights.indexer, cfg)


def _compress_in_torch(x: torch.Tensor, dec: DecodeInputs, weights: CompressorWeights, state: CompressorState,
                       rope: Rope, eps: float) -> None:
    """:func:`_compress` of ``x``'s projections."""
    _compress(*project(x, dec.positions, weights), dec, weights, state, rope, eps)


def _compress_in_kernel(x: torch.Tensor, dec: DecodeInputs, weights: CompressorWeights, state: CompressorState,
                        rope: Rope, eps: float) -> None:
    """:func:`_compress` of ``x``'s projections, in ``decode_triton.decode_compress``."""
    kv, score = project(x, dec.positions, weights)
    decode_triton.decode_compress(kv, score, state.tail_kv, state.tail_score, dec.slots, dec.positions,
                                  dec.block_table, state.pool, weights.norm, rope.inv_freq, weights.ratio,
                                  weights.overlap, eps)


def pack_rows(rows: Sequence[tuple[int, int, int, Sequence[int]]], count: int, width: int, scratch: int,
              trash: int) -> torch.Tensor:
    """``(token, position, slot, block ids)`` per sequence as ``[count, 3 + width]`` int64 host rows
    ``[token, position, slot, block table...]``, tables padded with the ``trash`` block, rows past the
    sequences padding (the ``scratch`` slot, trash blocks): what a fixed-shape decode step copies over."""
    table = [[token, position, slot, *blocks] + [trash] * (width - len(blocks))
             for token, position, slot, blocks in rows]
    table += [[0, 0, scratch] + [trash] * width] * (count - len(rows))
    return torch.tensor(table, dtype=torch.long)
