"""Streaming split of DeepSeek-V4 / V4.1 output into reasoning and content.

In thinking mode the prompt ends with ``<｜Assistant｜><think>``, so generation
starts inside the reasoning block and leaves it with ``</think>``; in chat mode
the prompt ends with ``</think>`` and everything is content.  The stream is told
which case applies (``prompt_ends_in_reasoning``) and additionally accepts output
that opens its own ``<think>`` first.

Rules:

- Reasoning runs until ``</think>``.  A DSML ``<｜DSML｜tool_calls>`` block
  (V4.1: ``<｜DSML｜ calls>``) that starts inside reasoning also ends it (the
  model sometimes skips ``</think>`` before calling a tool); the block, with the newlines right before it, goes to
  content so the tool-call parser sees it.
- ``<think>`` / ``</think>`` never reach either side: a stray ``<think>`` inside
  reasoning is dropped, and at the start of content (before any non-blank text)
  a ``</think>`` is dropped and a ``<think>`` re-enters reasoning.  Once content
  has started it passes through untouched, so code that mentions the tags is not
  altered.
- Text that may be the start of a tag is held back until the next feed decides
  it (or ``finish()`` releases it as plain text), so the result does not depend
  on how the text was split into feeds.

``NoReasoningParser`` (``none``) lives in :mod:`ds4d.plugins.passthrough`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ds4d.contracts import PluginContext, ReasoningDelta
from ds4d.plugins.dsml_format import THINK_END, THINK_START, V4_SPELLING, V41_SPELLING, partial_suffix_length

_BLOCK_NEWLINES = 2
_REASONING, _CONTENT_START, _CONTENT = "reasoning", "content_start", "content"


class DeepseekV4ReasoningStream:
    """One request's reasoning/content split (see the module docstring)."""

    def __init__(self, *, prompt_ends_in_reasoning: bool, tool_calls_open: str = V4_SPELLING.calls_open) -> None:
        self._tool_calls_open = tool_calls_open
        self._state = _REASONING if prompt_ends_in_reasoning else _CONTENT_START
        self._buf = ""
        self._finished = False

    def feed(self, text: str) -> ReasoningDelta:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> ReasoningDelta:
        if self._finished:
            return ReasoningDelta()
        self._finished = True
        return self._drain(final=True)

    def _drain(self, final: bool) -> ReasoningDelta:
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            if self._state == _REASONING:
                progressed = self._step_reasoning(reasoning, final)
            elif self._state == _CONTENT_START:
                progressed = self._step_content_start(final)
            else:
                content.append(self._buf)
                self._buf = ""
                progressed = False
            if not progressed:
                break
        return ReasoningDelta(reasoning="".join(reasoning), content="".join(content))

    def _step_reasoning(self, reasoning: list[str], final: bool) -> bool:
        buf = self._buf
        calls_open = self._tool_calls_open
        hits = [(buf.find(m), m) for m in (THINK_END, THINK_START, calls_open)]
        hits = [(i, m) for i, m in hits if i >= 0]
        if not hits:
            hold = 0
            if not final:
                hold = max(
                    partial_suffix_length(buf, (THINK_END, THINK_START)),
                    partial_suffix_length(buf, (calls_open,), 0, _BLOCK_NEWLINES),
                )
            reasoning.append(buf[: len(buf) - hold])
            self._buf = buf[len(buf) - hold :]
            return False
        index, marker = min(hits)
        if marker == calls_open:
            start = index
            while start > 0 and index - start < _BLOCK_NEWLINES and buf[start - 1] == "\n":
                start -= 1
            reasoning.append(buf[:start])
            self._buf = buf[start:]
            self._state = _CONTENT
        else:
            reasoning.append(buf[:index])
            self._buf = buf[index + len(marker) :]
            if marker == THINK_END:
                self._state = _CONTENT_START
        return True

    def _step_content_start(self, final: bool) -> bool:
        stripped = self._buf.lstrip()
        for tag, state in ((THINK_START, _REASONING), (THINK_END, _CONTENT_START)):
            if stripped.startswith(tag):
                self._buf = stripped[len(tag) :]
                self._state = state
                return True
        undecided = not stripped or THINK_START.startswith(stripped) or THINK_END.startswith(stripped)
        if undecided and not final:
            return False
        self._state = _CONTENT
        return True


class DeepseekV4ReasoningParser:
    """ReasoningParser plugin ``deepseek_v4``."""

    name = "deepseek_v4"
    tool_calls_open = V4_SPELLING.calls_open

    def __init__(self, ctx: PluginContext, options: Mapping[str, Any] | None = None) -> None:
        self._ctx = ctx

    def stream(self, *, prompt_ends_in_reasoning: bool) -> DeepseekV4ReasoningStream:
        return DeepseekV4ReasoningStream(prompt_ends_in_reasoning=prompt_ends_in_reasoning,
                                         tool_calls_open=self.tool_calls_open)


class DeepseekV41ReasoningParser(DeepseekV4ReasoningParser):
    """ReasoningParser plugin ``deepseek_v41``: V4's rules, V4.1's ``<｜DSML｜ calls>`` block."""

    name = "deepseek_v41"
    tool_calls_open = V41_SPELLING.calls_open
