"""What the HTTP handlers share: the resolved components of a running daemon, and admission.

The listener starts before the model is loaded, so the app holds a
:class:`Lifecycle` whose ``state`` is None while loading; API routes answer
503 ``loading`` until it is set.  Admission (``check_alive``,
``check_queue_room``) runs before any stream starts, so a refused request
always gets a plain OpenAI error with ``Retry-After``.
"""

from __future__ import annotations

import itertools
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import psutil
from aiohttp import web

from ds4d.config import GIB, Config, LoadedConfig
from ds4d.contracts import ChatEncoder, ModelInfo, ReasoningParser, Tokenizer, ToolCallParser
from ds4d.engine.client import EngineClient
from ds4d.server.errors import ApiError
from ds4d.server.sessions import SessionMemory


def host_mem_available_bytes() -> int:
    return psutil.virtual_memory().available


@dataclass
class ServingState:
    loaded: LoadedConfig
    info: ModelInfo
    tokenizer: Tokenizer
    encoder: ChatEncoder
    reasoning: ReasoningParser
    tools: ToolCallParser
    client: EngineClient
    """The one door to the engine thread."""
    served_model_name: str
    max_context_tokens: int
    plugins: dict[str, str]
    sessions: SessionMemory
    memory_plan: dict | None = None
    """The GPU memory plan made at start (``GpuMemoryPlan.as_dict``), None without one."""
    warmup: dict | None = None
    """What the warm-up before serving ran and how long it took (``WarmupReport.as_dict``), None without one."""
    started_at: float = field(default_factory=time.time)
    draining: bool = False
    malformed_tool_calls_total: int = 0
    _ids: Any = field(default_factory=lambda: itertools.count(1))

    @property
    def config(self):
        return self.loaded.config

    def new_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}{secrets.token_hex(4)}"

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.served_model_name:
            raise ApiError(404, f"model {name!r} does not exist; this server serves {self.served_model_name!r}",
                           type="not_found_error", param="model", code="model_not_found")

    def memory_state(self) -> tuple[str, int]:
        """("ok" | "below_watermark" | "below_floor", MemAvailable bytes).

        Below the floor new work is refused; below the watermark /ready is false
        (and cache tiers shed) but requests are still admitted, so a host that
        simply has less free RAM than the watermark keeps serving."""
        available = host_mem_available_bytes()
        if available < self.config.mem_floor_gib * GIB:
            return "below_floor", available
        if available < self.config.mem_watermark_gib * GIB:
            return "below_watermark", available
        return "ok", available

    def check_alive(self) -> None:
        """Refuse new work that cannot start now: dead engine, draining, host memory, full queue."""
        if not self.client.alive:
            raise ApiError(503, "the engine is not running", type="server_error", code="engine_dead")
        if self.draining:
            raise ApiError(503, "the server is shutting down", type="server_error", code="shutting_down",
                           headers={"Retry-After": "5"})
        memory, available = self.memory_state()
        if memory == "below_floor":
            raise ApiError(503, f"host memory is low ({available / GIB:.1f} GiB available, floor "
                           f"{self.config.mem_floor_gib:g} GiB); retry later", type="server_error",
                           code="insufficient_memory", headers={"Retry-After": "5"})
        if self.client.num_queued >= self.config.max_queued_requests:
            raise ApiError(503, f"too many queued requests ({self.client.num_queued}); retry later",
                           type="server_error", code="overloaded", headers={"Retry-After": "2"})

    def check_queue_room(self, prompt_tokens: int) -> None:
        """503 when the queued prompt tokens would pass max_queued_tokens.  An empty queue
        always takes the request, so no prompt that fits the context is refused forever."""
        cap = self.config.max_queued_tokens
        queued = self.client.queued_tokens
        if cap and queued and queued + prompt_tokens > cap:
            raise ApiError(503, f"too many queued prompt tokens ({queued} + {prompt_tokens} > {cap}); retry later",
                           type="server_error", code="overloaded", headers={"Retry-After": "2"})

    def output_budget(self, prompt_tokens: int, requested: int | None) -> int:
        """Tokens the request may generate; 400 if the prompt alone does not fit."""
        limit = self.max_context_tokens
        if prompt_tokens >= limit:
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your prompt has "
                f"{prompt_tokens} tokens. Please reduce the length of the messages.",
                param="messages", code="context_length_exceeded")
        room = limit - prompt_tokens
        return room if requested is None else min(requested, room)


class Lifecycle:
    """The daemon's phase as HTTP sees it: loading -> serving (state set) -> draining.

    ``state`` stays None until the model is loaded and the engine runs."""

    def __init__(self, config: Config, state: ServingState | None = None) -> None:
        self.config = config
        self.state = state

    @property
    def phase(self) -> str:
        if self.state is None:
            return "loading"
        if not self.state.client.alive:
            return "dead"
        return "draining" if self.state.draining else "ready"


LIFECYCLE = web.AppKey("lifecycle", Lifecycle)
API_KEY = web.RequestKey("api_key", str)  # the caller's key, set by the auth middleware


def serving_state(request: web.Request) -> ServingState:
    """The running daemon's state; 503 ``loading`` while the model is still loading."""
    state = request.app[LIFECYCLE].state
    if state is None:
        raise ApiError(503, "the model is still loading; retry shortly", type="server_error", code="loading",
                       headers={"Retry-After": "5"})
    return state
