"""Streaming parser for DeepSeek-V4 / V4.1 DSML tool calls -> OpenAI tool-call deltas.

DeepSeek-V4 writes tool calls as a markup block after its content::

    \\n\\n<｜DSML｜tool_calls>
    <｜DSML｜invoke name="read">
    <｜DSML｜parameter name="filePath" string="true">/a/b.py</｜DSML｜parameter>
    <｜DSML｜parameter name="limit" string="false">50</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

``string="true"`` values are raw text and become JSON strings; ``string="false"``
values are JSON already.  Agents start acting on a call as soon as they see it,
so the stream emits the call's id and name when the ``invoke`` tag closes and
the arguments while the values are still being generated: string values are
JSON-escaped and streamed as they arrive, other values are buffered until their
closing tag so a value that turns out not to be JSON can still be sent as a
string.  The arguments text is ``{"k": v, "k2": v2}`` (``", "`` and ``": "``
separators), the same text the official parser produces.

V4.1 writes the same tree with a leading space in each tag name
(``<｜DSML｜ calls>``, ``<｜DSML｜ invoke ...>``); a stream takes the model's
:class:`~ds4d.plugins.dsml_format.DsmlSpelling` (plugins ``dsml`` and ``dsml_v41``).

The parser is a pure stream: it holds back only text that might be the start of
a marker it is waiting for (a partial ``<｜DSML｜tool_calls>``, with up to two
newlines before it, or a partial closing tag), so feeding a completion whole,
token by token or character by character yields the same content and calls.
The blank line before a block belongs to the markup, as in the official format.

Tool names are not checked against the request's ``tools``: a call to an unknown
tool still reaches the client, which tells the model, as OpenAI-compatible
servers do.  ``parallel_tool_calls=False`` keeps the first call and drops the
markup of any others.

Malformed markup never turns into half a tool call in the result: the stream
switches to passing the raw text through as content, and ``finish()`` returns
no calls, the whole raw text as content and an ``error`` saying what was wrong.
Argument deltas already streamed for the broken block cannot be taken back.

The parsers also constrain decoding to the markup they read (``constraint``, for
``tool_choice`` and ``tool_markup_guard``; :mod:`ds4d.plugins.dsml_constraint`).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from ds4d.contracts import (
    PluginContext,
    TokenConstraint,
    Tokenizer,
    ToolCall,
    ToolCallDelta,
    ToolParseDelta,
    ToolParseResult,
)
from ds4d.plugins.dsml_constraint import build_block_guard, build_tool_constraint
from ds4d.plugins.dsml_format import V4_SPELLING, V41_SPELLING, DsmlSpelling, partial_suffix_length, to_json
from ds4d.plugins.dsv4_reasoning import DeepseekV4ReasoningStream

EOS = "<｜end▁of▁sentence｜>"
_MAX_TAG_CHARS = 2048
_BLOCK_NEWLINES = 2
"""Newlines before ``<｜DSML｜tool_calls>`` that belong to the markup, not the content."""

_CONTENT, _BLOCK, _INVOKE, _PARAM, _RAW = "content", "block", "invoke", "param", "raw"


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


class _DeltaBuilder:
    """Collects one feed's output, merging argument fragments of the same call."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.calls: list[ToolCallDelta] = []

    def add_call(self, delta: ToolCallDelta) -> None:
        last = self.calls[-1] if self.calls else None
        if last is not None and last.index == delta.index and delta.id is None:
            self.calls[-1] = ToolCallDelta(last.index, last.id, last.name, last.arguments + delta.arguments)
        else:
            self.calls.append(delta)

    def build(self) -> ToolParseDelta:
        return ToolParseDelta(content="".join(self.content), calls=tuple(self.calls))


