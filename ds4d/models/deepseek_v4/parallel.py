"""DeepSeek-V4 over several devices: expert parallel, layer split, or a grid of both.

Shape of the design: one process per device, all running the same SPMD step
(:class:`~ds4d.models.deepseek_v4.shard.ShardRunner`).  Rank 0 lives in the
daemon; :class:`ParallelDeepseekV4Model` is the :class:`~ds4d.contracts.Model`
the engine sees there.  Each call on it is first broadcast to the other ranks
as a small command over the gloo control group, then run by every rank at once:

=================  ==================================================================
command            what every rank does
=================  ==================================================================
``allocate``       allocates the cache of its own layers; rank 0 gathers the outcome
``forward``        runs :meth:`ShardRunner.step` on the same batch (rank 0 returns logits)
``forward_parts``  a prompt step cut into micro-batches: :meth:`ShardRunner.step_pipelined`
``save_state``     each stage's ep-rank 0 hands its layers' slot state to rank 0
``load_state``     each rank takes its stage's part of the snapshot
``export_blocks``  each stage's ep-rank 0 hands its layers' part of the KV blocks to rank 0
``import_blocks``  each rank writes its stage's part of the KV block payloads
``expert_stats``   each rank hands rank 0 its expert-offload counters (about once a second)
``transfers``      every rank times a step's all-reduce and stage hand-ons (``ds4d.parallel.link``; benchmarks)
``stop``           leaves the loop; the process group is torn down
=================  ==================================================================

Ranks ``1 ..`` run :func:`run_worker`: join the groups, load their shard, report
ready, then obey commands until ``stop`` (or until rank 0 is gone, which breaks
the broadcast).  Batches are validated on rank 0 before they are broadcast, so
a bad batch raises on the engine thread and never reaches the workers.

:func:`build_parallel_model` is what the kernel calls instead of
``family.load`` when more than one device is configured: it plans the
placement (``ds4d.parallel.topology``), starts the workers
(``ds4d.parallel.launch``), joins as rank 0 and returns the model.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import signal
import time
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ds4d.contracts import ForwardBatch, ModelInfo
from ds4d.models.deepseek_v4.cache import payload_rows
from ds4d.models.deepseek_v4.config import DeepseekV4Config
from ds4d.models.deepseek_v4.knobs import torch_dtype
from ds4d.models.deepseek_v4.loader import load_tokenizer
from ds4d.models.deepseek_v4.microbatch import split_prompt
from ds4d.models.deepseek_v4.model import check_batch
from ds4d.models.deepseek_v4.offload import OffloadOptions
from ds4d.models.deepseek_v4.random_init import RandomReader
from ds4d.models.deepseek_v4.shard import ShardRunner, read_shard, shard_layout, shard_weights
from ds4d.parallel.launch import (
    ParallelGroups,
    TorchrunJob,
    broadcast_object,
    free_tcp_init_method,
    gather_objects,
    init_groups,
    start_workers,
    stop_workers,
)
from ds4d.parallel.link import Transfer, time_transfers
from ds4d.parallel.topology import Placement, describe, parse_layout, plan_for_gpus, plan_placement

log = logging.getLogger("ds4d.models")


class ParallelStartError(RuntimeError):
    """A rank failed to load its shard or to allocate its cache."""


LOST_RANK_WAIT_S = 5.0
"""After a failed collective with every worker still running, how long to wait for one to exit (and name it)
before passing the error on."""


class ParallelRankLost(RuntimeError):
    """A worker process of the split model has exited: the model cannot run any more."""


@dataclass(frozen=True)
class RandomWeights:
    """A model of random weights instead of a checkpoint (benchmarks, ``load_format = random``): no weight file.

    Every rank draws only its own tensors; see
    :class:`~ds4d.models.deepseek_v4.random_init.RandomReader` (the same seed and config: the same tensors as one
    process draws).  ``directory``: where the config came from, for the model's name and tokenizer (none: no
    tokenizer, the model named ``random-v4``)."""

    config: dict
    seed: int = 0
    directory: str | None = None

    @property
    def name(self) -> str:
        return Path(self.directory).name if self.directory else "random-v4"


def _load_runner(
    source, placement: Placement, groups: ParallelGroups, dtype: torch.dtype, fast_path, native: bool = False,
    offload: OffloadOptions | None = None, padded_decode: bool = False,
):
    """This rank's shard of the checkpoint (or random weights) and its step; experts on the host with offload."""
    expert_device = torch.device("cpu") if offload is not None else None
    random = isinstance(source, RandomWeights)
    cfg = DeepseekV4Config.from_dict(source.config, name=source.name) if random else DeepseekV4Config.from_file(source)
    layout = shard_layout(cfg, groups.stage, groups.stages, groups.ep_rank, groups.ep_size)
    if random:  # shapes only in ``issued``: no second, decoded copy of FP8 weights while the shard is drawn
        reader = RandomReader(cfg, dtype=dtype, device=groups.device, seed=source.seed, native=native,
                              keep_values=False)
        weights = shard_weights(reader, cfg, layout, expert_device)
    else:
        weights = read_shard(source, cfg, layout, dtype, groups.device, native=native, expert_device=expert_device)
    if offload is not None and native:
        offload = replace(offload, native=True)
    return ShardRunner(cfg, layout, weights, groups, dtype, fast_path=fast_path, offload=offload,
                       padded_decode=padded_decode)


