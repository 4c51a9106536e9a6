"""The DeepSeek-V4.1 chat protocol through a live daemon.

No V4.1 checkpoint exists for ds4d yet, so this serves the tiny DeepSeek-V4 checkpoint with
``chat_encoder = deepseek_v41`` (the parsers, left on auto, follow the encoder: V4.1's).  Its tokenizer is V4's, which has no
``<｜System｜>`` token: the rendered text is V4.1's byte for byte, its ids are V4's tokenisation
of that text.
"""

from __future__ import annotations

import json
import urllib.request

import openai
import pytest

from ds4d.plugins.dsv41_encoder import render_messages
from tests.daemon import Daemon
from tests.http.test_openai_api import post

pytest.importorskip("transformers")

from ds4d.models.deepseek_v4 import write_tiny_checkpoint  # noqa: E402
from ds4d.models.hf_tokenizer import HFTokenizer  # noqa: E402

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime."}]
TOOL = {"type": "function", "function": {"name": "read", "description": "Read a file.", "parameters": {
    "type": "object", "properties": {"filePath": {"type": "string"}}, "required": ["filePath"]}}}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("tinyv4"), layers=[0, 4], seed=3)
    daemon = Daemon("--model", str(path), "--threads", "1", "--kv-cache-tokens", "4096", "--max-num-seqs", "2",
                    "--chat-encoder", "deepseek_v41", "--tool-markup-guard")
    try:
        client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="x", max_retries=0, timeout=120)
        yield daemon, client, client.models.list().data[0].id, HFTokenizer(path / "tokenizer.json")
    finally:
        daemon.stop()


def test_the_parsers_follow_the_encoder(served):
    daemon = served[0]
    with urllib.request.urlopen(daemon.url + "/v1/ds4d/stats", timeout=30) as reply:
        plugins = json.loads(reply.read())["plugins"]
    assert plugins["chat_encoder"] == plugins["reasoning_parser"] == "deepseek_v41"
    assert plugins["tool_parser"] == "dsml_v41"


def test_tokenize_shows_the_v41_rendering(served):
    daemon, _, model_id, tokenizer = served
    assert "deepseek_v41: the tokenizer splits <｜System｜>" in daemon.log
    for effort, budget in ((None, 75), ("low", 50), (30, 30), ("max", 100)):
        body = {"model": model_id, "messages": MESSAGES, "tools": [TOOL]}
        if effort is not None:
            body["reasoning_effort"] = effort
        status, data = post(daemon, "/tokenize", body)
        assert status == 200, data
        assert data["prompt"] == render_messages(MESSAGES, [TOOL], True, True, effort)
        assert data["prompt"].startswith(f"<｜begin▁of▁sentence｜><｜System｜>Reasoning Effort: {budget} (range 1-100")
        assert '"<｜DSML｜ calls>"' in data["prompt"]
        assert data["tokens"] == tokenizer.encode(data["prompt"])
    _, chat = post(daemon, "/tokenize", {"model": model_id, "messages": MESSAGES,
                                         "chat_template_kwargs": {"thinking": False}})
    assert chat["prompt"] == "<｜begin▁of▁sentence｜><｜System｜>You are terse.<｜User｜>Name a prime.<｜Assistant｜></think>"


@pytest.mark.parametrize("route", ["/tokenize", "/v1/chat/completions"])
def test_unknown_or_out_of_range_effort_is_a_400(served, route):
    daemon, _, model_id, _ = served
    for effort in (0, 101, "minimal", True, 2.5):
        status, reply = post(daemon, route, {"model": model_id, "messages": MESSAGES, "reasoning_effort": effort,
                                             "max_tokens": 1})
        assert status == 400, (effort, reply)
        error = reply["error"]
        assert (error["code"], error["param"], error["type"]) == ("invalid_value", "reasoning_effort",
                                                                  "invalid_request_error")


@pytest.mark.parametrize("route", ["/tokenize", "/v1/chat/completions"])
def test_a_text_only_model_refuses_images(served, route):
    daemon, _, model_id, _ = served
    content = [{"type": "text", "text": "What is this?"},
               {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]
    status, reply = post(daemon, route, {"model": model_id, "messages": [{"role": "user", "content": content}],
                                         "max_tokens": 1})
    assert status == 400, reply
    error = reply["error"]
    assert error["code"] == "unsupported_content" and error["param"] == "messages.0.content.1"
    assert "text-only" in error["message"]


def test_forced_tool_call_is_v41_markup_and_parses(served):
    """tool_choice "required" constrains a random model to one V4.1-spelled call, which the
    dsml_v41 parser returns as a tool call with typed arguments."""
    _, client, model_id, _ = served
    reply = client.chat.completions.create(model=model_id, messages=MESSAGES, tools=[TOOL], tool_choice="required",
                                           max_tokens=60, temperature=0)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls", message
    (call,) = message.tool_calls
    assert call.function.name == "read"
    assert set(json.loads(call.function.arguments)) == {"filePath"}
    assert "DSML" not in (message.content or "")


@pytest.mark.parametrize("choice", ["auto", "none"])
def test_guarded_requests_generate_as_usual(served, choice):
    """With tool_markup_guard the guard rides along auto and none requests; a random model that
    opens no block is not held back."""
    _, client, model_id, _ = served
    reply = client.chat.completions.create(model=model_id, messages=MESSAGES, tools=[TOOL], tool_choice=choice,
                                           max_tokens=12, temperature=0)
    choice_out = reply.choices[0]
    assert choice_out.finish_reason in ("length", "stop") and reply.usage.completion_tokens <= 12
    assert "DSML" not in (choice_out.message.content or "")
