"""Where each routed expert sits: a device bank per layer, page-locked host slots, and the moves between.

:class:`ExpertResidency` keeps, per layer, the device bank of hot experts and
the host slot of each expert with a host copy.  When the device banks hold the
stored form (native MXFP4, float and GGUF experts) a hot expert has no host copy, so
device and host together hold each expert once; decoded banks keep every host
copy (``keeps_all``).  A placement change (:meth:`ExpertResidency.set_placement`)
builds each moved layer's new bank: experts that stay are copied on the device,
new ones come from their host slots (which are then free), and ones that leave
are copied back into free host slots.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ds4d.cuda.host_memory import HostSlots
from ds4d.models.deepseek_v4.offload_parts import (
    DeviceBank,
    ExpertForm,
    bank_matrices,
    bank_parts,
    copy_slot,
    fill_slot,
)


class ExpertResidency:
    """The device banks and host slots of every layer's routed experts, and the bytes moved between them."""

    def __init__(self, layers: int, experts: int) -> None:
        self.layers, self.experts = layers, experts
        self.form: ExpertForm | None = None
        self.slots: HostSlots | None = None
        """Page-locked host slots, one expert's stored parts each (set by :meth:`hold`)."""
        self.keeps_all = False
        self.host_slot: list[list[tuple[int, int] | None]] = [[None] * experts for _ in range(layers)]
        self.banks: list[DeviceBank | None] = [None] * layers
        self.placement_bytes = 0
        """Bytes copied host -> device by placement (adoption and changes)."""
        self.demoted_bytes = 0
        """Bytes copied device -> host by placement changes (experts turning cold)."""

    def hold(self, form: ExpertForm, slots: HostSlots, keeps_all: bool) -> None:
        """The experts' form and the host slots they go into (before the first :meth:`adopt`)."""
        self.form, self.slots, self.keeps_all = form, slots, keeps_all

    def adopt(self, layer: int, hot: list[int], stored: dict[str, torch.Tensor]) -> None:
        """``layer``'s experts from ``stored`` (every expert's parts stacked, on any device): ``hot``
        into a device bank, the cold ones (every one with ``keeps_all``) into host slots."""
        self.banks[layer] = self.new_bank(hot, lambda expert: {n: t[expert] for n, t in stored.items()})
        for expert in range(self.experts):
            if self.keeps_all or self.banks[layer].slot_of[expert] < 0:
                slot = self.slots.take()
                for name, dst in self.slots.parts(slot).items():
                    dst.copy_(stored[name][expert])
                self.host_slot[layer][expert] = slot

    def new_bank(self, ids: list[int], parts_of: Callable[[int], dict[str, torch.Tensor]],
                 old: DeviceBank | None = None) -> DeviceBank:
        """A device bank for ``ids``: slots of experts ``old`` holds are copied on the device, the others
        filled from ``parts_of(expert)`` (stored parts, on any device)."""
        form = self.form
        gate_up, down = bank_matrices(form, len(ids))
        slot_of = [-1] * self.experts
        for slot, expert in enumerate(ids):
            slot_of[expert] = slot
            if old is not None and old.slot_of[expert] >= 0:
                copy_slot(gate_up, slot, old.gate_up, old.slot_of[expert])
                copy_slot(down, slot, old.down, old.slot_of[expert])
                continue
            parts = {n: t.to(form.device, non_blocking=True) for n, t in parts_of(expert).items()}
            fill_slot(form, gate_up, down, slot, parts)
            self.placement_bytes += form.host_expert_bytes
        return DeviceBank(ids, slot_of, gate_up, down)

    def demote(self, layer: int, expert: int, bank: DeviceBank) -> None:
        """Copy a hot expert's device bytes (the stored form) into a free host slot."""
        slot, at = self.slots.take(), bank.slot_of[expert]
        host = self.slots.parts(slot)
        for name, source in bank_parts(self.form, bank.gate_up, bank.down).items():
            host[name].copy_(source[at])
        self.host_slot[layer][expert] = slot
        self.demoted_bytes += self.form.host_expert_bytes

    def expert_parts(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        """A cold expert's stored parts in its host slot (views)."""
        return self.slots.parts(self.host_slot[layer][expert])

    def hot_experts(self) -> list[list[int]]:
        return [list(bank.ids) if bank is not None else [] for bank in self.banks]

    def host_experts(self) -> int:
        """Experts with a copy in host RAM (each holds one slot)."""
        return self.slots.slots - len(self.slots.free)

    def device_experts(self) -> int:
        """Experts in the device banks."""
        return sum(len(bank.ids) for bank in self.banks if bank is not None)

    def set_placement(self, hot: list[list[int]], moved: Callable[[int], None] | None = None) -> None:
        """Make ``hot[layer]`` the device-resident experts of each layer; ``moved(layer)`` runs after each
        layer's new bank is in place.

        Experts that stay keep their bytes (copied on the device into the new
        bank); new ones come from their host slots, which are then free (unless
        ``keeps_all``); ones that leave are copied into free host slots.  Layers
        that free slots go first, so the host grows only by what the whole move
        needs."""
        moves = [(layer, sorted(ids)) for layer, ids in enumerate(hot) if self.banks[layer].ids != sorted(ids)]
        if not self.keeps_all:
            moves.sort(key=lambda move: len(self.banks[move[0]].ids) - len(move[1]))
            demand, peak = 0, 0
            for layer, ids in moves:
                demand += len(self.banks[layer].ids) - len(ids)
                peak = max(peak, demand)
            self.slots.reserve(peak)
        for layer, ids in moves:
            old = self.banks[layer]
            new = self.new_bank(ids, lambda expert, layer=layer: self.expert_parts(layer, expert), old)
            if not self.keeps_all:
                for expert in ids:
                    if old.slot_of[expert] < 0:
                        self.slots.give(self.host_slot[layer][expert])
                        self.host_slot[layer][expert] = None
                for expert in old.ids:
                    if new.slot_of[expert] < 0:
                        self.demote(layer, expert, old)
            self.banks[layer] = new
            if moved is not None:
                moved(layer)
