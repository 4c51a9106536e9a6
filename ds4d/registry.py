"""Plugin registry: kind + name -> factory.

Built-in plugins are declared as entry points in pyproject.toml (groups
``ds4d.<kind>``), exactly like third-party ones, and resolved through
``importlib.metadata``.  The table below mirrors those declarations so a plain
source tree (no installed distribution, e.g. a benchmark run on a GPU box) still
finds the built-ins; a test keeps the two in sync.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

KINDS = ("model_family", "chat_encoder", "reasoning_parser", "tool_parser", "scheduler_policy", "cache_tier")

BUILTINS: dict[str, dict[str, str]] = {
    "model_family": {
        "llama": "ds4d.models.llama:LlamaFamily",
        "deepseek_v4": "ds4d.models.deepseek_v4:DeepseekV4Family",
        "deepseek_v41": "ds4d.models.deepseek_v41.family:DeepseekV41Family",
    },
    "chat_encoder": {
        "jinja": "ds4d.plugins.jinja_encoder:JinjaChatEncoder",
        "deepseek_v4": "ds4d.plugins.dsv4_encoder:DeepseekV4ChatEncoder",
        "deepseek_v41": "ds4d.plugins.dsv41_encoder:DeepseekV41ChatEncoder",
        "chatml": "ds4d.plugins.chatml_encoder:ChatMLEncoder",
    },
    "reasoning_parser": {
        "none": "ds4d.plugins.passthrough:NoReasoningParser",
        "deepseek_v4": "ds4d.plugins.dsv4_reasoning:DeepseekV4ReasoningParser",
        "deepseek_v41": "ds4d.plugins.dsv4_reasoning:DeepseekV41ReasoningParser",
    },
    "tool_parser": {
        "none": "ds4d.plugins.passthrough:NoToolParser",
        "dsml": "ds4d.plugins.dsml_tools:DsmlToolParser",
        "dsml_v41": "ds4d.plugins.dsml_tools:DsmlV41ToolParser",
    },
    "scheduler_policy": {
        "fcfs": "ds4d.plugins.scheduler_fcfs:FcfsPolicy",
    },
    "cache_tier": {
        "gpu": "ds4d.cache.tiers:GpuTier",
        "ram": "ds4d.cache.ram:RamTier",
        "disk": "ds4d.cache.disk:DiskTier",
    },
}


class PluginError(LookupError):
    pass


@dataclass(frozen=True)
class PluginSpec:
    kind: str
    name: str
    target: str
    origin: str  # "entry point" or "built-in table"

    def load(self) -> Any:
        module_name, _, attr = self.target.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise PluginError(f"{self.kind} plugin {self.name!r}: cannot import {module_name}: {exc}") from exc
        try:
            return getattr(module, attr)
        except AttributeError:
            raise PluginError(f"{self.kind} plugin {self.name!r}: {module_name} has no {attr}") from None


def available(kind: str) -> dict[str, PluginSpec]:
    """Every plugin of ``kind``: entry points first, built-in table for what they lack."""
    if kind not in KINDS:
        raise PluginError(f"unknown plugin kind {kind!r}")
    found = {name: PluginSpec(kind, name, target, "built-in table") for name, target in BUILTINS[kind].items()}
    for ep in entry_points(group=f"ds4d.{kind}"):
        found[ep.name] = PluginSpec(kind, ep.name, ep.value, "entry point")
    return found


def resolve(kind: str, name: str) -> Any:
    """The factory registered as ``name`` for ``kind``."""
    specs = available(kind)
    if name not in specs:
        raise PluginError(f"no {kind} plugin named {name!r} (installed: {', '.join(sorted(specs)) or 'none'})")
    return specs[name].load()
