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

With ``fetch_ahead`` (:meth:`ZeroCopyExperts.prepare_ahead`) a layer's cold experts are also fetched before
its routing is known: the model hands over a prediction of the layer's experts (its router on the input of
the feed-forward before; hash layers' table, exact) and a side stream copies the predicted experts that sit
in host memory into one of two scratch buffers while the layer before finishes and this layer's attention
runs.  When the layer's routing is known, each cold row whose expert was fetched ahead reads that copy; the
others are gathered then, as without it.  A wrong prediction costs link time, never a different result.

Routing counts of these steps stay on the device (``decode_counts``, and
``host_reads`` for the pairs whose expert was read from host memory) until the
next step boundary hands them to the placement policy.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import torch

from ds4d.cuda import moe_gemv, quant_matmul
from ds4d.cuda.host_memory import HostSlots
from ds4d.models.deepseek_v4.moe import combine_sorted, expert_ffn
from ds4d.models.deepseek_v4.offload_parts import DeviceBank, ExpertForm, bank_parts
from ds4d.models.deepseek_v4.placement import PlacementPolicy
from ds4d.models.deepseek_v4.stored import GgufAddresses, Mxfp4Addresses

AHEAD_PROGRAMS = 8
"""Programs a row of a fetch ahead (``quant_matmul.fetch_rows``): it runs beside the step's kernels, so it
takes few SMs; eight programs of eight warps a row keep a few MB of reads in flight."""


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
        self.gather = False
        """Cold experts are gathered into the scratch (:meth:`prepare_gather`) before the GEMVs read them."""
        self.ahead_rows = 0
        """(token, expert) rows a decode step may have for its cold experts to be fetched ahead (0: never)."""
        self.ahead_hits = torch.zeros(layers, dtype=torch.int64, device=device)
        """Of ``host_reads``, the pairs whose expert had been fetched ahead, per layer."""
        self._pending: dict[int, tuple[int, int, object]] = {}

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

    def prepare_ahead(self, slots: HostSlots, rows: int) -> None:
        """Two scratch buffers of ``rows`` host slots each for experts fetched ahead (:meth:`fetch_ahead`):
        one layer's fill one while the layer before reads the other.  A side stream copies on CUDA."""
        words = slots.slot_bytes // 8
        self.ahead_rows = rows
        self._ahead = [torch.empty((rows, words), dtype=torch.int64, device=self.device) for _ in range(2)]
        parts = torch.tensor([at for _, _, _, at, _ in slots.layout], dtype=torch.int64)
        steps = torch.arange(rows, dtype=torch.int64) * slots.slot_bytes
        self._ahead_at = [(buffer.data_ptr() + steps.unsqueeze(0) + parts.unsqueeze(1)).to(self.device)
                          for buffer in self._ahead]
        self._predicted = [torch.zeros(rows, dtype=torch.int64, device=self.device) for _ in range(2)]
        self._side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    @torch.compiler.disable
    def fetch_ahead(self, layer: int, x: torch.Tensor, predict: Callable[[], torch.Tensor]) -> None:
        """Copy the host-held experts among ``predict()``'s ``[T, k]`` expert ids of ``layer`` into a scratch
        buffer, on the side stream (which first waits for the work queued so far: ``x``, the input the
        prediction reads, is ready).  Skipped when the step has more rows than :attr:`ahead_rows`."""
        if not (self.gather and self._scratch is not None and self.ahead_rows):
            return
        buffer = layer % 2
        side, main = self._side, torch.cuda.current_stream(self.device) if self._side is not None else None
        if side is not None:
            side.wait_stream(main)
            x.record_stream(side)  # read there; not reused before the side stream is past it
        with torch.cuda.stream(side) if side is not None else nullcontext():
            flat = predict().reshape(-1)
            count = flat.shape[0]
            if count > self.ahead_rows:
                return
            predicted = self._predicted[buffer][:count]
            predicted.copy_(flat)
            quant_matmul.fetch_rows(self.tables[layer][0], self.on_host[layer][predicted], predicted,
                                    self._ahead[buffer], programs=AHEAD_PROGRAMS)
            done = side.record_event() if side is not None else None
        self._pending[layer] = (buffer, count, done)

    def _join(self, done) -> None:
        """The compute stream waits for a fetch ahead (``done``: its event; None on the CPU)."""
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)

    def settle(self) -> None:
        """The compute stream waits for any fetch ahead no layer has read (a step ends with none in flight)."""
        for _, _, done in self._pending.values():
            self._join(done)
        self._pending.clear()

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
        if self.gather and self._scratch is not None:
            gate_up, down, expert_of_row = self.gathered(layer, expert_of_row, real[order])
        if pair_weighted:
            out = expert_ffn(x[order // k], gate_up, down, None, expert_of_row, limit, step_rows=tokens * k,
                             pair_weights=expert_weights.reshape(-1)[order])
            return combine_sorted(out, order, None, tokens, k, torch.float32)
        out = expert_ffn(x[order // k], gate_up, down, None, expert_of_row, limit, step_rows=tokens * k)
        return combine_sorted(out, order, expert_weights, tokens, k, x.dtype)

    def gathered(self, layer: int, experts: torch.Tensor, real: torch.Tensor,
                 ) -> tuple[Mxfp4Addresses, Mxfp4Addresses, torch.Tensor]:
        """The cold experts of these rows copied whole into device scratch (one kernel, large reads
        over the link); address tables per row: the scratch copy for cold rows, the bank for hot
        ones.  Row ``r`` then uses entry ``r``: the same bytes as in place, so the same results.
        Cold rows whose expert was fetched ahead (:meth:`fetch_ahead`) read that copy instead, and
        count into :attr:`ahead_hits` where ``real``."""
        rows = experts.shape[0]
        table = self.tables[layer]
        on_host = self.on_host[layer]
        scratch = self._scratch_at[:, :rows]  # [4, rows]: each part's address in row r's scratch
        cold = on_host[experts].bool()
        at = torch.where(cold.unsqueeze(0), scratch, table[:, experts])
        fetched = self._ahead_parts(layer, experts, real, cold, at) if self.ahead_rows else None
        if fetched is None:
            quant_matmul.gather_cold(table[0], on_host, experts, self._scratch)
        return (*self.addresses(at if fetched is None else fetched), self._row_ids[:rows])

    @torch.compiler.disable  # streams, events and the pending fetches stay out of ``torch.compile``'s graphs
    def _ahead_parts(self, layer: int, experts: torch.Tensor, real: torch.Tensor, cold: torch.Tensor,
                     gathered: torch.Tensor) -> torch.Tensor | None:
        """:meth:`gathered`'s addresses ``[parts, rows]`` once ``layer``'s fetch ahead is done: the fetched copy
        for a cold row whose expert it holds, else ``gathered``'s (the other cold rows' copies, gathered now;
        the bank for hot ones); None when nothing was fetched ahead for ``layer``."""
        ahead = self._pending.pop(layer, None)
        if ahead is None:
            return None
        buffer, count, done = ahead
        self._join(done)
        table = self.tables[layer]
        match = experts.unsqueeze(1) == self._predicted[buffer][:count].unsqueeze(0)  # [rows, count]
        hit = cold & match.any(dim=1)
        quant_matmul.fetch_rows(table[0], cold & ~hit, experts, self._scratch)
        self.ahead_hits[layer] += (hit.to(real.dtype) * real).sum()
        fetched = self._ahead_at[buffer][:, match.int().argmax(dim=1)]  # the first prediction that matched
        return torch.where(hit.unsqueeze(0), fetched, gathered)

    def observe(self, policy: PlacementPolicy) -> None:
        """Routing counts of zero-copy decode steps since the last call into the placement policy."""
        now = self.decode_counts.cpu()
        fresh, self._counts_seen = now - self._counts_seen, now
        for layer in range(self.layers):
            if fresh[layer].any():
                policy.observe(layer, fresh[layer].tolist())
