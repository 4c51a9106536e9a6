"""Plugin contracts and the small frozen types that cross component boundaries.

Every pluggable component kind is a ``typing.Protocol`` here.  A plugin is a class (or factory) registered
under a name in an entry-point group ``ds4d.<kind>`` and constructed once at start as ``Factory(ctx, options)``,
where ``ctx`` is a :class:`PluginContext` (its ``config`` holds every knob) and ``options`` a mapping of
construction arguments from the kernel: empty but for cache tiers, which get ``compat_hash``.  The config file
has no per-plugin tables.

Kinds and their entry-point groups:

=====================  ==========================  =================================
kind                   group                       what one instance does
=====================  ==========================  =================================
ModelFamily            ``ds4d.model_family``       loads a checkpoint -> :class:`Model`
ChatEncoder            ``ds4d.chat_encoder``       OpenAI messages -> prompt text + ids
ReasoningParser        ``ds4d.reasoning_parser``   makes per-request reasoning streams
ToolCallParser         ``ds4d.tool_parser``        makes per-request tool-call streams
SchedulerPolicy        ``ds4d.scheduler_policy``   orders waiting work, picks victims
CacheTier              ``ds4d.cache_tier``         stores prefix-cache blocks off the pool
=====================  ==========================  =================================

The engine thread is the only caller of :meth:`Model.forward`; everything the asyncio side needs from a model
goes through the tokenizer and :class:`ModelInfo`, which are safe to use from any thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # torch is heavy; the console and the contract docs do not need it
    import torch

    from ds4d.config import Config


# --------------------------------------------------------------------------- context


@dataclass(frozen=True)
class PluginContext:
    """What every plugin constructor receives besides its own options."""

    config: "Config"
    log: logging.Logger


# --------------------------------------------------------------------------- tokenizer


@runtime_checkable
class Tokenizer(Protocol):
    """Text <-> token ids.  Thread-safe; owned by the model, shared with the API side."""

    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: frozenset[int]
    """Ids that end generation (end-of-turn markers included)."""

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Encode ``text``; special-token strings inside ``text`` map to their ids."""

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Decode ids; incomplete UTF-8 at the end shows as U+FFFD."""

    def token_to_id(self, token: str) -> int | None:
        """The id of one vocabulary entry (e.g. a special token), or None."""

    def id_to_token(self, token_id: int) -> str | None:
        """The raw vocabulary entry of one id, or None."""

    # optional: ``boundary_tokens() -> tuple[str, ...]``, the added tokens the tokenizer splits the
    # text at before anything else (text before and after one tokenises independently)


# --------------------------------------------------------------------------- model


@dataclass(frozen=True)
class ModelInfo:
    """Static facts about a loaded model that the engine and the API plan with."""

    family: str
    """Registry name of the family that loaded it (``llama``, ``deepseek_v4``)."""
    name: str
    """Human name from the checkpoint metadata (used as the default served name)."""
    vocab_size: int
    max_context_tokens: int
    """Longest sequence (prompt + output) the model supports."""
    block_size_tokens: int
    """Tokens per KV block; the engine allocates and hashes whole blocks."""
    cache_bytes_per_block: int
    """Bytes one KV block costs (all layers), for sizing the pool."""
    state_bytes_per_seq: int = 0
    """Bytes of fixed per-sequence state (sliding window, compressor tails); 0 if none."""
    default_chat_encoder: str = "jinja"
    default_reasoning_parser: str = "none"
    default_tool_parser: str = "none"
    chat_template: str | None = None
    """Jinja chat template carried by the checkpoint, if any."""
    accepts_images: bool = False
    """The model reads image content parts; a text-only model's server refuses them (HTTP 400)."""
    dtype: str = "float32"
    device: str = "cpu"
    parameter_bytes: int = 0
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SeqChunk:
    """One sequence's share of a forward step.

    The engine guarantees ``block_ids`` covers positions ``0 .. start_pos + len(token_ids) - 1`` (``ceil(end /
    block_size)`` blocks, in order) and that positions ``< start_pos`` already hold this sequence's KV (computed
    earlier or shared through the prefix cache).  ``start_pos == 0`` means a fresh sequence: a model with
    per-sequence state resets slot ``state_slot``.
    """

    state_slot: int
    """Index of this sequence's fixed-size state slot (0 .. max_seqs-1)."""
    token_ids: tuple[int, ...]
    """Tokens fed this step (a prefill chunk, or the one last sampled token)."""
    start_pos: int
    """Absolute position of ``token_ids[0]``."""
    block_ids: tuple[int, ...]
    """Block table of the sequence (ids into the model's KV pool)."""
    logits_tokens: int = 1
    """How many trailing positions of this chunk need logits (0, 1 or all)."""


