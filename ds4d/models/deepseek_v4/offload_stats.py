"""Counters of the routed-expert offload and the reports built from them.

``LayerStats`` counts the MoE calls that read routing back (``offload_compute``);
the zero-copy decode counters stay on the device (``offload_zero_copy``) and are
read only here, when a report is asked for.  :func:`expert_report` is what
``ExpertOffload.expert_stats`` returns (``/v1/ds4d/stats`` shows it per layer);
:func:`memory_plan` is the offload's part of the printed memory plan.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ds4d.cuda.host_memory import PinnedRegistry
from ds4d.models.deepseek_v4.offload_residency import ExpertResidency
from ds4d.models.deepseek_v4.offload_zero_copy import ZeroCopyExperts


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


@dataclass(frozen=True)
class OffloadSizes:
    """What the report needs beyond the counters: sizes, measurements and the policy's state."""

    host_expert_bytes: int
    device_expert_bytes: int
    staging_bytes: int
    zero_copy: bool
    placement: str
    replans: int
    pcie_bytes_s: float
    cpu_expert_s: float
    form: str = ""
    """How the experts are held (``ExpertForm.label``)."""


def expert_report(stats: list[LayerStats], residency: ExpertResidency, zero_copy_experts: ZeroCopyExperts,
                  sizes: OffloadSizes) -> dict:
    """Placement, traffic and hit rates, in total and per layer."""
    gpu = residency.device_experts()
    total = residency.layers * residency.experts
    layers = []
    direct_pairs = zero_copy_experts.decode_counts.sum(dim=1).tolist()
    host_reads = zero_copy_experts.host_reads.tolist()
    ahead_hits = zero_copy_experts.ahead_hits.tolist()
    for index, (layer_stats, bank) in enumerate(zip(stats, residency.banks)):
        row = asdict(layer_stats)
        row["cpu_expert_ms"] = round(row.pop("cpu_expert_s") * 1e3, 3)
        pairs = layer_stats.pairs + direct_pairs[index]
        hot = layer_stats.hot_pairs + direct_pairs[index] - host_reads[index]
        row.update(layer=index, gpu_experts=len(bank.ids), hit_rate=hot / pairs if pairs else None,
                   zero_copy_pairs=direct_pairs[index], host_read_pairs=host_reads[index],
                   fetched_ahead_pairs=ahead_hits[index])
        layers.append(row)
    return {
        "form": sizes.form,
        "gpu_experts": gpu,
        "ram_experts": total - gpu,
        "placement": sizes.placement,
        "replans": sizes.replans,
        "pcie_gb_s": round(sizes.pcie_bytes_s / 1e9, 3),
        "cpu_expert_ms": round(sizes.cpu_expert_s * 1e3, 3),
        "bytes_copied": sum(s.bytes_copied for s in stats),
        "bytes_skipped": sum(s.bytes_skipped for s in stats),
        "skipped_transfers": sum(s.skipped_transfers for s in stats),
        "placement_bytes": residency.placement_bytes,
        "demoted_bytes": residency.demoted_bytes,
        "host_experts": residency.host_experts(),
        "host_ram_bytes": residency.host_bytes(),
        "vram_bytes": residency.device_bytes() + sizes.staging_bytes,
        "zero_copy": sizes.zero_copy,
        "host_read_bytes": sum(host_reads) * sizes.host_expert_bytes,
        "fetched_ahead_pairs": sum(ahead_hits),  # of the host-read pairs, those whose expert was fetched ahead
        "layers": layers,
    }


def memory_plan(residency: ExpertResidency, pinned: PinnedRegistry, staging_bytes: int,
                pass_bytes: int = 0) -> dict[str, dict[str, int]]:
    """Device and host memory the offload holds, by use (``pass_bytes``: the bank that keeps one layer's
    cold experts through a layer-by-layer prefill, once one has run)."""
    gpu = residency.device_experts()
    pools = list(residency.pools.values())
    return {
        "routed experts (device banks)": {"vram_bytes": residency.device_bytes(), "experts": gpu},
        "expert staging (2 banks, decode gather scratch)": {"vram_bytes": staging_bytes},
        **({"expert staging (one layer, layer-by-layer prefill)": {"vram_bytes": pass_bytes}} if pass_bytes else {}),
        "routed experts (host RAM, pinned)": {
            "ram_bytes": residency.host_bytes(), "experts": residency.host_experts(),
            "slots": sum(slots.slots for slots in pools),
            "huge_pages": int(any(slots.arena.huge_pages for slots in pools)),
            "pinned": int(pinned.enabled)},
    }
