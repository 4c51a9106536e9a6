"""The ``deepseek_v41`` model family plugin: recognises and loads V4.1 checkpoints.

A directory is a V4.1 checkpoint when its ``config.json`` says ``model_type:
deepseek_v41`` (the release's composite config) or ``deepseek_v41_text`` (the bare
text config HF ``save_pretrained`` writes).  Loading checks the whole directory
against the config's layout before reading (``checkpoint.py``: official FP8/FP4
shards or HF names), skips the vision and DSpark tensors (one log line), and reads
the tensors one at a time as the model is built (one decoded tensor in host memory at
once).  ``weight_format`` picks what happens to the FP8 linears (e8m0 scales per
32 x 32) and the routed experts' FP4: ``native`` keeps values, codes and scales as
stored on the device (half and a quarter of bf16's bytes, read by V4's FP8 and MXFP4
kernels; CUDA, bfloat16 or float16; the FP8 linears only from compute capability 8.9),
``dense`` decodes them to the activation dtype, ``auto`` is native where it can run.
Each Engram table stays as stored (FP8 with its per-row scales, or float in an HF
save) in the place ``engram_storage`` picks:

* ``ram``: copied into host memory;
* ``mmap``: views of the checkpoint's copy-on-write memory maps (nothing written to
  them ever reaches the file), paged in as rows are gathered;
* ``auto``: ram when the tables fit in MemAvailable minus ``mem_watermark_gib``.

The tokenizer is the checkpoint's ``tokenizer.json``; without one, V4's with V4.1's
added tokens (``tokenizer.py``: one id there is assumed, and the load says so).

The model runs on the CPU or one CUDA device, in float32, bfloat16 or float16 (for GPUs
without bf16), through its
torch forward and V4's kernels (``paths.py``); the Engram tables never leave host memory
(``ram`` copies are page-locked when the device is a GPU, so the rows of a step
cross in one asynchronous copy).  With ``expert_vram_gib`` > 0 the routed experts are
split between the device (the hot ones, within that budget) and page-locked host RAM
as they are read (``offload.py``: V4's expert offload with V4.1's arithmetic, and V4's
``expert_*`` knobs).  ``int4``, compiled decode off CUDA and splitting over processes
are refused at start with a message saying so.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ds4d.contracts import PluginContext
from ds4d.cuda import quant_matmul
from ds4d.models.deepseek_v4.knobs import offload_options
from ds4d.models.deepseek_v4.offload import OffloadOptions
from ds4d.models.deepseek_v4.stored import Fp8Weight
from ds4d.models.deepseek_v41.checkpoint import OfficialCheckpoint
from ds4d.models.deepseek_v41.config import DeepseekV41Config
from ds4d.models.deepseek_v41.layout import FP4, FP8, SCALE, is_engram_table
from ds4d.models.deepseek_v41.model import DeepseekV41Model
from ds4d.models.deepseek_v41.paths import ForwardPaths
from ds4d.models.deepseek_v41.random_init import RandomTensors
from ds4d.models.deepseek_v41.serving import DEFAULT_BLOCK_TOKENS, DeepseekV41Serving
from ds4d.models.deepseek_v41.tokenizer import load_tokenizer
from ds4d.registry import PluginError

MODEL_TYPES = ("deepseek_v41", "deepseek_v41_text")
ENGRAM_STORAGE = ("auto", "ram", "mmap")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": None}
GIB = 2**30


def engram_table_bytes(checkpoint: OfficialCheckpoint) -> int:
    """Bytes the Engram tables (and their scales) take as stored."""
    return sum(checkpoint.stored(name).nbytes for name in checkpoint.names() if is_engram_table(name))


def choose_engram_storage(wanted: str, table_bytes: int, available_bytes: int, watermark_bytes: int) -> str:
    """``ram`` or ``mmap`` for the ``engram_storage`` knob (auto: ram when the tables fit above the watermark)."""
    if wanted not in ENGRAM_STORAGE:
        raise ValueError(f"engram_storage {wanted!r}: use one of {', '.join(ENGRAM_STORAGE)}")
    if wanted != "auto":
        return wanted
    return "ram" if table_bytes <= available_bytes - watermark_bytes else "mmap"


class CheckpointTensors(Mapping):
    """``{official name: tensor}`` over a checked checkpoint, read when a name is looked up.

    Quantised weights come decoded to float32, except those of the kinds in ``stored`` (``fp8``: the
    FP8 linears, ``fp4``: the routed experts), which come as stored (e4m3 values or FP4 codes under
    ``.weight``, e8m0 scales under ``.scale``);
    the Engram tables (and scales) come as stored, copied into memory once for ``ram``
    (page-locked with ``pin``), views of the shards' maps for ``mmap``.  A model built from
    it reads each tensor once, so the host holds one decoded tensor at a time."""

    def __init__(self, checkpoint: OfficialCheckpoint, engram_storage: str, *, pin: bool = False,
                 stored: tuple[str, ...] = ()) -> None:
        self.checkpoint, self.storage, self.pin = checkpoint, engram_storage, pin
        self._tables: dict[str, torch.Tensor] = {}
        layout = checkpoint.layout
        self._stored = {name for name in checkpoint.names()
                        if is_engram_table(name) or _quantised_kind(layout, name) in stored}
        self._names = [name for name in checkpoint.names() if name in self._stored or layout[name].quant != SCALE]

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._stored:
            if name not in self._names:
                raise KeyError(name)
            return self.checkpoint.dense(name)
        if not is_engram_table(name):
            return self.checkpoint.stored(name)
        if name not in self._tables:
            stored = self.checkpoint.stored(name)
            if self.storage == "ram":
                stored = stored.pin_memory() if self.pin else stored.clone()
            self._tables[name] = stored
        return self._tables[name]

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def _quantised_kind(layout, name: str) -> str | None:
    """``fp8`` or ``fp4`` for a quantised weight or its scale (the checkpoint lists no scale of a weight
    it stores decoded), else None."""
    spec = layout[name]
    if spec.quant == SCALE:
        spec = layout[name.removesuffix("scale") + "weight"]
    return spec.quant if spec.is_quantized else None


FP8_CAPABILITY = (8, 9)
"""The first CUDA compute capability whose Triton has the e4m3 type (Ada, Hopper): the FP8 kernels' need."""


