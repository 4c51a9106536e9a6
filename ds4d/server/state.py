"""What the HTTP handlers share: the resolved components of a running daemon."""

from __future__ import annotations

import itertools
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from ds4d.config import LoadedConfig
from ds4d.contracts import ChatEncoder, ModelInfo, ReasoningParser, Tokenizer, ToolCallParser
from ds4d.engine.client import EngineClient
from ds4d.engine.core import EngineCore
from ds4d.server.errors import ApiError


@dataclass
class ServingState:
    loaded: LoadedConfig
    info: ModelInfo
    tokenizer: Tokenizer
    encoder: ChatEncoder
    reasoning: ReasoningParser
    tools: ToolCallParser
    core: EngineCore
    client: EngineClient
    served_model_name: str
    max_context_tokens: int
    plugins: dict[str, str]
    started_at: float = field(default_factory=time.time)
    draining: bool = False
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

    def check_alive(self) -> None:
        if not self.core.alive:
            raise ApiError(503, "the engine is not running", type="server_error", code="engine_dead")
        if self.draining:
            raise ApiError(503, "the server is shutting down", type="server_error", code="shutting_down",
                           headers={"Retry-After": "5"})
        if len(self.core.scheduler.waiting) >= self.config.max_queued_requests:
            raise ApiError(503, "too many queued requests; retry later", type="server_error", code="overloaded",
                           headers={"Retry-After": "2"})

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


STATE = web.AppKey("state", ServingState)
