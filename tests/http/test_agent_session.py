"""A six-step agent session on a tiny DeepSeek-V4 through a live daemon.

The bodies follow OpenCode's real requests (shared reference): its system
prompt and ten tools, streamed with usage, ``tool_choice: "auto"``, the
assistant turn replayed with ``content`` (never null), ``reasoning_content`` and
``tool_calls``, tool results as ``role: "tool"`` messages, one ``x-session-id``.
Every step after the first must reuse at least 95% of what the previous step
sent and received, although a random-weight model's reply does not tokenise
back to the ids it was generated as.  A request that changes an earlier
message is explained in /v1/ds4d/stats.
"""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path

import openai
import pytest

from ds4d.models.deepseek_v4 import write_tiny_checkpoint
from tests.daemon import Daemon

REPO = Path(__file__).resolve().parents[2]
REFERENCE = Path(os.environ.get("DS4D_REFERENCE_DIR", REPO / "tests" / "fixtures" / "reference"))
FIRST = REFERENCE / "opencode" / "requests" / "run2_tool_read_002_POST_v1_chat_completions.json"
SESSION = "ses_agent_replay"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    if not FIRST.exists():
        pytest.skip(f"reference requests not found at {REFERENCE}")
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("tinyv4-agent"), layers=[0, 4, 128, 4], seed=7)
    d = Daemon("--model", str(path), "--threads", "2", "--kv-cache-tokens", "65536", "--max-num-seqs", "2",
               "--prefill-chunk", "2048")
    try:
        yield d
    finally:
        d.stop()


def stream_step(client: openai.OpenAI, body: dict, messages: list[dict], session: str) -> tuple[dict, object]:
    stream = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=messages, tools=body["tools"], tool_choice="auto",
        max_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True},
        extra_headers={"x-session-id": session, "x-session-affinity": session})
    content, reasoning, calls, usage = [], [], {}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            content.append(delta.get("content") or "")
            reasoning.append(delta.get("reasoning_content") or "")
            for call in delta.get("tool_calls") or ():
                slot = calls.setdefault(call["index"], {"id": None, "type": "function",
                                                        "function": {"name": "", "arguments": ""}})
                slot["id"] = call.get("id") or slot["id"]
                fn = call.get("function") or {}
                slot["function"]["name"] += fn.get("name") or ""
                slot["function"]["arguments"] += fn.get("arguments") or ""
    assert usage is not None, "no usage chunk"
    message = {"role": "assistant", "content": "".join(content)}
    if "".join(reasoning):
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message, usage


def follow_up(message: dict, step: int) -> list[dict]:
    """What the agent sends after ``message``: tool results in call order, else a user turn."""
    if message.get("tool_calls"):
        return [{"role": "tool", "tool_call_id": c["id"], "content": f"<content>result {step} of {c['id']}</content>"}
                for c in message["tool_calls"]]
    return [{"role": "user", "content": f"Step {step}: read the next file and summarize it."}]


def stats(d: Daemon) -> dict:
    with urllib.request.urlopen(d.url + "/v1/ds4d/stats", timeout=10) as r:
        return json.loads(r.read())


def test_six_step_session_reuses_every_previous_turn(daemon):
    body = json.loads(FIRST.read_text())["body"]
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="x", max_retries=0, timeout=300)
    messages = list(body["messages"])
    previous = None
    report = []
    for step in range(1, 7):
        message, usage = stream_step(client, body, messages, SESSION)
        cached = usage.prompt_tokens_details.cached_tokens
        report.append((step, usage.prompt_tokens, usage.completion_tokens, cached))
        if previous is not None:
            sent_and_received = previous.prompt_tokens + previous.completion_tokens
            assert cached >= 0.95 * sent_and_received, (report, stats(daemon)["sessions"])
            assert cached >= sent_and_received - 1, report  # stateful model: up to the last sampled token
        previous = usage
        messages += [message, *follow_up(message, step)]
    s = stats(daemon)
    assert s["sessions"]["reuse_misses_total"] == 0, s["sessions"]
    # the random model's replies do not tokenise back to their ids: the session memory supplied them
    assert s["sessions"]["prompts_continued_total"] >= 1, s["sessions"]
    print("step prompt completion cached:", report, s["sessions"]["prompts_continued_total"])

    # the agent edits its first user message: the miss is explained where it happened
    edited = [dict(m) for m in messages]
    first_user = next(i for i, m in enumerate(edited) if m["role"] == "user")
    edited[first_user]["content"] = "Read the file OTHER.md instead"
    stream_step(client, body, edited, SESSION)
    miss = stats(daemon)["sessions"]["recent_misses"][-1]
    assert miss["session"] == SESSION and miss["message_index"] == first_user and miss["role"] == "user", miss
    assert "OTHER" in miss["new_excerpt"] and "README" in miss["previous_excerpt"], miss
    with urllib.request.urlopen(daemon.url + "/metrics", timeout=10) as r:
        assert "ds4d_session_reuse_misses_total 1" in r.read().decode()


def test_session_survives_a_restart_through_the_disk_tier(tmp_path):
    if not FIRST.exists():
        pytest.skip(f"reference requests not found at {REFERENCE}")
    path = write_tiny_checkpoint(tmp_path / "tinyv4", layers=[0, 4, 128, 4], seed=7)
    args = ("--model", str(path), "--threads", "2", "--kv-cache-tokens", "16384", "--max-num-seqs", "1",
            "--prefill-chunk", "2048", "--cache-disk-dir", str(tmp_path / "disk"), "--cache-disk-gib", "1")
    body = json.loads(FIRST.read_text())["body"]
    d = Daemon(*args)
    try:
        client = openai.OpenAI(base_url=d.url + "/v1", api_key="x", max_retries=0, timeout=300)
        message, first = stream_step(client, body, list(body["messages"]), SESSION)
    finally:
        assert d.stop() == 0
    assert any("state checkpoints written" in line for line in d.log_lines), d.log
    assert any("session memory: 1 sessions written" in line for line in d.log_lines), d.log

    restarted = Daemon(*args)
    try:
        client = openai.OpenAI(base_url=restarted.url + "/v1", api_key="x", max_retries=0, timeout=300)
        follow = [*body["messages"], message, *follow_up(message, 1)]
        _, usage = stream_step(client, body, follow, SESSION)
        by_tier = usage.model_dump()["ds4d"]["cached_tokens_by_tier"]
        # blocks, the checkpoint at the end of the reply and the session memory all came back from disk
        assert usage.prompt_tokens_details.cached_tokens == first.prompt_tokens + first.completion_tokens - 1, usage
        assert by_tier["disk"] >= first.prompt_tokens // 128 * 128 and by_tier["gpu"] < 128, by_tier
    finally:
        restarted.stop()