@dataclass(frozen=True)
class ForwardBatch:
    """Everything :meth:`Model.forward` needs for one engine step."""

    chunks: tuple[SeqChunk, ...]
    input_tokens: Any = None
    """A tensor ``[len(chunks)]`` on the model's device, or None.  When set, every chunk feeds one
    token, and chunk ``i``'s token is ``input_tokens[i]`` (its ``token_ids`` hold a placeholder):
    the previous step sampled them and the engine queued this step before reading them back.
    Only a model whose ``accepts_input_tokens`` is true is given one."""

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


@runtime_checkable
class Model(Protocol):
    """A loaded model with its own KV/state tensors.  Used only by the engine thread."""

    info: ModelInfo
    tokenizer: Tokenizer

    def allocate_cache(self, num_blocks: int, max_seqs: int) -> None:
        """Create the KV pool (``num_blocks`` blocks) and ``max_seqs`` state slots."""

    def forward(self, batch: ForwardBatch) -> "torch.Tensor":
        """Run one step and write the new tokens' KV into the pool.

        Returns float32 logits of shape ``[sum(c.logits_tokens), vocab_size]``,
        rows in chunk order, and within a chunk in position order.
        Results for a sequence do not depend on what else is in the batch.
        """


class ModelFamily(Protocol):
    """Loads checkpoints of one architecture."""

    name: str

    def can_load(self, path: Path) -> bool:
        """True if ``path`` (file or directory) looks like this family's checkpoint."""

    def load(self, path: Path) -> Model:
        """Load ``path`` as the config asks (``gpus``: see ``ds4d.parallel.gpus.SplitModelFamily``)."""


# --------------------------------------------------------------------------- chat


KnownPrefix = Callable[[str], "tuple[int, Sequence[int]] | None"]
"""Given a rendered prompt text: ``(chars, ids)`` when the text's first ``chars`` characters are
known to tokenise as ``ids`` and the rest starts where the tokenizer splits anyway (an added
token), so only the rest needs the tokenizer; None otherwise.  The session memory provides it;
encoders tokenise through :func:`ds4d.plugins.known_prefix.encode_prompt`."""


@dataclass(frozen=True)
class ChatRenderRequest:
    """An OpenAI chat request reduced to what rendering needs (plain JSON values)."""

    messages: tuple[Mapping[str, Any], ...]
    tools: tuple[Mapping[str, Any], ...] = ()
    thinking: bool | None = None
    """Thinking mode asked for (``chat_template_kwargs.thinking``); None = encoder default."""
    drop_thinking: bool | None = None
    reasoning_effort: str | int | None = None
    """``low``/``medium``/``high``/``max``/``xhigh`` or 1-100 (the server checks it; encoders map it to their scale)."""
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True
    known_prefix: KnownPrefix | None = field(default=None, compare=False)
    """Tokenise through ``encode_prompt`` with this (an agent's next turn: only its new part)."""


