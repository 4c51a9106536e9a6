"""Routed experts in their stored form, and the device tensors that hold them.

A host slot holds one expert's stored parts: ``w1`` / ``w2`` / ``w3`` bytes
with their scales (``s1`` / ``s2`` / ``s3``) for MXFP4 and FP8, ``gate_up`` /
``w2`` values for float experts, and with ``native`` MXFP4 the stacked layout
the ``quant_matmul`` kernels read (``gu`` / ``sgu`` for w1 over w3, ``w2`` /
``s2``).  A device bank holds one layer's hot experts as the grouped matmul
reads them (decoded values, or MXFP4 matrices with ``native``); a staging bank
receives copied cold experts, as stored, and, when they are quantised and not
``native``, their decoded values too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ds4d.models.deepseek_v4.quant import dequant_fp8_block, dequant_mxfp4
from ds4d.models.deepseek_v4.stored import Mxfp4Matrices
from ds4d.models.deepseek_v4.weights import ExpertBank


@dataclass(frozen=True)
class ExpertForm:
    """How one model's routed experts are held, fixed by the first layer adopted."""

    kind: str
    """``mxfp4``, ``fp8`` or ``float`` (``ExpertBank.kind``)."""
    block: tuple[int, int]
    """FP8 scale block."""
    native: bool
    """MXFP4 kept as stored on the device too (device banks and staging)."""
    dtype: torch.dtype
    """The model dtype decoded experts are computed in."""
    device: torch.device
    experts: int
    """Routed experts per layer."""
    intermediate: int
    """``moe_intermediate_size``."""
    hidden: int
    """``hidden_size``."""
    host_expert_bytes: int
    """One expert's stored parts (one host slot's payload)."""
    pair_weighted: bool = False
    """Each (token, expert) pair's routing weight multiplies its float32 SwiGLU before ``w2``
    (DeepSeek-V4.1; ``moe.expert_ffn(pair_weights=...)``) instead of its output."""

    @property
    def decodes(self) -> bool:
        """Copied experts are decoded on the device before the matmul (quantised and not ``native``)."""
        return self.kind != "float" and not self.native


@dataclass
class DeviceBank:
    """One layer's hot experts on the device."""

    ids: list[int]
    """The hot experts, in slot order."""
    slot_of: list[int]
    """Per expert of the layer: its slot in this bank, -1 when cold."""
    gate_up: torch.Tensor | Mxfp4Matrices  # [n, 2I, D] (MXFP4: [n, 2I, D/2] + scales)
    down: torch.Tensor | Mxfp4Matrices  # [n, D, I]


@dataclass
class StagingBank:
    """Device room for a batch of copied cold experts, with the copy stream's events around it."""

    packed: dict[str, torch.Tensor]
    """Where the stored parts land, one tensor per part, one row per expert."""
    gate_up: torch.Tensor | Mxfp4Matrices
    down: torch.Tensor | Mxfp4Matrices
    ready: object = None
    """Recorded on the copy stream after the batch's copies."""
    free: object = None
    """Recorded on the compute stream after the batch's matmuls."""
    experts: list[int] = field(default_factory=list)


def stored_parts(bank: ExpertBank, stacked: bool = False) -> dict[str, torch.Tensor]:
    """One layer's experts as stored; ``stacked`` (MXFP4 kept native): w1 over w3 as ``gu`` / ``sgu``
    (the layout the native kernels read), w2 / s2 as they are."""
    if bank.kind == "float":
        gate_up = bank.gate_up if bank.gate_up is not None else torch.cat([bank.weights["w1"], bank.weights["w3"]], 1)
        return {"gate_up": gate_up, "w2": bank.weights["w2"]}
    if stacked:
        if bank.native is not None:
            gate_up, down = bank.native
            return {"gu": gate_up.packed, "sgu": gate_up.scales, "w2": down.packed, "s2": down.scales}
        return {"gu": torch.cat([bank.weights["w1"], bank.weights["w3"]], 1),
                "sgu": torch.cat([bank.scales["w1"], bank.scales["w3"]], 1),
                "w2": bank.weights["w2"], "s2": bank.scales["w2"]}
    parts = {w: bank.weights[w] for w in ("w1", "w2", "w3")}
    parts.update({"s" + w[1]: bank.scales[w] for w in ("w1", "w2", "w3")})
    return parts


