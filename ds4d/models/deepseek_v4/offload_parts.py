"""Routed experts in their stored form, and the device tensors that hold them.

A host slot holds one expert's stored parts: ``w1`` / ``w2`` / ``w3`` bytes
with their scales (``s1`` / ``s2`` / ``s3``) for MXFP4 and FP8, ``gate_up`` /
``w2`` values for float experts, ``gate_up`` / ``w2`` GGUF blocks (or values,
for a matrix of a type no kernel reads) for GGUF experts, and with ``native``
MXFP4 the stacked layout the ``quant_matmul`` kernels read (``gu`` / ``sgu`` for
w1 over w3, ``w2`` / ``s2``).  A device bank holds one layer's hot experts as the
grouped matmul reads them (decoded values, MXFP4 matrices with ``native``, GGUF
blocks as stored); a staging bank receives copied cold experts, as stored, and,
when they are MXFP4 or FP8 and not ``native``, their decoded values too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ds4d.cuda import gguf_matmul
from ds4d.models.deepseek_v4.quant import dequant_fp8_block, dequant_mxfp4
from ds4d.models.deepseek_v4.stored import GgufMatrices, Mxfp4Matrices, gguf_values
from ds4d.models.deepseek_v4.weights import ExpertBank

Matrices = torch.Tensor | Mxfp4Matrices | GgufMatrices
"""One matrix per expert of a bank: decoded values, MXFP4 or GGUF blocks as stored."""


@dataclass(frozen=True)
class ExpertForm:
    """How one model's routed experts are held, fixed by the first layer adopted."""

    kind: str
    """``mxfp4``, ``fp8``, ``float`` or ``gguf`` (``ExpertBank.kind``)."""
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
    gguf: tuple[str | None, str | None] = (None, None)
    """``gguf`` experts: the GGUF types of (w1 over w3, w2) as the kernels read them; None for a matrix
    held as decoded values in ``dtype`` (a type no kernel reads)."""
    gguf_int8: bool = False
    """``gguf`` experts: their decode GEMVs round the inputs to int8 (``stored.GgufMatrices.int8_inputs``)."""

    @property
    def label(self) -> str:
        """``mxfp4``, ``mxfp4 as stored``, ``fp8``, ``float``, or ``gguf`` with its types (``gguf IQ2_XXS/Q2_K``)."""
        if self.kind == "gguf":
            return "gguf " + "/".join(qtype or "decoded" for qtype in self.gguf)
        return self.kind + (" as stored" if self.native else "")

    @property
    def device_expert_bytes(self) -> int:
        """One expert in a device bank: as stored, or decoded to ``dtype`` where the bank decodes."""
        if not self.decodes:
            return self.host_expert_bytes
        return 3 * self.intermediate * self.hidden * torch.empty(0, dtype=self.dtype).element_size()

    @property
    def decodes(self) -> bool:
        """Copied experts are decoded on the device before the matmul (MXFP4 or FP8, not ``native``);
        the device holds the other forms as stored."""
        return self.kind in ("mxfp4", "fp8") and not self.native


@dataclass
class DeviceBank:
    """One layer's hot experts on the device."""

    ids: list[int]
    """The hot experts, in slot order."""
    slot_of: list[int]
    """Per expert of the layer: its slot in this bank, -1 when cold."""
    gate_up: Matrices  # [n, 2I, D] (MXFP4: [n, 2I, D/2] + scales; GGUF: [n, 2I, row bytes])
    down: Matrices  # [n, D, I]


@dataclass
class StagingBank:
    """Device room for a batch of copied cold experts, with the copy stream's events around it."""

    packed: dict[str, torch.Tensor]
    """Where the stored parts land, one tensor per part, one row per expert."""
    gate_up: Matrices
    down: Matrices
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
    if bank.kind == "gguf":  # ``weights.gguf_bank``: (w1 over w3, w2), blocks or decoded values
        gate_up, down = bank.native
        return {"gate_up": held(gate_up), "w2": held(down)}
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


def gguf_form(bank: ExpertBank) -> tuple[str | None, str | None]:
    """A ``gguf`` bank's types of (w1 over w3, w2), None for a matrix held decoded."""
    return tuple(m.qtype if isinstance(m, GgufMatrices) else None for m in bank.native)


def gguf_int8(bank: ExpertBank) -> bool:
    """A bank's GGUF blocks take their decode GEMVs on int8 inputs (False for a bank without GGUF blocks)."""
    return any(isinstance(m, GgufMatrices) and m.int8_inputs for m in bank.native or ())


def held(matrices: torch.Tensor | GgufMatrices) -> torch.Tensor:
    """The tensor that holds a bank's matrices: GGUF blocks' bytes, or the values themselves."""
    return matrices.raw if isinstance(matrices, GgufMatrices) else matrices


def bank_slots(bank: Matrices) -> int:
    """Experts a bank's matrices have room for."""
    return bank.packed.shape[0] if isinstance(bank, Mxfp4Matrices) else held(bank).shape[0]


def copy_slot(dst: Matrices, slot: int, src: Matrices, src_slot: int) -> None:
    if isinstance(dst, Mxfp4Matrices):
        dst.packed[slot].copy_(src.packed[src_slot])
        dst.scales[slot].copy_(src.scales[src_slot])
    else:
        held(dst)[slot].copy_(held(src)[src_slot])


