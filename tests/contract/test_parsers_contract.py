"""Contract tests every reasoning parser and every tool-call parser must pass.

The parsers are the built-in ones plus every plugin the registry knows for the
``reasoning_parser`` / ``tool_parser`` kinds (built-in table and entry points).
"""

from __future__ import annotations

import logging
import types

import pytest

from ds4d.contracts import PluginContext, ReasoningDelta, ToolParseDelta, ToolParseResult
from ds4d.plugins.dsml_tools import DsmlToolParser
from ds4d.plugins.dsv4_reasoning import DeepseekV4ReasoningParser
from ds4d.plugins.passthrough import NoReasoningParser, NoToolParser
from ds4d.registry import available

CTX = PluginContext(config=types.SimpleNamespace(thinking_default=True), log=logging.getLogger("t"))

PLAIN_TEXTS = [
    "Hello, world.",
    "Code: if a < b and b > c:\n    return [x for x in y]\n\n",
    "中文回答，带表情💡与全角符号｜。",
    "",
    "  leading and trailing spaces  ",
    "A line\n\nAnother paragraph ending in a lone <",
]

MARKED_UP_TEXTS = [
    "reasoning here</think>answer here",
    (
        '<think>r</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n'
        '<｜DSML｜parameter name="a" string="false">[1, 2]</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
    ),
    'Content.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f"',
    (  # V4.1 spelling
        '<think>r</think>\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="ns::f">\n'
        '<｜DSML｜ parameter name="a" string="true">x < y</｜DSML｜ parameter>\n'
        "</｜DSML｜ invoke>\n</｜DSML｜ calls>"
    ),
    'Content.\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="f"',
]


def _collect(kind: str, builtins: list[type]) -> list[type]:
    found = list(builtins)
    for spec in available(kind).values():
        factory = spec.load()
        if factory not in found:
            found.append(factory)
    return found


REASONING_PARSERS = _collect("reasoning_parser", [DeepseekV4ReasoningParser, NoReasoningParser])
TOOL_PARSERS = _collect("tool_parser", [DsmlToolParser, NoToolParser])


def _reason(factory, pieces: list[str], in_reasoning: bool) -> tuple[str, str]:
    stream = factory(CTX, {}).stream(prompt_ends_in_reasoning=in_reasoning)
    deltas = [stream.feed(p) for p in pieces] + [stream.finish()]
    assert all(isinstance(d, ReasoningDelta) for d in deltas)
    return "".join(d.reasoning for d in deltas), "".join(d.content for d in deltas)


def _tools(factory, pieces: list[str]) -> tuple[str, list[tuple[str, str]], ToolParseResult]:
    stream = factory(CTX, {}).stream(tools=(), parallel_tool_calls=True)
    deltas = [stream.feed(p) for p in pieces]
    last, result = stream.finish()
    deltas.append(last)
    assert all(isinstance(d, ToolParseDelta) for d in deltas)
    arguments: dict[int, list[str]] = {}
    names: dict[int, str] = {}
    for delta in deltas:
        for call in delta.calls:
            if call.name is not None:
                names[call.index] = call.name
            arguments.setdefault(call.index, []).append(call.arguments)
    calls = [(names[i], "".join(arguments[i])) for i in sorted(arguments)]
    return "".join(d.content for d in deltas), calls, result


@pytest.mark.parametrize("factory", REASONING_PARSERS, ids=lambda f: f.name)
def test_reasoning_parser_has_a_name(factory) -> None:
    assert isinstance(factory.name, str) and factory(CTX, {}).name == factory.name


@pytest.mark.parametrize("factory", REASONING_PARSERS, ids=lambda f: f.name)
@pytest.mark.parametrize("text", PLAIN_TEXTS + MARKED_UP_TEXTS)
@pytest.mark.parametrize("in_reasoning", [False, True])
def test_reasoning_whole_equals_char_by_char(factory, text: str, in_reasoning: bool) -> None:
    assert _reason(factory, [text], in_reasoning) == _reason(factory, list(text), in_reasoning)


@pytest.mark.parametrize("factory", REASONING_PARSERS, ids=lambda f: f.name)
@pytest.mark.parametrize("text", PLAIN_TEXTS)
def test_reasoning_plain_text_round_trips_as_content(factory, text: str) -> None:
    assert _reason(factory, [text], False) == ("", text)
    assert _reason(factory, list(text), False) == ("", text)


@pytest.mark.parametrize("factory", REASONING_PARSERS, ids=lambda f: f.name)
def test_reasoning_finish_is_safe_to_repeat(factory) -> None:
    stream = factory(CTX, {}).stream(prompt_ends_in_reasoning=True)
    stream.feed("some text")
    stream.finish()
    assert stream.finish() == ReasoningDelta()


@pytest.mark.parametrize("factory", TOOL_PARSERS, ids=lambda f: f.name)
def test_tool_parser_has_a_name(factory) -> None:
    assert isinstance(factory.name, str) and factory(CTX, {}).name == factory.name


@pytest.mark.parametrize("factory", TOOL_PARSERS, ids=lambda f: f.name)
@pytest.mark.parametrize("text", PLAIN_TEXTS + MARKED_UP_TEXTS)
def test_tool_whole_equals_char_by_char(factory, text: str) -> None:
    whole_content, whole_calls, whole = _tools(factory, [text])
    char_content, char_calls, chars = _tools(factory, list(text))
    assert (whole_content, whole_calls) == (char_content, char_calls)
    assert (whole.content, whole.error) == (chars.content, chars.error)
    assert [(c.name, c.arguments) for c in whole.calls] == [(c.name, c.arguments) for c in chars.calls]


@pytest.mark.parametrize("factory", TOOL_PARSERS, ids=lambda f: f.name)
@pytest.mark.parametrize("text", PLAIN_TEXTS)
def test_tool_plain_text_round_trips_as_content(factory, text: str) -> None:
    for pieces in ([text], list(text)):
        content, calls, result = _tools(factory, pieces)
        assert content == text and calls == []
        assert result == ToolParseResult(content=text, calls=())


@pytest.mark.parametrize("factory", TOOL_PARSERS, ids=lambda f: f.name)
def test_tool_finish_is_safe_to_repeat(factory) -> None:
    stream = factory(CTX, {}).stream(tools=())
    stream.feed("some text")
    _, first = stream.finish()
    last, second = stream.finish()
    assert second == first and last.content == "" and last.calls == ()


@pytest.mark.parametrize("factory", TOOL_PARSERS, ids=lambda f: f.name)
def test_tool_streamed_calls_match_the_result(factory) -> None:
    for text in MARKED_UP_TEXTS:
        content, calls, result = _tools(factory, list(text))
        if result.error is None:
            assert calls == [(c.name, c.arguments) for c in result.calls]
            assert content == result.content
        else:
            assert result.calls == () and result.content == text
