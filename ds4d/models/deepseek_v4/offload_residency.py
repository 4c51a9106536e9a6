"""Where each routed expert sits: a device bank per layer, page-locked host slots, and the moves between.

:class:`ExpertResidency` keeps, per layer, the device bank of hot experts and
the host slot of each expert with a host copy.  Each layer has a form
(``offload_parts.ExpertForm``): the layers of a checkpoint share one, a GGUF
file's may differ (llama-quantize's mixes change a matrix's type from layer to
layer), and every form has host slots of its own size.  When the device banks
hold the stored form (native MXFP4, float and GGUF experts) a hot expert has no
host copy, so device and host together hold each expert once; decoded banks keep
every host copy (``ExpertForm.decodes``).  A placement change
(:meth:`ExpertResidency.set_placement`) builds each moved layer's new bank:
experts that stay are copied on the device, new ones come from their host slots
(which are then free), and ones that leave are copied back into free host slots.
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
        self.forms: list[ExpertForm | None] = [None] * layers
        """Each layer's form (set by :meth:`adopt`)."""
        self.pools: dict[ExpertForm, HostSlots] = {}
        """Page-locked host slots per form, one expert's stored parts each (:meth:`hold`)."""
        self.host_slot: list[list[tuple[int, int] | None]] = [[None] * experts for _ in range(layers)]
        self.banks: list[DeviceBank | None] = [None] * layers
        self.placement_bytes = 0
        """Bytes copied host -> device by placement (adoption and changes)."""
        self.demoted_bytes = 0
        """Bytes copied device -> host by placement changes (experts turning cold)."""

    @property
    def slots(self) -> HostSlots | None:
        """The first form's host slots (every layer's, unless the forms differ)."""
        return next(iter(self.pools.values()), None)

    def hold(self, form: ExpertForm, slots: HostSlots) -> None:
        """Host slots for experts of ``form`` (before the first :meth:`adopt` of a layer of that form)."""
        self.pools[form] = slots

    def slots_of(self, layer: int) -> HostSlots:
        return self.pools[self.forms[layer]]

    def adopt(self, layer: int, form: ExpertForm, hot: list[int], stored: dict[str, torch.Tensor]) -> None:
        """``layer``'s experts of ``form`` from ``stored`` (every expert's parts stacked, on any device):
        ``hot`` into a device bank, the cold ones (every one when the bank decodes) into host slots."""
        self.forms[layer] = form
        self.banks[layer] = self.new_bank(layer, hot, lambda expert: {n: t[expert] for n, t in stored.items()})
        slots = self.pools[form]
        cold = [e for e in range(self.experts) if form.decodes or self.banks[layer].slot_of[e] < 0]
        slots.reserve(len(cold))  # one chunk for the layer when the form's slots were not grown ahead
        for expert in cold:
            slot = slots.take()
            for name, dst in slots.parts(slot).items():
                dst.copy_(stored[name][expert])
            self.host_slot[layer][expert] = slot

    def new_bank(self, layer: int, ids: list[int], parts_of: Callable[[int], dict[str, torch.Tensor]],
                 old: DeviceBank | None = None) -> DeviceBank:
        """A device bank of ``layer``'s form for ``ids``: slots of experts ``old`` holds are copied on the
        device, the others filled from ``parts_of(expert)`` (stored parts, on any device)."""
        form = self.forms[layer]
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
        form, slots = self.forms[layer], self.slots_of(layer)
        slot, at = slots.take(), bank.slot_of[expert]
        host = slots.parts(slot)
        for name, source in bank_parts(form, bank.gate_up, bank.down).items():
            host[name].copy_(source[at])
        self.host_slot[layer][expert] = slot
        self.demoted_bytes += form.host_expert_bytes

    def expert_parts(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        """A cold expert's stored parts in its host slot (views)."""
        return self.slots_of(layer).parts(self.host_slot[layer][expert])

    def hot_experts(self) -> list[list[int]]:
        return [list(bank.ids) if bank is not None else [] for bank in self.banks]

    def host_experts(self) -> int:
        """Experts with a copy in host RAM (each holds one slot)."""
        return sum(slots.slots - len(slots.free) for slots in self.pools.values())

    def host_bytes(self) -> int:
        """Host RAM of every form's slots, free ones included."""
        return sum(slots.bytes for slots in self.pools.values())

    def device_bytes(self) -> int:
        """Device memory of the hot experts in the banks."""
        return sum(len(bank.ids) * form.device_expert_bytes for bank, form in zip(self.banks, self.forms)
                   if bank is not None)

    def stored_bytes(self) -> int:
        """Every routed expert once, as stored."""
        return sum(form.host_expert_bytes * self.experts for form in self.forms if form is not None)

    def device_experts(self) -> int:
        """Experts in the device banks."""
        return sum(len(bank.ids) for bank in self.banks if bank is not None)

    def set_placement(self, hot: list[list[int]], moved: Callable[[int], None] | None = None) -> None:
        """Make ``hot[layer]`` the device-resident experts of each layer; ``moved(layer)`` runs after each
        layer's new bank is in place.

        Experts that stay keep their bytes (copied on the device into the new
        bank); new ones come from their host slots, which are then free (unless
        the form's banks decode: then every expert keeps its host copy); ones that
        leave are copied into free host slots.  Layers that free slots go first, so
        each form's host slots grow only by what the whole move needs."""
        moves = [(layer, sorted(ids)) for layer, ids in enumerate(hot) if self.banks[layer].ids != sorted(ids)]
        moves.sort(key=lambda move: len(self.banks[move[0]].ids) - len(move[1]))
        demand = {form: 0 for form in self.pools}
        peak = dict(demand)
        for layer, ids in moves:
            form = self.forms[layer]
            if not form.decodes:
                demand[form] += len(self.banks[layer].ids) - len(ids)
                peak[form] = max(peak[form], demand[form])
        for form, most in peak.items():
            self.pools[form].reserve(most)
        for layer, ids in moves:
            old, keeps_all = self.banks[layer], self.forms[layer].decodes
            new = self.new_bank(layer, ids, lambda expert, layer=layer: self.expert_parts(layer, expert), old)
            if not keeps_all:
                for expert in ids:
                    if old.slot_of[expert] < 0:
                        self.slots_of(layer).give(self.host_slot[layer][expert])
                        self.host_slot[layer][expert] = None
                for expert in old.ids:
                    if new.slot_of[expert] < 0:
                        self.demote(layer, expert, old)
            self.banks[layer] = new
            if moved is not None:
                moved(layer)
