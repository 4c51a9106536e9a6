"""Request state as the engine thread sees it, and the messages it publishes.

A request is created on the asyncio side (``EngineRequest``: prompt ids and
sampling parameters, immutable) and owned by the engine thread afterwards
(``Sequence``: mutable progress).  Outputs travel back as ``StepOutput``.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from ds4d.contracts import TokenConstraint


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 = no top-k cut."""
    seed: int | None = None
    max_tokens: int = 256
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    logprobs: int | None = None
    """Return the sampled token's logprob plus this many top alternatives."""
    prompt_logprobs: int | None = None
    """Return a logprob entry for every prompt token (echo), with this many alternatives."""
    constraint: TokenConstraint | None = field(default=None, compare=False)
    """Restricts which tokens may be sampled (applied before greedy/temperature sampling)."""

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    cache_salt: str = ""
    arrival_time: float = field(default_factory=time.monotonic)
    volatile_tail: int = 0
    """The last this-many prompt tokens are a hand-over that the conversation's next request
    renders differently (DeepSeek-V4 in thinking mode without tools: the ``<think>`` that opens
    this turn's reasoning is ``</think>`` once the turn is history).  A model with per-sequence
    state also saves a checkpoint just before them, so that next request reuses the prompt up to
    there.  0 = none."""
    stable_prefix: int = 0
    """Leading prompt tokens other conversations are likely to repeat exactly: the system prompt
    and the tool declarations, as the chat encoder rendered them (0 = not known).  A model with
    per-sequence state checkpoints there, so a new session or a subagent with the same system
    prompt resumes after it."""
    message_starts: tuple[int, ...] = ()
    """Prompt positions where a chat message begins; a model with per-sequence state checkpoints
    at some of them (``ds4d.engine.checkpoint_plan``)."""


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"
    TIMEOUT = "timeout"


@dataclass(frozen=True)
class StepOutput:
    """What one engine step produced for one request."""

    request_id: str
    new_token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob | None, ...] = ()
    """Entries for prompt positions computed this step (None for position 0)."""
    finish_reason: FinishReason | None = None
    error: str | None = None
    cached_tokens: int = 0
    """Prompt tokens served from the prefix cache (final once prefill starts)."""
    cached_by_tier: tuple[tuple[str, int], ...] = ()
    """``cached_tokens`` split by the tier that served them (tiers with 0 left out)."""
    cache_note: str = ""
    """Why the prefix cache did not reuse more of the prompt ("" when it reused all it could)."""
    first_token: bool = False


PENDING_TOKEN = -1
"""Stands in ``Sequence.output_ids`` for a token sampled on the device and not read back yet
(while the engine looks one step ahead)."""


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Mutable progress of one request inside the engine thread."""

    def __init__(self, request: EngineRequest) -> None:
        self.request = request
        self.request_id = request.request_id
        self.arrival_time = request.arrival_time
        self.status = SeqStatus.WAITING
        self.output_ids: list[int] = []
        self.num_computed_tokens = 0
        self.cached_tokens = 0
        self.cached_by_tier: dict[str, int] = {}
        """Reused prompt tokens per cache tier (gpu, ram, disk)."""
        self.cache_note = ""
        self.block_ids: list[int] = []
        self.block_key_chain: list[bytes] = []
        """Prefix-cache keys of the sequence's leading full blocks, hashed so far (the scheduler extends it)."""
        self.state_slot: int | None = None
        self.checkpoint_marks: tuple[int, ...] = ()
        """Prompt positions a prefill chunk ends at to save a state checkpoint (set by the scheduler)."""
        self.preemptions = 0
        self.prompt_logprobs_sent = 0
        self.prefill_started_at: float | None = None
        self.prefill_ms = 0.0
        self.first_token_at: float | None = None
        self.chunks_done = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return [*self.request.prompt_ids, *self.output_ids]

    def tokens_between(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` without building the whole list (a decode step feeds one token
        of a context that may be hundreds of thousands long)."""
        prompt = self.request.prompt_ids
        cut = len(prompt)
        if end <= cut:
            return list(prompt[start:end])
        if start >= cut:
            return self.output_ids[start - cut:end - cut]
        return [*prompt[start:], *self.output_ids[:end - cut]]

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_ids) + len(self.output_ids)

    @property
    def stable_prompt_end(self) -> int:
        """Where the prompt stops being what the conversation's next request repeats (see
        ``EngineRequest.volatile_tail``): the prompt length when nothing at its end is volatile."""
        return self.num_prompt_tokens - min(max(self.request.volatile_tail, 0), self.num_prompt_tokens)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose KV is not in the cache yet (the last sampled token included)."""
        return self.num_tokens - self.num_computed_tokens
