"""DeepSeek-V4 chat encoding against the official vectors and the extra reference cases."""

from __future__ import annotations

import json
import logging
import os
import types
from pathlib import Path

import pytest

from ds4d.contracts import ChatRenderRequest, PluginContext
from ds4d.plugins.dsml_tools import parse_completion
from ds4d.server.openai_routes import boundaries_within
from ds4d.plugins.dsv4_encoder import (
    REASONING_EFFORT_MAX_PREFIX,
    USER,
    DeepseekV4ChatEncoder,
    render_messages,
)

REPO = Path(__file__).resolve().parents[2]
REFERENCE = Path(os.environ.get("DS4D_REFERENCE_DIR", REPO / "tests" / "fixtures" / "reference"))
ENCODING = REFERENCE / "dsv4" / "encoding"
OPENCODE = REFERENCE / "opencode" / "requests"
needs_reference = pytest.mark.skipif(
    not ENCODING.is_dir(),
    reason=f"reference vectors not found at {ENCODING} (set DS4D_REFERENCE_DIR)",
)

TOOL_BASH = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a shell command.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
    },
}


def _extra_cases(kind: str) -> list:
    path = ENCODING / "extra_vectors.json"
    if not path.is_file():
        return []
    return [c for c in json.loads(path.read_text(encoding="utf-8")) if kind in c]


def _official_case(number: int) -> tuple[list, str, str]:
    data = json.loads((ENCODING / f"test_input_{number}.json").read_text(encoding="utf-8"))
    if isinstance(data, dict):  # case 1: top-level tools go on the first message
        messages = [dict(m) for m in data["messages"]]
        messages[0]["tools"] = data["tools"]
    else:
        messages = data
    expected = (ENCODING / f"test_output_{number}.txt").read_text(encoding="utf-8")
    return messages, ("chat" if number == 4 else "thinking"), expected


def _ctx(thinking_default: bool = True) -> PluginContext:
    return PluginContext(config=types.SimpleNamespace(thinking_default=thinking_default), log=logging.getLogger("t"))


class _CountingTokenizer:
    """Stand-in tokenizer: one id per character (the real one is tested elsewhere)."""

    vocab_size = 0x110000
    bos_token_id = None
    eos_token_ids = frozenset()

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]


def _encoder(options=None, thinking_default=True) -> DeepseekV4ChatEncoder:
    return DeepseekV4ChatEncoder(_ctx(thinking_default), options or {}, _CountingTokenizer(), None)


@needs_reference
@pytest.mark.parametrize("number", [1, 2, 3, 4])
def test_official_vectors_byte_exact(number: int) -> None:
    messages, mode, expected = _official_case(number)
    assert render_messages(messages, None, mode, True, None) == expected


@needs_reference
@pytest.mark.parametrize("case", _extra_cases("expected_prompt"), ids=lambda c: c["name"])
def test_extra_vectors_byte_exact(case: dict) -> None:
    got = render_messages(
        case["messages"],
        case["tools"],
        case["thinking_mode"],
        case["drop_thinking"],
        case["reasoning_effort"],
    )
    assert got == case["expected_prompt"]


@needs_reference
@pytest.mark.parametrize("case", _extra_cases("expected_prompt"), ids=lambda c: c["name"])
def test_plugin_renders_like_the_function(case: dict) -> None:
    encoder = _encoder()
    request = ChatRenderRequest(
        messages=tuple(case["messages"]),
        tools=tuple(case["tools"] or ()),
        thinking=case["thinking_mode"] == "thinking",
        drop_thinking=case["drop_thinking"],
        reasoning_effort=case["reasoning_effort"],
    )
    prompt = encoder.render(request)
    assert prompt.text == case["expected_prompt"]
    assert prompt.token_ids == tuple(ord(c) for c in prompt.text)
    assert prompt.ends_in_reasoning == prompt.text.endswith("<think>")
    assert prompt.ends_in_reasoning == (case["thinking_mode"] == "thinking")