def decode_parts(form: ExpertForm, parts: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert's stored parts -> (gate_up ``[2I, D]``, down ``[D, I]``) in ``form.dtype``, as
    ``ExpertBank.dense`` decodes them."""
    kind, dtype, block = form.kind, form.dtype, form.block
    if kind == "float":
        return parts["gate_up"], parts["w2"]
    if kind == "gguf":  # only host experts decode these (on host threads: numpy, never a kernel)
        gate_up, down = gguf_matrices(form, parts["gate_up"], parts["w2"])
        return tuple(gguf_values(m.raw, m.qtype, m.cols, kernel=False).to(dtype) if isinstance(m, GgufMatrices)
                     else m for m in (gate_up, down))
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


def gguf_matrices(form: ExpertForm, gate_up: torch.Tensor, down: torch.Tensor) -> tuple[Matrices, Matrices]:
    """A ``gguf`` form's (w1 over w3, w2) over the tensors that hold them (``[..., 2I, row]``, ``[..., D, row]``):
    :class:`GgufMatrices` for a type the kernels read, the tensor itself for decoded values."""
    gate_type, down_type = form.gguf
    return (GgufMatrices(gate_up, gate_type, form.hidden, form.gguf_int8) if gate_type else gate_up,
            GgufMatrices(down, down_type, form.intermediate, form.gguf_int8) if down_type else down)


def _gguf_empty(form: ExpertForm, n: int, rows: int, cols: int, qtype: str | None) -> torch.Tensor:
    if qtype is None:
        return torch.empty((n, rows, cols), dtype=form.dtype, device=form.device)
    # zeros: a spare tile may decode a slot never filled
    return torch.zeros((n, rows, gguf_matmul.row_bytes_of(qtype, cols)), dtype=torch.uint8, device=form.device)


def bank_matrices(form: ExpertForm, n: int) -> tuple[Matrices, Matrices]:
    """Uninitialised (gate/up, down) matrices for a device bank of ``n`` experts."""
    if form.native:
        return native_matrices(form, n)
    inter, hidden = form.intermediate, form.hidden
    if form.kind == "gguf":
        return gguf_matrices(form, _gguf_empty(form, n, 2 * inter, hidden, form.gguf[0]),
                             _gguf_empty(form, n, hidden, inter, form.gguf[1]))
    gate_up = torch.empty((n, 2 * inter, hidden), dtype=form.dtype, device=form.device)
    return gate_up, torch.empty((n, hidden, inter), dtype=form.dtype, device=form.device)


def fill_slot(form: ExpertForm, gate_up: Matrices, down: Matrices, slot: int, parts: dict) -> None:
    """Slot ``slot`` of a device bank's matrices from one expert's stored parts (on the device): copied
    as they are where the bank holds the stored form, else decoded."""
    if form.native:
        gate_up.packed[slot].copy_(parts["gu"])
        gate_up.scales[slot].copy_(parts["sgu"])
        down.packed[slot].copy_(parts["w2"])
        down.scales[slot].copy_(parts["s2"])
    elif form.kind == "gguf":
        held(gate_up)[slot].copy_(parts["gate_up"])
        held(down)[slot].copy_(parts["w2"])
    else:
        dense_gate_up, dense_down = decode_parts(form, parts)
        gate_up[slot].copy_(dense_gate_up)
        down[slot].copy_(dense_down)


def bank_parts(form: ExpertForm, gate_up: Matrices, down: Matrices) -> dict[str, torch.Tensor]:
    """A device bank's matrices under the names of the stored parts they hold (banks that hold the
    stored form: ``native`` MXFP4, float and GGUF experts), so a slot can go back to the host."""
    if form.native:
        return {"gu": gate_up.packed, "sgu": gate_up.scales, "w2": down.packed, "s2": down.scales}
    return {"gate_up": held(gate_up), "w2": held(down)}


def staging_bank(form: ExpertForm, layout, n: int) -> StagingBank:
    """A staging bank for ``n`` experts; ``layout`` is the host slots' (``HostSlots.layout``)."""
    inter, hidden = form.intermediate, form.hidden
    if form.native:  # copies land in the stacked MXFP4 matrices the kernels read
        gate_up, down = native_matrices(form, n)
        return StagingBank(bank_parts(form, gate_up, down), gate_up, down)
    packed = {name: torch.empty((n, *shape), dtype=dtype, device=form.device) for name, shape, dtype, _, _ in layout}
    if form.kind == "float":
        return StagingBank(packed, packed["gate_up"], packed["w2"])
    if form.kind == "gguf":  # read as copied; zeros: a spare tile may decode a slot this step left empty
        for tensor in packed.values():
            tensor.zero_()
        return StagingBank(packed, *gguf_matrices(form, packed["gate_up"], packed["w2"]))
    gate_up = torch.empty((n, 2 * inter, hidden), dtype=form.dtype, device=form.device)
    return StagingBank(packed, gate_up, torch.empty((n, hidden, inter), dtype=form.dtype, device=form.device))