def stored_weight_choice(weight_format: str, dtype: torch.dtype, device: str,
                         capability: tuple[int, int] | None = None) -> tuple[str, ...]:
    """Which quantised weights stay as stored (``weight_format`` auto | dense | native): ``()``,
    ``("fp4",)`` or ``("fp8", "fp4")``.  ``native`` needs a CUDA device, Triton and bfloat16 or float16
    activations; ``auto`` is native there.  The routed experts' FP4 codes are plain bytes to the
    kernels; the FP8 linears need a device of compute capability 8.9 or more (``capability``: the
    device's, read when not given), and are decoded below it (a V100 keeps only the experts as stored)."""
    if weight_format not in ("auto", "dense", "native"):
        raise ValueError(f"weight_format {weight_format!r}: DeepSeek-V4.1 takes auto, dense or native")
    usable = (torch.device(device).type == "cuda" and dtype in (torch.bfloat16, torch.float16)
              and quant_matmul.available())
    if weight_format == "native" and not usable:
        raise ValueError(f"weight_format native needs a CUDA device, bfloat16 or float16 and Triton "
                         f"(here: {device}, {str(dtype).removeprefix('torch.')})")
    if weight_format == "dense" or not usable:
        return ()
    if capability is None:
        capability = torch.cuda.get_device_capability(torch.device(device))
    return (FP8, FP4) if tuple(capability) >= FP8_CAPABILITY else (FP4,)