def test_thinking_default_comes_from_config_then_options_then_request() -> None:
    messages = ({"role": "user", "content": "hi"},)
    assert _encoder().render(ChatRenderRequest(messages)).text.endswith("<think>")
    assert _encoder(thinking_default=False).render(ChatRenderRequest(messages)).text.endswith("</think>")
    chat_by_option = _encoder({"thinking_default": False}, thinking_default=True)
    assert not chat_by_option.render(ChatRenderRequest(messages)).ends_in_reasoning
    assert chat_by_option.render(ChatRenderRequest(messages, thinking=True)).ends_in_reasoning
    by_kwargs = ChatRenderRequest(messages, template_kwargs={"enable_thinking": False})
    assert not _encoder().render(by_kwargs).ends_in_reasoning


def test_drop_thinking_false_keeps_history_reasoning() -> None:
    messages = (
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b", "reasoning_content": "why b"},
        {"role": "user", "content": "c"},
    )
    dropped = _encoder().render(ChatRenderRequest(messages)).text
    kept = _encoder().render(ChatRenderRequest(messages, drop_thinking=False)).text
    assert "why b" not in dropped and "<｜Assistant｜></think>b" in dropped
    assert "<｜Assistant｜><think>why b</think>b<｜end▁of▁sentence｜>" in kept


def test_reasoning_alias_and_content_shapes() -> None:
    base = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "r",
            "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "bash", "arguments": '{"command":"ls"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "1", "content": "out"},
    ]
    alias = [dict(m) for m in base]
    alias[2] = {k: v for k, v in base[2].items() if k != "reasoning_content"} | {"reasoning": "r"}
    alias[0]["content"] = [{"type": "text", "text": "sys"}]
    alias[3]["content"] = [{"type": "text", "text": "out"}]
    expected = render_messages(base, [TOOL_BASH], True, True, None)
    assert render_messages(alias, [TOOL_BASH], True, True, None) == expected
    assert "<think>r</think>\n\n<｜DSML｜tool_calls>" in expected
    assert expected.endswith("<｜User｜><tool_result>out</tool_result><｜Assistant｜><think>")


def test_consecutive_user_messages_merge_with_blank_line() -> None:
    text = render_messages(
        [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "A"},
            {"role": "user", "content": [{"type": "text", "text": "B"}, {"type": "text", "text": "C"}]},
        ],
        None,
        "chat",
        True,
        None,
    )
    assert text == "<｜begin▁of▁sentence｜>S<｜User｜>A\n\nB\n\nC<｜Assistant｜></think>"


def test_tools_without_system_message_get_an_empty_system_turn() -> None:
    text = render_messages([{"role": "user", "content": "x"}], [TOOL_BASH], "chat", True, None)
    assert text.startswith("<｜begin▁of▁sentence｜>\n\n## Tools\n\n")
    assert text.endswith("\n<｜User｜>x<｜Assistant｜></think>")


def test_tool_call_argument_shapes() -> None:
    def calls(arguments) -> str:
        return render_messages(
            [
                {"role": "user", "content": "q"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": arguments}}],
                },
            ],
            None,
            "chat",
            True,
            None,
        )

    assert '<｜DSML｜invoke name="f">\n\n</｜DSML｜invoke>' in calls("")
    assert calls("{}") == calls("") == calls(None)
    assert calls({"n": 1, "s": "x"}) == calls('{"n": 1, "s": "x"}')
    assert '<｜DSML｜parameter name="n" string="false">1</｜DSML｜parameter>' in calls({"n": 1})
    assert '<｜DSML｜parameter name="arguments" string="true">not json</｜DSML｜parameter>' in calls("not json")


