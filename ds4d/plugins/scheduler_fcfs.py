"""First-come, first-served scheduling policy.

Waiting requests are admitted in arrival order; when KV blocks run out the
most recently arrived running request is preempted, so the oldest request
always keeps its blocks and finishes (the engine's progress guarantee relies on
the victim never being the oldest running request while another exists).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ds4d.contracts import PluginContext, SchedulableRequest


class FcfsPolicy:
    name = "fcfs"

    def __init__(self, ctx: PluginContext, options: Mapping[str, Any] | None = None) -> None:
        self._ctx = ctx

    def order_waiting(self, waiting: Sequence[SchedulableRequest]) -> list[SchedulableRequest]:
        return sorted(waiting, key=lambda r: r.arrival_time)

    def choose_victim(self, running: Sequence[SchedulableRequest]) -> SchedulableRequest:
        return max(running, key=lambda r: r.arrival_time)