def _facts(runner: ShardRunner) -> dict[str, Any]:
    return {
        "layers": (runner.layout.layers.start, runner.layout.layers.stop),
        "experts": (runner.layout.experts.start, runner.layout.experts.stop),
        "device": str(runner.device),
        "parameter_bytes": runner.weights.parameter_bytes(),
        "weights": "native" if runner.native_weights else "decoded",
        "cache_bytes_per_block": runner.cache_bytes_per_block(),
        "state_bytes_per_seq": runner.state_bytes_per_seq(),
    }


def _attempt(action) -> tuple[bool, Any]:
    try:
        return True, action()
    except Exception as exc:  # reported to rank 0, which raises it on the engine side
        log.exception("parallel rank failed")
        return False, f"{type(exc).__name__}: {exc}"


def _allocate(runner: ShardRunner, num_blocks: int, max_seqs: int) -> int:
    """Allocate the rank's cache; the bytes of its part of one block's payload."""
    runner.allocate_cache(num_blocks, max_seqs)
    return runner.payload_bytes()


def run_worker(
    rank: int,
    source: str | RandomWeights,
    placement: Placement,
    init_method: str,
    dtype_name: str,
    use_cuda: bool,
    threads: int | None = None,
    fast_path: bool | None = None,
    native: bool = False,
    offload: OffloadOptions | None = None,
    padded_decode: bool = False,
) -> None:
    """Body of ranks 1 .. world - 1: load the shard, then obey rank 0's commands until ``stop``."""
    if threads:
        torch.set_num_threads(threads)
    groups = init_groups(rank, placement, init_method, use_cuda=use_cuda)
    if not isinstance(source, RandomWeights):
        source = Path(source)
    loaded = _attempt(
        lambda: _load_runner(source, placement, groups, torch_dtype(dtype_name), fast_path, native, offload,
                             padded_decode)
    )
    gather_objects((loaded[0], _facts(loaded[1]) if loaded[0] else loaded[1]), groups)
    runner = loaded[1] if loaded[0] else None
    try:
        while True:
            command = broadcast_object(None, groups)
            kind = command[0]
            if kind == "stop" or runner is None:
                break
            if kind == "forward":
                runner.step(command[1])
            elif kind == "forward_parts":
                runner.step_pipelined(command[1])
            elif kind == "allocate":
                gather_objects(_attempt(partial(_allocate, runner, command[1], command[2])), groups)
            elif kind == "save_state":
                gather_objects(runner.export_slot(command[1]) if groups.ep_rank == 0 else None, groups)
            elif kind == "load_state":
                runner.import_slot(command[1], command[2][groups.stage])
            elif kind == "export_blocks":
                gather_objects(runner.export_rows(command[1]) if groups.ep_rank == 0 else None, groups)
            elif kind == "import_blocks":
                runner.import_blocks(command[1], command[2][groups.stage])
            elif kind == "expert_stats":
                gather_objects(runner.offload.expert_stats() if runner.offload is not None else None, groups)
            elif kind == "transfers":
                sizes = _transfer_sizes(runner.cfg, command[1], runner.dtype)
                gather_objects(time_transfers(groups, *sizes, reps=command[2]), groups)
    except (RuntimeError, ConnectionError) as exc:  # rank 0 went away mid-broadcast
        log.warning("rank %d leaving: %s", rank, exc)
        return
    if runner is not None:
        runner.release()
    dist.destroy_process_group()


