"""Parsers that parse nothing: for models without reasoning blocks or tool-call markup.

They let the output path treat every model the same way -- there is always a
reasoning parser and a tool parser -- and are the baseline the contract tests
hold the real parsers to: all text comes back, unchanged, as content.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ds4d.contracts import PluginContext, ReasoningDelta, ToolParseDelta, ToolParseResult


class _NoReasoningStream:
    def feed(self, text: str) -> ReasoningDelta:
        return ReasoningDelta(content=text)

    def finish(self) -> ReasoningDelta:
        return ReasoningDelta()


class NoReasoningParser:
    """ReasoningParser ``none``: everything is content."""

    name = "none"

    def __init__(self, ctx: PluginContext, options: Mapping[str, Any] | None = None) -> None:
        self._ctx = ctx

    def stream(self, *, prompt_ends_in_reasoning: bool) -> _NoReasoningStream:
        return _NoReasoningStream()


class _NoToolStream:
    def __init__(self) -> None:
        self._content: list[str] = []

    def feed(self, text: str) -> ToolParseDelta:
        self._content.append(text)
        return ToolParseDelta(content=text)

    def finish(self) -> tuple[ToolParseDelta, ToolParseResult]:
        return ToolParseDelta(), ToolParseResult(content="".join(self._content), calls=())


class NoToolParser:
    """ToolCallParser ``none``: everything is content, never a call."""

    name = "none"

    def __init__(self, ctx: PluginContext, options: Mapping[str, Any] | None = None) -> None:
        self._ctx = ctx

    def stream(self, *, tools: Sequence[Mapping[str, Any]], parallel_tool_calls: bool = True) -> _NoToolStream:
        return _NoToolStream()
