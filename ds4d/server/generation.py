"""From engine outputs to API deltas: detokenise, stop strings, reasoning, tool calls.

One :class:`Generation` per request runs the pipeline
``token ids -> text -> stop matcher -> reasoning parser -> tool-call parser``
and yields :class:`Delta` objects; the chat and completion handlers only
format them.  It also keeps the request's accounting for usage and the log.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from ds4d.contracts import ReasoningStream, Tokenizer, ToolCall, ToolCallDelta, ToolCallStream
from ds4d.engine.client import RequestStream
from ds4d.engine.output import IncrementalDetokenizer, StopMatcher
from ds4d.engine.request import FinishReason, TokenLogprob

log = logging.getLogger("ds4d.requests")

KEEPALIVE_S = 15.0


@dataclass
class Delta:
    reasoning: str = ""
    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    keepalive: bool = False

    def empty(self) -> bool:
        return not (self.reasoning or self.content or self.tool_calls or self.logprobs or self.prompt_logprobs)


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    cached_by_tier: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
            "ds4d": {"cached_tokens_by_tier": self.by_tier()},
        }

    def by_tier(self) -> dict[str, int]:
        return {"gpu": 0, "ram": 0, "disk": 0, **self.cached_by_tier}


class Generation:
    def __init__(
        self,
        stream: RequestStream,
        tokenizer: Tokenizer,
        *,
        prompt_tokens: int,
        stops: list[str],
        reasoning: ReasoningStream | None = None,
        tools: ToolCallStream | None = None,
        drop_output_tokens: bool = False,
        on_finish: Callable[[Generation], None] | None = None,
    ) -> None:
        self.stream = stream
        self.tokenizer = tokenizer
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
        self.stop = StopMatcher(stops)
        self.reasoning = reasoning
        self.tools = tools
        self.usage = Usage(prompt_tokens)
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.error_code = "generation_failed"
        self.output_ids: list[int] = []
        """Every generated token id, the final stop token included."""
        self.cache_note = ""
        self.calls: tuple[ToolCall, ...] = ()
        self.tool_error: str | None = None
        self.drop_output_tokens = drop_output_tokens
        self.on_finish = on_finish
        """Called once when the request ends without an error, before its last delta is yielded."""
        self.started = time.monotonic()
        self.first_token_at: float | None = None

    async def deltas(self) -> AsyncIterator[Delta]:
        """Deltas until the request ends; a keepalive Delta every KEEPALIVE_S while idle."""
        eos = self.tokenizer.eos_token_ids
        try:
            while True:
                out = await self.stream.next(KEEPALIVE_S)
                if out is None:
                    yield Delta(keepalive=True)
                    continue
                self.usage.cached_tokens = out.cached_tokens
                self.usage.cached_by_tier = dict(out.cached_by_tier)
                self.cache_note = out.cache_note
                delta = Delta(prompt_logprobs=list(out.prompt_logprobs))
                ids = [] if self.drop_output_tokens else list(out.new_token_ids)
                if ids and self.first_token_at is None:
                    self.first_token_at = time.monotonic()
                self.usage.completion_tokens += len(ids)
                self.output_ids += ids
                delta.logprobs = list(out.logprobs) if not self.drop_output_tokens else []
                text_ids = [t for t in ids if t not in eos or out.finish_reason is None]
                text = self.detok.add(text_ids) if text_ids else ""
                if out.finish_reason is not None:
                    text += self.detok.flush()
                safe, stopped = self.stop.feed(text)
                if out.finish_reason is not None and not stopped:
                    safe += self.stop.flush()
                self._route(safe, delta, final=stopped or out.finish_reason is not None)
                if stopped:
                    self.finish_reason = "stop"
                elif out.finish_reason is not None:
                    self.finish_reason = "stop" if out.finish_reason is FinishReason.STOP else out.finish_reason.value
                    if out.finish_reason in (FinishReason.ERROR, FinishReason.TIMEOUT):
                        self.error = out.error or "generation failed"
                        if out.finish_reason is FinishReason.TIMEOUT:
                            self.error_code = "timeout"
                if delta.reasoning and not delta.content:
                    self.usage.reasoning_tokens += len(ids)
                done = stopped or out.finish_reason is not None
                if done:
                    if self.calls:
                        self.finish_reason = "tool_calls"
                    if self.on_finish is not None and self.error is None:
                        self._call_on_finish()
                if not delta.empty():
                    yield delta
                if done:
                    return
        finally:
            self.stream.close()
            self._log()

    def _call_on_finish(self) -> None:
        try:
            self.on_finish(self)
        except Exception:  # bookkeeping must never fail a finished request
            log.exception("%s: finish hook failed", self.stream.request_id)

    def _route(self, text: str, delta: Delta, *, final: bool) -> None:
        content = text
        if self.reasoning is not None:
            r = self.reasoning.feed(text)
            if final:
                tail = self.reasoning.finish()
                r = type(r)(r.reasoning + tail.reasoning, r.content + tail.content)
            delta.reasoning, content = r.reasoning, r.content
        if self.tools is not None:
            t = self.tools.feed(content)
            calls = list(t.calls)
            content = t.content
            if final:
                last, result = self.tools.finish()
                content += last.content
                calls += last.calls
                self.calls = result.calls
                self.tool_error = result.error
            delta.tool_calls = tuple(calls)
        delta.content = content

    def _log(self) -> None:
        now = time.monotonic()
        u = self.usage
        computed = u.prompt_tokens - u.cached_tokens
        first = self.first_token_at or now
        prefill_ms = (first - self.started) * 1000
        decode_ms = (now - first) * 1000
        log.info(
            "%s prompt %d tokens = %d reused (gpu %d, ram %d, disk %d) + %d computed in %.0f ms (%.1f tok/s); "
            "decode %d tokens in %.0f ms (%.1f tok/s) finish=%s",
            self.stream.request_id, u.prompt_tokens, u.cached_tokens, *(u.by_tier()[t] for t in ("gpu", "ram", "disk")),
            computed, prefill_ms,
            computed / max(prefill_ms / 1000, 1e-6), u.completion_tokens, decode_ms,
            max(u.completion_tokens - 1, 0) / max(decode_ms / 1000, 1e-6), self.finish_reason or "abort")
