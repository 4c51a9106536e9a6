"""A V4.1 decode step of several sequences at fixed shapes, over state that lives in the engine's slots.

:meth:`DeepseekV41Model.forward` keeps one sequence's state in growing tensors
and decides on the host what a step writes; that cannot be captured in a CUDA
graph, and it runs each sequence's attention alone.  Here every sequence's
state sits at a fixed place: the window rings of all slots in one tensor
(:class:`SlotArrays`), the ratio-2 compressor tails beside them, the
compressed entries and index keys in the block pool (one trash block takes
the writes of steps that complete no entry).  One step takes packed rows
``[token, position, slot, block table...]`` (V4's
:func:`~ds4d.models.deepseek_v4.decode.pack_rows`, padded to a bucket of rows
and table width) and the Engram rows gathered for them, and
computes every row's logits with device-side arithmetic only:

* the window: the new KV written at ``position % sliding_window``, then each
  row's ring read oldest first, slots not yet written masked;
* a KV source: at ratio 1 every step adds an entry, at ratio 2 a step at an odd
  position pools its tail with itself (the step at an even position leaves
  itself as the tail); the entry and its index key are written at the entry's
  place in the row's blocks (the trash block when the step completes none);
* the indexer, the candidate blocks and the top-k over each row's entries as
  far as its block table reaches, entries not yet visible masked, so the picks
  are the ones the per-sequence code makes over the visible entries alone;
* the attention over window plus picked entries, batched over the rows.

Each row's arithmetic is :meth:`DeepseekV41Model.forward`'s for one token; the
sums run over padded (zero-weighted) keys, so the two agree to float rounding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ds4d.models.deepseek_v4.offload import counted_rows
from ds4d.models.deepseek_v4.ops import apply_rope, linear, rms_norm
from ds4d.models.deepseek_v41.attention import (
    NEG_INF,
    StepRows,
    candidate_blocks,
    output_projection,
    project,
    top_k,
)
from ds4d.models.deepseek_v41.config import LayerPlan
from ds4d.models.deepseek_v41.qat import round_fp4_blocks

if TYPE_CHECKING:
    from ds4d.models.deepseek_v41.model import DeepseekV41Model

HEADER = 3
"""Packed row: token, position, slot, then the block table."""


class SlotArrays:
    """Per-slot state at fixed addresses: the window rings ``[slots + 1, layers, window, head_dim]`` and,
    per ratio-2 KV source, the compressor's pending row (kv and gate, float32).  The last slot is scratch:
    the padding rows of a step write there."""

    def __init__(self, model: DeepseekV41Model, slots: int) -> None:
        cfg = model.cfg
        ratios = {plan.ratio for plan in model.plans if plan.is_kv_source}
        if ratios - {1, 2}:
            raise ValueError(f"the fixed-shape decode takes compress ratios 1 and 2, not {sorted(ratios)}")
        self.scratch = slots
        self.rings = torch.zeros(slots + 1, cfg.num_hidden_layers, cfg.sliding_window, cfg.head_dim,
                                 dtype=model.dtype, device=model.device)
        self.tail_index = {plan.layer: i for i, plan in enumerate(p for p in model.plans
                                                                 if p.is_kv_source and p.ratio == 2)}
        """Ratio-2 KV source -> its row in :attr:`tail_kv` / :attr:`tail_gate`."""
        shape = (slots + 1, max(1, len(self.tail_index)), cfg.head_dim)
        self.tail_kv = torch.zeros(shape, dtype=torch.float32, device=model.device)
        self.tail_gate = torch.zeros(shape, dtype=torch.float32, device=model.device)

    def ring_views(self, slot: int) -> list[torch.Tensor]:
        """The slot's ring of every layer, as views (writes through them land here)."""
        return list(self.rings[slot].unbind(0))


@dataclass
class _GroupStep:
    """What a KV source hands the later layers of its group within the step (cf. ``StepShared``)."""

    entries: torch.Tensor | None = None
    """``[B, T, head_dim]``: each row's entries as far as its table reaches."""
    index_keys: torch.Tensor | None = None
    """``[B, T, index_head_dim]``, beside them."""
    topk_bias: torch.Tensor | None = None
    """``[B, T]``: 0 on the entries each row attends to, -inf elsewhere."""
    candidates: torch.Tensor | None = None
    """``[B, T]`` bool: the candidate source's blocks, per row."""