class DsmlToolCallStream:
    """One request's DSML tool-call stream (see the module docstring)."""

    def __init__(self, tools: Sequence[Mapping[str, Any]], parallel_tool_calls: bool = True,
                 spelling: DsmlSpelling = V4_SPELLING) -> None:
        self._spelling = spelling
        self._parallel = parallel_tool_calls
        self._text = ""
        self._pos = 0
        self._state = _CONTENT
        self._block_start = 0
        self._content: list[str] = []
        self._calls: list[ToolCall] = []
        self._error: str | None = None
        self._result: ToolParseResult | None = None
        # the call being parsed
        self._call_index = -1
        self._call_kept = False
        self._call_id = ""
        self._call_name = ""
        self._call_args: list[str] = []
        self._param_names: set[str] = set()
        self._param_is_string = True
        self._param_value: list[str] = []

    # ------------------------------------------------------------------ public

    def feed(self, text: str) -> ToolParseDelta:
        if self._result is not None:
            raise RuntimeError("feed() after finish()")
        self._text += text
        out = _DeltaBuilder()
        self._drain(out, final=False)
        return out.build()

    def finish(self) -> tuple[ToolParseDelta, ToolParseResult]:
        if self._result is not None:
            return ToolParseDelta(), self._result
        out = _DeltaBuilder()
        self._drain(out, final=True)
        if self._state in (_BLOCK, _INVOKE, _PARAM):
            self._fail(out, "unterminated tool_calls block at end of output")
        if self._error is not None:
            self._result = ToolParseResult(content=self._text, calls=(), error=self._error)
        else:
            self._result = ToolParseResult(content="".join(self._content), calls=tuple(self._calls))
        return out.build(), self._result

    # ------------------------------------------------------------------ machinery

    def _emit_content(self, out: _DeltaBuilder, text: str) -> None:
        if text:
            out.content.append(text)
            self._content.append(text)

    def _emit_args(self, out: _DeltaBuilder, fragment: str) -> None:
        self._call_args.append(fragment)
        if self._call_kept and fragment:
            out.add_call(ToolCallDelta(index=self._call_index, arguments=fragment))

    def _fail(self, out: _DeltaBuilder, reason: str) -> None:
        self._error = reason
        self._emit_content(out, self._text[self._block_start :])
        self._pos = len(self._text)
        self._state = _RAW

    def _drain(self, out: _DeltaBuilder, final: bool) -> None:
        step = {
            _CONTENT: self._step_content,
            _BLOCK: self._step_tag,
            _INVOKE: self._step_tag,
            _PARAM: self._step_param,
            _RAW: self._step_raw,
        }
        while step[self._state](out, final):
            pass

    def _step_raw(self, out: _DeltaBuilder, final: bool) -> bool:
        self._emit_content(out, self._text[self._pos :])
        self._pos = len(self._text)
        return False

    def _step_content(self, out: _DeltaBuilder, final: bool) -> bool:
        text, pos = self._text, self._pos
        calls_open = self._spelling.calls_open
        found = text.find(calls_open, pos)
        if found < 0:
            hold = 0 if final else partial_suffix_length(text, (calls_open,), pos, _BLOCK_NEWLINES)
            self._emit_content(out, text[pos : len(text) - hold])
            self._pos = len(text) - hold
            return False
        start = found
        while start > pos and found - start < _BLOCK_NEWLINES and text[start - 1] == "\n":
            start -= 1
        self._emit_content(out, text[pos:start])
        self._block_start = start
        self._pos = found + len(calls_open)
        self._state = _BLOCK
        return True

    def _step_tag(self, out: _DeltaBuilder, final: bool) -> bool:
        text = self._text
        pos = self._pos
        while pos < len(text) and text[pos].isspace():
            pos += 1
        self._pos = pos
        if pos == len(text):
            return False
        spelling = self._spelling
        heads = (
            (spelling.invoke_open_prefix, spelling.calls_close) if self._state == _BLOCK
            else (spelling.parameter_open_prefix, spelling.invoke_close)
        )
        close = text.find(">", pos, pos + _MAX_TAG_CHARS)
        fragment = text[pos : close + 1] if close >= 0 else text[pos : pos + _MAX_TAG_CHARS]
        if not any(h.startswith(fragment) or fragment.startswith(h) for h in heads):
            # report up to the first character no tag can continue with, so the
            # message does not depend on how the text was split into feeds
            agree = max(_common_prefix_length(fragment, h) for h in heads)
            self._fail(out, f"unexpected {fragment[: agree + 1][:80]!r} inside tool_calls block")
            return True
        if close < 0:
            if len(fragment) < _MAX_TAG_CHARS:
                return False
            self._fail(out, f"tag longer than {_MAX_TAG_CHARS} characters inside tool_calls block")
            return True
        tag = fragment
        self._pos = close + 1
        if self._state == _BLOCK:
            match = spelling.invoke_tag.fullmatch(tag)
            if match:
                self._open_call(out, match.group(1))
                self._state = _INVOKE
            elif tag == spelling.calls_close:
                self._state = _CONTENT
            else:
                self._fail(out, f"expected an invoke tag, got {tag[:80]!r}")
            return True
        match = spelling.parameter_tag.fullmatch(tag)
        if match:
            name, string = match.group(1), match.group(2)
            if name in self._param_names:
                self._fail(out, f"duplicate parameter {name!r} in call to {self._call_name!r}")
                return True
            self._emit_args(out, ("{" if not self._param_names else ", ") + to_json(name) + ": ")
            self._param_names.add(name)
            self._param_is_string = string == "true"
            self._param_value = []
            if self._param_is_string:
                self._emit_args(out, '"')
            self._state = _PARAM
        elif tag == spelling.invoke_close:
            self._emit_args(out, "}" if self._param_names else "{}")
            self._close_call()
            self._state = _BLOCK
        else:
            self._fail(out, f"expected a parameter tag, got {tag[:80]!r}")
        return True

    def _step_param(self, out: _DeltaBuilder, final: bool) -> bool:
        text, pos = self._text, self._pos
        close = self._spelling.parameter_close
        found = text.find(close, pos)
        end = found if found >= 0 else len(text) - partial_suffix_length(text, (close,), pos)
        chunk = text[pos:end]
        if self._param_is_string:
            if chunk:
                self._emit_args(out, to_json(chunk)[1:-1])
        else:
            self._param_value.append(chunk)
        if found < 0:
            self._pos = end
            return False
        self._pos = found + len(close)
        if self._param_is_string:
            self._emit_args(out, '"')
        else:
            self._emit_args(out, _json_value("".join(self._param_value)))
        self._state = _INVOKE
        return True

    def _open_call(self, out: _DeltaBuilder, name: str) -> None:
        self._call_kept = self._parallel or not self._calls_started()
        self._call_index += 1 if self._call_kept else 0
        self._call_id = new_call_id()
        self._call_name = name
        self._call_args = []
        self._param_names = set()
        if self._call_kept:
            out.add_call(ToolCallDelta(index=self._call_index, id=self._call_id, name=name))

    def _calls_started(self) -> bool:
        return self._call_index >= 0

    def _close_call(self) -> None:
        if self._call_kept:
            self._calls.append(ToolCall(self._call_id, self._call_name, "".join(self._call_args)))
        self._call_kept = False


