"""Routed experts split between device memory (hot) and pinned host RAM (cold).

Every routed expert keeps its stored form (MXFP4 / FP8 bytes with scales, or
model-dtype values) in host RAM (``ds4d.cuda.host_memory``: anonymous memory,
huge pages when the buddy allocator has them, page-locked in parallel).  The
device holds a decoded bank per layer for the experts the placement policy
(``placement.py``) calls hot, plus two staging banks of ``stage_experts``
experts each.  One MoE call:

1. routes as usual, counts tokens per expert on the device and reads the
   counts back (the one host read per layer);
2. experts with zero tokens cost nothing: a cold one is never copied (counted
   as a skipped transfer);
3. hot experts run as one grouped matmul over the device bank;
4. used cold experts stream through the two staging banks on a copy stream,
   batch ``j + 1`` copying while batch ``j`` computes; quantised ones are
   decoded on the device after the copy, except with ``native`` MXFP4 banks,
   where hot banks and staging hold the stored bytes and the ``quant_matmul``
   kernels read them as copied (a quarter of the bf16 bytes per device expert);
5. in decode steps, cold experts with at most ``cpu_max_rows`` tokens may run on
   the host instead (threads reading the host copy while the device works),
   when the copy bandwidth and the CPU expert time measured at start say that
   is cheaper (``decode_cold``: ``auto`` | ``cpu`` | ``copy``).

The rows of each (token, expert) pair are computed by the same per-row
arithmetic wherever the expert's weights sit (``moe.expert_ffn``) and summed by
the same code (``moe.combine_sorted``), so device and staged experts give the
all-on-device result bit for bit; host-computed experts differ only where the
host's matmul rounds differently from the device's (never on a CPU "device").

Placement moves between steps (:meth:`ExpertOffload.begin_step`): experts that
stay keep their slots' contents, new ones are copied in, and the step runs on
the new banks; nothing else waits.  The machinery is device-agnostic: with a
CPU "device" the copies are plain and the events are ``None``.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import torch

from ds4d.cuda import moe_gemv, quant_matmul
from ds4d.cuda.host_memory import (
    CopyStream,
    HostArena,
    PinnedRegistry,
    host_pointers_usable,
    huge_pages_fit,
    mem_available_bytes,
)
from ds4d.models.deepseek_v4.config import DeepseekV4Config
from ds4d.models.deepseek_v4.moe import _swiglu, combine_sorted, expert_ffn, route, tally_routing
from ds4d.models.deepseek_v4.placement import PlacementPolicy, capacity_for_budget
from ds4d.models.deepseek_v4.quant import dequant_fp8_block, dequant_mxfp4
from ds4d.models.deepseek_v4.weights import ExpertBank, ModelWeights, MoEWeights, Mxfp4Addresses, Mxfp4Matrices

DECODE_COLD = ("auto", "cpu", "copy")


@dataclass
class OffloadOptions:
    vram_bytes: int
    """Device memory for routed experts: the hot banks plus the two staging banks."""
    placement: str = "online"
    cpu_threads: int = 4
    stage_experts: int = 8
    decode_cold: str = "auto"
    cpu_max_rows: int = 4
    replan_tokens: int = 8192
    mem_watermark_bytes: int = 0
    pin_threads: int = 8
    calibration: list[list[float]] | None = None
    native: bool = False
    """MXFP4 experts stay MXFP4 on the device too (hot banks and staging; ``quant_matmul`` kernels):
    about a quarter of the bf16 bytes per device expert and no decode after a copy."""


@dataclass
class LayerStats:
    calls: int = 0
    pairs: int = 0
    hot_pairs: int = 0
    copied_experts: int = 0
    bytes_copied: int = 0
    skipped_transfers: int = 0
    bytes_skipped: int = 0
    cpu_experts: int = 0
    cpu_pairs: int = 0
    cpu_expert_s: float = 0.0


@dataclass
class _Bank:
    ids: list[int]
    slot_of: list[int]
    gate_up: torch.Tensor | Mxfp4Matrices  # [n, 2I, D] (MXFP4: [n, 2I, D/2] + scales)
    down: torch.Tensor | Mxfp4Matrices  # [n, D, I]


@dataclass
class _Stage:
    packed: dict[str, torch.Tensor]
    gate_up: torch.Tensor | Mxfp4Matrices
    down: torch.Tensor | Mxfp4Matrices
    ready: object = None
    free: object = None
    experts: list[int] = field(default_factory=list)


def _stored_parts(bank: ExpertBank, stacked: bool = False) -> dict[str, torch.Tensor]:
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


def _slots(bank: torch.Tensor | Mxfp4Matrices) -> int:
    return bank.packed.shape[0] if isinstance(bank, Mxfp4Matrices) else bank.shape[0]


def _copy_slot(dst: torch.Tensor | Mxfp4Matrices, slot: int, src: torch.Tensor | Mxfp4Matrices, src_slot: int) -> None:
    if isinstance(dst, Mxfp4Matrices):
        dst.packed[slot].copy_(src.packed[src_slot])
        dst.scales[slot].copy_(src.scales[src_slot])
    else:
        dst[slot].copy_(src[src_slot])


def _decode(kind: str, parts: dict[str, torch.Tensor], dtype: torch.dtype, block) -> tuple[torch.Tensor, torch.Tensor]:
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


class ExpertOffload:
    """Owns the routed experts of every layer: host copies, device banks, staging, statistics."""

    def __init__(
        self, weights: ModelWeights, cfg: DeepseekV4Config, *, device: str | torch.device, dtype: torch.dtype,
        options: OffloadOptions, mem_available=mem_available_bytes,
    ) -> None:
        self.cfg, self.options, self.dtype = cfg, options, dtype
        self.device = torch.device(device)
        if options.decode_cold not in DECODE_COLD:
            raise ValueError(f"decode_cold {options.decode_cold!r}: use one of {', '.join(DECODE_COLD)}")
        banks = [layer.ffn.experts for layer in weights.layers]
        self.kind, self.block = banks[0].kind, banks[0].block
        self.layers, self.experts = len(banks), cfg.n_routed_experts
        inter, hidden = cfg.moe_intermediate_size, cfg.hidden_size
        element = torch.empty(0, dtype=dtype).element_size()
        self.native = options.native and self.kind == "mxfp4" and quant_matmul.available()
        parts = [_stored_parts(bank, self.native) for bank in banks]
        self.host_expert_bytes = sum(t[0].numel() * t.element_size() for t in parts[0].values())
        self.device_expert_bytes = self.host_expert_bytes if self.native else 3 * inter * hidden * element
        host_total = self.host_expert_bytes * self.experts * self.layers
        new_bytes = host_total if banks[0].weights["w2"].device.type != "cpu" else host_total // max(1, self.layers)
        available = mem_available()
        if options.mem_watermark_bytes and available and available - new_bytes < options.mem_watermark_bytes:
            raise MemoryError(
                f"routed experts need {new_bytes / 2**30:.1f} GiB more host RAM, leaving "
                f"{(available - new_bytes) / 2**30:.1f} GiB, under the {options.mem_watermark_bytes / 2**30:.1f} GiB "
                "watermark: raise expert_vram_gib or lower mem_watermark_gib")
        self.arena = HostArena(huge_pages=huge_pages_fit(host_total))
        self.hosts = [self._adopt(bank, p) for bank, p in zip(banks, parts)]
        del parts
        self.pinned = PinnedRegistry(options.pin_threads)
        self.pinned.pin([t for host in self.hosts for t in host.values()])
        self.zero_copy = self.native and (self.device.type == "cpu" or (
            self.pinned.enabled and host_pointers_usable(self.device)))
        """Decode steps of up to ``moe_gemv.MAX_ROWS`` (token, expert) rows read cold experts straight
        from host memory (kernels on the device, through per-expert address tables): no host read,
        no copy, so those steps are captured in CUDA graphs like the all-on-device ones."""
        self.tables: list[torch.Tensor | None] = [None] * self.layers
        """int64 ``[4, E]`` per layer: addresses of each expert's gate/up bytes and scales, down bytes and scales."""
        self.addressed: list[tuple[Mxfp4Addresses, Mxfp4Addresses] | None] = [None] * self.layers
        self.decode_counts = torch.zeros(self.layers, self.experts, dtype=torch.int64, device=self.device)
        self.host_reads = torch.zeros(self.layers, dtype=torch.int64, device=self.device)
        """Zero-copy (token, expert) pairs whose expert was read from host memory, per layer."""
        self.row_valid: torch.Tensor | None = None
        """Set by the model around a padded decode step (``model.counted_rows``): True for the real rows;
        the bucket's padding rows are computed but not counted."""
        self.on_host = torch.zeros(self.layers, self.experts, dtype=torch.int64, device=self.device)
        self._counts_seen = torch.zeros(self.layers, self.experts, dtype=torch.int64)
        stage_n = max(1, options.stage_experts)
        quantised_stage = self.host_expert_bytes if self.kind != "float" and not self.native else 0
        self.staging_bytes = 2 * stage_n * (self.device_expert_bytes + quantised_stage)
        capacity = capacity_for_budget(options.vram_bytes, self.device_expert_bytes, self.staging_bytes,
                                       self.layers * self.experts)
        calibration = options.calibration
        if calibration is not None and (len(calibration) != self.layers
                                        or any(len(row) != self.experts for row in calibration)):
            raise ValueError(f"expert calibration counts are {len(calibration)} layers x "
                             f"{len(calibration[0]) if calibration else 0} experts; this model has "
                             f"{self.layers} x {self.experts}")
        self.policy = PlacementPolicy(self.layers, self.experts, capacity, mode=options.placement,
                                      replan_tokens=options.replan_tokens, calibration=options.calibration)
        self.stats = [LayerStats() for _ in range(self.layers)]
        self.placement_bytes = 0
        self.banks: list[_Bank | None] = [None] * self.layers
        self.set_placement(self.policy.initial())
        self.stages = [self._stage(stage_n) for _ in range(2)]
        self.copier = CopyStream(self.device)
        self.pool = ThreadPoolExecutor(max(1, options.cpu_threads), thread_name_prefix="ds4d-expert")
        self.pcie_bytes_s, self.cpu_expert_s = self._measure()

    # ------------------------------------------------------------------ setup

    def _adopt(self, bank: ExpertBank, parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Move one layer's stored experts into host memory; the bank then refers to the host copy."""
        host = {}
        for name, tensor in parts.items():
            host[name] = self.arena.empty(tuple(tensor.shape), tensor.dtype)
            host[name].copy_(tensor)
        if self.kind == "float":
            inter = host["gate_up"].shape[1] // 2
            bank.gate_up = host["gate_up"]
            bank.weights = {"w1": host["gate_up"][:, :inter], "w3": host["gate_up"][:, inter:], "w2": host["w2"]}
        elif "gu" in host:
            inter = host["gu"].shape[1] // 2
            bank.weights = {"w1": host["gu"][:, :inter], "w3": host["gu"][:, inter:], "w2": host["w2"]}
            bank.scales = {"w1": host["sgu"][:, :inter], "w3": host["sgu"][:, inter:], "w2": host["s2"]}
        else:
            bank.weights = {w: host[w] for w in ("w1", "w2", "w3")}
            bank.scales = {w: host["s" + w[1]] for w in ("w1", "w2", "w3")}
        bank._dense_cache = None
        bank.native = None  # the device copy goes; the banks below hold what the device keeps
        return host

    def _stage(self, n: int) -> _Stage:
        inter, hidden = self.cfg.moe_intermediate_size, self.cfg.hidden_size
        if self.native:  # copies land in the stacked MXFP4 matrices the kernels read
            gate_up, down = self._native_bank(n)
            packed = {"gu": gate_up.packed, "sgu": gate_up.scales, "w2": down.packed, "s2": down.scales}
            return _Stage(packed, gate_up, down)
        packed = {name: torch.empty((n, *t.shape[1:]), dtype=t.dtype, device=self.device)
                  for name, t in self.hosts[0].items()}
        if self.kind == "float":
            return _Stage(packed, packed["gate_up"], packed["w2"])
        gate_up = torch.empty((n, 2 * inter, hidden), dtype=self.dtype, device=self.device)
        return _Stage(packed, gate_up, torch.empty((n, hidden, inter), dtype=self.dtype, device=self.device))

    def _native_bank(self, n: int) -> tuple[Mxfp4Matrices, Mxfp4Matrices]:
        inter, hidden = self.cfg.moe_intermediate_size, self.cfg.hidden_size

        def empty(rows: int, inputs: int) -> Mxfp4Matrices:
            return Mxfp4Matrices(torch.empty((n, rows, inputs // 2), dtype=torch.uint8, device=self.device),
                                 torch.empty((n, rows, inputs // 32), dtype=torch.uint8, device=self.device))

        return empty(2 * inter, hidden), empty(hidden, inter)

    @staticmethod
    def _fill_native(gate_up: Mxfp4Matrices, down: Mxfp4Matrices, slot: int, parts: dict) -> None:
        gate_up.packed[slot].copy_(parts["gu"])
        gate_up.scales[slot].copy_(parts["sgu"])
        down.packed[slot].copy_(parts["w2"])
        down.scales[slot].copy_(parts["s2"])

    def _address_table(self, layer: int) -> None:
        """Per expert of ``layer``, where its four stored parts are: the device bank slot when hot, the
        host copy otherwise.  Written in place, so captured graphs read the current placement."""
        host, bank = self.hosts[layer], self.banks[layer]
        rows = []
        for name, matrices in (("gu", bank.gate_up.packed), ("sgu", bank.gate_up.scales), ("w2", bank.down.packed),
                               ("s2", bank.down.scales)):
            stored = host[name]
            row = [stored.data_ptr() + e * stored.stride(0) for e in range(self.experts)]
            for expert, slot in enumerate(bank.slot_of):
                if slot >= 0:
                    row[expert] = matrices.data_ptr() + slot * matrices.stride(0)
            rows.append(row)
        table = torch.tensor(rows, dtype=torch.int64)
        self.on_host[layer].copy_(torch.tensor([int(slot < 0) for slot in bank.slot_of]))
        if self.tables[layer] is None:
            self.tables[layer] = table = table.to(self.device)
            inter, hidden = self.cfg.moe_intermediate_size, self.cfg.hidden_size
            self.addressed[layer] = (Mxfp4Addresses(table[0], table[1], 2 * inter, hidden),
                                     Mxfp4Addresses(table[2], table[3], hidden, inter))
        else:
            self.tables[layer].copy_(table)

    def _expert_parts(self, layer: int, expert: int, device: torch.device | None = None) -> dict[str, torch.Tensor]:
        host = self.hosts[layer]
        if device is None or device.type == "cpu":
            return {name: t[expert] for name, t in host.items()}
        return {name: t[expert].to(device, non_blocking=True) for name, t in host.items()}

    def _measure(self) -> tuple[float, float]:
        """(host -> device bytes/s for one expert, seconds for one expert on one row on the host)."""
        stage = self.stages[0]
        experts = list(range(min(_slots(stage.gate_up), self.experts)))
        seconds = []
        for _ in range(4):  # a whole staging bank per copy; the first one warms up
            began = time.perf_counter()
            self._issue(0, experts, stage, count=False)
            self.copier.synchronize()
            seconds.append(time.perf_counter() - began)
        pcie = len(experts) * self.host_expert_bytes / max(sorted(seconds[1:])[1], 1e-9)
        rows = torch.randn(1, self.cfg.hidden_size, dtype=self.dtype)
        self._cpu_expert(0, 0, rows)
        began = time.perf_counter()
        for _ in range(3):
            self._cpu_expert(0, 0, rows)
        return pcie, (time.perf_counter() - began) / 3

    # ------------------------------------------------------------------ placement

    def hot_experts(self) -> list[list[int]]:
        return [list(bank.ids) if bank is not None else [] for bank in self.banks]

    def set_placement(self, hot: list[list[int]]) -> None:
        """Make ``hot[layer]`` the device-resident experts of each layer (between steps)."""
        inter, hidden = self.cfg.moe_intermediate_size, self.cfg.hidden_size
        for layer, ids in enumerate(hot):
            ids = sorted(ids)
            old = self.banks[layer]
            if old is not None and old.ids == ids:
                continue
            if self.native:
                gate_up, down = self._native_bank(len(ids))
            else:
                gate_up = torch.empty((len(ids), 2 * inter, hidden), dtype=self.dtype, device=self.device)
                down = torch.empty((len(ids), hidden, inter), dtype=self.dtype, device=self.device)
            slot_of = [-1] * self.experts
            for slot, expert in enumerate(ids):
                slot_of[expert] = slot
                if old is not None and old.slot_of[expert] >= 0:
                    _copy_slot(gate_up, slot, old.gate_up, old.slot_of[expert])
                    _copy_slot(down, slot, old.down, old.slot_of[expert])
                    continue
                parts = self._expert_parts(layer, expert, self.device)
                if self.native:
                    self._fill_native(gate_up, down, slot, parts)
                else:
                    dense_gate_up, dense_down = _decode(self.kind, parts, self.dtype, self.block)
                    gate_up[slot].copy_(dense_gate_up)
                    down[slot].copy_(dense_down)
                self.placement_bytes += self.host_expert_bytes
            self.banks[layer] = _Bank(ids, slot_of, gate_up, down)
            if self.zero_copy:
                self._address_table(layer)

    def begin_step(self) -> None:
        """Between steps: adopt a new placement when the online policy has one."""
        if self.zero_copy and self.policy.mode == "online":
            self._observe_decode_counts()
        if self.policy.due():
            proposal = self.policy.replan(self.hot_experts())
            if proposal is not None:
                self.set_placement(proposal)

    # ------------------------------------------------------------------ forward

    def moe_forward(
        self, layer: int, x: torch.Tensor, token_ids: torch.Tensor, weights: MoEWeights, cfg: DeepseekV4Config,
        *, decode: bool = False, tally: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``moe.moe_forward(grouped=True)`` with this layer's routed experts wherever they sit."""
        expert_weights, indices = route(x, token_ids, weights, cfg)
        tally_routing(tally, indices)
        limit = cfg.swiglu_limit
        shared = _swiglu(x, weights.shared_w1, weights.shared_w3, weights.shared_w2, limit)
        return self.routed(layer, x, expert_weights, indices, limit=limit, decode=decode) + shared

    def routed(
        self, layer: int, x: torch.Tensor, expert_weights: torch.Tensor, indices: torch.Tensor, *, limit: float,
        decode: bool = False,
    ) -> torch.Tensor:
        """The routed experts' weighted output for routing already done (``indices`` into this offload's
        experts; a split model's rank passes its own experts' pairs and zero weights for the others)."""
        return self._routed(layer, x, expert_weights, indices, limit, decode)

    def _observe_decode_counts(self) -> None:
        """Routing counts of zero-copy decode steps (kept on the device) into the placement policy."""
        now = self.decode_counts.cpu()
        fresh, self._counts_seen = now - self._counts_seen, now
        for layer in range(self.layers):
            if fresh[layer].any():
                self.policy.observe(layer, fresh[layer].tolist())

    def capturable(self, rows: int) -> bool:
        """Whether a decode step of ``rows`` sequences runs without host reads (zero-copy experts)."""
        return self.zero_copy and rows * self.cfg.num_experts_per_tok <= moe_gemv.MAX_ROWS

    def _split_cold(self, cold: list[int], counts: list[int], decode: bool) -> tuple[list[int], list[int]]:
        """(experts for the host, experts to copy)."""
        mode = self.options.decode_cold
        if not decode or mode == "copy" or not cold:
            return [], cold
        eligible = [e for e in cold if counts[e] <= self.options.cpu_max_rows]
        if mode == "auto" and eligible:
            cpu_s = math.ceil(len(eligible) / self.options.cpu_threads) * self.cpu_expert_s
            if cpu_s >= len(eligible) * self.host_expert_bytes / self.pcie_bytes_s:
                return [], cold
        return eligible, [e for e in cold if e not in eligible]

    def _zero_copy(self, layer, x, expert_weights, indices, limit) -> torch.Tensor:
        """Every routed expert read where it sits (device bank or mapped host copy): ``moe.expert_ffn``
        over the layer's address tables, the per-row MXFP4 kernel, with no host read."""
        tokens, k = indices.shape
        flat = indices.reshape(-1)
        if self.row_valid is None:
            real = torch.ones_like(flat)
        else:  # each row's k pairs (expand: no host read, capturable)
            real = self.row_valid.to(flat.dtype).unsqueeze(1).expand(tokens, k).reshape(-1)
        self.decode_counts[layer].index_add_(0, flat, real)
        self.host_reads[layer] += (self.on_host[layer][flat] * real).sum()
        expert_of_row, order = torch.sort(flat, stable=True)
        gate_up, down = self.addressed[layer]
        out = expert_ffn(x[order // k], gate_up, down, None, expert_of_row, limit, step_rows=tokens * k)
        return combine_sorted(out, order, expert_weights, tokens, k, x.dtype)

    def _routed(self, layer, x, expert_weights, indices, limit, decode) -> torch.Tensor:
        tokens, k = indices.shape
        if decode and self.capturable(tokens):
            return self._zero_copy(layer, x, expert_weights, indices, limit)
        flat = indices.reshape(-1)
        counts = torch.bincount(flat, minlength=self.experts).tolist()
        self.policy.observe(layer, counts)
        bank, stats = self.banks[layer], self.stats[layer]
        cold = [e for e in range(self.experts) if counts[e] and bank.slot_of[e] < 0]
        on_host, copied = self._split_cold(cold, counts, decode)
        key = list(bank.slot_of)
        base = len(bank.ids)
        for position, expert in enumerate(copied + on_host):
            key[expert] = base + position
        sorted_key, order = torch.sort(torch.tensor(key, device=x.device)[flat], stable=True)
        rows = x[order // k]
        hot_rows = sum(counts[e] for e in bank.ids)
        stats.calls += 1
        stats.pairs += tokens * k
        stats.hot_pairs += hot_rows
        skipped = self.experts - len(bank.ids) - len(cold)
        stats.skipped_transfers += skipped
        stats.bytes_skipped += skipped * self.host_expert_bytes

        begin = hot_rows + sum(counts[e] for e in copied)
        host_rows = rows[begin:].to("cpu") if on_host else None
        pieces = []
        if hot_rows:
            offsets = self._offsets([counts[e] for e in bank.ids], len(bank.ids), x.device)
            pieces.append(expert_ffn(rows[:hot_rows], bank.gate_up, bank.down, offsets, sorted_key[:hot_rows],
                                     limit, step_rows=tokens * k))
        pieces.extend(self._staged(layer, copied, counts, rows[hot_rows:begin], sorted_key[hot_rows:begin] - base,
                                   limit, tokens * k))
        if on_host:  # the device works through the launches above meanwhile
            began = time.perf_counter()
            pieces.append(self._host_experts(layer, on_host, counts, host_rows).to(x.device))
            stats.cpu_expert_s += time.perf_counter() - began
            stats.cpu_experts += len(on_host)
            stats.cpu_pairs += host_rows.shape[0]
        out = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        return combine_sorted(out, order, expert_weights, tokens, k, x.dtype)

    @staticmethod
    def _offsets(counts: list[int], groups: int, device) -> torch.Tensor:
        ends, total = [], 0
        for count in counts + [0] * (groups - len(counts)):
            total += count
            ends.append(total)
        return torch.tensor(ends, dtype=torch.int32).to(device, non_blocking=True)

    def _issue(self, layer: int, experts: list[int], stage: _Stage, count: bool = True) -> None:
        self.copier.wait(stage.free)
        host = self.hosts[layer]
        for slot, expert in enumerate(experts):
            for name, tensor in host.items():
                self.copier.copy(stage.packed[name][slot], tensor[expert])
        stage.ready = self.copier.record()
        stage.experts = experts
        if not count:
            return
        stats = self.stats[layer]
        stats.copied_experts += len(experts)
        stats.bytes_copied += len(experts) * self.host_expert_bytes

    def _staged(self, layer, copied, counts, rows, slots, limit, step_rows) -> list[torch.Tensor]:
        """Cold experts through the double-buffered staging banks, copy of batch j + 1 under compute of j."""
        size = _slots(self.stages[0].gate_up)
        batches = [copied[at : at + size] for at in range(0, len(copied), size)]
        out, row = [], 0
        if batches:
            self._issue(layer, batches[0], self.stages[0])
        for index, batch in enumerate(batches):
            if index + 1 < len(batches):
                self._issue(layer, batches[index + 1], self.stages[(index + 1) % 2])
            stage = self.stages[index % 2]
            self.copier.compute_waits(stage.ready)
            if self.kind != "float" and not self.native:  # decode after the copy (native: read as copied)
                for slot in range(len(batch)):
                    gate_up, down = _decode(self.kind, {n: t[slot] for n, t in stage.packed.items()}, self.dtype,
                                            self.block)
                    stage.gate_up[slot].copy_(gate_up)
                    stage.down[slot].copy_(down)
            n = sum(counts[e] for e in batch)
            offsets = self._offsets([counts[e] for e in batch], size, rows.device)
            out.append(expert_ffn(rows[row : row + n], stage.gate_up, stage.down, offsets,
                                  slots[row : row + n] - index * size, limit, step_rows=step_rows))
            stage.free = self.copier.compute_event()
            row += n
        return out

    def _cpu_expert(self, layer: int, expert: int, rows: torch.Tensor) -> torch.Tensor:
        gate_up, down = _decode(self.kind, self._expert_parts(layer, expert), self.dtype, self.block)
        if rows.shape[0] == 1:  # as moe._grouped_linear: a lone bmm product rounds differently
            return self._cpu_expert(layer, expert, rows.expand(2, -1))[:1]
        n = rows.shape[0]
        hidden = torch.bmm(gate_up.expand(n, -1, -1), rows.unsqueeze(-1)).squeeze(-1)
        gate, up = hidden.chunk(2, dim=-1)
        limit = self.cfg.swiglu_limit
        if limit > 0:
            gate = gate.clamp(max=limit)
            up = up.clamp(min=-limit, max=limit)
        act = torch.nn.functional.silu(gate) * up
        return torch.bmm(down.expand(n, -1, -1), act.unsqueeze(-1)).squeeze(-1)

    def _host_experts(self, layer: int, experts: list[int], counts: list[int], rows: torch.Tensor) -> torch.Tensor:
        spans, at = [], 0
        for expert in experts:
            spans.append((expert, at, at + counts[expert]))
            at += counts[expert]
        if len(experts) == 1:
            return self._cpu_expert(layer, experts[0], rows)
        futures = [self.pool.submit(self._cpu_expert, layer, e, rows[a:b]) for e, a, b in spans[1:]]
        first = self._cpu_expert(layer, spans[0][0], rows[spans[0][1] : spans[0][2]])
        return torch.cat([first] + [f.result() for f in futures])

    # ------------------------------------------------------------------ reporting

    def expert_stats(self) -> dict:
        gpu = sum(len(bank.ids) for bank in self.banks if bank is not None)
        total = self.layers * self.experts
        layers = []
        direct = self.decode_counts.sum(dim=1).tolist()
        host_reads = self.host_reads.tolist()
        for index, (stats, bank) in enumerate(zip(self.stats, self.banks)):
            row = asdict(stats)
            row["cpu_expert_ms"] = round(row.pop("cpu_expert_s") * 1e3, 3)
            pairs, hot = stats.pairs + direct[index], stats.hot_pairs + direct[index] - host_reads[index]
            row.update(layer=index, gpu_experts=len(bank.ids), hit_rate=hot / pairs if pairs else None,
                       zero_copy_pairs=direct[index], host_read_pairs=host_reads[index])
            layers.append(row)
        return {
            "gpu_experts": gpu,
            "ram_experts": total - gpu,
            "placement": self.policy.mode,
            "replans": self.policy.replans,
            "pcie_gb_s": round(self.pcie_bytes_s / 1e9, 3),
            "cpu_expert_ms": round(self.cpu_expert_s * 1e3, 3),
            "bytes_copied": sum(s.bytes_copied for s in self.stats),
            "bytes_skipped": sum(s.bytes_skipped for s in self.stats),
            "skipped_transfers": sum(s.skipped_transfers for s in self.stats),
            "placement_bytes": self.placement_bytes,
            "zero_copy": self.zero_copy,
            "host_read_bytes": sum(host_reads) * self.host_expert_bytes,
            "layers": layers,
        }

    def memory_plan(self) -> dict[str, dict[str, int]]:
        gpu = sum(len(bank.ids) for bank in self.banks if bank is not None)
        return {
            "routed experts (device banks)": {"vram_bytes": gpu * self.device_expert_bytes, "experts": gpu},
            "expert staging (2 banks)": {"vram_bytes": self.staging_bytes},
            "routed experts (host RAM, pinned)": {
                "ram_bytes": self.host_expert_bytes * self.layers * self.experts,
                "experts": self.layers * self.experts, "huge_pages": int(self.arena.huge_pages),
                "pinned": int(self.pinned.enabled)},
        }

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.pinned.close()