@dataclass
class FixedDecode:
    """The fixed-shape decode step of a model over its slots' arrays and its block pool's tensors."""

    model: DeepseekV41Model
    arrays: SlotArrays
    entries: dict[int, torch.Tensor]
    """KV source -> entry pool ``[blocks + 1, per_block, head_dim]`` (the last block is trash)."""
    index_keys: dict[int, torch.Tensor]
    trash_block: int
    engram_layers: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        self.engram_layers = tuple(i for i, w in enumerate(self.model.weights.layers) if w.engram is not None)

    def step(self, packed: torch.Tensor, *engram: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, vocab]`` (float32) of the packed rows; ``engram``: each Engram layer's gathered rows
        ``[B, columns, head_dim]`` in layer order.  Capturable: no host reads, shapes from the inputs'."""
        model = self.model
        positions, slots, table = packed[:, 1], packed[:, 2], packed[:, HEADER:]
        rows = StepRows.make(positions, (), model.rope_main, model.rope_compress)
        streams, pre_mix = model._streams(packed[:, 0])
        gathered = dict(zip(self.engram_layers, engram))
        shared = _GroupStep()
        with counted_rows(model.expert_offload, slots != self.arrays.scratch):  # padding rows are not counted
            for layer, (plan, w) in enumerate(zip(model.plans, model.weights.layers)):
                attend = partial(self._attention, plan=plan, w=w.attn, rows=rows, slots=slots, table=table,
                                 shared=shared)
                streams, pre_mix = model.layer_around(layer, streams, pre_mix, gathered.get(layer), attend,
                                                      decode=True)
        return model.logits(streams, pre_mix)

    # ------------------------------------------------------------ attention

    def _attention(self, x, plan: LayerPlan, w, rows: StepRows, slots, table, shared: _GroupStep) -> torch.Tensor:
        cfg = self.model.cfg
        projected = project(x, plan, w, cfg, rows, x.shape[0])
        keys, mask = self._window(plan.layer, projected.kv, rows.positions, slots)
        if plan.ratio:
            if plan.is_kv_source:
                self._compress(x, plan, w, rows, slots, table, shared)
            if plan.is_index_source:
                self._index(x, projected.q_residual, plan, w.indexer, rows, shared)
            if shared.entries is not None:
                bias = shared.topk_bias
                if bias is None:
                    bias = mask.new_full((mask.shape[0], shared.entries.shape[1]), NEG_INF)
                keys = torch.cat([keys, shared.entries.to(keys.dtype)], dim=1)
                mask = torch.cat([mask, bias.to(mask.dtype)], dim=-1)
        out = attend_rows(projected.q, keys, mask, w.sink, cfg.head_dim**-0.5)
        return output_projection(out, plan, w, cfg, rows)

    def _window(self, layer: int, kv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor):
        """Write each row's window KV into its ring; (its ring oldest first ``[B, W, D]``, mask ``[B, W]``)."""
        rings = self.arrays.rings
        window = rings.shape[2]
        rings[slots, layer, positions % window] = kv.to(rings.dtype)
        back = torch.arange(window - 1, -1, -1, device=kv.device)  # oldest (window - 1 back) first
        held = positions.view(-1, 1) - back  # the position each key stands for
        keys = rings[slots.view(-1, 1), layer, held % window]
        mask = torch.zeros(held.shape, dtype=torch.float32, device=kv.device).masked_fill(held < 0, NEG_INF)
        return keys, mask

    def _compress(self, x, plan: LayerPlan, w, rows: StepRows, slots, table, shared: _GroupStep) -> None:
        """At a KV source: this step's entry (and index key), written where it belongs, then every row's
        entries and keys as far as its table reaches."""
        ratio, eps = plan.ratio, self.model.cfg.rms_norm_eps
        positions = rows.positions
        if ratio == 1:
            latent = rms_norm(F.linear(x, w.compressor.wkv), w.compressor.norm, eps)
            complete = torch.ones_like(positions, dtype=torch.bool)
        else:
            tail = self.arrays.tail_index[plan.layer]
            kv = F.linear(x.float(), w.compressor.wkv)
            gate = F.linear(x.float(), w.compressor.wgate)
            pair_kv = torch.stack([self.arrays.tail_kv[slots, tail], kv], dim=1)
            pair_gate = torch.stack([self.arrays.tail_gate[slots, tail], gate], dim=1)
            pooled = (pair_kv * pair_gate.softmax(dim=1)).sum(dim=1)
            latent = rms_norm(pooled.to(x.dtype), w.compressor.norm, eps)
            complete = (positions + 1) % ratio == 0
            # an even position leaves itself pending for the next; an odd one leaves the tail as it was
            # (never read again), so running the step twice writes the same state (graph warm-up, replay)
            keep = complete.view(-1, 1)
            self.arrays.tail_kv[slots, tail] = torch.where(keep, pair_kv[:, 0], kv)
            self.arrays.tail_gate[slots, tail] = torch.where(keep, pair_gate[:, 0], gate)
        entry = positions // ratio
        pool = self.entries[plan.layer]
        per_block = pool.shape[1]
        block = table.gather(1, (entry // per_block).view(-1, 1)).view(-1)
        block = torch.where(complete, block, torch.full_like(block, self.trash_block))
        offset = torch.where(complete, entry % per_block, torch.zeros_like(entry))
        entry_rope = rows.compress_rope.cos_sin(entry * ratio)
        pool[block, offset] = round_fp4_blocks(apply_rope(latent, *entry_rope), 16, e4m3_scales=True).to(pool.dtype)
        shared.entries = pool[table].flatten(1, 2)
        if plan.is_index_source:
            key_pool = self.index_keys[plan.layer]
            keys = rms_norm(F.linear(latent, w.indexer.wk), w.indexer.k_norm, eps)
            key_pool[block, offset] = round_fp4_blocks(apply_rope(keys, *entry_rope), 32).to(key_pool.dtype)
            shared.index_keys = key_pool[table].flatten(1, 2)

    def _index(self, x, q_residual, plan: LayerPlan, w, rows: StepRows, shared: _GroupStep) -> None:
        """An index source: its top-k bias over the group's entries (cf. ``attention.index_step``)."""
        keys = shared.index_keys
        if keys is None:
            return
        cfg = self.model.cfg
        visible = ((rows.positions + 1) // plan.ratio).view(-1, 1)  # entry j once the row reaches (j + 1) * ratio - 1
        count, heads, width = keys.shape[1], cfg.index_n_heads, cfg.index_head_dim
        q = linear(q_residual, w.wq_b).unflatten(-1, (heads, width))
        q = round_fp4_blocks(apply_rope(q, *rows.compress), 32)
        scores = torch.einsum("bhd,btd->bht", q.float(), keys.float()).relu_() * width**-0.5
        head_weights = F.linear(x, w.weights_proj).float() * heads**-0.5
        scores = (scores * head_weights.unsqueeze(-1)).sum(dim=1)  # [B, T]
        scores = scores.masked_fill(torch.arange(count, device=scores.device).view(1, -1) >= visible, NEG_INF)
        if plan.is_candidate_source:
            shared.candidates = candidate_blocks(scores, visible, cfg.candidate_topk_blocks, cfg.candidate_block_size)
        elif plan.uses_candidates and shared.candidates is not None:
            scores = scores.masked_fill(~shared.candidates, NEG_INF)
        values, indices = top_k(scores, min(cfg.index_topk, count))
        columns = torch.where(values > NEG_INF, indices, torch.full_like(indices, count))
        bias = scores.new_full((scores.shape[0], count + 1), NEG_INF).scatter_(-1, columns, 0.0)
        shared.topk_bias = bias[:, :count]


def attend_rows(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, sink: torch.Tensor,
                scale: float) -> torch.Tensor:
    """Each row's ``q [B, H, D]`` over its own shared K=V rows ``keys [B, T, D]`` with ``mask [B, T]`` and a
    sink logit per head (cf. ``attention.attend``: scores and softmax in float32)."""
    logits = torch.einsum("bhd,btd->bht", q.float(), keys.float()) * scale + mask.unsqueeze(1)
    sinks = sink.view(1, -1, 1).expand(q.shape[0], -1, 1).to(logits.dtype)
    logits = torch.cat([logits, sinks], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    return torch.einsum("bht,btd->bhd", probs.to(keys.dtype), keys)
