"""`ds4d bench agent --trace` against live daemons: OpenCode's recorded system prompt and tools, sessions
interleaved with title requests and subagents, on the embedded model and on a tiny DeepSeek-V4."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ds4d.bench.agent_trace import AFTER_FIRST, LATER_FIRST, load_recorded
from ds4d.models.deepseek_v4 import write_tiny_checkpoint
from tests.daemon import REPO, Daemon

TRACE = ("--trace", "--sessions", "2", "--steps", "2", "--subagents", "1", "--subagent-steps", "2",
         "--tool-words", "40", "--min-tool-words", "10", "--max-tokens", "3", "--system-chars", "800",
         "--max-tools", "0")


def run_trace(url: str, out, trace=TRACE) -> dict:
    proc = subprocess.run([sys.executable, "-m", "ds4d.cli", "bench", "agent", "--url", url, *trace, "--json", str(out)],
                          check=False, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| step kind | requests |" in proc.stdout
    return json.loads(out.read_text())


def check_shape(result: dict) -> dict:
    summary = result["summary"]
    counts = {kind: row["requests"] for kind, row in summary.items()}
    # 2 sessions x 2 steps, a title beside each first step, 1 subagent each x 2 steps
    assert counts == {"title": 2, "first": 2, LATER_FIRST: 1, "next": 2, "subagent first": 2, "subagent next": 2,
                      "after first": 6}
    assert len(result["requests"]) == 10
    for row in summary.values():
        assert row["ttft_ms"]["p50"] > 0 and row["ttft_ms"]["p99"] >= row["ttft_ms"]["p50"]
        assert sum(row["cached_by_tier"].values()) == row["cached_tokens"]
    after = summary["after first"]
    assert after["cached_tokens"] == sum(summary[k]["cached_tokens"] for k in AFTER_FIRST)
    later = [r for r in result["requests"] if r["kind"] == "first"][1:]
    assert summary[LATER_FIRST]["cached_tokens"] == sum(r["cached_tokens"] for r in later)
    assert summary[LATER_FIRST]["prompt_tokens"] == sum(r["prompt_tokens"] for r in later)
    return summary


def test_recorded_requests_give_opencode_prompt_and_tools():
    system, tools, title = load_recorded(REPO / "tests/fixtures/reference/opencode/requests", 0, -1)
    assert system.startswith("You are opencode") and title.startswith("You are a title generator")
    assert [t["function"]["name"] for t in tools][:3] == ["bash", "edit", "glob"] and len(tools) == 10


def test_trace_on_the_embedded_model_reuses_within_and_across_sessions(daemon, tmp_path):
    summary = check_shape(run_trace(daemon.url, tmp_path / "trace.json"))
    # a next step resends the previous prompt and reply: most of it is reused
    assert summary["next"]["cached_fraction"] > 0.5
    # a subagent shares its session's system prompt and tools; the second title shares the first's prompt
    assert summary["subagent first"]["cached_tokens"] > 0
    assert summary["title"]["cached_tokens"] > 0


@pytest.fixture(scope="module")
def tiny_v4(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tinyv4-trace"), layers=[0, 4, 128, 4], seed=7)


def check_the_system_prompt_is_reused(model_dir, tmp_path) -> str:
    """OpenCode's whole system prompt and its ten tools (about 7.3K tokens) on a tiny model: the second
    session's first step and every subagent's reuse them, and a next step reuses the previous request.
    The daemon's log back."""
    daemon = Daemon("--model", str(model_dir), "--threads", "2", "--kv-cache-tokens", "32768", "--max-num-seqs", "2",
                    "--prefill-chunk", "512")
    full = ("--trace", "--sessions", "2", "--steps", "2", "--subagents", "1", "--subagent-steps", "2",
            "--tool-words", "40", "--min-tool-words", "10", "--max-tokens", "3")
    try:
        result = run_trace(daemon.url, tmp_path / "trace.json", full)
    finally:
        daemon.stop()
    summary = check_shape(result)
    firsts = [r for r in result["requests"] if r["kind"] == "first"]
    assert firsts[0]["cached_tokens"] == 0 and firsts[0]["prompt_tokens"] > 7000
    assert firsts[1]["cached_tokens"] > 0.95 * firsts[1]["prompt_tokens"]  # all but the session's own task
    assert summary[LATER_FIRST]["cached_fraction"] > 0.95
    assert summary["subagent first"]["cached_fraction"] > 0.95
    assert summary["next"]["cached_fraction"] > 0.9 and summary["after first"]["cached_fraction"] > 0.9
    return daemon.log


def test_trace_on_a_tiny_deepseek_v4_reuses_the_system_prompt_across_sessions(tiny_v4, tmp_path):
    """DeepSeek-V4 resumes only at a state checkpoint: the engine checkpoints where the system prompt and
    tools end (:func:`check_the_system_prompt_is_reused`)."""
    check_the_system_prompt_is_reused(tiny_v4, tmp_path)


def test_trace_on_a_tiny_deepseek_v41_reuses_the_system_prompt_across_sessions(tmp_path):
    """The same for DeepSeek-V4.1 (its chat encoder, Engram layers, a state saved anywhere): a tiny model on
    the real 129,280-token vocabulary (V4's tokenizer with V4.1's added tokens)."""
    from ds4d.models.deepseek_v41.make_tiny import write_tiny

    path = write_tiny(tmp_path / "tinyv41", seed=7, tokenizer="v4", max_position_embeddings=65536)
    assert "loading deepseek_v41 model from" in check_the_system_prompt_is_reused(path, tmp_path)
