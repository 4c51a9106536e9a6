"""Process launch and process groups for one model spread over several devices.

One process per device.  Global rank ``stage * ep_size + ep_rank`` runs on
``placement.device_of(rank)``; rank 0 is the daemon's own process (the engine
thread drives it) and starts ranks ``1 .. world - 1`` with
:func:`start_workers` (``torch.multiprocessing``, spawn).  Under ``torchrun``
(``gpus = torchrun``, one host or several) torchrun starts every rank instead:
each runs ``ds4d serve`` with the same configuration, rank 0 becomes the
daemon, the others become workers (:class:`TorchrunJob`), and the same
:func:`init_groups` runs with ``init_method="env://"``.

Groups, made identically on every rank (``new_group`` is collective):

* the default group, backend ``nccl`` on CUDA and ``gloo`` on the CPU: the
  stage-to-stage ``send``/``recv`` of the hidden streams and the logits;
* one expert-parallel group per stage (``ep_size`` ranks): the per-layer
  ``all_reduce`` of the routed-expert output;
* a ``gloo`` control group over all ranks: rank 0 broadcasts each step's
  plain-Python description (a pickled :class:`~ds4d.contracts.ForwardBatch`)
  and gathers small objects, without a device round trip.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ds4d.parallel.topology import Placement, parse_layout

INIT_TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True)
class ParallelGroups:
    """One rank's view of the layout and the groups it talks over."""

    rank: int
    world_size: int
    stages: int
    ep_size: int
    device: torch.device
    ep_group: Any
    """Process group of this rank's stage (None when ``ep_size == 1``)."""
    control_group: Any
    """gloo group over all ranks for pickled objects (None = the default group, already gloo)."""

    @property
    def stage(self) -> int:
        return self.rank // self.ep_size

    @property
    def ep_rank(self) -> int:
        return self.rank % self.ep_size

    def rank_of(self, stage: int, ep_rank: int) -> int:
        return stage * self.ep_size + ep_rank


@dataclass(frozen=True)
class TorchrunJob:
    """This process is one rank of a job torchrun started (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` in the environment).

    torchrun numbers ranks host by host, so rank ``r`` runs on GPU ``LOCAL_RANK``
    of its host.  ``auto`` makes each host one stage whose GPUs split the experts:
    the per-layer all-reduce stays inside a host, and only the streams of a stage
    boundary (one send per step) cross the network."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    use_cuda: bool

    @classmethod
    def from_environment(cls, use_cuda: bool) -> TorchrunJob:
        names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        missing = [name for name in names if name not in os.environ]
        if missing:
            raise RuntimeError(f"gpus = torchrun, but {', '.join(missing)} not set: start ds4d under torchrun")
        values = {name: int(os.environ[name]) for name in names[:4]}
        return cls(values["RANK"], values["WORLD_SIZE"], values["LOCAL_RANK"], values["LOCAL_WORLD_SIZE"], use_cuda)

    def placement(self, layout: str) -> Placement:
        if self.world_size % self.local_world_size:
            raise ValueError(f"{self.world_size} ranks are not whole hosts of {self.local_world_size}")
        if layout.strip().lower() == "auto":
            stages, ep = self.world_size // self.local_world_size, self.local_world_size
        else:
            stages, ep = parse_layout(layout, self.world_size)
        grid = tuple(tuple((s * ep + e) % self.local_world_size for e in range(ep)) for s in range(stages))
        return Placement(grid)


def free_tcp_init_method(host: str = "127.0.0.1") -> str:
    """``tcp://host:port`` on a port free right now (rank 0 binds it soon after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return f"tcp://{host}:{sock.getsockname()[1]}"


def device_for(placement: Placement, rank: int, use_cuda: bool) -> torch.device:
    if not use_cuda:
        return torch.device("cpu")
    return torch.device("cuda", placement.device_of(rank))


def init_groups(rank: int, placement: Placement, init_method: str, *, use_cuda: bool) -> ParallelGroups:
    """Join the job as ``rank`` and make the groups (every rank calls this, same arguments)."""
    device = device_for(placement, rank, use_cuda)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    world = placement.world_size
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world, timeout=INIT_TIMEOUT, **kwargs
    )
    ep_group = None
    for stage in range(placement.stages):
        ranks = list(range(stage * placement.ep_size, (stage + 1) * placement.ep_size))
        group = dist.new_group(ranks) if placement.ep_size > 1 else None
        if rank in ranks:
            ep_group = group
    control = dist.new_group(backend="gloo") if backend != "gloo" else None
    return ParallelGroups(rank, world, placement.stages, placement.ep_size, device, ep_group, control)


def start_workers(
    world_size: int, target: Callable[..., None], args: Sequence[Any], *, cuda_order_by_bus: bool = True
) -> list[mp.Process]:
    """Start ranks ``1 .. world_size - 1`` as ``target(rank, *args)`` in fresh (spawned) processes.

    Workers are daemonic: they end with the process that started them.  CUDA
    devices are numbered in PCI bus order, as NVML numbers them."""
    if cuda_order_by_bus:
        os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    context = mp.get_context("spawn")
    workers = []
    for rank in range(1, world_size):
        process = context.Process(target=target, args=(rank, *args), name=f"ds4d-rank{rank}", daemon=True)
        process.start()
        workers.append(process)
    return workers


def stop_workers(workers: Sequence[mp.Process], timeout_s: float = 30.0) -> list[int | None]:
    """Wait for the workers to leave (after the stop command); terminate the ones that do not."""
    codes = []
    for process in workers:
        process.join(timeout_s)
        if process.is_alive():
            process.terminate()
            process.join(5.0)
        codes.append(process.exitcode)
    return codes


def broadcast_object(obj: Any, groups: ParallelGroups) -> Any:
    """Rank 0's ``obj`` on every rank (pass anything on the others)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=groups.control_group)
    return box[0]


def gather_objects(obj: Any, groups: ParallelGroups) -> list[Any] | None:
    """Every rank's ``obj`` in rank order on rank 0; None elsewhere."""
    out = [None] * groups.world_size if groups.rank == 0 else None
    dist.gather_object(obj, out, dst=0, group=groups.control_group)
    return out