def _common_prefix_length(a: str, b: str) -> int:
    length = 0
    for x, y in zip(a, b):
        if x != y:
            break
        length += 1
    return length


def _json_value(raw: str) -> str:
    """A ``string="false"`` value: its JSON text if valid, else the text as a JSON string."""
    value = raw.strip()
    try:
        json.loads(value)
    except ValueError:
        return to_json(raw)
    return value


class DsmlToolParser:
    """ToolCallParser plugin ``dsml`` (DeepSeek-V4 tool-call markup)."""

    name = "dsml"
    spelling = V4_SPELLING

    def __init__(self, ctx: PluginContext, options: Mapping[str, Any] | None = None) -> None:
        self._ctx = ctx

    def stream(self, *, tools: Sequence[Mapping[str, Any]], parallel_tool_calls: bool = True) -> DsmlToolCallStream:
        return DsmlToolCallStream(tools, parallel_tool_calls, self.spelling)

    def constraint(self, tokenizer: Tokenizer, *, tools: Sequence[Mapping[str, Any]], tool_choice: Any,
                   prompt_ends_in_reasoning: bool, max_tokens: int, guard_markup: bool) -> TokenConstraint | None:
        """A forced call (:func:`~ds4d.plugins.dsml_constraint.build_tool_constraint`) for "required" or a
        named function; the block guard (:func:`~ds4d.plugins.dsml_constraint.build_block_guard`) for
        "auto"/"none" with ``guard_markup``; else None."""
        if tool_choice not in (None, "auto", "none"):
            return build_tool_constraint(tokenizer, tools, tool_choice, max_tokens=max_tokens, spelling=self.spelling,
                                         prompt_ends_in_reasoning=prompt_ends_in_reasoning)
        if guard_markup:
            return build_block_guard(tokenizer, tools, tool_choice, spelling=self.spelling, max_tokens=max_tokens)
        return None


class DsmlV41ToolParser(DsmlToolParser):
    """ToolCallParser plugin ``dsml_v41`` (DeepSeek-V4.1 markup: ``<｜DSML｜ calls>``).

    A namespaced call comes out with its qualified name, ``ns::name``: OpenAI clients
    have nowhere else to keep the namespace, and the V4.1 encoder splits the name
    again when the call is replayed, so the next prompt renders the same bytes.
    """

    name = "dsml_v41"
    spelling = V41_SPELLING


def parse_completion(text: str, thinking_mode: bool | str, spelling: DsmlSpelling = V4_SPELLING) -> dict[str, Any]:
    """Parse one whole completion into an assistant message, as the official parser does.

    Returns ``{"role", "content", "reasoning_content", "tool_calls"}`` with
    OpenAI-shaped ``tool_calls`` (``type`` and ``function``; no ids).  Text after
    the first end-of-sentence token is ignored; malformed tool markup comes back
    as content with no calls.  With V4.1's spelling a ``ns::name`` call is split
    as the official V4.1 parser does: bare ``name``, and ``namespace`` beside
    ``function``.
    """
    thinking = thinking_mode == "thinking" if isinstance(thinking_mode, str) else bool(thinking_mode)
    end = text.find(EOS)
    if end >= 0:
        text = text[:end]
    reasoning = DeepseekV4ReasoningStream(prompt_ends_in_reasoning=thinking, tool_calls_open=spelling.calls_open)
    first, last = reasoning.feed(text), reasoning.finish()
    tools = DsmlToolCallStream(tools=(), spelling=spelling)
    tools.feed(first.content + last.content)
    _, result = tools.finish()
    calls = []
    for call in result.calls:
        namespace, name = (None, call.name)
        if spelling.namespaces:
            namespace, separator, bare = call.name.partition("::")
            namespace, name = (namespace, bare) if separator else (None, call.name)
        calls.append({"type": "function", "function": {"name": name, "arguments": call.arguments}}
                     | ({"namespace": namespace} if namespace is not None else {}))
    return {
        "role": "assistant",
        "content": result.content,
        "reasoning_content": first.reasoning + last.reasoning,
        "tool_calls": calls,
    }
