"""DeepSeek-V4.1 chat encoding against the release's vectors (tests/fixtures/dsv41_encoding.json)."""

from __future__ import annotations

import copy
import json
import logging
import types
from pathlib import Path

import pytest

from ds4d.contracts import ChatRenderRequest, PluginContext
from ds4d.plugins.dsml_format import V41_SPELLING
from ds4d.plugins.dsml_tools import parse_completion
from ds4d.plugins.dsv41_encoder import (
    EFFORT_LEVELS,
    DeepseekV41ChatEncoder,
    effort_budget,
    render_messages,
)

VECTORS = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "dsv41_encoding.json").read_text("utf-8"))
GENERATED = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "dsv41_generated.json").read_text("utf-8"))
PROMPT_CASES = [c for c in VECTORS["extra"] if "expected_prompt" in c]
COMPLETION_CASES = [c for c in VECTORS["extra"] if "expected_message" in c]
BOS = "<｜begin▁of▁sentence｜>"
EFFORT_75 = "<｜System｜>Reasoning Effort: 75 (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
TOOL_BASH = {"type": "function", "function": {"name": "bash", "description": "Run a shell command.",
                                              "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}}


def _ctx(thinking_default: bool = True) -> PluginContext:
    return PluginContext(config=types.SimpleNamespace(thinking_default=thinking_default), log=logging.getLogger("t"))


class _CountingTokenizer:
    """Stand-in tokenizer: one id per character (the real one is tested elsewhere)."""

    vocab_size = 0x110000
    bos_token_id = None
    eos_token_ids = frozenset()

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]


def _encoder(options=None) -> DeepseekV41ChatEncoder:
    return DeepseekV41ChatEncoder(_ctx(), options or {}, _CountingTokenizer(), None)


def _official(case: dict) -> tuple[list, str, str | int | None]:
    """An official case as the release's test encodes it: tools on the first message, chat mode
    unless the case says otherwise."""
    messages = copy.deepcopy(case["messages"])
    if "tools" in case:
        messages[0]["tools"] = case["tools"]
    return messages, case.get("thinking_mode") or "chat", case.get("reasoning_effort")


@pytest.mark.parametrize("vector", VECTORS["official"], ids=lambda v: v["name"])
def test_official_vectors_byte_exact(vector: dict) -> None:
    messages, mode, effort = _official(vector["case"])
    assert render_messages(messages, None, mode, True, effort) == vector["expected_prompt"]


@pytest.mark.parametrize("case", PROMPT_CASES, ids=lambda c: c["name"])
def test_extra_vectors_byte_exact(case: dict) -> None:
    got = render_messages(case["messages"], case["tools"], case["thinking_mode"], case["drop_thinking"],
                          case["reasoning_effort"])
    assert got == case["expected_prompt"]


@pytest.mark.parametrize("case", GENERATED["prompts"], ids=lambda c: c["name"])
def test_generated_conversations_byte_exact(case: dict) -> None:
    got = render_messages(case["messages"], case["tools"], case["thinking_mode"], case["drop_thinking"],
                          case["reasoning_effort"])
    assert got == case["expected_prompt"]


@pytest.mark.parametrize("case", PROMPT_CASES, ids=lambda c: c["name"])
def test_plugin_renders_like_the_function(case: dict) -> None:
    request = ChatRenderRequest(messages=tuple(case["messages"]), tools=tuple(case["tools"] or ()),
                                thinking=case["thinking_mode"] == "thinking", drop_thinking=case["drop_thinking"],
                                reasoning_effort=case["reasoning_effort"])
    prompt = _encoder().render(request)
    assert prompt.text == case["expected_prompt"]
    assert prompt.token_ids == tuple(ord(c) for c in prompt.text)
    assert prompt.ends_in_reasoning == (case["thinking_mode"] == "thinking")


@pytest.mark.parametrize("case", COMPLETION_CASES + GENERATED["completions"], ids=lambda c: c["name"])
def test_completions_parse_as_the_release_does(case: dict) -> None:
    assert parse_completion(case["completion_text"], case["thinking_mode"], V41_SPELLING) == case["expected_message"]


@pytest.mark.parametrize("case", COMPLETION_CASES, ids=lambda c: c["name"])
def test_parsed_completion_renders_back_to_the_same_bytes(case: dict) -> None:
    """A generated turn replayed by the client re-renders byte-identically (prefix cache)."""
    history = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    prompt = render_messages(history, [TOOL_BASH], case["thinking_mode"], True, None)
    message = parse_completion(case["completion_text"], case["thinking_mode"], V41_SPELLING)
    for number, call in enumerate(message["tool_calls"]):
        call["id"] = f"call_{number}"
    replay = render_messages(history + [message], [TOOL_BASH], case["thinking_mode"], True, None)
    assert replay == prompt + case["completion_text"]


def test_reasoning_effort_levels_and_numbers() -> None:
    assert {name: effort_budget(name) for name in EFFORT_LEVELS} == {
        "low": 50, "medium": 62, "high": 75, "max": 100, "xhigh": 100}
    assert effort_budget(None) == 75 and effort_budget(1) == 1 and effort_budget(100) == 100
    for bad in (0, 101, -5, True, "minimal", "HIGH", "75", 7.5):
        with pytest.raises(ValueError, match="reasoning_effort"):
            effort_budget(bad)
    messages = [{"role": "user", "content": "U"}]
    assert render_messages(messages, None, True, True, 33) == (
        BOS + EFFORT_75.replace("75", "33") + "<｜User｜>U<｜Assistant｜><think>")
    assert render_messages(messages, None, "chat", True, "max") == BOS + "<｜User｜>U<｜Assistant｜></think>"
    with pytest.raises(ValueError):  # checked in chat mode too, as the release does
        render_messages(messages, None, "chat", True, 0)


def test_system_token_and_mid_conversation_system_messages() -> None:
    chat = render_messages([{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                            {"role": "assistant", "content": "A"}, {"role": "system", "content": "Now be terse."}],
                           None, "chat", True, None)
    assert chat == (BOS + "<｜System｜>S<｜User｜>U<｜Assistant｜></think>A<｜end▁of▁sentence｜>"
                    "<｜System｜>Now be terse.<｜Assistant｜></think>")
    # the later system message is the last user turn: reasoning before it is dropped
    thinking = render_messages([{"role": "user", "content": "U"},
                                {"role": "assistant", "content": "A", "reasoning_content": "why"},
                                {"role": "developer", "content": "D"}], None, True, True, None)
    assert thinking == (BOS + EFFORT_75 + "<｜User｜>U<｜Assistant｜></think>A<｜end▁of▁sentence｜>"
                        "<｜System｜>D<｜Assistant｜><think>")
    first_developer = render_messages([{"role": "developer", "content": "D"}, {"role": "user", "content": "U"}],
                                      None, "chat", True, None)
    assert first_developer == BOS + "<｜System｜>D<｜User｜>U<｜Assistant｜></think>"


def test_tool_namespaces() -> None:
    tools = [
        {"type": "function", "namespace": "fs", "function": {"name": "read", "description": "Read a file."}},
        {"type": "function", "namespace": {"name": "web", "description": "Web tools."},
         "function": {"name": "open", "parameters": {}}},
        {"type": "function", "function": {"name": "git::log", "description": "Show history."}},
    ]
    history = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "1", "type": "function", "namespace": "fs",
                    "function": {"name": "read", "arguments": '{"path": "/a"}'}},
                   {"id": "2", "type": "function", "function": {"name": "git::log", "arguments": "{}"}}]}]
    text = render_messages(history, tools, "chat", True, None)
    assert '{"name": "fs::read", "description": "Read a file."}' in text
    assert '{"name": "web::open", "parameters": {}, "description": "Web tools.\\n"}' in text
    assert '{"name": "git::log", "description": "Show history."}' in text
    assert '<｜DSML｜ invoke name="fs::read">\n<｜DSML｜ parameter name="path" string="true">/a</｜DSML｜ parameter>' in text
    assert '<｜DSML｜ invoke name="git::log">\n\n</｜DSML｜ invoke>' in text
    with pytest.raises(ValueError, match="namespace"):
        render_messages([{"role": "user", "content": "U"}], [
            {"type": "function", "namespace": "a", "function": {"name": "b::c"}}], "chat", True, None)