def _transfer_sizes(cfg: DeepseekV4Config, rows: int, dtype: torch.dtype) -> tuple[Transfer, list[Transfer]]:
    """A step's transfers at ``rows`` tokens: the routed output's all-reduce, and the hand-ons (streams, logits)."""
    streams = Transfer(rows * cfg.hc_mult * cfg.hidden_size, dtype)
    return Transfer(rows * cfg.hidden_size, dtype), [streams, Transfer(rows * cfg.vocab_size, torch.float32)]


EXPERT_STATS_EVERY_S = 1.0
_SUMMED_EXPERT_STATS = ("gpu_experts", "ram_experts", "replans", "bytes_copied", "bytes_skipped", "skipped_transfers",
                        "placement_bytes", "demoted_bytes", "host_read_bytes", "fetched_ahead_pairs", "host_experts",
                        "host_ram_bytes")


def merge_expert_stats(parts: Sequence[dict[str, Any]], first_layers: Sequence[int]) -> dict[str, Any]:
    """One expert-offload report from every rank's (``ExpertOffload.expert_stats``), rank order."""
    merged: dict[str, Any] = {key: sum(part[key] for part in parts) for key in _SUMMED_EXPERT_STATS}
    merged.update(
        placement=parts[0]["placement"],
        zero_copy=all(part["zero_copy"] for part in parts),
        pcie_gb_s=min(part["pcie_gb_s"] for part in parts),
        cpu_expert_ms=max(part["cpu_expert_ms"] for part in parts),
        layers=[{**row, "layer": first + row["layer"], "rank": rank}
                for rank, (part, first) in enumerate(zip(parts, first_layers)) for row in part["layers"]],
    )
    return merged


