"""The routed experts of one MoE call, with the routing counts read back to the host.

:meth:`StagedCompute.routed`:

1. counts tokens per expert and reads the counts back (the one host read per
   layer), and hands them to the placement policy;
2. experts with zero tokens cost nothing: a cold one is never copied (counted
   as a skipped transfer);
3. hot experts run as one grouped matmul over the device bank;
4. used cold experts stream through the two staging banks of the layer's form on a copy stream,
   batch ``j + 1`` copying while batch ``j`` computes; quantised ones are
   decoded on the device after the copy, except with ``native`` MXFP4, where
   staging holds the stored bytes and the ``quant_matmul`` kernels read them as
   copied;
5. while a layer's blocks of one prefill step run one after another (``begin_pass``, the model's
   layer-by-layer prefill), a cold expert copied for one block stays in a pass bank of its own
   (room for every cold expert of a layer) for the next ones, so the step copies it once;
6. in decode steps, cold experts with at most ``cpu_max_rows`` tokens may run on
   the host instead (threads reading the host copy while the device works),
   when the copy bandwidth and the CPU expert time measured at start
   (:meth:`StagedCompute.measure`) say that is cheaper (``decode_cold``:
   ``auto`` | ``cpu`` | ``copy``).

The pieces come out in the order hot, copied, host, and ``moe.combine_sorted``
puts every (token, expert) row back, as the all-on-device path does.  With
``ExpertForm.pair_weighted`` (DeepSeek-V4.1) every piece takes its rows' routing
weights inside the expert (``moe.expert_ffn(pair_weights=...)``) and the sum is
float32.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from ds4d.cuda.host_memory import CopyStream
from ds4d.models.deepseek_v4.config import DeepseekV4Config
from ds4d.models.deepseek_v4.moe import combine_sorted, expert_ffn
from ds4d.models.deepseek_v4.offload_parts import ExpertForm, StagingBank, bank_slots, decode_parts, staging_bank
from ds4d.models.deepseek_v4.offload_residency import ExpertResidency
from ds4d.models.deepseek_v4.offload_stats import LayerStats
from ds4d.models.deepseek_v4.placement import PlacementPolicy


class StagedCompute:
    """Hot experts from the device banks, used cold ones through the staging banks or on host threads."""

    def __init__(
        self, cfg: DeepseekV4Config, residency: ExpertResidency, stats: list[LayerStats], policy: PlacementPolicy,
        stage_experts: int, *, decode_cold: str, cpu_max_rows: int, cpu_threads: int,
    ) -> None:
        self.cfg, self.form = cfg, residency.forms[0]
        self.residency, self.stats, self.policy = residency, stats, policy
        self.stage_experts = max(1, stage_experts)
        self.staging: dict[ExpertForm, list[StagingBank]] = {}
        """Two staging banks per form (:meth:`stages_of`)."""
        self.stages = self.stages_of(self.form)
        """The first layer's form's staging banks."""
        # when cold experts of a decode step run on host threads (``OffloadOptions``)
        self.decode_cold, self.cpu_max_rows, self.cpu_threads = decode_cold, cpu_max_rows, cpu_threads
        self.copier = CopyStream(self.form.device)
        self.pool = ThreadPoolExecutor(max(1, cpu_threads), thread_name_prefix="ds4d-expert")
        self.pcie_bytes_s = 0.0
        """Host -> device copy bandwidth for staged experts (set by :meth:`measure`)."""
        self.cpu_expert_s = 0.0
        """Seconds for one expert on one row on the host (set by :meth:`measure`)."""
        self.pass_banks: dict[ExpertForm, StagingBank] = {}
        """Per form, room for one layer's cold experts while its blocks run (made at the first
        :meth:`begin_pass` of a layer of that form)."""
        self.pass_bank: StagingBank | None = None
        """The pass bank of the layer in a pass."""
        self.pass_layer: int | None = None
        self.pass_slot_of: dict[int, int] = {}
        """Cold experts of ``pass_layer`` in the pass bank, and their slots there."""

    def stages_of(self, form: ExpertForm) -> list[StagingBank]:
        """The two staging banks of ``form`` (made when a layer of that form first needs them)."""
        if form not in self.staging:
            layout = self.residency.pools[form].layout
            self.staging[form] = [staging_bank(form, layout, self.stage_experts) for _ in range(2)]
        return self.staging[form]

    @property
    def pass_bytes(self) -> int:
        """Device bytes of the pass banks (0 until a layer-by-layer prefill made one)."""
        total = 0
        for form, bank in self.pass_banks.items():
            tensors = list(bank.packed.values())
            if form.decodes:
                tensors += [bank.gate_up, bank.down]
            total += sum(t.numel() * t.element_size() for t in tensors)
        return total

    def begin_pass(self, layer: int) -> None:
        """The next calls of ``layer`` are blocks of one step: copied cold experts stay for the next block."""
        form = self.residency.forms[layer]
        if form not in self.pass_banks:
            most = max(form.experts - len(bank.ids) for bank, other in zip(self.residency.banks, self.residency.forms)
                       if other == form)
            self.pass_banks[form] = staging_bank(form, self.residency.pools[form].layout, max(1, most))
        self.pass_bank = self.pass_banks[form]
        self.pass_layer, self.pass_slot_of = layer, {}

    def end_pass(self) -> None:
        self.pass_layer = None

    def measure(self) -> None:
        """Time a host -> device copy of a staging bank and one expert on one row on the host."""
        stage, slots = self.stages[0], self.residency.pools[self.form]
        # any slots of the first chunk will do for timing
        rows = next(iter(slots.chunks[0].values())).shape[0] if slots.chunks else 0
        sources = [slots.parts((0, row)) for row in range(min(bank_slots(stage.gate_up), rows))]
        if not sources:  # no expert of the first form is cold
            return
        seconds = []
        for _ in range(4):  # a whole staging bank per copy; the first one warms up
            began = time.perf_counter()
            self._issue(sources, stage)
            self.copier.synchronize()
            seconds.append(time.perf_counter() - began)
        self.pcie_bytes_s = len(sources) * self.form.host_expert_bytes / max(sorted(seconds[1:])[1], 1e-9)
        rows = torch.randn(1, self.cfg.hidden_size, dtype=self.form.dtype)
        self._cpu_expert(self.form, sources[0], rows)
        began = time.perf_counter()
        for _ in range(3):
            self._cpu_expert(self.form, sources[0], rows)
        self.cpu_expert_s = (time.perf_counter() - began) / 3

    def split_cold(self, form: ExpertForm, cold: list[int], counts: list[int], decode: bool,
                   ) -> tuple[list[int], list[int]]:
        """(experts for the host, experts to copy) of a layer of ``form``."""
        mode = self.decode_cold
        if not decode or mode == "copy" or not cold:
            return [], cold
        eligible = [e for e in cold if counts[e] <= self.cpu_max_rows]
        if mode == "auto" and eligible:
            cpu_s = math.ceil(len(eligible) / self.cpu_threads) * self.cpu_expert_s
            if cpu_s >= len(eligible) * form.host_expert_bytes / self.pcie_bytes_s:
                return [], cold
        return eligible, [e for e in cold if e not in eligible]

    def routed(self, layer, x, expert_weights, indices, limit, decode) -> torch.Tensor:
        """The routed experts' weighted output of one layer for routing already done."""
        tokens, k = indices.shape
        form = self.residency.forms[layer]
        experts = form.experts
        flat = indices.reshape(-1)
        counts = torch.bincount(flat, minlength=experts).tolist()
        self.policy.observe(layer, counts)
        bank, stats = self.residency.banks[layer], self.stats[layer]
        cold = [e for e in range(experts) if counts[e] and bank.slot_of[e] < 0]
        on_host, copied = self.split_cold(form, cold, counts, decode)
        held = None if decode else self._pass_slots(layer, copied)
        key = list(bank.slot_of)
        base = len(bank.ids)
        for position, expert in enumerate(copied + on_host):
            key[expert] = base + (position if held is None else self.pass_slot_of[expert])
        sorted_key, order = torch.sort(torch.tensor(key, device=x.device)[flat], stable=True)
        rows = x[order // k]
        hot_rows = sum(counts[e] for e in bank.ids)
        stats.calls += 1
        stats.pairs += tokens * k
        stats.hot_pairs += hot_rows
        skipped = experts - len(bank.ids) - len(cold)
        stats.skipped_transfers += skipped
        stats.bytes_skipped += skipped * form.host_expert_bytes

        begin = hot_rows + sum(counts[e] for e in copied)
        weighted = form.pair_weighted
        pair_weights = expert_weights.reshape(-1)[order].float() if weighted else None

        def weights_of(at: int, end: int | None) -> torch.Tensor | None:
            return pair_weights[at:end] if weighted else None

        host_rows = rows[begin:].to("cpu") if on_host else None
        host_weights = pair_weights[begin:].to("cpu") if on_host and weighted else None
        pieces = []
        if hot_rows:
            offsets = self._offsets([counts[e] for e in bank.ids], len(bank.ids), x.device)
            pieces.append(expert_ffn(rows[:hot_rows], bank.gate_up, bank.down, offsets, sorted_key[:hot_rows],
                                     limit, step_rows=tokens * k, pair_weights=weights_of(0, hot_rows)))
        if held is not None:
            pieces.extend(self._held(layer, copied, held, counts, rows[hot_rows:begin],
                                     sorted_key[hot_rows:begin] - base, limit, tokens * k, weights_of(hot_rows, begin)))
        else:
            pieces.extend(self._staged(layer, copied, counts, rows[hot_rows:begin],
                                       sorted_key[hot_rows:begin] - base, limit, tokens * k,
                                       weights_of(hot_rows, begin)))
        if on_host:  # the device works through the launches above meanwhile
            began = time.perf_counter()
            pieces.append(self._host_experts(layer, on_host, counts, host_rows, host_weights).to(x.device))
            stats.cpu_expert_s += time.perf_counter() - began
            stats.cpu_experts += len(on_host)
            stats.cpu_pairs += host_rows.shape[0]
        out = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        if weighted:
            return combine_sorted(out, order, None, tokens, k, torch.float32)
        return combine_sorted(out, order, expert_weights, tokens, k, x.dtype)

    @staticmethod
    def _offsets(counts: list[int], groups: int, device) -> torch.Tensor:
        ends, total = [], 0
        for count in counts + [0] * (groups - len(counts)):
            total += count
            ends.append(total)
        return torch.tensor(ends, dtype=torch.int32).to(device, non_blocking=True)

    def _issue(self, sources: list[dict[str, torch.Tensor]], stage: StagingBank) -> None:
        """Copy experts' stored parts (host slots) into ``stage`` on the copy stream."""
        self.copier.wait(stage.free)
        for slot, parts in enumerate(sources):
            for name, tensor in parts.items():
                self.copier.copy(stage.packed[name][slot], tensor)
        stage.ready = self.copier.record()

    def _issue_experts(self, layer: int, experts: list[int], stage: StagingBank) -> None:
        self._issue([self.residency.expert_parts(layer, expert) for expert in experts], stage)
        stage.experts = experts
        stats = self.stats[layer]
        stats.copied_experts += len(experts)
        stats.bytes_copied += len(experts) * self.residency.forms[layer].host_expert_bytes

    def _staged(self, layer, copied, counts, rows, slots, limit, step_rows, pair_weights=None) -> list[torch.Tensor]:
        """Cold experts through the double-buffered staging banks, copy of batch j + 1 under compute of j
        (``pair_weights``: the rows' routing weights, ``ExpertForm.pair_weighted``)."""
        form = self.residency.forms[layer]
        stages = self.stages_of(form)
        size = bank_slots(stages[0].gate_up)
        batches = [copied[at : at + size] for at in range(0, len(copied), size)]
        out, row = [], 0
        if batches:
            self._issue_experts(layer, batches[0], stages[0])
        for index, batch in enumerate(batches):
            if index + 1 < len(batches):
                self._issue_experts(layer, batches[index + 1], stages[(index + 1) % 2])
            stage = stages[index % 2]
            self.copier.compute_waits(stage.ready)
            if form.decodes:  # decode after the copy (native: read as copied)
                for slot in range(len(batch)):
                    gate_up, down = decode_parts(form, {n: t[slot] for n, t in stage.packed.items()})
                    stage.gate_up[slot].copy_(gate_up)
                    stage.down[slot].copy_(down)
            n = sum(counts[e] for e in batch)
            offsets = self._offsets([counts[e] for e in batch], size, rows.device)
            out.append(expert_ffn(rows[row : row + n], stage.gate_up, stage.down, offsets,
                                  slots[row : row + n] - index * size, limit, step_rows=step_rows,
                                  pair_weights=None if pair_weights is None else pair_weights[row : row + n]))
            stage.free = self.copier.compute_event()
            row += n
        return out

    def _pass_slots(self, layer: int, copied: list[int]) -> list[int] | None:
        """In a pass over ``layer``: give the call's cold experts slots in the pass bank and return the
        ones it must copy there (the rest are there from an earlier block); None outside a pass, or
        when the bank has no room left for them (they then go through the staging banks)."""
        if self.pass_layer != layer or not copied:
            return None
        new = [e for e in copied if e not in self.pass_slot_of]
        if len(self.pass_slot_of) + len(new) > bank_slots(self.pass_bank.gate_up):
            return None
        for expert in new:
            self.pass_slot_of[expert] = len(self.pass_slot_of)
        return new

    def _held(self, layer, copied, new, counts, rows, slots, limit, step_rows, pair_weights=None) -> list[torch.Tensor]:
        """Cold experts from the pass bank: ``new`` ones copied there first (the rows of ``copied`` come
        sorted by pass-bank slot)."""
        stage, form = self.pass_bank, self.residency.forms[layer]
        if new:
            self.copier.wait(stage.free)  # the blocks before may still read the bank
            for expert in new:
                for name, tensor in self.residency.expert_parts(layer, expert).items():
                    self.copier.copy(stage.packed[name][self.pass_slot_of[expert]], tensor)
            stage.ready = self.copier.record()
            stats = self.stats[layer]
            stats.copied_experts += len(new)
            stats.bytes_copied += len(new) * form.host_expert_bytes
        self.copier.compute_waits(stage.ready)
        if new and form.decodes:
            for expert in new:
                slot = self.pass_slot_of[expert]
                gate_up, down = decode_parts(form, {n: t[slot] for n, t in stage.packed.items()})
                stage.gate_up[slot].copy_(gate_up)
                stage.down[slot].copy_(down)
        per_slot = [0] * len(self.pass_slot_of)
        for expert in copied:
            per_slot[self.pass_slot_of[expert]] = counts[expert]
        offsets = self._offsets(per_slot, bank_slots(stage.gate_up), rows.device)
        out = expert_ffn(rows, stage.gate_up, stage.down, offsets, slots, limit, step_rows=step_rows,
                         pair_weights=pair_weights)
        stage.free = self.copier.compute_event()
        return [out]

    def _cpu_expert(self, form: ExpertForm, parts: dict[str, torch.Tensor], rows: torch.Tensor,
                    pair_weights: torch.Tensor | None = None) -> torch.Tensor:
        """One expert of ``form`` (its stored parts in host memory) on ``rows``, on the host
        (``pair_weights``: the rows' routing weights, ``ExpertForm.pair_weighted``)."""
        gate_up, down = decode_parts(form, parts)
        if rows.shape[0] == 1:  # as moe._grouped_linear: a lone bmm product rounds differently
            weights = None if pair_weights is None else pair_weights.expand(2)
            return self._cpu_expert(form, parts, rows.expand(2, -1), weights)[:1]
        n = rows.shape[0]
        hidden = torch.bmm(gate_up.expand(n, -1, -1), rows.unsqueeze(-1)).squeeze(-1)
        gate, up = hidden.chunk(2, dim=-1)
        if pair_weights is not None:  # as moe.expert_ffn: the SwiGLU in float32, weighted before w2
            gate, up = gate.float(), up.float()
        limit = self.cfg.swiglu_limit
        if limit > 0:
            gate = gate.clamp(max=limit)
            up = up.clamp(min=-limit, max=limit)
        act = torch.nn.functional.silu(gate) * up
        if pair_weights is not None:
            act = (pair_weights.float()[:, None] * act).to(rows.dtype)
        out = torch.bmm(down.expand(n, -1, -1), act.unsqueeze(-1)).squeeze(-1)
        return out if pair_weights is None else out.float()

    def _host_experts(self, layer: int, experts: list[int], counts: list[int], rows: torch.Tensor,
                      pair_weights: torch.Tensor | None = None) -> torch.Tensor:
        parts_of, form = self.residency.expert_parts, self.residency.forms[layer]
        spans, at = [], 0
        for expert in experts:
            spans.append((expert, at, at + counts[expert]))
            at += counts[expert]

        def weights(a: int, b: int) -> torch.Tensor | None:
            return None if pair_weights is None else pair_weights[a:b]

        if len(experts) == 1:
            return self._cpu_expert(form, parts_of(layer, experts[0]), rows, pair_weights)
        futures = [self.pool.submit(self._cpu_expert, form, parts_of(layer, e), rows[a:b], weights(a, b))
                   for e, a, b in spans[1:]]
        first = self._cpu_expert(form, parts_of(layer, spans[0][0]), rows[spans[0][1] : spans[0][2]],
                                 weights(spans[0][1], spans[0][2]))
        return torch.cat([first] + [f.result() for f in futures])

    def close(self) -> None:
        self.pool.shutdown(wait=True)