def test_effort_task_and_generation_prompt_options() -> None:
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert REASONING_EFFORT_MAX_PREFIX not in render_messages(messages, None, True, True, "high")
    assert REASONING_EFFORT_MAX_PREFIX not in render_messages(messages, None, False, True, "max")
    assert render_messages(messages, None, True, True, "max").startswith(
        "<｜begin▁of▁sentence｜>" + REASONING_EFFORT_MAX_PREFIX + "S"
    )
    titled = [messages[0], {"role": "user", "content": "U", "task": "title"}]
    assert render_messages(titled, None, True, True, None).endswith("<｜User｜>U<｜title｜>")
    bare = render_messages(messages, None, True, True, None, add_generation_prompt=False)
    assert bare == "<｜begin▁of▁sentence｜>S<｜User｜>U"


def test_numeric_and_alias_efforts_on_v4() -> None:
    messages = [{"role": "user", "content": "U"}]
    with_max = [e for e in ("low", "medium", "high", "max", "xhigh", 1, 50, 99, 100, None)
                if REASONING_EFFORT_MAX_PREFIX in render_messages(messages, None, True, True, e)]
    assert with_max == ["max", "xhigh", 100]


def test_invalid_input_is_rejected() -> None:
    with pytest.raises(ValueError, match="role"):
        render_messages([{"role": "robot", "content": "x"}], None, True, True, None)
    with pytest.raises(ValueError, match="task"):
        render_messages([{"role": "user", "content": "x", "task": "nope"}], None, True, True, None)
    with pytest.raises(ValueError, match="thinking_mode"):
        render_messages([{"role": "user", "content": "x"}], None, "deep", True, None)


@needs_reference
@pytest.mark.parametrize("case", _extra_cases("expected_message"), ids=lambda c: c["name"])
def test_parsed_completion_renders_back_to_the_same_bytes(case: dict) -> None:
    """A generated turn replayed by the client re-renders byte-identically (prefix cache)."""
    history = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    tools = [TOOL_BASH]  # tools keep reasoning, as in agent loops
    prompt = render_messages(history, tools, case["thinking_mode"], True, None)
    message = parse_completion(case["completion_text"], case["thinking_mode"])
    for number, call in enumerate(message["tool_calls"]):
        call["id"] = f"call_{number}"
    replay = render_messages(history + [message], tools, case["thinking_mode"], True, None)
    assert replay == prompt + case["completion_text"]


@pytest.mark.skipif(not OPENCODE.is_dir(), reason=f"OpenCode requests not found at {OPENCODE}")
def test_opencode_agent_steps_extend_the_previous_prompt() -> None:
    bodies = [
        json.loads(p.read_text(encoding="utf-8"))["body"] for p in sorted(OPENCODE.glob("run2_tool_read_00[23]_*.json"))
    ]
    prompts = [render_messages(b["messages"], b.get("tools"), True, True, None) for b in bodies]
    assert len(prompts) == 2 and prompts[0].endswith("<｜Assistant｜><think>")
    assert prompts[1].startswith(prompts[0])
    assert prompts[1].endswith("</tool_result><｜Assistant｜><think>")


def test_volatile_tail_is_the_think_hand_over_the_next_turn_renders_otherwise() -> None:
    """Thinking mode without tools drops history reasoning, so the next request renders this
    turn's ``<think>`` hand-over as ``</think>``: that token is the prompt's volatile tail, and the
    next request repeats every token before it (real tokenizer)."""
    from ds4d.models.hf_tokenizer import deepseek_v4_tokenizer

    encoder = DeepseekV4ChatEncoder(_ctx(), {}, deepseek_v4_tokenizer(), None)
    turn1 = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime."}]
    turn2 = turn1 + [{"role": "assistant", "content": "7", "reasoning_content": "Small ones: 2, 3, 5, 7."},
                     {"role": "user", "content": "Another."}]
    first = encoder.render(ChatRenderRequest(messages=tuple(turn1)))
    second = encoder.render(ChatRenderRequest(messages=tuple(turn2)))
    keep = len(first.token_ids) - first.volatile_tail
    assert first.volatile_tail == 1 and first.ends_in_reasoning
    assert second.token_ids[:keep] == first.token_ids[:keep]
    assert second.token_ids[keep] != first.token_ids[keep]

    tool = {"type": "function", "function": {"name": "read", "parameters": {"type": "object", "properties": {}}}}
    stable = [ChatRenderRequest(messages=tuple(turn1), tools=(tool,)),  # history reasoning is kept
              ChatRenderRequest(messages=tuple(turn1), thinking=False),  # ends in </think>, as history does
              ChatRenderRequest(messages=tuple(turn1), drop_thinking=False)]
    assert [encoder.render(r).volatile_tail for r in stable] == [0, 0, 0]


