"""DeepSeek-V4 reasoning/content split, fed whole, token by token and character by character."""

from __future__ import annotations

import logging
import random
import types

import pytest

from ds4d.contracts import PluginContext, ReasoningDelta
from ds4d.models.hf_tokenizer import HFTokenizer, deepseek_v4_tokenizer
from ds4d.plugins.dsml_tools import DsmlToolParser
from ds4d.plugins.dsv4_reasoning import DeepseekV4ReasoningParser

CTX = PluginContext(config=types.SimpleNamespace(thinking_default=True), log=logging.getLogger("t"))

CALL = (
    '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="read">\n'
    '<｜DSML｜parameter name="filePath" string="true">/a/b.py</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
)

# (output text, prompt ends in reasoning, expected reasoning, expected content)
CASES = [
    ("The user wants X.</think>Here is X.", True, "The user wants X.", "Here is X."),
    ("only thinking, cut off by max_tokens", True, "only thinking, cut off by max_tokens", ""),
    ("Bonjour !", False, "", "Bonjour !"),
    ("<think>plan</think>answer", False, "plan", "answer"),
    ("\n<think>plan</think>answer", False, "plan", "answer"),
    ("a<think>b</think>c", True, "ab", "c"),
    ("plan</think></think>answer", True, "plan", "answer"),
    ("</think>chat answer", False, "", "chat answer"),
    ("plan</think>\n\nx <think> y </think> z", True, "plan", "\n\nx <think> y </think> z"),
    ("Need to read.\n\n" + CALL, True, "Need to read.", "\n\n" + CALL),
    ("Need to read." + CALL, True, "Need to read.", CALL),
    ("Need to read.</think>\n\n" + CALL, True, "Need to read.", "\n\n" + CALL),
    ("a < b and c </thin d", True, "a < b and c </thin d", ""),
    ("ends with a partial tag </thi", True, "ends with a partial tag </thi", ""),
    ("   ", False, "", "   "),
    ("<thi", False, "", "<thi"),
    ("中文推理。</think>中文回答💡", True, "中文推理。", "中文回答💡"),
]


@pytest.fixture(scope="module")
def v4() -> HFTokenizer:
    return deepseek_v4_tokenizer()


def token_pieces(tokenizer: HFTokenizer, text: str) -> list[str]:
    """Text as an incremental detokenizer would emit it, one token at a time."""
    ids = tokenizer.encode(text)
    pieces: list[str] = []
    start = 0
    for end in range(1, len(ids) + 1):
        piece = tokenizer.decode(ids[start:end])
        if not piece.endswith("\ufffd"):
            pieces.append(piece)
            start = end
    assert "".join(pieces) == text
    return pieces


def run(pieces: list[str], prompt_ends_in_reasoning: bool) -> tuple[str, str, list[ReasoningDelta]]:
    stream = DeepseekV4ReasoningParser(CTX, {}).stream(prompt_ends_in_reasoning=prompt_ends_in_reasoning)
    deltas = [stream.feed(p) for p in pieces] + [stream.finish()]
    return "".join(d.reasoning for d in deltas), "".join(d.content for d in deltas), deltas


def splits(tokenizer: HFTokenizer, text: str) -> dict[str, list[str]]:
    return {"whole": [text], "tokens": token_pieces(tokenizer, text), "chars": list(text)}


@pytest.mark.parametrize("text,in_reasoning,reasoning,content", CASES)
def test_split_is_the_same_however_the_text_arrives(
    v4: HFTokenizer, text: str, in_reasoning: bool, reasoning: str, content: str
) -> None:
    for how, pieces in splits(v4, text).items():
        got_reasoning, got_content, _ = run(pieces, in_reasoning)
        assert (got_reasoning, got_content) == (reasoning, content), how


def test_partial_end_tag_is_held_back_until_decided() -> None:
    stream = DeepseekV4ReasoningParser(CTX, {}).stream(prompt_ends_in_reasoning=True)
    assert stream.feed("abc</th") == ReasoningDelta(reasoning="abc")
    assert stream.feed("ink>de") == ReasoningDelta(content="de")
    assert stream.feed("f") == ReasoningDelta(content="f")
    assert stream.finish() == ReasoningDelta()
    assert stream.finish() == ReasoningDelta()


def test_reasoning_streams_before_the_end_tag_arrives() -> None:
    stream = DeepseekV4ReasoningParser(CTX, {}).stream(prompt_ends_in_reasoning=True)
    assert stream.feed("step one, ").reasoning == "step one, "
    assert stream.feed("step two").reasoning == "step two"


def test_tool_block_inside_reasoning_reaches_the_tool_parser(v4: HFTokenizer) -> None:
    text = "I will read the file.\n\n" + CALL
    for how, pieces in splits(v4, text).items():
        reasoning, content, _ = run(pieces, True)
        tools = DsmlToolParser(CTX, {}).stream(tools=())
        tools.feed(content)
        _, result = tools.finish()
        assert reasoning == "I will read the file.", how
        assert result.content == "" and result.error is None, how
        assert [(c.name, c.arguments) for c in result.calls] == [("read", '{"filePath": "/a/b.py"}')], how


@pytest.mark.parametrize("text,in_reasoning,reasoning,content", CASES)
def test_no_tag_leaks_from_the_delimiting_positions(
    text: str, in_reasoning: bool, reasoning: str, content: str
) -> None:
    got_reasoning, got_content, _ = run(list(text), in_reasoning)
    assert "<think>" not in got_reasoning and "</think>" not in got_reasoning
    if "<think> y" not in text:  # tags inside started content pass through untouched
        assert "<think>" not in got_content and "</think>" not in got_content


def test_feed_after_finish_is_an_error() -> None:
    stream = DeepseekV4ReasoningParser(CTX, {}).stream(prompt_ends_in_reasoning=False)
    stream.finish()
    with pytest.raises(RuntimeError):
        stream.feed("x")


@pytest.mark.parametrize("text,in_reasoning,reasoning,content", CASES)
def test_random_splits_agree(text: str, in_reasoning: bool, reasoning: str, content: str) -> None:
    rng = random.Random(7)
    for _ in range(40):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 20))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert run(pieces, in_reasoning)[:2] == (reasoning, content)
