"""OpenAI request shapes (pydantic).

Unknown fields are accepted and ignored, as OpenAI-compatible servers do
(clients send vendor extensions); known fields with wrong types or values are
rejected with a 400 naming the field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator


# the widest integer an OpenAI client's typed fields hold (int64); a larger count or seed is a client
# error (400 invalid_value), not something to clamp
INT64_MAX = 2**63 - 1
UINT64_MAX = 2**64 - 1


class _Base(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Base):
    include_usage: bool = False


class _Sampling(_Base):
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=INT64_MAX)
    seed: int | None = Field(default=None, ge=-(2**63), le=UINT64_MAX)  # what a torch generator takes
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=1)
    ignore_eos: bool = False
    cache_salt: str | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 16:
            raise ValueError("at most 16 stop sequences")
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


REASONING_EFFORT_LEVELS = ("low", "medium", "high", "max", "xhigh")


def _reasoning_effort(value: Any) -> str | int | None:
    """A level name or an integer 1-100 (a decimal string of one is taken as the integer);
    what each means is the chat encoder's business (README: reasoning effort)."""
    if value is None or value in REASONING_EFFORT_LEVELS:
        return value
    if isinstance(value, str) and value.isascii() and value.isdigit():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 100:
        return value
    raise ValueError(f"must be one of {', '.join(REASONING_EFFORT_LEVELS)} or an integer from 1 to 100, "
                     f"not {value!r}"[:200])


ReasoningEffort = Annotated[
    Literal["low", "medium", "high", "max", "xhigh"] | Annotated[int, Field(ge=1, le=100)] | None,
    BeforeValidator(_reasoning_effort),
]


class ChatMessage(_Base):
    role: Literal["system", "developer", "user", "assistant", "tool", "latest_reminder"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=INT64_MAX)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT64_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: ReasoningEffort = None

    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0, le=INT64_MAX)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be empty")
            if isinstance(v[0], (str, list)) and len(v) != 1:
                raise ValueError("only one prompt per request is supported")
        elif isinstance(v, str) and not v:
            raise ValueError("prompt must not be empty")
        return v


class TokenizeRequest(_Base):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: ReasoningEffort = None
    add_special_tokens: bool = False


class DetokenizeRequest(_Base):
    model: str | None = None
    tokens: list[int]


# --------------------------------------------------------------------------- response shapes (documentation)
#
# The handlers build their JSON directly; these models only describe it for the
# OpenAPI document (ds4d/server/openapi.py), and the fuzz tests check every
# response against them.


class ErrorDetail(_Base):
    message: str
    type: str
    param: str | None
    code: str


class ErrorResponse(_Base):
    error: ErrorDetail


class PromptTokensDetails(_Base):
    cached_tokens: int


class CompletionTokensDetails(_Base):
    reasoning_tokens: int


class Usage(_Base):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails
    ds4d: dict[str, Any] | None = None


class ToolCallFunction(_Base):
    name: str
    arguments: str


class ToolCall(_Base):
    id: str
    type: Literal["function"]
    function: ToolCallFunction


class AssistantMessage(_Base):
    role: Literal["assistant"]
    content: str
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_Base):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: dict[str, Any] | None


class ChatCompletion(_Base):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(_Base):
    index: int
    text: str
    finish_reason: str | None
    logprobs: dict[str, Any] | None


class Completion(_Base):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ModelCard(_Base):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(_Base):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(_Base):
    tokens: list[int]
    count: int
    prompt: str
    max_model_len: int


class DetokenizeResponse(_Base):
    prompt: str


class HealthResponse(_Base):
    status: str
    reason: str | None = None


class ReadyResponse(_Base):
    ready: bool
    reasons: list[str]