@dataclass(frozen=True)
class RenderedPrompt:
    text: str
    token_ids: tuple[int, ...]
    ends_in_reasoning: bool = False
    """The prompt leaves the model inside a reasoning block (e.g. ends with ``<think>``)."""
    prefix_tokens: int = 0
    """Leading ``token_ids`` taken from ``ChatRenderRequest.known_prefix`` rather than the tokenizer."""
    prefix_chars: int = 0
    """The characters of ``text`` those ids stand for."""
    volatile_tail: int = 0
    """How many of the last ``token_ids`` the next request renders differently once this turn is history
    (the engine checkpoints before them; ``EngineRequest.volatile_tail``)."""
    stable_prefix: int = 0
    """Leading ``token_ids`` of the system prompt and tools, which conversations with the same system prompt
    repeat (0 = none or not known; ``EngineRequest.stable_prefix``)."""
    message_starts: tuple[int, ...] = ()
    """Positions in ``token_ids`` where a message begins (``EngineRequest.message_starts``)."""


class ChatEncoder(Protocol):
    """Renders chat messages into a prompt for one model's chat format.

    Constructed as ``ChatEncoder(ctx, options, tokenizer, model_info)``.
    """

    name: str
    # optional class attributes ``reasoning_parser`` / ``tool_parser``: the parsers that read the
    # output of the model this format belongs to; ``auto`` parsers follow them (else the family's)

    def render(self, request: ChatRenderRequest) -> RenderedPrompt: ...


@dataclass(frozen=True)
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningStream(Protocol):
    """Per-request streaming split of generated text into reasoning and content."""

    def feed(self, text: str) -> ReasoningDelta: ...

    def finish(self) -> ReasoningDelta: ...


class ReasoningParser(Protocol):
    name: str

    def stream(self, *, prompt_ends_in_reasoning: bool) -> ReasoningStream: ...


