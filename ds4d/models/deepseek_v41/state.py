"""What one sequence carries from one forward step to the next.

* ``windows[layer]``: a ring of the last ``sliding_window`` window KV rows of
  every layer (FP8-rounded, after RoPE); position ``p`` lives in slot
  ``p % sliding_window``;
* ``groups[source]``, for every KV source layer: the ratio-2 compressor's tail
  (the projections of the tokens after the last complete pair: 0 or 1 rows),
  the compressed KV entries (FP4-rounded, after RoPE) and the index keys
  (FP4-rounded, after RoPE), one per entry;
* ``engram_ids``: the compressed token ids of the last ``max_ngram_size - 1``
  tokens (fewer at the start of the sequence);
* ``position``: how many tokens the state has taken in.

The candidate blocks of the two-level top-k are not carried: each query's
blocks depend only on that query's scores, so every step computes them afresh
for its own rows (:class:`StepShared`).  The same holds for the top-k an index
source hands to the layers that reuse it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class GrowingRows:
    """Rows appended at the end, stored with spare capacity so decode steps do not copy everything."""

    def __init__(self, width: int, dtype: torch.dtype, device: torch.device | str) -> None:
        self._data = torch.empty(0, width, dtype=dtype, device=device)
        self.count = 0

    def append(self, rows: torch.Tensor) -> None:
        needed = self.count + rows.shape[0]
        if needed > self._data.shape[0]:
            grown = self._data.new_empty(max(needed, 2 * self._data.shape[0], 16), self._data.shape[1])
            grown[: self.count] = self._data[: self.count]
            self._data = grown
        self._data[self.count: needed] = rows
        self.count = needed

    def view(self) -> torch.Tensor:
        return self._data[: self.count]

    def clone(self) -> GrowingRows:
        copy = GrowingRows(self._data.shape[1], self._data.dtype, self._data.device)
        copy.append(self.view())
        return copy


@dataclass
class GroupState:
    """The state a KV source keeps for its group."""

    tail_kv: torch.Tensor
    """``[t, head_dim]`` float32 compressor projections of the tokens after the last full group."""
    tail_gate: torch.Tensor
    entries: GrowingRows
    """``[entries, head_dim]`` compressed KV."""
    index_keys: GrowingRows
    """``[entries, index_head_dim]``."""

    def clone(self) -> GroupState:
        return GroupState(self.tail_kv.clone(), self.tail_gate.clone(), self.entries.clone(), self.index_keys.clone())


@dataclass
class SequenceState:
    position: int
    windows: list[torch.Tensor]
    groups: dict[int, GroupState]
    engram_ids: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))

    @classmethod
    def empty(cls, cfg, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> SequenceState:
        windows = [torch.zeros(cfg.sliding_window, cfg.head_dim, dtype=dtype, device=device)
                   for _ in range(cfg.num_hidden_layers)]
        groups = {
            source: GroupState(
                tail_kv=torch.empty(0, cfg.head_dim, dtype=torch.float32, device=device),
                tail_gate=torch.empty(0, cfg.head_dim, dtype=torch.float32, device=device),
                entries=GrowingRows(cfg.head_dim, dtype, device),
                index_keys=GrowingRows(cfg.index_head_dim, dtype, device),
            )
            for source in cfg.kv_source_layer_ids
        }
        return cls(position=0, windows=windows, groups=groups)

    def clone(self) -> SequenceState:
        return SequenceState(
            position=self.position,
            windows=[w.clone() for w in self.windows],
            groups={k: g.clone() for k, g in self.groups.items()},
            engram_ids=self.engram_ids.clone(),
        )

    # ------------------------------------------------------------ window rings

    def window_history(self, layer: int, count: int) -> torch.Tensor:
        """The window KV of the ``count`` positions before :attr:`position`, oldest first."""
        ring = self.windows[layer]
        if count == 0:
            return ring[:0]
        start = (self.position - count) % ring.shape[0]
        return ring.roll(-start, 0)[:count]  # row i: the slot of position ``position - count + i``

    def write_window(self, layer: int, kv: torch.Tensor, first_position: int) -> None:
        """Store the window KV ``[n, D]`` of positions ``first_position ..`` (the last ring-full of them)."""
        ring = self.windows[layer]
        size = ring.shape[0]
        if kv.shape[0] == 1:
            ring[first_position % size] = kv[0].to(ring.dtype)
            return
        keep = min(kv.shape[0], size)
        first = first_position + kv.shape[0] - keep
        slots = torch.arange(first, first + keep, device=ring.device) % size
        ring[slots] = kv[-keep:].to(ring.dtype)
