"""DSML tool-call parsing: streamed deltas, whole-completion parsing, malformed markup."""

from __future__ import annotations

import json
import logging
import os
import random
import types
from pathlib import Path

import pytest

from ds4d.contracts import PluginContext, ToolParseResult
from ds4d.models.hf_tokenizer import HFTokenizer, deepseek_v4_tokenizer
from ds4d.plugins.dsml_format import partial_suffix_length
from ds4d.plugins.dsml_tools import DsmlToolParser, parse_completion

REPO = Path(__file__).resolve().parents[2]
REFERENCE = Path(os.environ.get("DS4D_REFERENCE_DIR", REPO / "tests" / "fixtures" / "reference"))
EXTRA = REFERENCE / "dsv4" / "encoding" / "extra_vectors.json"
CTX = PluginContext(config=types.SimpleNamespace(thinking_default=True), log=logging.getLogger("t"))

P = "｜DSML｜"


def block(*invokes: str) -> str:
    return f"\n\n<{P}tool_calls>\n" + "\n".join(invokes) + f"\n</{P}tool_calls>"


def invoke(name: str, *params: tuple[str, str, str]) -> str:
    lines = [f'<{P}parameter name="{k}" string="{s}">{v}</{P}parameter>' for k, s, v in params]
    return f'<{P}invoke name="{name}">\n' + "".join(line + "\n" for line in lines) + f"</{P}invoke>"


PLAIN = "Just an answer with <tags> and \n\n newlines.\n\n"
LOOKALIKE = f"a </{P}param b < </ {P} 中文💡"

# (completion content, expected content, expected [(name, arguments)])
FIXTURES = {
    "one_call": (
        block(invoke("read", ("filePath", "true", "/a/b.py"), ("limit", "false", "50"))),
        "",
        [("read", '{"filePath": "/a/b.py", "limit": 50}')],
    ),
    "content_then_parallel_calls": (
        "Let me check."
        + block(
            invoke("bash", ("command", "true", 'ls -la\necho "hi" \\ <x>'), ("description", "true", "list")),
            invoke("todowrite", ("todos", "false", '[{"content": "a", "status": "pending"}]')),
        ),
        "Let me check.",
        [
            ("bash", json.dumps({"command": 'ls -la\necho "hi" \\ <x>', "description": "list"})),
            ("todowrite", '{"todos": [{"content": "a", "status": "pending"}]}'),
        ],
    ),
    "unicode_and_lookalike_markup_in_values": (
        "好的\n" + block(invoke("write", ("content", "true", LOOKALIKE), ("flag", "false", "true"))),
        "好的\n",
        [("write", json.dumps({"content": LOOKALIKE, "flag": True}, ensure_ascii=False))],
    ),
    "no_arguments": (block(invoke("list_tools")), "", [("list_tools", "{}")]),
    "not_json_value_becomes_string": (
        block(invoke("f", ("n", "false", "not json"), ("m", "false", ' {"a": [1, 2]} '))),
        "",
        [("f", '{"n": "not json", "m": {"a": [1, 2]}}')],
    ),
    "text_after_block_and_extra_newlines": (
        "x\n" + block(invoke("f")) + " tail",
        "x\n tail",
        [("f", "{}")],
    ),
    "plain_text": (PLAIN, PLAIN, []),
    "partial_marker_at_end": ("almost a call\n\n<｜DSML｜tool_c", "almost a call\n\n<｜DSML｜tool_c", []),
}

MALFORMED = {
    "unterminated_block": "Sure." + block(invoke("read", ("filePath", "true", "/a")))[: -len(f"</{P}tool_calls>") - 3],
    "unterminated_value": "\n\n"
    + f'<{P}tool_calls>\n<{P}invoke name="read">\n<{P}parameter name="p" string="true">abc',
    "junk_between_invokes": block("hello " + invoke("f")),
    "bad_parameter_tag": block(f'<{P}invoke name="f">\n<{P}parameter nam="x">1</{P}parameter>\n</{P}invoke>'),
    "duplicate_parameter": block(invoke("f", ("a", "true", "1"), ("a", "true", "2"))),
    "missing_invoke_name": block(f"<{P}invoke>\n</{P}invoke>"),
}


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


def run(pieces: list[str], parallel: bool = True):
    stream = DsmlToolParser(CTX, {}).stream(tools=(), parallel_tool_calls=parallel)
    deltas = [stream.feed(p) for p in pieces]
    last, result = stream.finish()
    deltas.append(last)
    return deltas, result


def assembled(deltas) -> tuple[str, dict[int, dict]]:
    """What an OpenAI client reconstructs from the deltas."""
    calls: dict[int, dict] = {}
    for delta in deltas:
        for call in delta.calls:
            entry = calls.setdefault(call.index, {"id": None, "name": None, "arguments": ""})
            if call.id is not None:
                assert entry["id"] is None, "id sent twice"
                entry["id"], entry["name"] = call.id, call.name
            assert entry["id"] is not None, "arguments before the call's id"
            entry["arguments"] += call.arguments
    return "".join(d.content for d in deltas), calls


