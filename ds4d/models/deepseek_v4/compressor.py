"""Token -> compressed-entry pooling for CSA and HCA layers, chunk by chunk.

Each token contributes a projected value ``kv`` and a gate ``score`` (plus a
learned per-slot bias ``ape``).  Entry ``w`` pools window ``w`` (positions
``w*r .. w*r + r - 1``) with a per-channel softmax over the gates, then gets an
RMS norm and RoPE at position ``w*r``.  With overlap (CSA, ratio 4) the
projections are twice as wide: the second half is pooled for the token's own
window, the first half for the *next* window, so entry ``w`` softmaxes over
``2r`` slots (window ``w-1``'s first halves, window ``w``'s second halves);
entry 0 has no previous window and those slots get zero weight.

Chunks may end anywhere.  The projections of the last ``c * r`` tokens wait
in a per-sequence ring (``tail_kv`` / ``tail_score``, slot ``pos % (c*r)``), so
an entry is emitted exactly when its window's last token is processed, with the
same arithmetic whatever the chunking was.
"""

from __future__ import annotations

import torch

from ds4d.cuda import f32_gemv
from ds4d.models.deepseek_v4.cache import CompressorState
from ds4d.models.deepseek_v4.ops import Rope, apply_rope, linear_split, rms_norm
from ds4d.models.deepseek_v4.weights import CompressorWeights


def project(x: torch.Tensor, positions: torch.Tensor, weights: CompressorWeights,
            *, split: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (kv, score) in float32; the score already carries the slot bias.  ``split``: a bf16
    ``x`` meets both weights in one bf16 matmul (``weights.split``, ``ops.linear_split``) where set."""
    if split and weights.split is not None and x.dtype == torch.bfloat16:
        kv, score = linear_split(x, weights.split).split(weights.wkv.shape[0], dim=1)
    elif f32_gemv.usable(x, weights.wkv) and weights.wgate.dtype == torch.float32:  # a few rows: one launch
        kv, score = f32_gemv.rows_f32(x, weights.wkv, weights.wgate)
    else:
        x = x.float()
        kv, score = x @ weights.wkv.t(), x @ weights.wgate.t()
    return kv, score + weights.ape[positions % weights.ratio]


def compress_chunk(
    kv: torch.Tensor,
    score: torch.Tensor,
    start: int,
    slot: int,
    weights: CompressorWeights,
    state: CompressorState,
    rope: Rope,
    eps: float,
) -> tuple[int, torch.Tensor]:
    """Feed positions ``start .. start + n - 1``; return (first new window, new entries ``[m, d]``)."""
    ratio, dim, overlap = weights.ratio, weights.head_dim, weights.overlap
    ring = state.tail_kv.shape[1]
    end = start + kv.shape[0]
    first_new = start // ratio
    base_window = max(first_new - 1, 0) if overlap else first_new
    base = base_window * ratio

    if base < start:
        held = torch.arange(base, start, device=kv.device) % ring
        kv_seq = torch.cat([state.tail_kv[slot, held], kv])
        score_seq = torch.cat([state.tail_score[slot, held], score])
    else:
        kv_seq, score_seq = kv, score

    keep_from = max(start, end - ring)
    kept = torch.arange(keep_from, end, device=kv.device) % ring
    state.tail_kv[slot, kept] = kv[keep_from - start :]
    state.tail_score[slot, kept] = score[keep_from - start :]

    windows = end // ratio - base_window
    if end // ratio <= first_new:
        return first_new, kv.new_zeros(0, dim)
    win_kv = kv_seq[: windows * ratio].view(windows, ratio, -1)
    win_score = score_seq[: windows * ratio].view(windows, ratio, -1)
    if overlap:
        pooled_kv = win_kv.new_zeros(windows, 2 * ratio, dim)
        pooled_score = win_score.new_full((windows, 2 * ratio, dim), float("-inf"))
        pooled_kv[:, ratio:] = win_kv[..., dim:]
        pooled_score[:, ratio:] = win_score[..., dim:]
        pooled_kv[1:, :ratio] = win_kv[:-1, :, :dim]
        pooled_score[1:, :ratio] = win_score[:-1, :, :dim]
        skip = first_new - base_window
        win_kv, win_score = pooled_kv[skip:], pooled_score[skip:]
    entries = (win_kv * win_score.softmax(dim=1)).sum(dim=1)
    entries = rms_norm(entries, weights.norm, eps)
    positions = torch.arange(first_new, end // ratio, device=kv.device) * ratio
    cos, sin = rope.cos_sin(positions)
    return first_new, apply_rope(entries, cos, sin)


def store_entries(pool: torch.Tensor, block_ids: torch.Tensor, first: int, entries: torch.Tensor) -> None:
    """Write entries ``first ..`` into the sequence's blocks."""
    if entries.shape[0] == 0:
        return
    per_block = pool.shape[1]
    index = torch.arange(first, first + entries.shape[0], device=entries.device)
    pool[block_ids[index // per_block], index % per_block] = entries.to(pool.dtype)


def gather_entries(pool: torch.Tensor, block_ids: torch.Tensor, count: int) -> torch.Tensor:
    """Entries ``0 .. count - 1`` of the sequence, ``[count, d]``."""
    per_block = pool.shape[1]
    blocks = -(-count // per_block)
    return pool[block_ids[:blocks]].reshape(-1, pool.shape[-1])[:count]
