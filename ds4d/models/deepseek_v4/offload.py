"""Routed experts split between device memory (hot) and pinned host RAM (cold).

Cold routed experts keep their stored form (MXFP4 / FP8 bytes with scales, or
model-dtype values) in host RAM slots (``ds4d.cuda.host_memory.HostSlots``:
anonymous memory, huge pages when the buddy allocator has them, page-locked in
parallel).  The device holds a bank per layer for the experts the placement
policy (``placement.py``) calls hot, plus two staging banks of
``stage_experts`` experts each.  When the device banks hold the stored form
(native MXFP4, float experts) a hot expert has no host copy, so device and host
together hold each expert once; decoded banks keep every host copy.  The
experts are adopted layer by layer as the checkpoint is read
(:meth:`ExpertOffload.adopt`).  One MoE call:

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
stay keep their slots' contents, new ones are copied in (freeing their host
slots), leaving ones are copied out to free host slots, and the step runs on
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
    HostSlots,
    PinnedRegistry,
    host_pointers_usable,
    huge_pages_fit,
    mem_available_bytes,
)
from ds4d.models.deepseek_v4.config import DeepseekV4Config
from ds4d.models.deepseek_v4.moe import _swiglu, combine_sorted, expert_ffn, route, tally_routing
from ds4d.models.deepseek_v4.placement import PlacementPolicy, capacity_for_budget
from ds4d.models.deepseek_v4.quant import dequant_fp8_block, dequant_mxfp4
from ds4d.models.deepseek_v4.stored import Mxfp4Addresses, Mxfp4Matrices
from ds4d.models.deepseek_v4.weights import ExpertBank, ModelWeights, MoEWeights

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
    gather_cold: bool = True
    """Zero-copy decode: copy the rows' cold experts into device scratch with one kernel (large
    reads over the link), then run the GEMV on device memory; False: the GEMV reads them in place."""
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
    """Owns the routed experts of every layer: host copies, device banks, staging, statistics.

    Built whole from ``weights`` (every layer's experts already read), or layer
    by layer while the checkpoint is read: ``ExpertOffload(None, cfg, ...)``,
    then :meth:`adopt` per layer (``read_weights(expert_sink=...)``) and
    :meth:`finish`, so neither the device nor the host ever holds every expert
    at once.  When the device banks keep the stored form (``native`` MXFP4, or
    ``float`` experts) the host keeps only the cold experts: promoting one frees
    its host slot, demoting one copies the device bytes back into a free slot.
    Banks of decoded values cannot give the stored bytes back, so with those
    every expert keeps its host copy (``keeps_all``)."""

    def __init__(
        self, weights: ModelWeights | None, cfg: DeepseekV4Config, *, device: str | torch.device, dtype: torch.dtype,
        options: OffloadOptions, mem_available=mem_available_bytes,
    ) -> None:
        self.cfg, self.options, self.dtype = cfg, options, dtype
        self.device = torch.device(device)
        if options.decode_cold not in DECODE_COLD:
            raise ValueError(f"decode_cold {options.decode_cold!r}: use one of {', '.join(DECODE_COLD)}")
        self.layers = len(weights.layers) if weights is not None else cfg.num_hidden_layers
        self.experts = cfg.n_routed_experts
        self._mem_available = mem_available
        self.pinned = PinnedRegistry(options.pin_threads)
        self.slots: HostSlots | None = None
        """Page-locked host slots, one expert's stored parts each (set up by the first :meth:`adopt`)."""
        self.host_slot: list[list[tuple[int, int] | None]] = [[None] * self.experts for _ in range(self.layers)]
        self.banks: list[_Bank | None] = [None] * self.layers
        self.stats = [LayerStats() for _ in range(self.layers)]
        self.placement_bytes = 0
        """Bytes copied host -> device by placement (adoption and changes)."""
        self.demoted_bytes = 0
        """Bytes copied device -> host by placement changes (experts turning cold)."""
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
        self.stages: list[_Stage] = []
        if weights is not None:
            for layer, layer_weights in enumerate(weights.layers):
                self.adopt(layer, layer_weights.ffn.experts)
            self.finish()

    # ------------------------------------------------------------------ setup

    def _setup(self, bank: ExpertBank) -> None:
        """Sizes, placement policy and the host slots, from the first layer's stored experts."""
        options, cfg = self.options, self.cfg
        self.kind, self.block = bank.kind, bank.block
        self.native = options.native and self.kind == "mxfp4" and quant_matmul.available()
        self.keeps_all = not (self.native or self.kind == "float")
        """Every expert keeps its host copy, hot ones too: the device banks hold decoded values."""
        inter, hidden = cfg.moe_intermediate_size, cfg.hidden_size
        element = torch.empty(0, dtype=self.dtype).element_size()
        template = {name: t[0] for name, t in _stored_parts(bank, self.native).items()}
        self.host_expert_bytes = sum(t.numel() * t.element_size() for t in template.values())
        self.device_expert_bytes = self.host_expert_bytes if self.native else 3 * inter * hidden * element
        self.slots = HostSlots(template, HostArena(), self.pinned)
        self.zero_copy = self.native and (self.device.type == "cpu" or (
            self.pinned.enabled and host_pointers_usable(self.device)))
        """Decode steps of up to ``moe_gemv.MAX_ROWS`` (token, expert) rows read cold experts straight
        from host memory (kernels on the device, through per-expert address tables): no host read,
        no copy, so those steps are captured in CUDA graphs like the all-on-device ones."""
        self.gather = self.zero_copy and options.gather_cold
        """Zero-copy decode first copies its rows' cold experts into device scratch with one kernel."""
        stage_n = max(1, options.stage_experts)
        quantised_stage = self.host_expert_bytes if self.kind != "float" and not self.native else 0
        self.staging_bytes = 2 * stage_n * (self.device_expert_bytes + quantised_stage)
        if self.gather:
            self.staging_bytes += moe_gemv.MAX_ROWS * self.slots.slot_bytes
        total = self.layers * self.experts
        capacity = capacity_for_budget(options.vram_bytes, self.device_expert_bytes, self.staging_bytes, total)
        calibration = options.calibration
        if calibration is not None and (len(calibration) != self.layers
                                        or any(len(row) != self.experts for row in calibration)):
            raise ValueError(f"expert calibration counts are {len(calibration)} layers x "
                             f"{len(calibration[0]) if calibration else 0} experts; this model has "
                             f"{self.layers} x {self.experts}")
        self.policy = PlacementPolicy(self.layers, self.experts, capacity, mode=options.placement,
                                      replan_tokens=options.replan_tokens, calibration=calibration)
        self._initial = self.policy.initial()
        host_count = total if self.keeps_all else total - capacity + stage_n  # a spare bank for moves
        new_bytes = host_count * self.slots.slot_bytes
        available = self._mem_available()
        if options.mem_watermark_bytes and available and available - new_bytes < options.mem_watermark_bytes:
            raise MemoryError(
                f"routed experts need {new_bytes / 2**30:.1f} GiB more host RAM, leaving "
                f"{(available - new_bytes) / 2**30:.1f} GiB, under the {options.mem_watermark_bytes / 2**30:.1f} GiB "
                "watermark: raise expert_vram_gib or lower mem_watermark_gib")
        self.slots.arena.huge_pages = huge_pages_fit(new_bytes)
        self.slots.grow(host_count)

    def adopt(self, layer: int, bank: ExpertBank) -> ExpertBank:
        """Take over ``layer``'s stored experts (on any device): the hot ones into a device bank, the
        cold ones (every one with ``keeps_all``) into host slots.  ``bank`` is emptied (its tensors can
        go) and returned, so this is ``read_weights``' ``expert_sink``."""
        if self.slots is None:
            self._setup(bank)
        stored = _stored_parts(bank, self.native)
        bank.weights, bank.scales, bank.gate_up, bank.native, bank._dense_cache = {}, {}, None, None, None
        hot = sorted(self._initial[layer])
        self.banks[layer] = self._new_bank(hot, lambda expert: {n: t[expert] for n, t in stored.items()})
        for expert in range(self.experts):
            if self.keeps_all or self.banks[layer].slot_of[expert] < 0:
                slot = self.slots.take()
                for name, dst in self.slots.parts(slot).items():
                    dst.copy_(stored[name][expert])
                self.host_slot[layer][expert] = slot
        if self.zero_copy:
            self._address_table(layer)
        return bank

    def finish(self) -> None:
        """After the last :meth:`adopt`: staging banks, the copy stream, and the bandwidths measured."""
        missing = [layer for layer, bank in enumerate(self.banks) if bank is None]
        if missing:
            raise ValueError(f"expert offload: layers {missing} were never adopted")
        self.stages = [self._stage(max(1, self.options.stage_experts)) for _ in range(2)]
        if self.gather:  # scratch for gathered cold experts (``_gathered``), one slot per decode row
            words = self.slots.slot_bytes // 8
            self._scratch = torch.empty((moe_gemv.MAX_ROWS, words), dtype=torch.int64, device=self.device)
            base = self._scratch.data_ptr() + torch.arange(moe_gemv.MAX_ROWS, dtype=torch.int64) * self.slots.slot_bytes
            offsets = {name: at for name, _, _, at, _ in self.slots.layout}
            parts = torch.tensor([offsets[name] for name in ("gu", "sgu", "w2", "s2")], dtype=torch.int64)
            if offsets["gu"] != 0:
                raise ValueError("host slots must start with the gate/up bytes")
            self._scratch_at = (base.unsqueeze(0) + parts.unsqueeze(1)).to(self.device)
            self._row_ids = torch.arange(moe_gemv.MAX_ROWS, dtype=torch.int64, device=self.device)
        self.copier = CopyStream(self.device)
        self.pool = ThreadPoolExecutor(max(1, self.options.cpu_threads), thread_name_prefix="ds4d-expert")
        self.pcie_bytes_s, self.cpu_expert_s = self._measure()

    def _stage(self, n: int) -> _Stage:
        inter, hidden = self.cfg.moe_intermediate_size, self.cfg.hidden_size
        if self.native:  # copies land in the stacked MXFP4 matrices the kernels read
            gate_up, down = self._native_bank(n)
            packed = {"gu": gate_up.packed, "sgu": gate_up.scales, "w2": down.packed, "s2": down.scales}
            return _Stage(packed, gate_up, down)
        packed = {name: torch.empty((n, *shape), dtype=dtype, device=self.device)
                  for name, shape, dtype, _, _ in self.slots.layout}
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

    def _new_bank(self, ids: list[int], parts_of, old: _Bank | None = None) -> _Bank:
        """A device bank for ``ids``: slots of experts ``old`` holds are copied on the device, the others
        filled from ``parts_of(expert)`` (stored parts, on any device)."""
        inter, hidden = self.cfg.moe_intermediate_size, self.cfg.hidden_size
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
            parts = {n: t.to(self.device, non_blocking=True) for n, t in parts_of(expert).items()}
            if self.native:
                self._fill_native(gate_up, down, slot, parts)
            else:
                dense_gate_up, dense_down = _decode(self.kind, parts, self.dtype, self.block)
                gate_up[slot].copy_(dense_gate_up)
                down[slot].copy_(dense_down)
            self.placement_bytes += self.host_expert_bytes
        return _Bank(ids, slot_of, gate_up, down)

    @staticmethod
    def _fill_native(gate_up: Mxfp4Matrices, down: Mxfp4Matrices, slot: int, parts: dict) -> None:
        gate_up.packed[slot].copy_(parts["gu"])
        gate_up.scales[slot].copy_(parts["sgu"])
        down.packed[slot].copy_(parts["w2"])
        down.scales[slot].copy_(parts["s2"])

    def _demote(self, layer: int, expert: int, bank: _Bank) -> None:
        """Copy a hot expert's device bytes (the stored form) into a free host slot."""
        slot, at = self.slots.take(), bank.slot_of[expert]
        host = self.slots.parts(slot)
        if self.native:
            sources = {"gu": bank.gate_up.packed, "sgu": bank.gate_up.scales, "w2": bank.down.packed,
                       "s2": bank.down.scales}
        else:
            sources = {"gate_up": bank.gate_up, "w2": bank.down}
        for name, source in sources.items():
            host[name].copy_(source[at])
        self.host_slot[layer][expert] = slot
        self.demoted_bytes += self.host_expert_bytes

    def _address_table(self, layer: int) -> None:
        """Per expert of ``layer``, where its four stored parts are: the device bank slot when hot, the
        host copy otherwise.  Written in place, so captured graphs read the current placement."""
        bank = self.banks[layer]
        rows = []
        for name, matrices in (("gu", bank.gate_up.packed), ("sgu", bank.gate_up.scales), ("w2", bank.down.packed),
                               ("s2", bank.down.scales)):
            row = []
            for expert, slot in enumerate(bank.slot_of):
                if slot >= 0:
                    row.append(matrices.data_ptr() + slot * matrices.stride(0))
                else:
                    row.append(self.slots.parts(self.host_slot[layer][expert])[name].data_ptr())
            rows.append(row)
        if any(address % 16 for row in rows for address in row):  # the kernels are told every address is
            raise ValueError("expert parts must sit at 16-byte aligned addresses")  # (``_addresses``)
        table = torch.tensor(rows, dtype=torch.int64)
        self.on_host[layer].copy_(torch.tensor([int(slot < 0) for slot in bank.slot_of]))
        if self.tables[layer] is None:
            self.tables[layer] = table = table.to(self.device)
            self.addressed[layer] = self._addresses(table)
        else:
            self.tables[layer].copy_(table)

    def _expert_parts(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        """A cold expert's stored parts in its host slot (views)."""
        return self.slots.parts(self.host_slot[layer][expert])

    def _measure(self) -> tuple[float, float]:
        """(host -> device bytes/s for one expert, seconds for one expert on one row on the host)."""
        stage = self.stages[0]
        # any slots will do for timing; they are all in the first chunk until a placement change grows it
        sources = [self.slots.parts((0, row)) for row in range(min(_slots(stage.gate_up), self.slots.slots))]
        seconds = []
        for _ in range(4):  # a whole staging bank per copy; the first one warms up
            began = time.perf_counter()
            self._issue(sources, stage)
            self.copier.synchronize()
            seconds.append(time.perf_counter() - began)
        pcie = len(sources) * self.host_expert_bytes / max(sorted(seconds[1:])[1], 1e-9)
        rows = torch.randn(1, self.cfg.hidden_size, dtype=self.dtype)
        self._cpu_expert(sources[0], rows)
        began = time.perf_counter()
        for _ in range(3):
            self._cpu_expert(sources[0], rows)
        return pcie, (time.perf_counter() - began) / 3

    # ------------------------------------------------------------------ placement

    def hot_experts(self) -> list[list[int]]:
        return [list(bank.ids) if bank is not None else [] for bank in self.banks]

    @property
    def stored_bytes(self) -> int:
        """Every routed expert once, as stored (what the emptied banks no longer count)."""
        return self.layers * self.experts * self.host_expert_bytes

    def host_experts(self) -> int:
        """Experts with a copy in host RAM (each holds one slot)."""
        return self.slots.slots - len(self.slots.free)

    def set_placement(self, hot: list[list[int]]) -> None:
        """Make ``hot[layer]`` the device-resident experts of each layer (between steps).

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
            new = self._new_bank(ids, lambda expert, layer=layer: self._expert_parts(layer, expert), old)
            if not self.keeps_all:
                for expert in ids:
                    if old.slot_of[expert] < 0:
                        self.slots.give(self.host_slot[layer][expert])
                        self.host_slot[layer][expert] = None
                for expert in old.ids:
                    if new.slot_of[expert] < 0:
                        self._demote(layer, expert, old)
            self.banks[layer] = new
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
        if self.gather:
            gate_up, down, expert_of_row = self._gathered(layer, expert_of_row)
        out = expert_ffn(x[order // k], gate_up, down, None, expert_of_row, limit, step_rows=tokens * k)
        return combine_sorted(out, order, expert_weights, tokens, k, x.dtype)

    def _gathered(self, layer: int, experts: torch.Tensor) -> tuple[Mxfp4Addresses, Mxfp4Addresses, torch.Tensor]:
        """The cold experts of these rows copied whole into device scratch (one kernel, large reads
        over the link); address tables per row: the scratch copy for cold rows, the bank for hot
        ones.  Row ``r`` then uses entry ``r``: the same bytes as in place, so the same results."""
        rows = experts.shape[0]
        table = self.tables[layer]
        on_host = self.on_host[layer]
        quant_matmul.gather_cold(table[0], on_host, experts, self._scratch)
        scratch = self._scratch_at[:, :rows]  # [4, rows]: each part's address in row r's scratch
        cold = on_host[experts].bool().unsqueeze(0)
        return (*self._addresses(torch.where(cold, scratch, table[:, experts])), self._row_ids[:rows])

    def _addresses(self, table: torch.Tensor) -> tuple[Mxfp4Addresses, Mxfp4Addresses]:
        """Gate/up and down matrices found through ``table`` (rows: gate/up bytes, its scales, down
        bytes, its scales; one column per entry)."""
        inter, hidden = self.cfg.moe_intermediate_size, self.cfg.hidden_size
        # aligned: checked for the tables (``_address_table``); host slots and scratch rows start at
        # multiples of 256 bytes (``SlotArena``)
        return (Mxfp4Addresses(table[0], table[1], 2 * inter, hidden, aligned=True),
                Mxfp4Addresses(table[2], table[3], hidden, inter, aligned=True))

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

    def _issue(self, sources: list[dict[str, torch.Tensor]], stage: _Stage) -> None:
        """Copy experts' stored parts (host slots) into ``stage`` on the copy stream."""
        self.copier.wait(stage.free)
        for slot, parts in enumerate(sources):
            for name, tensor in parts.items():
                self.copier.copy(stage.packed[name][slot], tensor)
        stage.ready = self.copier.record()

    def _issue_experts(self, layer: int, experts: list[int], stage: _Stage) -> None:
        self._issue([self._expert_parts(layer, expert) for expert in experts], stage)
        stage.experts = experts
        stats = self.stats[layer]
        stats.copied_experts += len(experts)
        stats.bytes_copied += len(experts) * self.host_expert_bytes

    def _staged(self, layer, copied, counts, rows, slots, limit, step_rows) -> list[torch.Tensor]:
        """Cold experts through the double-buffered staging banks, copy of batch j + 1 under compute of j."""
        size = _slots(self.stages[0].gate_up)
        batches = [copied[at : at + size] for at in range(0, len(copied), size)]
        out, row = [], 0
        if batches:
            self._issue_experts(layer, batches[0], self.stages[0])
        for index, batch in enumerate(batches):
            if index + 1 < len(batches):
                self._issue_experts(layer, batches[index + 1], self.stages[(index + 1) % 2])
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

    def _cpu_expert(self, parts: dict[str, torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
        """One expert (its stored parts in host memory) on ``rows``, on the host."""
        gate_up, down = _decode(self.kind, parts, self.dtype, self.block)
        if rows.shape[0] == 1:  # as moe._grouped_linear: a lone bmm product rounds differently
            return self._cpu_expert(parts, rows.expand(2, -1))[:1]
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
            return self._cpu_expert(self._expert_parts(layer, experts[0]), rows)
        futures = [self.pool.submit(self._cpu_expert, self._expert_parts(layer, e), rows[a:b]) for e, a, b in spans[1:]]
        first = self._cpu_expert(self._expert_parts(layer, spans[0][0]), rows[spans[0][1] : spans[0][2]])
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
            "demoted_bytes": self.demoted_bytes,
            "host_experts": self.host_experts(),
            "host_ram_bytes": self.slots.bytes,
            "vram_bytes": gpu * self.device_expert_bytes + self.staging_bytes,
            "zero_copy": self.zero_copy,
            "host_read_bytes": sum(host_reads) * self.host_expert_bytes,
            "layers": layers,
        }

    def memory_plan(self) -> dict[str, dict[str, int]]:
        gpu = sum(len(bank.ids) for bank in self.banks if bank is not None)
        return {
            "routed experts (device banks)": {"vram_bytes": gpu * self.device_expert_bytes, "experts": gpu},
            "expert staging (2 banks, decode gather scratch)": {"vram_bytes": self.staging_bytes},
            "routed experts (host RAM, pinned)": {
                "ram_bytes": self.slots.bytes, "experts": self.host_experts(), "slots": self.slots.slots,
                "huge_pages": int(self.slots.arena.huge_pages),
                "pinned": int(self.pinned.enabled)},
        }

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.pinned.close()