class ParallelDeepseekV4Model:
    """Rank 0's face of the sharded model: the engine's :class:`~ds4d.contracts.Model` (and StatefulModel)."""

    def __init__(
        self,
        cfg: DeepseekV4Config,
        runner: ShardRunner,
        groups: ParallelGroups,
        tokenizer,
        placement: Placement,
        rank_facts: Sequence[dict[str, Any]],
        workers: Sequence[Any] = (),
    ) -> None:
        self.cfg, self.runner, self.groups, self.tokenizer = cfg, runner, groups, tokenizer
        self.placement, self.rank_facts, self.workers = placement, list(rank_facts), list(workers)
        self._closed = False
        self.microbatches = placement.stages
        """A prompt step over several stages is cut into this many micro-batches that flow through the
        stages (``microbatch.py``; ``pipeline_microbatches``); 1: not cut."""
        self._num_blocks = self._max_seqs = 0
        self._expert_stats: dict[str, Any] = {}
        self._expert_stats_at = 0.0
        self._payload_bytes: list[int] = []
        """Bytes of each stage's part of a block payload (stage order), known once the cache exists."""
        self.info = ModelInfo(
            family="deepseek_v4",
            name=cfg.name,
            vocab_size=cfg.vocab_size,
            max_context_tokens=cfg.max_position_embeddings,
            block_size_tokens=cfg.block_size_tokens,
            # per device; the stage with the most cache per block is what limits the pool
            cache_bytes_per_block=max(f["cache_bytes_per_block"] for f in rank_facts),
            state_bytes_per_seq=max(f["state_bytes_per_seq"] for f in rank_facts),
            default_chat_encoder="deepseek_v4",
            default_reasoning_parser="deepseek_v4",
            default_tool_parser="dsml",
            dtype=str(runner.dtype).removeprefix("torch."),
            device=str(groups.device),
            parameter_bytes=sum(f["parameter_bytes"] for f in rank_facts),
            extra={
                "compress_ratios": list(cfg.compress_ratios),
                "sliding_window": cfg.sliding_window,
                "num_hash_layers": cfg.num_hash_layers,
                "weights": rank_facts[0]["weights"],
                "parallel": {
                    "stages": placement.stages,
                    "ep_size": placement.ep_size,
                    "devices": list(placement.devices),
                    "ranks": list(rank_facts),
                },
            },
        )

    # ------------------------------------------------------------------ contract

    def allocate_cache(self, num_blocks: int, max_seqs: int) -> None:
        self._bind_device()
        with self._ranks_alive():
            broadcast_object(("allocate", num_blocks, max_seqs), self.groups)
            outcomes = gather_objects(_attempt(lambda: _allocate(self.runner, num_blocks, max_seqs)), self.groups)
        failed = {rank: detail for rank, (ok, detail) in enumerate(outcomes) if not ok}
        if failed:
            raise ParallelStartError(f"could not allocate {num_blocks} blocks: {failed}")
        self._num_blocks, self._max_seqs = num_blocks, max_seqs
        self._payload_bytes = [outcomes[self.groups.rank_of(stage, 0)][1] for stage in range(self.groups.stages)]
        if self.runner.offload is not None:
            with self._ranks_alive():
                self._gather_expert_stats()

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        self._check(batch)
        self._bind_device()
        parts = [batch]
        if self.groups.stages > 1 and self.microbatches > 1:
            parts = split_prompt(batch, self.microbatches, self.cfg.block_size_tokens)
        with self._ranks_alive():
            if len(parts) > 1:
                broadcast_object(("forward_parts", parts), self.groups)
                logits = self.runner.step_pipelined(parts)
            else:
                broadcast_object(("forward", batch), self.groups)
                logits = self.runner.step(batch)
            if self.runner.offload is not None and time.monotonic() - self._expert_stats_at >= EXPERT_STATS_EVERY_S:
                self._gather_expert_stats()
        return logits

    def expert_stats(self) -> dict[str, Any]:
        """Expert-offload counters of every rank (layers numbered as in the whole model, with their rank),
        as of the last gathering (after a step, at most once a second); empty without offload."""
        return self._expert_stats

    def refresh_expert_stats(self) -> None:
        """Gather every rank's counters now, for :meth:`expert_stats`; on the engine thread, between steps."""
        if self.runner.offload is not None:
            with self._ranks_alive():
                self._gather_expert_stats()

    def _gather_expert_stats(self) -> None:
        """On the engine thread, between steps: the control group is not shared with the HTTP side."""
        broadcast_object(("expert_stats",), self.groups)
        parts = gather_objects(self.runner.offload.expert_stats(), self.groups)
        self._expert_stats = merge_expert_stats(parts, [facts["layers"][0] for facts in self.rank_facts])
        self._expert_stats_at = time.monotonic()

    def transfer_seconds(self, rows: int, reps: int = 20) -> dict[str, float | None]:
        """The link's part of a step of ``rows`` tokens, timed on the ranks (``ds4d.parallel.link``): the
        medians of ``all_reduce`` (one layer's routed output summed over a stage's expert ranks; the slowest
        rank's), ``streams`` (a stage's streams handed to the next) and ``logits`` (the last stage's logits to
        rank 0), None where the layout makes no such transfer; ``step``: the seconds a step spends in them,
        made one after another (an all-reduce a layer, a hand-on a stage boundary, the logits once).
        Between steps, on the engine thread (or a benchmark's)."""
        cfg = self.cfg
        sizes = _transfer_sizes(cfg, rows, self.runner.dtype)
        with self._ranks_alive():
            broadcast_object(("transfers", rows, reps), self.groups)
            parts = gather_objects(time_transfers(self.groups, *sizes, reps=reps), self.groups)
        reduced = [part["all_reduce"] for part in parts if part["all_reduce"] is not None]
        streams, logits = parts[0]["hops"]
        out = {"all_reduce": max(reduced) if reduced else None, "streams": streams, "logits": logits}
        stages = self.placement.stages
        out["step"] = (cfg.num_hidden_layers * (out["all_reduce"] or 0.0) + (stages - 1) * (streams or 0.0)
                       + (out["logits"] or 0.0))
        return out

    def save_state(self, slot: int) -> list[list[torch.Tensor]]:
        """The slot's state, one list of tensors per stage (host copies)."""
        self._check_slot(slot)
        with self._ranks_alive():
            broadcast_object(("save_state", slot), self.groups)
            parts = gather_objects(self.runner.export_slot(slot), self.groups)
        return [parts[self.groups.rank_of(stage, 0)] for stage in range(self.groups.stages)]

    def load_state(self, slot: int, snapshot: list[list[torch.Tensor]]) -> None:
        self._check_slot(slot)
        if len(snapshot) != self.groups.stages:
            raise ValueError("state snapshot does not match this model's stages")
        with self._ranks_alive():
            broadcast_object(("load_state", slot, snapshot), self.groups)
            self.runner.import_slot(slot, snapshot[0])

    def export_blocks(self, block_ids: Sequence[int]) -> list[torch.Tensor]:
        """Each block as one uint8 host tensor: every stage's part, in stage order (the prefix cache's payload)."""
        block_ids = [self._check_block(b) for b in block_ids]
        if not block_ids:
            return []
        with self._ranks_alive():
            broadcast_object(("export_blocks", block_ids), self.groups)
            parts = gather_objects(self.runner.export_rows(block_ids), self.groups)
        stages = [parts[self.groups.rank_of(stage, 0)] for stage in range(self.groups.stages)]
        return [torch.cat([stage[i] for stage in stages]) for i in range(len(block_ids))]

    def import_blocks(self, block_ids: Sequence[int], payloads: Sequence[Any]) -> None:
        """Write payloads made by :meth:`export_blocks`: each rank takes its stage's slice of each."""
        block_ids = [self._check_block(b) for b in block_ids]
        rows = payload_rows(block_ids, payloads, sum(self._payload_bytes))
        if not rows:
            return
        per_stage, offset = [], 0
        for size in self._payload_bytes:  # clones: a pickled view would carry the whole row
            per_stage.append([row[offset:offset + size].clone() for row in rows])
            offset += size
        with self._ranks_alive():
            broadcast_object(("import_blocks", block_ids, per_stage), self.groups)
            self.runner.import_blocks(block_ids, per_stage[0])

    def close(self) -> None:
        """Stop the workers and leave the process group (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._bind_device()
        lost = self._lost_ranks()
        if lost:
            log.warning("%s", lost)
        else:
            try:
                broadcast_object(("stop",), self.groups)
            except (RuntimeError, ConnectionError) as exc:  # a rank went away meanwhile
                log.warning("could not tell every rank to stop: %s", exc)
        self.runner.release()
        stop_workers(self.workers)
        dist.destroy_process_group()

    # ------------------------------------------------------------------ checks (rank 0 only)

    def _lost_ranks(self) -> str:
        """Which worker processes have exited, in words ("" when all run, or when torchrun started them)."""
        gone = [(rank, process.exitcode) for rank, process in enumerate(self.workers, start=1)
                if not process.is_alive()]
        if not gone:
            return ""
        on_gpu = self.groups.device.type == "cuda"
        where = ", ".join(
            f"rank {rank} ({f'GPU {self.placement.device_of(rank)}' if on_gpu else 'CPU'}) exited with code {code}"
            for rank, code in gone
        )
        return f"{where}: a model split over processes cannot go on without it; restart the daemon"

    @contextmanager
    def _ranks_alive(self):
        """Run a command with every rank; a lost worker process is named rather than left as a socket error."""
        lost = self._lost_ranks()
        if lost:
            raise ParallelRankLost(lost)
        try:
            yield
        except (RuntimeError, ConnectionError) as exc:
            lost = self._lost_ranks() or self._lost_ranks_within(LOST_RANK_WAIT_S)
            if lost:
                raise ParallelRankLost(lost) from exc
            raise

    def _lost_ranks_within(self, seconds: float) -> str:
        """:meth:`_lost_ranks` once a worker process has exited, waiting up to ``seconds`` for one to: a
        killed peer's sockets close while it is still exiting, so its reset can reach this rank before its
        process is seen gone."""
        if self.workers:
            multiprocessing.connection.wait([process.sentinel for process in self.workers], timeout=seconds)
        return self._lost_ranks()

    def _bind_device(self) -> None:
        """The CUDA current device is per thread; the engine thread is not the one that loaded."""
        if self.groups.device.type == "cuda" and torch.cuda.current_device() != self.groups.device.index:
            torch.cuda.set_device(self.groups.device)

    def _check_block(self, block: int) -> int:
        if self.runner.cache is None:
            raise RuntimeError("allocate_cache() must run first")
        if not 0 <= int(block) < self._num_blocks:
            raise ValueError(f"block {block} outside 0..{self._num_blocks - 1}")
        return int(block)

    def _check_slot(self, slot: int) -> None:
        if self.runner.cache is None:
            raise RuntimeError("allocate_cache() must run first")
        if not 0 <= slot < self._max_seqs:
            raise ValueError(f"state slot {slot} outside 0..{self._max_seqs - 1}")

    def _check(self, batch: ForwardBatch) -> None:
        if self.runner.cache is None:
            raise RuntimeError("allocate_cache() must run before forward()")
        check_batch(batch, self.cfg, self._max_seqs, self._num_blocks)

def serve_torchrun_worker(
    job: TorchrunJob, path: str | Path | RandomWeights, layout: str, *, dtype: str, threads: int | None = None,
    native: bool = False, offload: OffloadOptions | None = None,
) -> None:
    """Ranks ``1 ..`` of a torchrun job: follow rank 0 (the daemon) until it stops.

    SIGINT and SIGTERM are ignored: torchrun forwards them to every rank, and a
    worker leaves when rank 0, draining on the same signal, sends ``stop``
    (or when rank 0 is gone)."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    source = path if isinstance(path, RandomWeights) else str(path)
    run_worker(job.rank, source, job.placement(layout), "env://", dtype, job.use_cuda, threads, None, native, offload)