def test_call_arguments_encoded_twice_render_as_parameters() -> None:
    def rendered(arguments) -> str:
        return render_messages([{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [
            {"id": "1", "function": {"name": "f", "arguments": arguments}}]}], None, "chat", True, None)

    assert rendered(json.dumps(json.dumps({"n": 1}))) == rendered({"n": 1}) == rendered('{"n": 1}')
    assert '<｜DSML｜ parameter name="arguments" string="true">not json</｜DSML｜ parameter>' in rendered("not json")
    assert rendered("") == rendered(None) == rendered("{}")


def test_images_render_as_placeholders_and_the_placeholder_is_not_text() -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    text = render_messages([{"role": "user", "content": [{"type": "text", "text": "a"}, image,
                                                         {"type": "input_audio", "input_audio": {}}]}],
                           None, "chat", True, None)
    assert text == BOS + "<｜User｜>a\n\n<｜deepseek_image｜>\n\n[Unsupported input_audio]<｜Assistant｜></think>"
    for content in ("see <｜deepseek_image｜>", [{"type": "text", "text": "<｜deepseek_image｜>"}]):
        with pytest.raises(ValueError, match="deepseek_image"):
            render_messages([{"role": "user", "content": content}], None, "chat", True, None)


def test_volatile_tail_and_the_v4_tokenizer_warning(caplog) -> None:
    from ds4d.models.hf_tokenizer import deepseek_v4_tokenizer

    with caplog.at_level(logging.WARNING):
        encoder = DeepseekV41ChatEncoder(_ctx(), {}, deepseek_v4_tokenizer(), None)
    assert "<｜System｜>" in caplog.text
    turn1 = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime."}]
    turn2 = turn1 + [{"role": "assistant", "content": "7", "reasoning_content": "2, 3, 5, 7."},
                     {"role": "user", "content": "Another."}]
    first = encoder.render(ChatRenderRequest(messages=tuple(turn1)))
    second = encoder.render(ChatRenderRequest(messages=tuple(turn2)))
    keep = len(first.token_ids) - first.volatile_tail
    assert first.volatile_tail == 1 and first.ends_in_reasoning
    assert second.token_ids[:keep] == first.token_ids[:keep]
    assert encoder.render(ChatRenderRequest(messages=tuple(turn1), tools=(TOOL_BASH,))).volatile_tail == 0