def test_boundaries_are_the_end_of_the_system_prompt_and_each_message_start() -> None:
    """The encoder reports where the system prompt and tools end and where messages begin, at
    the ``<｜User｜>`` marker and after each ``<｜end▁of▁sentence｜>`` (real tokenizer): two sessions
    with the same system prompt and tools share exactly the tokens before ``stable_prefix``."""
    from ds4d.models.hf_tokenizer import deepseek_v4_tokenizer

    tokenizer = deepseek_v4_tokenizer()
    encoder = DeepseekV4ChatEncoder(_ctx(), {}, tokenizer, None)
    tool = {"type": "function", "function": {"name": "read", "parameters": {"type": "object", "properties": {}}}}
    system = {"role": "system", "content": "You are a careful coding agent."}
    one = encoder.render(ChatRenderRequest(messages=(system, {"role": "user", "content": "List the files."}),
                                           tools=(tool,)))
    two = encoder.render(ChatRenderRequest(messages=(system, {"role": "user", "content": "Fix the bug."},
                                                     {"role": "assistant", "content": "Done."},
                                                     {"role": "user", "content": "Thanks."}), tools=(tool,)))
    user = tokenizer.encode(USER, add_special_tokens=False)[0]
    assert one.stable_prefix > 1 and one.stable_prefix == two.stable_prefix
    assert one.token_ids[:one.stable_prefix] == two.token_ids[:two.stable_prefix]
    assert one.token_ids[one.stable_prefix] == user
    assert one.token_ids[one.stable_prefix + 1] != two.token_ids[two.stable_prefix + 1]
    assert one.message_starts == (one.stable_prefix,)
    assert len(two.message_starts) == 2 and all(two.token_ids[p] == user for p in two.message_starts)
    assert boundaries_within(one, one.token_ids) == (one.stable_prefix, one.message_starts)
    assert boundaries_within(one, one.token_ids[:5]) == (0, ())  # a prompt that is not these ids

    bare = encoder.render(ChatRenderRequest(messages=({"role": "user", "content": "Hi."},)))
    assert bare.stable_prefix == 0 and bare.message_starts == (1,)  # nothing but BOS before the user


@pytest.mark.skipif(not OPENCODE.is_dir(), reason=f"OpenCode requests not found at {OPENCODE}")
def test_opencode_steps_share_their_system_prompt_and_tools_up_to_the_stable_prefix() -> None:
    """OpenCode's recorded agent steps: the same long system prompt and tool declarations, so
    the same ``stable_prefix``, and the tokens before it identical (a subagent or a new session
    with that system prompt resumes there)."""
    from ds4d.models.hf_tokenizer import deepseek_v4_tokenizer

    encoder = DeepseekV4ChatEncoder(_ctx(), {}, deepseek_v4_tokenizer(), None)
    rendered = []
    for path in sorted(OPENCODE.glob("run2_tool_read_00[23]_*.json")):
        body = json.loads(path.read_text(encoding="utf-8"))["body"]
        rendered.append(encoder.render(ChatRenderRequest(messages=tuple(body["messages"]),
                                                         tools=tuple(body.get("tools") or ()))))
    first, second = rendered
    assert first.stable_prefix == second.stable_prefix > 1000
    assert first.token_ids[:first.stable_prefix] == second.token_ids[:second.stable_prefix]
    assert set(first.message_starts) <= set(second.message_starts)  # the next step adds messages after them
    assert len(second.message_starts) > len(first.message_starts)