def build_parallel_model(
    path: str | Path | RandomWeights,
    ranks: Sequence[int] | int | TorchrunJob,
    layout: str = "auto",
    *,
    dtype: str = "bfloat16",
    init_method: str | None = None,
    threads: int | None = None,
    fast_path: bool | None = None,
    native: bool = False,
    offload: OffloadOptions | None = None,
    padded_decode: bool = False,
) -> ParallelDeepseekV4Model:
    """Start the workers and join as rank 0.

    ``ranks``: the GPU indices to use (``[0, 1, 2, 3]``; one process each,
    NCCL), a number of CPU processes (gloo; for tests and development), or
    the :class:`~ds4d.parallel.launch.TorchrunJob` this process is rank 0 of.
    ``layout``: ``auto`` | ``ep`` | ``pp`` | ``SxE`` (see ``ds4d.parallel.topology``).
    ``path``: the checkpoint, or :class:`RandomWeights` (the tokenizer of its ``directory``, if it names one).
    ``native``: FP8 linears and MXFP4 experts kept as stored and multiplied by
    the Triton kernels (``weight_format = native``); else decoded to ``dtype``.
    ``offload``: each rank keeps its routed experts in host RAM and the hot
    ones on its device (``vram_bytes`` per device).
    ``padded_decode``: without CUDA, run decode steps padded to buckets as the
    graphs would (tests of that path on CPU processes).
    Call :meth:`ParallelDeepseekV4Model.close` at shutdown."""
    random = isinstance(path, RandomWeights)
    path = path if random else Path(path)
    workers = []
    if isinstance(ranks, TorchrunJob):  # torchrun started the other ranks (serve_torchrun_worker)
        if ranks.rank != 0:
            raise ValueError("only rank 0 builds the model; the other ranks run serve_torchrun_worker")
        use_cuda, placement, init_method = ranks.use_cuda, ranks.placement(layout), "env://"
    elif isinstance(ranks, int):
        use_cuda = False
        stages, ep = parse_layout(layout, ranks)
        placement = plan_placement([[0] * ranks for _ in range(ranks)], stages, ep)
    else:
        use_cuda = True
        placement, _ = plan_for_gpus(list(ranks), layout)
    log.info("%s", describe(placement))
    if not isinstance(ranks, TorchrunJob):
        init_method = init_method or free_tcp_init_method()
        workers = start_workers(
            placement.world_size,
            run_worker,
            (path if random else str(path), placement, init_method, dtype, use_cuda, threads, fast_path, native,
         offload, padded_decode),
        )
    try:
        groups = init_groups(0, placement, init_method, use_cuda=use_cuda)
    except Exception:
        stop_workers(workers, timeout_s=0)
        raise
    loaded = _attempt(
        lambda: _load_runner(path, placement, groups, torch_dtype(dtype), fast_path, native, offload, padded_decode)
    )
    reports = gather_objects((loaded[0], _facts(loaded[1]) if loaded[0] else loaded[1]), groups)
    failures = {rank: detail for rank, (ok, detail) in enumerate(reports) if not ok}
    if failures:
        broadcast_object(("stop",), groups)
        stop_workers(workers)
        dist.destroy_process_group()
        raise ParallelStartError(f"ranks failed to load their shards: {failures}")
    if random:
        tokenizer = load_tokenizer(Path(path.directory)) if path.directory else None
    else:
        tokenizer = load_tokenizer(path)
    facts = [detail for _, detail in reports]
    return ParallelDeepseekV4Model(loaded[1].cfg, loaded[1], groups, tokenizer, placement, facts, workers)