@pytest.mark.parametrize("name", FIXTURES)
def test_fixture_whole_tokens_and_chars_agree(v4: HFTokenizer, name: str) -> None:
    text, content, calls = FIXTURES[name]
    for how, pieces in {"whole": [text], "tokens": token_pieces(v4, text), "chars": list(text)}.items():
        deltas, result = run(pieces)
        assert result.error is None, how
        assert result.content == content, how
        assert [(c.name, c.arguments) for c in result.calls] == calls, how
        streamed_content, streamed_calls = assembled(deltas)
        assert streamed_content == content, how
        assert [(v["id"], v["name"], v["arguments"]) for _, v in sorted(streamed_calls.items())] == [
            (c.id, c.name, c.arguments) for c in result.calls
        ], how
        for call in result.calls:
            json.loads(call.arguments)
            assert call.id.startswith("call_") and len(call.id) > 10


def test_call_ids_are_unique_strings() -> None:
    _, result = run([FIXTURES["content_then_parallel_calls"][0]])
    ids = [c.id for c in result.calls]
    assert len(set(ids)) == 2 and all(isinstance(i, str) for i in ids)


def test_name_is_sent_as_soon_as_the_invoke_tag_closes() -> None:
    stream = DsmlToolParser(CTX, {}).stream(tools=())
    assert stream.feed("Checking.\n\n").content == "Checking."
    assert stream.feed(f'<{P}tool_calls>\n<{P}invoke name="read"').calls == ()
    first = stream.feed(">\n")
    assert [(c.index, c.name, c.arguments) for c in first.calls] == [(0, "read", "")]
    opened = stream.feed(f'<{P}parameter name="filePath" string="true">/tmp/fi')
    assert [c.arguments for c in opened.calls] == ['{"filePath": "/tmp/fi']
    assert [c.arguments for c in stream.feed(f"le</{P}param").calls] == ["le"]


def test_parallel_tool_calls_false_keeps_only_the_first_call() -> None:
    text = FIXTURES["content_then_parallel_calls"][0]
    for pieces in ([text], list(text)):
        deltas, result = run(pieces, parallel=False)
        assert [c.name for c in result.calls] == ["bash"]
        assert {c.index for d in deltas for c in d.calls} == {0}
        assert result.content == "Let me check."


@pytest.mark.parametrize("name", MALFORMED)
def test_malformed_markup_returns_raw_text_and_an_error(v4: HFTokenizer, name: str) -> None:
    text = MALFORMED[name]
    for how, pieces in {"whole": [text], "tokens": token_pieces(v4, text), "chars": list(text)}.items():
        deltas, result = run(pieces)
        assert result.calls == (), how
        assert result.content == text, how
        assert result.error, how
        assert "".join(d.content for d in deltas) == text, how


def test_finish_twice_returns_the_same_result() -> None:
    stream = DsmlToolParser(CTX, {}).stream(tools=())
    stream.feed(FIXTURES["one_call"][0])
    _, first = stream.finish()
    second_delta, second = stream.finish()
    assert isinstance(first, ToolParseResult) and second == first
    assert second_delta.content == "" and second_delta.calls == ()
    with pytest.raises(RuntimeError):
        stream.feed("more")


def test_partial_suffix_length() -> None:
    marker = f"<{P}tool_calls>"
    assert partial_suffix_length("abc", (marker,)) == 0
    assert partial_suffix_length("abc<", (marker,)) == 1
    assert partial_suffix_length("abc\n\n<｜DS", (marker,), 0, 2) == 6
    assert partial_suffix_length("abc\n\n\n", (marker,), 0, 2) == 2
    assert partial_suffix_length("abc" + marker, (marker,)) == 0


@pytest.mark.skipif(not EXTRA.is_file(), reason=f"extra vectors not found at {EXTRA} (set DS4D_REFERENCE_DIR)")
def test_parse_completion_matches_every_expected_message() -> None:
    cases = [c for c in json.loads(EXTRA.read_text(encoding="utf-8")) if "expected_message" in c]
    assert cases
    for case in cases:
        parsed = parse_completion(case["completion_text"], case["thinking_mode"])
        assert parsed == case["expected_message"], case["name"]


def test_parse_completion_handles_missing_end_tag_and_malformed_calls() -> None:
    text = f'Plan.\n\n<{P}tool_calls>\n<{P}invoke name="f">\n</{P}invoke>\n</{P}tool_calls>'
    text += "<｜end▁of▁sentence｜>"
    parsed = parse_completion(text, "thinking")
    assert parsed["reasoning_content"] == "Plan." and parsed["content"] == ""
    assert parsed["tool_calls"] == [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]
    broken = parse_completion(f'</think>\n\n<{P}tool_calls>\n<{P}invoke name="f">', "thinking")
    assert broken["tool_calls"] == [] and broken["content"].startswith(f"\n\n<{P}tool_calls>")


@pytest.mark.parametrize("text", [f[0] for f in FIXTURES.values()] + list(MALFORMED.values()))
def test_random_splits_give_the_same_result_and_error(text: str) -> None:
    rng = random.Random(7)
    _, reference = run([text])
    for _ in range(40):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 30))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        deltas, result = run(pieces)
        assert (result.content, result.error) == (reference.content, reference.error)
        assert [(c.name, c.arguments) for c in result.calls] == [(c.name, c.arguments) for c in reference.calls]
        assert assembled(deltas)[0] == (text if result.error else result.content)