def load_model(path: str | Path, *, engram_storage: str = "auto", mem_watermark_bytes: int = 0,
               available_bytes: int | None = None, block_tokens: int = DEFAULT_BLOCK_TOKENS,
               device: str = "cpu", dtype: torch.dtype = torch.float32, paths: ForwardPaths | None = None,
               weight_format: str = "auto", offload: OffloadOptions | None = None,
               log: logging.Logger | None = None, load_format: str = "auto") -> DeepseekV41Serving:
    """A servable V4.1 model from a checkpoint directory (weights and state on ``device`` in ``dtype``,
    the Engram tables in host memory; ``paths``: the device's by default; ``weight_format``: which
    quantised weights stay as stored, :func:`stored_weight_choice`; ``offload``: the routed experts
    split over the device and host RAM; ``load_format`` random: weights drawn at random for the
    directory's config.json, ``random_init.py``, the Engram tables in host memory)."""
    log = log or logging.getLogger("ds4d")
    path = Path(path)
    cfg = DeepseekV41Config.from_file(path)
    tokenizer, tokenizer_source = load_tokenizer(path)
    (log.info if tokenizer_source.source == "checkpoint" else log.warning)("%s", tokenizer_source.describe())
    stored = stored_weight_choice(weight_format, dtype, device)
    if available_bytes is None:
        import psutil

        available_bytes = psutil.virtual_memory().available
    pin = torch.device(device).type == "cuda"
    checkpoint = None
    try:
        if load_format == "random":
            tensors = RandomTensors(json.loads((path / "config.json").read_text(encoding="utf-8")), device=device,
                                    stored=stored, pin=pin)
            table_bytes = tensors.table_bytes()
            storage = choose_engram_storage(engram_storage, table_bytes, available_bytes, mem_watermark_bytes)
            if storage != "ram":
                raise PluginError(f"load_format random draws the Engram tables into host memory: "
                                  f"{table_bytes / GIB:.1f} GiB do not fit (MemAvailable "
                                  f"{available_bytes / GIB:.1f} GiB, watermark {mem_watermark_bytes / GIB:.1f} GiB) "
                                  "or engram_storage is mmap")
        else:
            checkpoint = OfficialCheckpoint(path, groups=("text",), log=log)
            table_bytes = engram_table_bytes(checkpoint)
            storage = choose_engram_storage(engram_storage, table_bytes, available_bytes, mem_watermark_bytes)
            tensors = CheckpointTensors(checkpoint, storage, pin=pin, stored=stored)
        log.info("Engram tables: %.3f GiB, %s (engram_storage = %s; MemAvailable %.1f GiB, watermark %.1f GiB)",
                 table_bytes / GIB, "read into host memory" if storage == "ram" else "memory-mapped from the shards",
                 engram_storage, available_bytes / GIB, mem_watermark_bytes / GIB)
        model = DeepseekV41Model.from_tensors(cfg, tensors, tokenizer, device=device, dtype=dtype, paths=paths,
                                              stored_weights=bool(stored), offload=offload)
    finally:
        if checkpoint is not None:
            checkpoint.shards.close()  # the mapped views handed out keep their maps
    del tensors
    experts = model.expert_offload
    weight_bytes = model.weights.parameter_bytes()
    if experts is None:
        expert_bytes = sum(layer.ffn.banks.stored_bytes() for layer in model.weights.layers)
        experts_stored = model.weights.layers[0].ffn.banks.stored
    else:
        expert_bytes, experts_stored = experts.stored_bytes, experts.native
        weight_bytes += expert_bytes
    first = model.weights.layers[0]  # what the model holds (a checkpoint may store weights decoded)
    kept = tuple(kind for kind, held in ((FP8, isinstance(first.attn.wq_a, Fp8Weight)), (FP4, experts_stored))
                 if held)
    decoded = f"decoded to {str(dtype).removeprefix('torch.')}"
    held = {(FP8, FP4): "FP8 linears and FP4 experts as stored", (FP4,): f"FP4 experts as stored, FP8 linears {decoded}",
            (FP8,): f"FP8 linears as stored, routed experts {decoded}", (): decoded}[kept]
    log.info("weights: %s, %.2f GiB (routed experts %.2f GiB; weight_format = %s)", held, weight_bytes / GIB,
             expert_bytes / GIB, weight_format)
    if experts is not None:
        experts.log_memory_plan(log, weight_bytes - expert_bytes)
    return DeepseekV41Serving(model, tokenizer, block_tokens=block_tokens, parameter_bytes=weight_bytes + table_bytes,
                              extra={"engram_storage": storage, "engram_table_bytes": table_bytes,
                                     "stored_weights": list(kept), "tokenizer": tokenizer_source.as_dict()})


