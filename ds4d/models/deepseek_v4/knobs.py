"""What the daemon's knobs mean for a DeepSeek-V4 model: dtype, weight format, expert offload, split.

The family (``family.py``) and the split model's ranks (``parallel.py``) both read
the config through these, so a knob means the same on one process and on many.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ds4d.cuda import quant_matmul
from ds4d.models.deepseek_v4.calibrate import read_counts
from ds4d.models.deepseek_v4.offload import OffloadOptions
from ds4d.registry import PluginError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """``dtype`` knob (``float32``, ``bf16``, ``torch.bfloat16``, ...) -> the torch dtype."""
    key = str(name).removeprefix("torch.")
    key = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(key, key)
    if key not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r} (use one of {', '.join(_DTYPES)})")
    return _DTYPES[key]


def native_weights(weight_format: str, dtype: torch.dtype, device: str) -> bool:
    """Whether FP8 linears and MXFP4 experts stay as stored (``weight_format``: auto | dense | native)."""
    usable = torch.device(device).type == "cuda" and dtype == torch.bfloat16 and quant_matmul.available()
    if weight_format == "native" and not usable:
        raise ValueError(f"weight_format native needs a CUDA device, bfloat16 and Triton (here: {device}, {dtype})")
    if weight_format not in ("auto", "dense", "native"):
        raise ValueError(f"weight_format {weight_format!r}: DeepSeek-V4 takes auto, dense or native")
    return weight_format == "native" or (weight_format == "auto" and usable)


def fetch_ahead(config: Any, rows: int) -> int:
    """``expert_fetch_ahead`` where it applies: a CUDA device, whose side stream the copies overlap on (the CPU
    would run them in line, before the layer, for nothing)."""
    return rows if str(getattr(config, "device", "cpu")).startswith("cuda") else 0


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
        fetch_ahead=fetch_ahead(config, int(knob("expert_fetch_ahead", 12))),
        mem_watermark_bytes=int(float(knob("mem_watermark_gib", 15)) * 2**30),
        calibration=read_counts(calibration_file) if calibration_file else None,
    )


OFFLOAD_PREFILL_BLOCK = 4096
"""``prefill_block`` 0 (auto) with routed experts offloaded: the default ``prefill_chunk``'s activations."""


def prefill_block(config: Any, offloaded: bool) -> int:
    """Rows a layer takes at once in a larger prompt step (``ForwardPaths.prefill_block``; 0 = the whole step)."""
    block = int(getattr(config, "prefill_block", 0) or 0)
    return block or (OFFLOAD_PREFILL_BLOCK if offloaded else 0)


def check_split_knobs(config: Any) -> None:
    """Knobs a model split over ``gpus`` cannot honour: refused at start, not ignored."""
    if config.weight_format == "int4":
        raise PluginError(f"weight_format=int4 is for GGUF files; a model split over gpus={config.gpus!r} takes "
                          "auto, dense or native")


def split_native(config: Any, on_cuda: bool) -> bool:
    """Whether a split model keeps FP8/MXFP4 weights as stored (only with ``weight_format = native``)."""
    if config.weight_format == "auto":
        return False  # decoded weights when split, unless native is asked for
    try:
        return native_weights(config.weight_format, torch_dtype(config.resolved_dtype()), "cuda" if on_cuda else "cpu")
    except ValueError as exc:
        raise PluginError(str(exc)) from None