def bank_slots(bank: torch.Tensor | Mxfp4Matrices) -> int:
    """Experts a bank's matrices have room for."""
    return bank.packed.shape[0] if isinstance(bank, Mxfp4Matrices) else bank.shape[0]


def copy_slot(dst: torch.Tensor | Mxfp4Matrices, slot: int, src: torch.Tensor | Mxfp4Matrices, src_slot: int) -> None:
    if isinstance(dst, Mxfp4Matrices):
        dst.packed[slot].copy_(src.packed[src_slot])
        dst.scales[slot].copy_(src.scales[src_slot])
    else:
        dst[slot].copy_(src[src_slot])


def decode_parts(
    kind: str, parts: dict[str, torch.Tensor], dtype: torch.dtype, block,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert's stored parts -> (gate_up ``[2I, D]``, down ``[D, I]``), as ``ExpertBank.dense`` decodes them."""
    if kind == "float":
        return parts["gate_up"], parts["w2"]
    if "gu" in parts:  # stacked MXFP4
        return dequant_mxfp4(parts["gu"], parts["sgu"]).to(dtype), dequant_mxfp4(parts["w2"], parts["s2"]).to(dtype)

    def one(w: str) -> torch.Tensor:
        if kind == "mxfp4":
            return dequant_mxfp4(parts[w], parts["s" + w[1]]).to(dtype)
        return dequant_fp8_block(parts[w], parts["s" + w[1]], block).to(dtype)

    return torch.cat([one("w1"), one("w3")]), one("w2")


def native_matrices(form: ExpertForm, n: int) -> tuple[Mxfp4Matrices, Mxfp4Matrices]:
    """Uninitialised MXFP4 (gate/up, down) matrices for ``n`` experts on the device."""
    inter, hidden = form.intermediate, form.hidden

    def empty(rows: int, inputs: int) -> Mxfp4Matrices:
        return Mxfp4Matrices(torch.empty((n, rows, inputs // 2), dtype=torch.uint8, device=form.device),
                             torch.empty((n, rows, inputs // 32), dtype=torch.uint8, device=form.device))

    return empty(2 * inter, hidden), empty(hidden, inter)


def bank_matrices(form: ExpertForm, n: int) -> tuple[torch.Tensor | Mxfp4Matrices, torch.Tensor | Mxfp4Matrices]:
    """Uninitialised (gate/up, down) matrices for a device bank of ``n`` experts."""
    if form.native:
        return native_matrices(form, n)
    inter, hidden = form.intermediate, form.hidden
    gate_up = torch.empty((n, 2 * inter, hidden), dtype=form.dtype, device=form.device)
    return gate_up, torch.empty((n, hidden, inter), dtype=form.dtype, device=form.device)


def fill_native(gate_up: Mxfp4Matrices, down: Mxfp4Matrices, slot: int, parts: dict) -> None:
    gate_up.packed[slot].copy_(parts["gu"])
    gate_up.scales[slot].copy_(parts["sgu"])
    down.packed[slot].copy_(parts["w2"])
    down.scales[slot].copy_(parts["s2"])


def staging_bank(form: ExpertForm, layout, n: int) -> StagingBank:
    """A staging bank for ``n`` experts; ``layout`` is the host slots' (``HostSlots.layout``)."""
    inter, hidden = form.intermediate, form.hidden
    if form.native:  # copies land in the stacked MXFP4 matrices the kernels read
        gate_up, down = native_matrices(form, n)
        packed = {"gu": gate_up.packed, "sgu": gate_up.scales, "w2": down.packed, "s2": down.scales}
        return StagingBank(packed, gate_up, down)
    packed = {name: torch.empty((n, *shape), dtype=dtype, device=form.device) for name, shape, dtype, _, _ in layout}
    if form.kind == "float":
        return StagingBank(packed, packed["gate_up"], packed["w2"])
    gate_up = torch.empty((n, 2 * inter, hidden), dtype=form.dtype, device=form.device)
    return StagingBank(packed, gate_up, torch.empty((n, hidden, inter), dtype=form.dtype, device=form.device))
