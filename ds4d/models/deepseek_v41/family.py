"""The ``deepseek_v41`` model family plugin: recognises and loads V4.1 checkpoints.

A directory is a V4.1 checkpoint when its ``config.json`` says ``model_type:
deepseek_v41`` (the release's composite config) or ``deepseek_v41_text`` (the bare
text config HF ``save_pretrained`` writes).  Loading checks the whole directory
against the config's layout before reading (``checkpoint.py``: official FP8/FP4
shards or HF names), skips the vision and DSpark tensors (one log line), decodes
every other quantised weight to float, and keeps each Engram table as stored (FP8
with its per-row scales, or float in an HF save) in the place ``engram_storage``
picks:

* ``ram``: copied into host memory;
* ``mmap``: views of the checkpoint's copy-on-write memory maps (nothing written to
  them ever reaches the file), paged in as rows are gathered;
* ``auto``: ram when the tables fit in MemAvailable minus ``mem_watermark_gib``.

The tokenizer is the checkpoint's ``tokenizer.json``; without one, V4's with V4.1's
added tokens (``tokenizer.py``: one id there is assumed, and the load says so).

The model runs on the CPU or one CUDA device, in float32, bfloat16 or float16 (for GPUs
without bf16), through its
torch forward (no V4.1 kernels yet); the Engram tables never leave host memory
(``ram`` copies are page-locked when the device is a GPU, so the rows of a step
cross in one asynchronous copy).  Expert offload, native weights, compiled decode
and splitting over processes are refused at start with a message saying so.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ds4d.contracts import PluginContext
from ds4d.models.deepseek_v41.checkpoint import OfficialCheckpoint
from ds4d.models.deepseek_v41.config import DeepseekV41Config
from ds4d.models.deepseek_v41.layout import SCALE
from ds4d.models.deepseek_v41.model import DeepseekV41Model
from ds4d.models.deepseek_v41.paths import ForwardPaths
from ds4d.models.deepseek_v41.serving import DEFAULT_BLOCK_TOKENS, DeepseekV41Serving
from ds4d.models.deepseek_v41.tokenizer import load_tokenizer
from ds4d.registry import PluginError

MODEL_TYPES = ("deepseek_v41", "deepseek_v41_text")
ENGRAM_STORAGE = ("auto", "ram", "mmap")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": None}
GIB = 2**30


def is_engram_table(name: str) -> bool:
    return ".engram.embed." in name


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


def read_tensors(checkpoint: OfficialCheckpoint, engram_storage: str, pin: bool = False) -> dict[str, torch.Tensor]:
    """``{official name: tensor}``: quantised weights decoded to float32, Engram tables (and scales) as stored,
    copied into memory for ``ram`` (page-locked with ``pin``), left as views of the shards' maps for ``mmap``."""
    tensors = {}
    for name in checkpoint.names():
        if is_engram_table(name):
            stored = checkpoint.stored(name)
            if engram_storage == "ram":
                stored = stored.pin_memory() if pin else stored.clone()
            tensors[name] = stored
        elif checkpoint.layout[name].quant != SCALE:
            tensors[name] = checkpoint.dense(name)
    return tensors