@dataclass(frozen=True)
class ToolCallDelta:
    """One OpenAI tool-call delta: the first for an index carries id/name."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str
    """JSON object text."""


@dataclass(frozen=True)
class ToolParseDelta:
    content: str = ""
    calls: tuple[ToolCallDelta, ...] = ()


@dataclass(frozen=True)
class ToolParseResult:
    content: str
    """Content text outside tool-call markup (all of it, for non-streaming replies)."""
    calls: tuple[ToolCall, ...]
    error: str | None = None
    """Set when markup was malformed; the raw text is then returned as content."""


class ToolCallStream(Protocol):
    def feed(self, text: str) -> ToolParseDelta: ...

    def finish(self) -> tuple[ToolParseDelta, ToolParseResult]:
        """Flush what is pending; return the last delta and the whole result."""


class ToolCallParser(Protocol):
    """Makes tool-call streams; forcing a ``tool_choice`` needs a :class:`ConstrainingToolCallParser`."""

    name: str

    def stream(self, *, tools: Sequence[Mapping[str, Any]], parallel_tool_calls: bool = True) -> ToolCallStream: ...


class TokenConstraint(Protocol):
    """Per-request constrained decoding (e.g. a forced tool call).  Stateful: the sampler asks for
    the allowed set before each sampled token and reports the token it chose.  Engine thread only."""

    def allowed_mask(self, vocab_size: int) -> "torch.Tensor | None":
        """Bool mask [vocab_size] of tokens allowed next; None = no restriction."""

    def accept(self, token_id: int) -> None:
        """The token that was sampled."""


@runtime_checkable
class ConstrainingToolCallParser(ToolCallParser, Protocol):
    """A tool-call parser that can keep the model to markup it parses (``dsml``, ``dsml_v41``)."""

    def constraint(self, tokenizer: Tokenizer, *, tools: Sequence[Mapping[str, Any]], tool_choice: Any,
                   prompt_ends_in_reasoning: bool, max_tokens: int, guard_markup: bool) -> TokenConstraint | None:
        """The constraint for one request's ``tool_choice``, or None (decoding left free).

        ``"required"`` or a named function: exactly one call to a tool of ``tools``, as this parser
        reads it, ended within ``max_tokens`` (ValueError, a client error, when the choice names no
        such tool or no call fits; None: this parser cannot force one).  ``"auto"``/``"none"``/None:
        with ``guard_markup`` (knob ``tool_markup_guard``) opened markup is written valid and none
        reaches the content ("none": none opens), else None.  Slow on first use: off the event loop."""


# --------------------------------------------------------------------------- scheduling


class SchedulableRequest(Protocol):
    """The view of a request a scheduler policy may look at."""

    request_id: str
    arrival_time: float
    num_prompt_tokens: int
    num_computed_tokens: int


class SchedulerPolicy(Protocol):
    """Ordering and victim choice only.  Budgets, chunking and block accounting stay
    in the engine so every policy inherits the progress guarantee."""

    name: str

    def order_waiting(self, waiting: Sequence[SchedulableRequest]) -> list[SchedulableRequest]:
        """Admission order for waiting requests (first = admitted first)."""

    def choose_victim(self, running: Sequence[SchedulableRequest]) -> SchedulableRequest:
        """The request to preempt when blocks run out, one of ``running``: the running requests
        other than the oldest, which the engine never preempts while another runs."""


# --------------------------------------------------------------------------- cache tiers


class CacheTier(Protocol):
    """A store for prefix-cache blocks below the KV pool (host RAM, disk).

    Keys are block hashes (bytes); values are the block's KV payload plus the token ids it covers, so every hit
    is verified token by token.

    A payload is bytes-like: ``bytes`` or a contiguous 1-D ``torch.uint8`` CPU tensor (what
    :meth:`BlockCopyModel.export_blocks` returns and what the RAM tier hands back, so a promotion can copy
    straight from pinned memory).

    Tiers are chained fastest first (``gpu`` -> ``ram`` -> ``disk``, config knob ``cache_tiers``): a block
    evicted from one tier is demoted to the next, a hit in a lower tier is copied back into the KV pool
    (promoted) and stays in the tier that served it.  The ``gpu`` tier is the pool's own LRU of unreferenced
    blocks; its ``put``/``get`` are never called.
    """

    name: str

    def put(self, key: bytes, token_ids: Sequence[int], payload: Any) -> bool:
        """Store a block; False when it does not fit the budget (nothing stored)."""

    def get(self, key: bytes, token_ids: Sequence[int]) -> Any | None:
        """The payload, or None when absent, damaged, or stored for other tokens."""

    def contains(self, key: bytes) -> bool:
        """Cheap presence test (no payload read, no verification)."""

    def evict(self, nbytes: int) -> int:
        """Drop least-recently-used entries until ``nbytes`` are freed; bytes freed."""

    def stats(self) -> Mapping[str, Any]:
        """At least ``bytes``, ``blocks``, ``budget_bytes``, ``evictions``, ``bytes_in``, ``bytes_out``."""


@dataclass(frozen=True)
class CacheEntry:
    """One block as it moves between tiers."""

    key: bytes
    token_ids: tuple[int, ...]
    payload: Any


@runtime_checkable
class DemotingCacheTier(CacheTier, Protocol):
    """A tier whose evictions can be demoted to the next tier and which outlives a restart or not.

    The built-in ``ram`` and ``disk`` tiers implement it; a plain :class:`CacheTier` simply loses what it
    evicts."""

    def take_evicted(self) -> list[CacheEntry]:
        """Entries evicted since the last call (oldest first), for the next tier down."""

    def entries(self) -> list[CacheEntry]:
        """Everything stored, oldest first (used to flush RAM to disk at shutdown)."""

    def close(self) -> None:
        """Finish pending writes and release resources; called once at shutdown."""


@runtime_checkable
class ReadAheadCacheTier(CacheTier, Protocol):
    """A tier whose reads are slow (disk), read ahead of the promotion that needs them.

    The engine thread asks for the blocks a waiting request would promote (``read_ahead``), keeps stepping the
    running requests while a thread of the tier reads them (file read and integrity check), and admits the
    request once every future is done; the promotion's ``get`` then takes the loaded payload without touching
    the disk.  ``get`` stays correct on its own: a block read ahead but not finished is waited for, one never
    read ahead is read at once.  A block that fails its check is a miss at ``get`` (deleted and logged there),
    exactly as without read-ahead.  Called from the engine thread only.
    """

    def read_ahead(self, key: bytes) -> Future | None:
        """Start loading ``key`` in the background, or join the load already started.

        The future is done when ``get`` will answer without reading the disk.
        None when no background read is needed or possible: the block is unknown
        or already in memory, reads ahead are off, or the bytes held by reads
        ahead are at their cap (``get`` then reads it synchronously)."""

    def cancel_read(self, key: bytes) -> None:
        """Drop a read ahead that ``get`` did not take (in flight or loaded); its memory is freed."""


@runtime_checkable
class BlockCopyModel(Protocol):
    """A model whose KV blocks can be copied out of and into its pool.

    The RAM and disk tiers hold what ``export_blocks`` returns.  Payloads are opaque to the engine, of equal
    size for every block of one model, and only ever imported into the same model (same compatibility hash).
    With a GPU, ``import_blocks`` may return before the copy ends provided the next :meth:`Model.forward`
    observes it (a ``non_blocking`` copy from pinned memory on the compute stream, as the built-in models do, or
    a copy stream plus an event the forward waits on), so the engine thread does not wait for promotions;
    ``export_blocks`` returns complete host copies (the pool block may be overwritten right after).
    """

    def export_blocks(self, block_ids: Sequence[int]) -> list[Any]:
        """One payload per block (bytes-like, see :class:`CacheTier`), in order."""

    def import_blocks(self, block_ids: Sequence[int], payloads: Sequence[Any]) -> None:
        """Write each payload into the matching block of the pool."""


@runtime_checkable
class AsyncBlockCopyModel(Protocol):
    """A :class:`BlockCopyModel` that can also copy blocks out without waiting for them.

    ``start_export`` queues the copies behind the work already queued on the device and returns the payloads
    with a ``done`` handle: None when they are complete already, else an object with ``query()`` (complete yet?)
    and ``synchronize()`` (wait), such as a CUDA event.  The pool blocks may be overwritten by work queued after
    the call; the payloads must not be read before ``done`` says so.  The prefix cache uses it for blocks
    evicted from the pool, so a step that evicts does not wait for the device to finish the step before it.
    """

    def start_export(self, block_ids: Sequence[int]) -> tuple[list[Any], Any]:
        """(one payload per block, done handle or None)."""


@runtime_checkable
class DecodeWarmableModel(Protocol):
    """A model whose decode steps go through per-bucket work done on first use (CUDA graph captures), which it
    can do ahead of serving (``ds4d.engine.warmup``)."""

    def warm_decode(self, max_rows: int, max_blocks: int) -> int:
        """Prepare every decode bucket of at most ``max_rows`` sequences of at most ``max_blocks`` blocks, without
        touching any sequence's state or blocks; how many buckets were prepared."""


@runtime_checkable
class StatefulModel(Protocol):
    """A model with per-sequence state beyond its KV blocks (DeepSeek-V4: sliding window ring and compressor
    tails).

    Prefix reuse of such a model needs a checkpoint of that state at the reuse point.  The engine keeps
    checkpoints at request boundaries and inside prompts (``ds4d.engine.checkpoint_plan``): ``save_state(slot)``
    right after the sequence's KV reached that point, and later ``load_state(slot, snapshot)`` into the slot of a
    new sequence with the same leading tokens, whose first chunk then starts at that position.  A snapshot must
    not alias the slot (the slot is reused).  Prefix reuse is enabled for such a model only when it is also a
    :class:`BlockCopyModel` (the checkpoint keeps a copy of the partly filled last block).
    """

    def save_state(self, slot: int) -> Any:
        """A copy of ``slot``'s state as it stands now."""

    def load_state(self, slot: int, snapshot: Any) -> None:
        """Overwrite ``slot``'s state with a snapshot taken by :meth:`save_state`."""
