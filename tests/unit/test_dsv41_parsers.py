"""DeepSeek-V4.1 output parsing (plugins ``deepseek_v41`` and ``dsml_v41``): the release's completion
vectors, whole, token by token, character by character and over random splits."""

from __future__ import annotations

import json
import logging
import random
import types
from pathlib import Path

import pytest

from ds4d.contracts import PluginContext
from ds4d.models.hf_tokenizer import HFTokenizer, deepseek_v4_tokenizer
from ds4d.plugins.dsml_tools import DsmlToolParser, DsmlV41ToolParser
from ds4d.plugins.dsv4_reasoning import DeepseekV41ReasoningParser
from tests.unit.test_dsml_tools import assembled, token_pieces

VECTORS = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "dsv41_encoding.json").read_text("utf-8"))
COMPLETIONS = [c for c in VECTORS["extra"] if "expected_message" in c]
CTX = PluginContext(config=types.SimpleNamespace(thinking_default=True), log=logging.getLogger("t"))
EOS = "<｜end▁of▁sentence｜>"
P = "｜DSML｜ "


@pytest.fixture(scope="module")
def v4() -> HFTokenizer:
    return deepseek_v4_tokenizer()


def random_pieces(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def parse(pieces: list[str], thinking: bool, parser=DsmlV41ToolParser) -> dict:
    """The pipeline the server runs: reasoning split, then tool calls over the content."""
    reasoning = DeepseekV41ReasoningParser(CTX, {}).stream(prompt_ends_in_reasoning=thinking)
    tools = parser(CTX, {}).stream(tools=(), parallel_tool_calls=True)
    split = [reasoning.feed(p) for p in pieces] + [reasoning.finish()]
    deltas = [tools.feed(d.content) for d in split]
    last, result = tools.finish()
    content, calls = assembled([*deltas, last])
    assert result.error is None
    assert content == result.content
    assert [(v["name"], v["arguments"]) for _, v in sorted(calls.items())] == [
        (c.name, c.arguments) for c in result.calls]
    return {"role": "assistant", "content": result.content, "reasoning_content": "".join(d.reasoning for d in split),
            "tool_calls": [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                           for c in result.calls]}


@pytest.mark.parametrize("case", COMPLETIONS, ids=lambda c: c["name"])
def test_streamed_completions_equal_the_release_parser(v4: HFTokenizer, case: dict) -> None:
    text = case["completion_text"].removesuffix(EOS)  # the engine stops at end-of-sentence
    thinking = case["thinking_mode"] == "thinking"
    ways = {"whole": [text], "tokens": token_pieces(v4, text), "chars": list(text)}
    ways |= {f"random{seed}": random_pieces(text, seed) for seed in range(20)}
    for how, pieces in ways.items():
        message = parse(pieces, thinking)
        assert message == case["expected_message"], how
        for call in message["tool_calls"]:
            assert isinstance(json.loads(call["function"]["arguments"]), dict)


GENERATED = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "dsv41_generated.json").read_text("utf-8"))


@pytest.mark.parametrize("case", GENERATED["completions"], ids=lambda c: c["name"])
def test_streamed_generated_completions_equal_the_release_parser(case: dict) -> None:
    """Namespaced calls stream with their qualified names; the release splits off the namespace."""
    text = case["completion_text"].removesuffix(EOS)
    expected = case["expected_message"]
    qualified = [{"type": "function", "function": {**c["function"], "name": f"{c['namespace']}::{c['function']['name']}"
                                                   if "namespace" in c else c["function"]["name"]}}
                 for c in expected["tool_calls"]]
    for seed in range(5):
        message = parse(random_pieces(text, seed), case["thinking_mode"] == "thinking")
        assert message == {**expected, "tool_calls": qualified}


def test_typed_arguments_and_namespaced_names() -> None:
    text = (f'Plan.</think>\n\n<{P}calls>\n<{P}invoke name="fs::write">\n'
            f'<{P}parameter name="path" string="true">/a "b"</{P}parameter>\n'
            f'<{P}parameter name="opts" string="false">{{"mode": 420, "force": true, "tags": [null, 1.5]}}</{P}parameter>\n'
            f"</{P}invoke>\n</{P}calls>")
    for pieces in ([text], list(text)):
        message = parse(pieces, thinking=True)
        call = message["tool_calls"][0]["function"]
        assert call["name"] == "fs::write"
        assert json.loads(call["arguments"]) == {"path": '/a "b"', "opts": {"mode": 420, "force": True,
                                                                           "tags": [None, 1.5]}}
        assert message["reasoning_content"] == "Plan." and message["content"] == ""


def test_the_other_spelling_is_plain_content() -> None:
    """V4 markup from a V4.1 model (and the reverse) is text, not a call."""
    v4_markup = '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'
    assert parse([v4_markup], thinking=False)["tool_calls"] == []
    v41 = COMPLETIONS[2]["completion_text"].removesuffix(EOS).split("</think>", 1)[1]
    assert parse([v41], thinking=False, parser=DsmlToolParser)["tool_calls"] == []
    assert parse([v41], thinking=False)["tool_calls"]


def test_block_inside_reasoning_ends_it() -> None:
    text = f'Thinking about it\n\n<{P}calls>\n<{P}invoke name="f">\n</{P}invoke>\n</{P}calls>'
    for pieces in ([text], list(text)):
        message = parse(pieces, thinking=True)
        assert message["reasoning_content"] == "Thinking about it"
        assert message["tool_calls"] == [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]
