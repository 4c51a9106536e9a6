"""Where V4 keeps what earlier tokens left behind: a block pool plus per-sequence state.

Every layer attends to the last ``sliding_window`` tokens exactly; compressed
layers also attend to *compressed entries*, one per ``ratio`` tokens.  The two
parts age differently, so they live in different places:

* **Block pool** (shared, paged): the compressed entries.  A block covers
  ``block_size_tokens`` (128) positions, i.e. ``128 / ratio`` entries per
  compressed layer (32 for CSA, plus 32 lightning-indexer keys; 1 for HCA).
  An entry is written once, when the last token of its window arrives, and never
  changes, so full blocks can be shared between sequences (prefix caching).
  A block's bytes (every compressed layer's pool rows, indexer rows after the
  compressor's, layer by layer) are what ``export_blocks`` hands the prefix
  cache's lower tiers and ``import_blocks`` writes back.
* **State slot** (one per running sequence, fixed size): for every layer a ring
  of the last ``sliding_window`` token KVs, and for every compressor a ring of
  the last ``c * ratio`` tokens' projected (kv, score) pairs — the tokens of the
  window still being filled, plus, for the overlapped CSA windows, the previous
  window, whose first half feeds the next entry.

A chunk starting at position 0 reads nothing from its slot, so reusing a slot
for a new sequence needs no clearing.

One state slot and one block beyond those asked for are scratch space: the
batched decode path (``decode.py``) pads a batch to a fixed size with rows that
write there, and sends entries that are not due yet to the trash block, so a
step's shapes never depend on the data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ds4d.models.deepseek_v4.config import CSA_RATIO, DeepseekV4Config


@dataclass
class CompressorState:
    pool: torch.Tensor  # [num_blocks, block / ratio, d]
    tail_kv: torch.Tensor  # [max_seqs, c * ratio, c * d] float32
    tail_score: torch.Tensor  # [max_seqs, c * ratio, c * d] float32


@dataclass
class LayerCache:
    ratio: int
    window: torch.Tensor  # [max_seqs, sliding_window, head_dim]
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None


def _coff(ratio: int) -> int:
    return 2 if ratio == CSA_RATIO else 1


def _compressor_state(
    num_blocks: int, max_seqs: int, block: int, ratio: int, dim: int, dtype: torch.dtype, device: torch.device
) -> CompressorState:
    coff = _coff(ratio)
    return CompressorState(
        pool=torch.zeros(num_blocks, block // ratio, dim, dtype=dtype, device=device),
        tail_kv=torch.zeros(max_seqs, coff * ratio, coff * dim, dtype=torch.float32, device=device),
        tail_score=torch.zeros(max_seqs, coff * ratio, coff * dim, dtype=torch.float32, device=device),
    )


class DeepseekV4Cache:
    """The tensors of one pool of ``num_blocks`` blocks and ``max_seqs`` state slots."""

    def __init__(
        self, cfg: DeepseekV4Config, num_blocks: int, max_seqs: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.num_blocks = num_blocks
        self.max_seqs = max_seqs
        self.scratch_slot = max_seqs
        self.trash_block = num_blocks
        self.block_size = cfg.block_size_tokens
        self.layers: list[LayerCache] = []
        slots, blocks = max_seqs + 1, num_blocks + 1
        for ratio in cfg.compress_ratios:
            layer = LayerCache(
                ratio=ratio,
                window=torch.zeros(slots, cfg.sliding_window, cfg.head_dim, dtype=dtype, device=device),
            )
            if ratio:
                layer.compressor = _compressor_state(blocks, slots, self.block_size, ratio, cfg.head_dim, dtype, device)
            if ratio == CSA_RATIO:
                layer.indexer = _compressor_state(
                    blocks, slots, self.block_size, ratio, cfg.index_head_dim, dtype, device
                )
            self.layers.append(layer)

    @staticmethod
    def bytes_per_block(cfg: DeepseekV4Config, dtype: torch.dtype) -> int:
        size = torch.empty((), dtype=dtype).element_size()
        block = cfg.block_size_tokens
        total = 0
        for ratio in cfg.compress_ratios:
            if ratio:
                total += (block // ratio) * cfg.head_dim * size
            if ratio == CSA_RATIO:
                total += (block // ratio) * cfg.index_head_dim * size
        return total

    @staticmethod
    def state_bytes_per_seq(cfg: DeepseekV4Config, dtype: torch.dtype) -> int:
        size = torch.empty((), dtype=dtype).element_size()
        total = 0
        for ratio in cfg.compress_ratios:
            total += cfg.sliding_window * cfg.head_dim * size
            if ratio:
                coff = _coff(ratio)
                total += 2 * (coff * ratio) * (coff * cfg.head_dim) * 4
            if ratio == CSA_RATIO:
                total += 2 * (2 * ratio) * (2 * cfg.index_head_dim) * 4
        return total

    def slot_views(self, slot: int) -> list[torch.Tensor]:
        """Every per-sequence tensor of ``slot`` (views into the state arrays)."""
        views = []
        for layer in self.layers:
            views.append(layer.window[slot])
            for state in (layer.compressor, layer.indexer):
                if state is not None:
                    views += [state.tail_kv[slot], state.tail_score[slot]]
        return views

    def export_slot(self, slot: int) -> list[torch.Tensor]:
        return [view.clone() for view in self.slot_views(slot)]

    def import_slot(self, slot: int, snapshot: list[torch.Tensor]) -> None:
        views = self.slot_views(slot)
        if len(views) != len(snapshot) or any(v.shape != s.shape for v, s in zip(views, snapshot)):
            raise ValueError("state snapshot does not match this model's state layout")
        for view, saved in zip(views, snapshot):
            view.copy_(saved)

    # ------------------------------------------------------------------ block copies (prefix cache tiers)

    def block_pools(self) -> list[torch.Tensor]:
        """The paged tensors, in payload order: per layer the compressor pool, then the indexer pool."""
        pools = []
        for layer in self.layers:
            pools += [state.pool for state in (layer.compressor, layer.indexer) if state is not None]
        return pools

    def payload_bytes(self) -> int:
        """Bytes of one block's payload (:meth:`export_blocks`)."""
        return sum(pool[0].numel() * pool.element_size() for pool in self.block_pools())

    def export_blocks(self, block_ids: Sequence[int]) -> list[torch.Tensor]:
        """Each block as one contiguous uint8 host tensor (see the module doc for the layout): the rows
        of :meth:`export_rows`, views of one buffer (the tiers copy or write what they keep; pickle
        :meth:`export_rows` instead, since a pickled view carries its whole buffer)."""
        return list(self.export_rows(block_ids).unbind(0))

    def export_rows(self, block_ids: Sequence[int]) -> torch.Tensor:
        """The blocks' payloads as one uint8 host tensor ``[len(block_ids), payload_bytes]``."""
        host, copied = self.start_export_rows(block_ids)
        if copied is not None:
            copied.synchronize()
        return host

    def start_export_rows(self, block_ids: Sequence[int]) -> tuple[torch.Tensor, Any]:
        """:meth:`export_rows` without waiting: with CUDA the device -> host copy is queued on the
        current stream (after the writes queued before it, before any write queued after it) into
        page-locked memory, and the CUDA event returned second is complete once the rows hold the
        blocks; None when they already do (CPU)."""
        pools = self.block_pools()
        if not block_ids or not pools:  # no compressed layer: a block holds nothing
            return torch.empty((len(block_ids), 0), dtype=torch.uint8), None
        device = pools[0].device
        # the index through page-locked memory: a copy from pageable memory would wait for the device
        index = torch.tensor(list(block_ids), dtype=torch.long, pin_memory=device.type == "cuda")
        index = index.to(device, non_blocking=True)
        rows = torch.cat([pool.index_select(0, index).reshape(len(block_ids), -1).view(torch.uint8)
                          for pool in pools], dim=1)
        if rows.device.type == "cpu":
            return rows, None  # a new tensor already
        host = torch.empty(rows.shape, dtype=torch.uint8, pin_memory=True)  # twice the rate of pageable memory
        host.copy_(rows, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return host, copied

    def import_blocks(self, block_ids: Sequence[int], payloads: Sequence[Any]) -> None:
        """Write payloads made by :meth:`export_blocks` into the given blocks.

        With CUDA the payloads are gathered into one pinned buffer and copied without a host
        sync (``non_blocking``) on the current stream, so the pool writes and the next forward
        are ordered after the copy while the engine thread goes on; the caching host allocator
        keeps the buffer until the copy is done."""
        width = self.payload_bytes()
        raw = payload_rows(block_ids, payloads, width)
        pools = self.block_pools()
        if not raw or not pools:
            return
        device = pools[0].device
        pinned = device.type == "cuda"
        staged = torch.stack(raw, out=torch.empty((len(raw), width), dtype=torch.uint8, pin_memory=pinned))
        index = torch.tensor(list(block_ids), dtype=torch.long, pin_memory=pinned)
        rows = staged.to(device, non_blocking=True)
        index = index.to(device, non_blocking=True)
        offset = 0
        for pool in pools:
            size = pool[0].numel() * pool.element_size()
            values = rows[:, offset:offset + size].contiguous().view(pool.dtype).view(len(block_ids), *pool.shape[1:])
            pool.index_copy_(0, index, values)
            offset += size


def payload_rows(block_ids: Sequence[int], payloads: Sequence[Any], width: int) -> list[torch.Tensor]:
    """Each block payload (a tensor or bytes-like, as the cache tiers hand them back) as a flat uint8
    tensor of ``width`` bytes; a count or size that does not match raises ``ValueError``."""
    if len(block_ids) != len(payloads):
        raise ValueError(f"{len(block_ids)} block ids for {len(payloads)} payloads")
    rows = []
    for payload in payloads:
        row = payload if isinstance(payload, torch.Tensor) else torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        if row.dtype != torch.uint8 or row.numel() != width:
            raise ValueError(f"block payload of {row.numel()} bytes, expected {width}")
        rows.append(row.reshape(-1))
    return rows
