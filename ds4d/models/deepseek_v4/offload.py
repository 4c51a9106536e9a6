"""Routed experts split between device memory (hot) and pinned host RAM (cold).

Cold routed experts keep their stored form (MXFP4 / FP8 bytes with scales, a
GGUF file's blocks, or model-dtype values) in host RAM slots (``ds4d.cuda.host_memory.HostSlots``:
anonymous memory, huge pages when the buddy allocator has them, page-locked in
parallel).  The device holds a bank per layer for the experts the placement
policy (``placement.py``) calls hot, plus two staging banks of
``stage_experts`` experts each.  When the device banks hold the stored form
(native MXFP4, GGUF blocks, float experts) a hot expert has no host copy, so device and host
together hold each expert once; decoded banks keep every host copy.  The
experts are adopted layer by layer as the checkpoint is read
(:meth:`ExpertOffload.adopt`).  One MoE call (``offload_compute``) reads the
routing counts back once per layer, never copies an expert with zero tokens,
runs the hot experts as one grouped matmul over the device bank, and streams
the used cold ones through the two staging banks on a copy stream (batch
``j + 1`` copying while batch ``j`` computes); quantised ones are decoded on the
device after the copy, except with ``native`` MXFP4 banks, where hot banks and
staging hold the stored bytes and the ``quant_matmul`` kernels read them as
copied (a quarter of the bf16 bytes per device expert), and with GGUF blocks,
which the ``gguf_matmul`` kernels read as copied.  A GGUF file's layers may hold
their experts in different forms (llama-quantize's mixes change a matrix's type
from layer to layer): each form has host slots and staging banks of its own.  In decode steps, cold
experts with at most ``cpu_max_rows`` tokens may run on host threads instead,
when the copy bandwidth and the CPU expert time measured at start say that is
cheaper (``decode_cold``: ``auto`` | ``cpu`` | ``copy``).

Small decode steps with native MXFP4 and host memory the device can address
read every expert where it sits instead, with no host read, so CUDA graphs can
capture them (``offload_zero_copy``).

The rows of each (token, expert) pair are computed by the same per-row
arithmetic wherever the expert's weights sit (``moe.expert_ffn``) and summed by
the same code (``moe.combine_sorted``), so device and staged experts give the
all-on-device result bit for bit; host-computed experts differ only where the
host's matmul rounds differently from the device's (never on a CPU "device").

Placement moves between steps (:meth:`ExpertOffload.begin_step`): experts that
stay keep their slots' contents, new ones are copied in (freeing their host
slots), leaving ones are copied out to free host slots, and the step runs on
the new banks; nothing else waits (``offload_residency``).  The machinery is
device-agnostic: with a CPU "device" the copies are plain and the events are
``None``.

This module holds the options and :class:`ExpertOffload`, which sizes the
offload and wires its parts together: ``offload_parts`` (the stored form and
the device tensors that hold it), ``offload_residency`` (device banks, host
slots, placement moves), ``offload_compute`` and ``offload_zero_copy`` (the
two compute paths) and ``offload_stats`` (counters and reports).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ds4d.cuda import gguf_matmul, moe_gemv, quant_matmul
from ds4d.cuda.host_memory import (
    HostArena,
    HostSlots,
    PinnedRegistry,
    host_pointers_usable,
    huge_pages_fit,
    mem_available_bytes,
)
from ds4d.models.deepseek_v4.config import DeepseekV4Config
from ds4d.models.deepseek_v4.moe import _swiglu, route, tally_routing
from ds4d.models.deepseek_v4.offload_compute import StagedCompute
from ds4d.models.deepseek_v4.offload_parts import DeviceBank, ExpertForm, gguf_form, gguf_int8, stored_parts
from ds4d.models.deepseek_v4.offload_residency import ExpertResidency
from ds4d.models.deepseek_v4.offload_stats import LayerStats, OffloadSizes, expert_report, memory_plan
from ds4d.models.deepseek_v4.offload_zero_copy import ZeroCopyExperts
from ds4d.models.deepseek_v4.placement import PlacementPolicy, capacity_for_budget
from ds4d.models.deepseek_v4.weights import ExpertBank, ModelWeights, MoEWeights

__all__ = ["DECODE_COLD", "ExpertOffload", "LayerStats", "OffloadOptions", "counted_rows"]

DECODE_COLD = ("auto", "cpu", "copy")

log = logging.getLogger("ds4d.models")


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
    fetch_ahead: int = 0
    """Zero-copy decode with ``gather_cold``: steps of up to this many (token, expert) rows fetch each layer's
    cold experts ahead, as predicted by its router on the feed-forward input of the layer before (hash layers:
    their table), on a side stream beside the compute (``ZeroCopyExperts.fetch_ahead``); 0: never.  Costs two
    scratch buffers of this many experts on the device."""
    native: bool = False
    """MXFP4 experts stay MXFP4 on the device too (hot banks and staging; ``quant_matmul`` kernels):
    about a quarter of the bf16 bytes per device expert and no decode after a copy."""
    pair_weighted: bool = False
    """The routing weight of each (token, expert) pair multiplies its float32 SwiGLU before ``w2``, and
    :meth:`ExpertOffload.routed` returns float32 (DeepSeek-V4.1's arithmetic; ``ExpertForm.pair_weighted``)."""


class ExpertOffload:
    """Owns the routed experts of every layer: host copies, device banks, staging, statistics.

    Built whole from ``weights`` (every layer's experts already read), or layer
    by layer while the checkpoint is read: ``ExpertOffload(None, cfg, ...)``,
    then :meth:`adopt` per layer (``read_weights(expert_sink=...)``) and
    :meth:`finish`, so neither the device nor the host ever holds every expert
    at once.  When the device banks keep the stored form (``native`` MXFP4, GGUF blocks or
    ``float`` experts) the host keeps only the cold experts: promoting one frees
    its host slot, demoting one copies the device bytes back into a free slot.
    Banks of decoded values cannot give the stored bytes back, so with those
    every expert keeps its host copy (``keeps_all``)."""

    def __init__(
        self, weights: ModelWeights | None, cfg: DeepseekV4Config, *, device: str | torch.device, dtype: torch.dtype,
        options: OffloadOptions, mem_available=mem_available_bytes, layer_expert_bytes: list[int] | None = None,
    ) -> None:
        self.cfg, self.options, self.dtype = cfg, options, dtype
        self.layer_expert_bytes = layer_expert_bytes
        """Each layer's bytes per routed expert as stored, where the reader knows them before the
        experts are read (a GGUF file's types may change from layer to layer): the budget then counts
        the largest; None: every layer as the first."""
        self.device = torch.device(device)
        if options.decode_cold not in DECODE_COLD:
            raise ValueError(f"decode_cold {options.decode_cold!r}: use one of {', '.join(DECODE_COLD)}")
        self.layers = len(weights.layers) if weights is not None else cfg.num_hidden_layers
        self.experts = cfg.n_routed_experts
        self._mem_available = mem_available
        self.pinned = PinnedRegistry(options.pin_threads)
        self.residency = ExpertResidency(self.layers, self.experts)
        self.host_slot = self.residency.host_slot
        """Per layer and expert: its host slot, None when it has no host copy."""
        self.banks: list[DeviceBank | None] = self.residency.banks
        self.stats = [LayerStats() for _ in range(self.layers)]
        self.zero_copy_experts = ZeroCopyExperts(self.layers, self.experts, cfg.moe_intermediate_size,
                                                 cfg.hidden_size, self.device)
        self.row_valid: torch.Tensor | None = None
        """Set by the model around a padded decode step (``counted_rows``): True for the real rows;
        the bucket's padding rows are computed but not counted."""
        self.staged: StagedCompute | None = None
        if weights is not None:
            for layer, layer_weights in enumerate(weights.layers):
                self.adopt(layer, layer_weights.ffn.experts)
            self.finish()

    @property
    def gather(self) -> bool:
        """Zero-copy decode first copies its rows' cold experts into device scratch with one kernel (False:
        its GEMVs read them in place; a benchmark may switch between the two once the scratch exists)."""
        return self.zero_copy_experts.gather

    @gather.setter
    def gather(self, on: bool) -> None:
        self.zero_copy_experts.gather = on

    @property
    def slots(self) -> HostSlots | None:
        """Page-locked host slots, one expert's stored parts each (set up by the first :meth:`adopt`)."""
        return self.residency.slots

    @property
    def placement_bytes(self) -> int:
        """Bytes copied host -> device by placement (adoption and changes)."""
        return self.residency.placement_bytes

    @property
    def demoted_bytes(self) -> int:
        """Bytes copied device -> host by placement changes (experts turning cold)."""
        return self.residency.demoted_bytes

    @property
    def pcie_bytes_s(self) -> float:
        """Host -> device bytes/s for staged experts, measured by :meth:`finish`."""
        return self.staged.pcie_bytes_s

    @property
    def cpu_expert_s(self) -> float:
        """Seconds for one expert on one row on the host, measured by :meth:`finish`."""
        return self.staged.cpu_expert_s

    # ------------------------------------------------------------------ setup

    def _form_of(self, bank: ExpertBank) -> tuple[ExpertForm, dict[str, torch.Tensor]]:
        """A layer's form and its experts' stored parts (stacked over experts)."""
        cfg = self.cfg
        native = self.options.native and bank.kind == "mxfp4" and quant_matmul.available()
        stored = stored_parts(bank, native)
        host_bytes = sum(t[0].numel() * t.element_size() for t in stored.values())
        form = ExpertForm(bank.kind, bank.block, native, self.dtype, self.device, self.experts,
                          cfg.moe_intermediate_size, cfg.hidden_size, host_bytes, self.options.pair_weighted,
                          gguf_form(bank) if bank.kind == "gguf" else (None, None), gguf_int8(bank))
        return form, stored

    def _setup(self, form: ExpertForm, stored: dict[str, torch.Tensor]) -> None:
        """Sizes, placement policy and the first form's host slots, from the first layer's experts (and,
        where the reader knows them ahead, every layer's bytes per expert: ``layer_expert_bytes``)."""
        options, cfg = self.options, self.cfg
        self.form, self.kind, self.block, self.native = form, form.kind, form.block, form.native
        self.keeps_all = form.decodes
        """Every expert keeps its host copy, hot ones too: the device banks hold decoded values."""
        inter, hidden = cfg.moe_intermediate_size, cfg.hidden_size
        element = torch.empty(0, dtype=self.dtype).element_size()
        self.host_expert_bytes = form.host_expert_bytes
        """The first layer's bytes per expert as stored (every layer's, unless a GGUF file's types differ)."""
        hints = self.layer_expert_bytes or [form.host_expert_bytes] * self.layers
        dense = 3 * inter * hidden * element
        self.device_expert_bytes = dense if form.decodes else max(hints)
        """Device bytes per expert in the budget: the largest layer's."""
        slots = self._host_slots(stored, HostArena())
        self.residency.hold(form, slots)
        addressable = self.native or (form.kind == "gguf" and None not in form.gguf and gguf_matmul.available()
                                      and len(set(hints)) == 1 and _aligned_matrices(form, inter, hidden))
        self.zero_copy = addressable and (self.device.type == "cpu" or (
            self.pinned.enabled and host_pointers_usable(self.device)))
        """Decode steps of up to ``moe_gemv.MAX_ROWS`` (token, expert) rows read cold experts straight
        from host memory (kernels on the device, through per-expert address tables): no host read,
        no copy, so those steps are captured in CUDA graphs like the all-on-device ones.  MXFP4 as
        stored, or GGUF blocks (gate/up and down both in blocks, every layer in one form)."""
        self.gather = self.zero_copy and options.gather_cold
        stage_n = max(1, options.stage_experts)
        self.staging_bytes = sum(2 * stage_n * ((dense + size) if form.decodes else size) for size in set(hints))
        """Two staging banks per form (forms told apart by their bytes per expert, where known ahead)."""
        if self.gather:
            self.staging_bytes += (moe_gemv.MAX_ROWS + 2 * options.fetch_ahead) * slots.slot_bytes
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
        average = sum(hints) / len(hints)
        host_count = total if self.keeps_all else total - capacity + stage_n  # a spare bank for moves
        new_bytes = int(host_count * average)
        available = self._mem_available()
        if options.mem_watermark_bytes and available and available - new_bytes < options.mem_watermark_bytes:
            raise MemoryError(
                f"routed experts need {new_bytes / 2**30:.1f} GiB more host RAM, leaving "
                f"{(available - new_bytes) / 2**30:.1f} GiB, under the {options.mem_watermark_bytes / 2**30:.1f} GiB "
                "watermark: raise expert_vram_gib or lower mem_watermark_gib")
        slots.arena.huge_pages = huge_pages_fit(new_bytes)
        like_first = sum(size == form.host_expert_bytes for size in hints)
        if like_first == self.layers:  # one chunk for every layer's host slots
            slots.grow(host_count)
        # otherwise each form's slots grow by a chunk per layer as the layers are adopted

    def adopt(self, layer: int, bank: ExpertBank) -> ExpertBank:
        """Take over ``layer``'s stored experts (on any device): the hot ones into a device bank, the
        cold ones (every one with ``keeps_all``) into host slots.  ``bank`` is emptied (its tensors can
        go) and returned, so this is ``read_weights``' ``expert_sink``."""
        form, stored = self._form_of(bank)
        if self.slots is None:
            self._setup(form, stored)
        elif form not in self.residency.pools:  # a GGUF file whose types change from layer to layer
            if self.zero_copy:  # the address tables and the gather scratch take one form
                log.info("expert offload: layer %d's experts are held as %s, the first layer's as %s: decode "
                         "steps read back the routing (no zero-copy decode)", layer, form.label, self.form.label)
                self.zero_copy = self.gather = False
            self.residency.hold(form, self._host_slots(stored, HostArena(huge_pages=self.slots.arena.huge_pages)))
        bank.weights, bank.scales, bank.gate_up, bank.native, bank.gguf, bank._dense_cache = ({}, {}, None, None,
                                                                                              None, None)
        self.residency.adopt(layer, form, sorted(self._initial[layer]), stored)
        if self.zero_copy:
            self._write_table(layer)
        return bank

    def _host_slots(self, stored: dict[str, torch.Tensor], arena: HostArena) -> HostSlots:
        """Host slots shaped for one expert of ``stored`` (every expert's parts, stacked)."""
        return HostSlots({name: t[0] for name, t in stored.items()}, arena, self.pinned)

    def finish(self) -> None:
        """After the last :meth:`adopt`: staging banks, the copy stream, and the bandwidths measured."""
        missing = [layer for layer, bank in enumerate(self.banks) if bank is None]
        if missing:
            raise ValueError(f"expert offload: layers {missing} were never adopted")
        if self.gather:  # scratch for gathered cold experts, one slot per decode row
            self.zero_copy_experts.prepare_gather(self.slots)
            if self.options.fetch_ahead:
                self.zero_copy_experts.prepare_ahead(self.slots, self.options.fetch_ahead)
        options = self.options
        self.staged = StagedCompute(self.cfg, self.residency, self.stats, self.policy, options.stage_experts,
                                    decode_cold=options.decode_cold, cpu_max_rows=options.cpu_max_rows,
                                    cpu_threads=options.cpu_threads)
        for form in self.residency.pools:  # every form's staging banks now, inside the plan
            self.staged.stages_of(form)
        self.staged.measure()

    @property
    def forms_label(self) -> str:
        """The layers' forms: ``ExpertForm.label``, with the layers of each where they differ."""
        forms = self.residency.forms
        if len(set(forms)) == 1:
            return forms[0].label
        return "; ".join(f"{form.label} (layers {', '.join(str(i) for i, f in enumerate(forms) if f == form)})"
                         for form in dict.fromkeys(forms))

    def _write_table(self, layer: int) -> None:
        """The zero-copy address table of ``layer`` for its current bank and host slots."""
        self.zero_copy_experts.write_table(layer, self.residency.forms[layer], self.banks[layer],
                                           lambda expert: self.residency.expert_parts(layer, expert))

    # ------------------------------------------------------------------ placement

    def hot_experts(self) -> list[list[int]]:
        return self.residency.hot_experts()

    @property
    def stored_bytes(self) -> int:
        """Every routed expert once, as stored (what the emptied banks no longer count)."""
        return self.residency.stored_bytes()

    def host_experts(self) -> int:
        """Experts with a copy in host RAM (each holds one slot)."""
        return self.residency.host_experts()

    def set_placement(self, hot: list[list[int]]) -> None:
        """Make ``hot[layer]`` the device-resident experts of each layer (between steps); see
        ``ExpertResidency.set_placement``.  Zero-copy address tables follow each moved layer."""
        self.residency.set_placement(hot, self._write_table if self.zero_copy else None)

    def begin_step(self) -> None:
        """Between steps: adopt a new placement when the online policy has one."""
        if self.zero_copy and self.policy.mode == "online":
            self.zero_copy_experts.observe(self.policy)
        if self.policy.due():
            proposal = self.policy.replan(self.hot_experts())
            if proposal is not None:
                self.set_placement(proposal)

    # ------------------------------------------------------------------ forward

    def moe_forward(
        self, layer: int, x: torch.Tensor, token_ids: torch.Tensor, weights: MoEWeights, cfg: DeepseekV4Config,
        *, decode: bool = False, tally: torch.Tensor | None = None, route_kernel: bool = False,
    ) -> torch.Tensor:
        """``moe.moe_forward(grouped=True)`` with this layer's routed experts wherever they sit (``route_kernel``:
        as there)."""
        expert_weights, indices = route(x, token_ids, weights, cfg, kernel=route_kernel)
        tally_routing(tally, indices)
        limit = cfg.swiglu_limit
        shared = _swiglu(x, weights.shared_w1, weights.shared_w3, weights.shared_w2, limit, w13=weights.shared_w13)
        return self.routed(layer, x, expert_weights, indices, limit=limit, decode=decode) + shared

    def fetch_ahead(self, layer: int, x: torch.Tensor, predict: Callable[[], torch.Tensor]) -> None:
        """In a decode step that reads experts where they sit and gathers the cold ones: start copying
        ``layer``'s cold experts among ``predict()``'s ``[rows, k]`` expert ids (computed from ``x``, say the
        layer's router on the input of the feed-forward before), before its own routing is known; nothing
        otherwise (``OffloadOptions.fetch_ahead``)."""
        rows = x.shape[0] * self.cfg.num_experts_per_tok
        if self.gather and rows <= self.options.fetch_ahead and self.capturable(x.shape[0]):
            self.zero_copy_experts.fetch_ahead(layer, x, predict)

    def routed(
        self, layer: int, x: torch.Tensor, expert_weights: torch.Tensor, indices: torch.Tensor, *, limit: float,
        decode: bool = False,
    ) -> torch.Tensor:
        """The routed experts' weighted output for routing already done (``indices`` into this offload's
        experts; a split model's rank passes its own experts' pairs and zero weights for the others):
        in ``x``'s dtype, or float32 with ``pair_weighted``."""
        if decode and self.capturable(indices.shape[0]):
            return self.zero_copy_experts.forward(layer, x, expert_weights, indices, limit, self.row_valid,
                                                  self.form.pair_weighted)
        return self.staged.routed(layer, x, expert_weights, indices, limit, decode)

    @contextmanager
    def layer_pass(self, layer: int):
        """While ``layer`` runs the blocks of one prefill step in turn (the model's layer-by-layer
        prefill): a cold expert copied for one block stays on the device for the next ones
        (``StagedCompute.begin_pass``)."""
        self.staged.begin_pass(layer)
        try:
            yield
        finally:
            self.staged.end_pass()

    def capturable(self, rows: int) -> bool:
        """Whether a decode step of ``rows`` sequences runs without host reads (zero-copy experts)."""
        return self.zero_copy and rows * self.cfg.num_experts_per_tok <= moe_gemv.MAX_ROWS

    # ------------------------------------------------------------------ reporting

    def expert_stats(self) -> dict:
        """Placement, traffic and hit rates (``offload_stats.expert_report``)."""
        sizes = OffloadSizes(self.host_expert_bytes, self.device_expert_bytes, self.staging_bytes, self.zero_copy,
                             self.policy.mode, self.policy.replans, self.pcie_bytes_s, self.cpu_expert_s,
                             self.forms_label)
        return expert_report(self.stats, self.residency, self.zero_copy_experts, sizes)

    def memory_plan(self) -> dict[str, dict[str, int]]:
        return memory_plan(self.residency, self.pinned, self.staging_bytes,
                           self.staged.pass_bytes if self.staged is not None else 0)

    def log_memory_plan(self, log, dense_bytes: int) -> None:
        """One log line per part of the plan: the dense weights (``dense_bytes`` on the device), then
        :meth:`memory_plan`'s."""
        plan = {"dense weights": {"vram_bytes": dense_bytes}, **self.memory_plan()}
        for component, sizes in plan.items():
            log.info("memory plan: %-34s %s", component, ", ".join(
                f"{k.removesuffix('_bytes')} {v / 2**30:.2f} GiB" if k.endswith("_bytes") else f"{k} {v}"
                for k, v in sizes.items()))

    def close(self) -> None:
        self.staged.close()
        self.pinned.close()


@contextmanager
def counted_rows(offload, real: torch.Tensor):
    """While a padded decode step runs: the offload counts routing of the ``real`` rows only
    (bucket padding, at the scratch slot, would otherwise pull placement towards its experts)."""
    if offload is None:
        yield
        return
    offload.row_valid = real
    try:
        yield
    finally:
        offload.row_valid = None
        offload.zero_copy_experts.settle()


def _aligned_matrices(form: ExpertForm, inter: int, hidden: int) -> bool:
    """A GGUF form's gate/up and down matrices are multiples of 16 bytes, so every expert of a device bank
    starts at an aligned address (what the zero-copy kernels are told)."""
    gate_up, down = form.gguf
    return (2 * inter * gguf_matmul.row_bytes_of(gate_up, hidden)) % 16 == 0 and \
        (hidden * gguf_matmul.row_bytes_of(down, inter)) % 16 == 0