def load_model(path: str | Path, *, engram_storage: str = "auto", mem_watermark_bytes: int = 0,
               available_bytes: int | None = None, block_tokens: int = DEFAULT_BLOCK_TOKENS,
               device: str = "cpu", dtype: torch.dtype = torch.float32, paths: ForwardPaths | None = None,
               log: logging.Logger | None = None) -> DeepseekV41Serving:
    """A servable V4.1 model from a checkpoint directory (weights and state on ``device`` in ``dtype``,
    the Engram tables in host memory; ``paths``: the device's by default)."""
    log = log or logging.getLogger("ds4d")
    path = Path(path)
    cfg = DeepseekV41Config.from_file(path)
    tokenizer, tokenizer_source = load_tokenizer(path)
    (log.info if tokenizer_source.source == "checkpoint" else log.warning)("%s", tokenizer_source.describe())
    checkpoint = OfficialCheckpoint(path, groups=("text",), log=log)
    try:
        table_bytes = engram_table_bytes(checkpoint)
        if available_bytes is None:
            import psutil

            available_bytes = psutil.virtual_memory().available
        storage = choose_engram_storage(engram_storage, table_bytes, available_bytes, mem_watermark_bytes)
        log.info("Engram tables: %.3f GiB, %s (engram_storage = %s; MemAvailable %.1f GiB, watermark %.1f GiB)",
                 table_bytes / GIB, "read into host memory" if storage == "ram" else "memory-mapped from the shards",
                 engram_storage, available_bytes / GIB, mem_watermark_bytes / GIB)
        tensors = read_tensors(checkpoint, storage, pin=torch.device(device).type == "cuda")
    finally:
        checkpoint.shards.close()  # the mapped views handed out keep their maps
    dense_bytes = sum(t.nbytes for name, t in tensors.items() if not is_engram_table(name))
    model = DeepseekV41Model.from_tensors(cfg, tensors, tokenizer, device=device, dtype=dtype, paths=paths)
    del tensors
    return DeepseekV41Serving(model, tokenizer, block_tokens=block_tokens, parameter_bytes=dense_bytes + table_bytes,
                              extra={"engram_storage": storage, "engram_table_bytes": table_bytes,
                                     "tokenizer": tokenizer_source.as_dict()})


def refuse_unserved(config: Any) -> None:
    """Knobs this family cannot honour yet: refused at start, never ignored."""
    device, dtype = str(getattr(config, "device", "cpu")), str(getattr(config, "dtype", "float32"))
    problems = []
    if device != "cpu" and not device.startswith("cuda"):
        problems.append(f"device = {device} (cpu or one cuda device)")
    if dtype.removeprefix("torch.") not in DTYPES:
        problems.append(f"dtype = {dtype} (float32, bfloat16 or float16)")
    if float(getattr(config, "expert_vram_gib", 0) or 0) > 0:
        problems.append("expert_vram_gib > 0 (no expert offload for V4.1 yet)")
    if getattr(config, "gpus", ""):
        problems.append("gpus (no split over processes for V4.1 yet)")
    if getattr(config, "weight_format", "auto") not in ("auto", "dense"):
        problems.append(f"weight_format = {config.weight_format} (V4.1 weights are decoded: auto or dense)")
    if getattr(config, "compile_decode", False) and not device.startswith("cuda"):
        problems.append("compile_decode off CUDA (it compiles the step the decode graphs capture)")
    if problems:
        raise PluginError("DeepSeek-V4.1 runs its torch forward on one device in float32, bfloat16 or float16; "
                          "unsupported: " + "; ".join(problems))


class DeepseekV41Family:
    """``ModelFamily`` plugin for DeepSeek-V4.1 (the text model)."""

    name = "deepseek_v41"

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
        self.ctx.log.info("loading DeepSeek-V4.1 checkpoint %s (%s on %s)", path, str(dtype).removeprefix("torch."),
                          device)
        watermark = int(float(getattr(config, "mem_watermark_gib", 15)) * GIB)
        paths = ForwardPaths.for_device(device).replace(compile_decode=bool(getattr(config, "compile_decode", False)))
        model = load_model(path, engram_storage=str(getattr(config, "engram_storage", "auto")),
                           mem_watermark_bytes=watermark, log=self.ctx.log, device=device, dtype=dtype, paths=paths,
                           block_tokens=int(self.options.get("block_tokens", DEFAULT_BLOCK_TOKENS)))
        self.ctx.log.info("loaded %s: %d layers, ratios %s, KV sources %s, %.1f MiB of parameters",
                          model.info.name, model.cfg.num_hidden_layers, model.info.extra["compress_ratios"],
                          list(model.cfg.kv_source_layer_ids), model.info.parameter_bytes / 2**20)
        return model