def refuse_unserved(config: Any) -> None:
    """Knobs this family cannot honour yet: refused at start, never ignored."""
    device, dtype = str(getattr(config, "device", "cpu")), str(getattr(config, "dtype", "float32"))
    problems = []
    if device != "cpu" and not device.startswith("cuda"):
        problems.append(f"device = {device} (cpu or one cuda device)")
    if dtype.removeprefix("torch.") not in DTYPES:
        problems.append(f"dtype = {dtype} (float32, bfloat16 or float16)")
    if getattr(config, "gpus", ""):
        problems.append("gpus (no split over processes for V4.1 yet)")
    weight_format = getattr(config, "weight_format", "auto")
    if weight_format not in ("auto", "dense", "native"):
        problems.append(f"weight_format = {weight_format} (V4.1 takes auto, dense or native)")
    elif weight_format == "native":
        try:
            stored_weight_choice(weight_format, DTYPES.get(dtype.removeprefix("torch.")) or torch.bfloat16, device)
        except ValueError as error:
            problems.append(str(error))
    if getattr(config, "compile_decode", False) and not device.startswith("cuda"):
        problems.append("compile_decode off CUDA (it compiles the step the decode graphs capture)")
    if problems:
        raise PluginError("DeepSeek-V4.1 runs its torch forward on one device in float32, bfloat16 or float16; "
                          "unsupported: " + "; ".join(problems))


class DeepseekV41Family:
    """``ModelFamily`` plugin for DeepSeek-V4.1 (the text model)."""

    name = "deepseek_v41"
    offloads_experts = True
    """``expert_vram_gib`` is honoured (``offload.py``); ``gpus`` is not."""
    random_formats = ("random",)
    """The random ``load_format`` honoured (``random_init.py``)."""

    def __init__(self, ctx: PluginContext, options: Mapping[str, Any] | None = None) -> None:
        self.ctx = ctx
        self.options = dict(options or {})

    def can_load(self, path: Path) -> bool:
        config = Path(path) / "config.json"
        if not config.is_file():
            return False
        try:
            return json.loads(config.read_text(encoding="utf-8")).get("model_type") in MODEL_TYPES
        except (OSError, ValueError):
            return False

    def load(self, path: Path) -> DeepseekV41Serving:
        config = self.ctx.config
        refuse_unserved(config)
        device = str(getattr(config, "device", "cpu"))
        dtype = DTYPES[str(getattr(config, "dtype", "float32")).removeprefix("torch.")]
        dtype = dtype or (torch.float32 if device == "cpu" else torch.bfloat16)
        load_format = str(getattr(config, "load_format", "auto"))
        if load_format == "random":
            self.ctx.log.warning("load_format = random: RANDOM WEIGHTS for %s/config.json (a benchmark mode: "
                                 "the output is noise)", path)
        self.ctx.log.info("loading DeepSeek-V4.1 checkpoint %s (%s on %s)", path, str(dtype).removeprefix("torch."),
                          device)
        watermark = int(float(getattr(config, "mem_watermark_gib", 15)) * GIB)
        paths = ForwardPaths.for_device(device).replace(compile_decode=bool(getattr(config, "compile_decode", False)))
        model = load_model(path, engram_storage=str(getattr(config, "engram_storage", "auto")),
                           mem_watermark_bytes=watermark, log=self.ctx.log, device=device, dtype=dtype, paths=paths,
                           weight_format=str(getattr(config, "weight_format", "auto")),
                           offload=offload_options(config, self.options),
                           block_tokens=int(self.options.get("block_tokens", DEFAULT_BLOCK_TOKENS)),
                           load_format=load_format)
        self.ctx.log.info("loaded %s: %d layers, ratios %s, KV sources %s, %.1f MiB of parameters",
                          model.info.name, model.cfg.num_hidden_layers, model.info.extra["compress_ratios"],
                          list(model.cfg.kv_source_layer_ids), model.info.parameter_bytes / 2**20)
        return model
