"""What the links between the ranks of a split model cost: the transfers of one step, timed where they run.

A split model's step waits on two kinds of transfer besides its own arithmetic:
each layer's routed output summed over the expert ranks of a stage (an
all-reduce), and a stage's streams handed to the next stage (plus the logits
back to rank 0 when the last stage is not rank 0's).  Both are timed here at the
sizes a step sends, on the groups the model runs on, so a benchmark can put a
floor under a layout's step: its bytes over the copy bandwidth plus its
transfers, one after another as the step makes them.

Every rank calls :func:`time_transfers` with the same arguments (a collective).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ds4d.parallel.launch import ParallelGroups


@dataclass(frozen=True)
class Transfer:
    """One transfer to time: ``elements`` of ``dtype`` (the same on every rank)."""

    elements: int
    dtype: torch.dtype


def _median_seconds(action, reps: int, sync, align) -> float:
    """Median wall time of ``action`` over ``reps`` runs after one unmeasured run, each run started together
    on every rank (``align``) and finished on the device (``sync``)."""
    action()
    sync()
    times = []
    for _ in range(reps):
        align()
        start = time.perf_counter()
        action()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_transfers(groups: ParallelGroups, all_reduce: Transfer, hops: Sequence[Transfer], reps: int = 20) -> dict:
    """Median seconds on this rank of ``all_reduce`` over its stage's expert ranks (None with one expert rank)
    and of each of ``hops``, one stage's tensor received by the next (None with one stage): half the round trip
    between stages 0 and 1 along this rank's expert lane, timed on stage 0 (the ranks of other stages wait).

    A collective: every rank calls it with the same arguments."""
    device = groups.device
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def align() -> None:
        dist.barrier(group=groups.control_group)

    out: dict = {"all_reduce": None, "hops": [None] * len(hops)}
    if groups.ep_size > 1:
        summed = torch.zeros(all_reduce.elements, dtype=all_reduce.dtype, device=device)
        out["all_reduce"] = _median_seconds(lambda: dist.all_reduce(summed, group=groups.ep_group), reps, sync, align)
    if groups.stages > 1:
        for i, hop in enumerate(hops):
            round_trip = _median_seconds(_round_trip(groups, hop), reps, sync, align)
            out["hops"][i] = round_trip / 2 if groups.stage == 0 else None
    return out


def _round_trip(groups: ParallelGroups, hop: Transfer):
    """What this rank does in one round trip of ``hop`` between stages 0 and 1 (nothing on later stages)."""
    if groups.stage > 1:
        return lambda: None
    passed = torch.zeros(hop.elements, dtype=hop.dtype, device=groups.device)
    first = groups.stage == 0
    peer = groups.rank_of(1 if first else 0, groups.ep_rank)

    def trip() -> None:
        if first:
            dist.send(passed, dst=peer)
            dist.recv(passed, src=peer)
        else:
            dist.recv(passed, src=peer)
            dist.send(passed, dst=peer)

    return trip
