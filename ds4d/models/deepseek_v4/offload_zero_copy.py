"""Zero-copy decode: small decode steps read every routed expert where it sits.

With native MXFP4 banks, or GGUF blocks (every layer in one form, gate/up and
down both kept in blocks), and host memory the device can address (or a CPU
"device"), a decode step of up to ``moe_gemv.MAX_ROWS`` (token, expert) rows
needs no routing read-back and no copy: per layer an int64 address table gives
each expert's stored parts (MXFP4: gate/up bytes, their scales, down bytes and
their scales; GGUF: the gate/up blocks and the down blocks), in the device bank
when the expert is hot and in its host slot otherwise, and the per-row MXFP4 or
GGUF kernel reads through it.  The tables are
rewritten in place when placement changes, so CUDA graphs captured over these
steps read the current placement.  With ``gather`` the rows' cold experts are
first copied whole into device scratch by one kernel (large reads over the
link) and the rows read the scratch copy: the same bytes, so the same results.

Routing counts of these steps stay on the device (``decode_counts``, and
``host_reads`` for the pairs whose expert was read from host memory) until the
next step boundary hands them to the placement policy.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ds4d.cuda import moe_gemv, quant_matmul
from ds4d.cuda.host_memory import HostSlots
from ds4d.models.deepseek_v4.moe import combine_sorted, expert_ffn
from ds4d.models.deepseek_v4.offload_parts import DeviceBank, ExpertForm, bank_parts
from ds4d.models.deepseek_v4.placement import PlacementPolicy
from ds4d.models.deepseek_v4.stored import GgufAddresses, Mxfp4Addresses


class ZeroCopyExperts:
    """Address tables, decode counters and gather scratch for the zero-copy decode path."""

    def __init__(self, layers: int, experts: int, intermediate: int, hidden: int, device: torch.device) -> None:
        self.layers, self.intermediate, self.hidden, self.device = layers, intermediate, hidden, device
        self.tables: list[torch.Tensor | None] = [None] * layers
        """int64 ``[parts, E]`` per layer: the address of each expert's stored parts (:meth:`write_table`)."""
        self.addressed: list[tuple | None] = [None] * layers
        self.form: ExpertForm | None = None
        """The experts' form (one for every layer; set by :meth:`write_table`)."""
        self.decode_counts = torch.zeros(layers, experts, dtype=torch.int64, device=device)
        self.host_reads = torch.zeros(layers, dtype=torch.int64, device=device)
        """Zero-copy (token, expert) pairs whose expert was read from host memory, per layer."""
        self.on_host = torch.zeros(layers, experts, dtype=torch.int64, device=device)
        self._counts_seen = torch.zeros(layers, experts, dtype=torch.int64)
        self._scratch: torch.Tensor | None = None

    def prepare_gather(self, slots: HostSlots) -> None:
        """Scratch for gathered cold experts (:meth:`gathered`), one host slot's size per decode row."""
        words = slots.slot_bytes // 8
        self._scratch = torch.empty((moe_gemv.MAX_ROWS, words), dtype=torch.int64, device=self.device)
        base = self._scratch.data_ptr() + torch.arange(moe_gemv.MAX_ROWS, dtype=torch.int64) * slots.slot_bytes
        offsets = {name: at for name, _, _, at, _ in slots.layout}
        parts = torch.tensor(list(offsets.values()), dtype=torch.int64)  # the table's rows, in slot order
        if parts[0] != 0:
            raise ValueError("host slots must start with the gate/up bytes")
        self._scratch_at = (base.unsqueeze(0) + parts.unsqueeze(1)).to(self.device)
        self._row_ids = torch.arange(moe_gemv.MAX_ROWS, dtype=torch.int64, device=self.device)

    def write_table(self, layer: int, form: ExpertForm, bank: DeviceBank,
                    host_parts: Callable[[int], dict[str, torch.Tensor]]) -> None:
        """Per expert of ``layer``, where its stored parts are (in the host slots' order): the device bank
        slot when hot, the host copy (``host_parts(expert)``) otherwise.  Written in place, so captured
        graphs read the current placement."""
        self.form = form
        rows = []
        for name, matrices in bank_parts(form, bank.gate_up, bank.down).items():
            row = []
            for expert, slot in enumerate(bank.slot_of):
                if slot >= 0:
                    row.append(matrices.data_ptr() + slot * matrices.stride(0) * matrices.element_size())
                else:
                    row.append(host_parts(expert)[name].data_ptr())
            rows.append(row)
        if any(address % 16 for row in rows for address in row):  # the kernels are told every address is
            raise ValueError("expert parts must sit at 16-byte aligned addresses")  # (``addresses``)
        table = torch.tensor(rows, dtype=torch.int64)
        self.on_host[layer].copy_(torch.tensor([int(slot < 0) for slot in bank.slot_of]))
        if self.tables[layer] is None:
            self.tables[layer] = table = table.to(self.device)
            self.addressed[layer] = self.addresses(table)
        else:
            self.tables[layer].copy_(table)

    def addresses(self, table: torch.Tensor) -> tuple[Mxfp4Addresses, Mxfp4Addresses] | tuple[GgufAddresses, ...]:
        """Gate/up and down matrices found through ``table`` (rows: the stored parts, MXFP4's gate/up bytes,
        its scales, down bytes, its scales, or GGUF's gate/up and down blocks; one column per entry)."""
        inter, hidden = self.intermediate, self.hidden
        if self.form.kind == "gguf":
            gate_up, down = self.form.gguf
            int8 = self.form.gguf_int8
            return (GgufAddresses(table[0], gate_up, 2 * inter, hidden, aligned=True, int8_inputs=int8),
                    GgufAddresses(table[1], down, hidden, inter, aligned=True, int8_inputs=int8))
        # aligned: checked for the tables (``write_table``); host slots and scratch rows start at
        # multiples of 256 bytes (``SlotArena``)
        return (Mxfp4Addresses(table[0], table[1], 2 * inter, hidden, aligned=True),
                Mxfp4Addresses(table[2], table[3], hidden, inter, aligned=True))

    def forward(self, layer, x, expert_weights, indices, limit, row_valid: torch.Tensor | None,
                pair_weighted: bool = False) -> torch.Tensor:
        """Every routed expert read where it sits (device bank or mapped host copy): ``moe.expert_ffn``
        over the layer's address tables, the per-row MXFP4 kernel, with no host read.  ``row_valid``
        (padded decode steps): True for the rows to count; ``pair_weighted``: see ``ExpertForm``."""
        tokens, k = indices.shape
        flat = indices.reshape(-1)
        if row_valid is None:
            real = torch.ones_like(flat)
        else:  # each row's k pairs (expand: no host read, capturable)
            real = row_valid.to(flat.dtype).unsqueeze(1).expand(tokens, k).reshape(-1)
        self.decode_counts[layer].index_add_(0, flat, real)
        self.host_reads[layer] += (self.on_host[layer][flat] * real).sum()
        expert_of_row, order = torch.sort(flat, stable=True)
        gate_up, down = self.addressed[layer]
        if self._scratch is not None:
            gate_up, down, expert_of_row = self.gathered(layer, expert_of_row)
        if pair_weighted:
            out = expert_ffn(x[order // k], gate_up, down, None, expert_of_row, limit, step_rows=tokens * k,
                             pair_weights=expert_weights.reshape(-1)[order])
            return combine_sorted(out, order, None, tokens, k, torch.float32)
        out = expert_ffn(x[order // k], gate_up, down, None, expert_of_row, limit, step_rows=tokens * k)
        return combine_sorted(out, order, expert_weights, tokens, k, x.dtype)

    def gathered(self, layer: int, experts: torch.Tensor) -> tuple[Mxfp4Addresses, Mxfp4Addresses, torch.Tensor]:
        """The cold experts of these rows copied whole into device scratch (one kernel, large reads
        over the link); address tables per row: the scratch copy for cold rows, the bank for hot
        ones.  Row ``r`` then uses entry ``r``: the same bytes as in place, so the same results."""
        rows = experts.shape[0]
        table = self.tables[layer]
        on_host = self.on_host[layer]
        quant_matmul.gather_cold(table[0], on_host, experts, self._scratch)
        scratch = self._scratch_at[:, :rows]  # [4, rows]: each part's address in row r's scratch
        cold = on_host[experts].bool().unsqueeze(0)
        return (*self.addresses(torch.where(cold, scratch, table[:, experts])), self._row_ids[:rows])

    def observe(self, policy: PlacementPolicy) -> None:
        """Routing counts of zero-copy decode steps since the last call into the placement policy."""
        now = self.decode_counts.cpu()
        fresh, self._counts_seen = now - self._counts_seen, now
        for layer in range(self.layers):
            if fresh[layer].any():
                policy.observe(layer, fresh[layer].tolist())
