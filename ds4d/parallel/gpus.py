"""The ``gpus`` knob: which processes one model is split over, and what a family needs to honour it.

``"0,1,2,3"``: one process per GPU index (NCCL); ``"cpu:2"``: that many CPU
processes (gloo); ``"torchrun"``: this process is one rank of a job torchrun
started (one host or several).  Empty: one process, no split.

Only a :class:`SplitModelFamily` is given ``gpus`` or ``expert_vram_gib``; the
kernel refuses both at start for any other family.  Imports no torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

from ds4d.contracts import ModelFamily
from ds4d.registry import PluginError

TORCHRUN = "torchrun"
"""``gpus`` value: this process is one rank of a job torchrun started (one or several hosts)."""


def parse_gpus(text: str) -> list[int] | int | str:
    """``gpus`` knob: ``"0,1,2,3"`` -> GPU indices; ``"cpu:2"`` -> 2 CPU processes; ``"torchrun"``."""
    text = text.strip().lower()
    if text == TORCHRUN:
        return TORCHRUN
    if text.startswith("cpu:"):
        count = text[4:]
        if not count.isdigit() or int(count) < 1:
            raise PluginError(f"gpus={text!r}: cpu:N needs a process count N >= 1")
        return int(count)
    try:
        ranks = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise PluginError(f"gpus={text!r}: give GPU indices such as 0,1,2,3 (or cpu:N, or torchrun)") from None
    if not ranks or len(set(ranks)) != len(ranks) or min(ranks) < 0:
        raise PluginError(f"gpus={text!r}: give distinct GPU indices such as 0,1,2,3")
    return ranks


def is_torchrun(text: str) -> bool:
    return text.strip().lower() == TORCHRUN


@runtime_checkable
class SplitModelFamily(ModelFamily, Protocol):
    """A family whose ``load`` also honours ``gpus`` (one model over several processes; the model it
    returns then is a :class:`ClosableModel`) and ``expert_vram_gib`` (routed experts partly in host RAM)."""

    def serve_worker(self, path: Path) -> None:
        """``ds4d serve`` on a torchrun rank other than 0: load this rank's part of the model and
        follow rank 0 until it stops."""


@runtime_checkable
class ClosableModel(Protocol):
    """A model holding worker processes or a process group: the kernel closes it once at shutdown,
    after the engine stopped."""

    def close(self) -> None: ...
