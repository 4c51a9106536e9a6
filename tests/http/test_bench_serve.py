"""`ds4d bench serve` against a live daemon on the embedded model: streams with cancellations, then a clean server."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

import openai
import pytest

from ds4d.bench.serve import percentile
from tests.daemon import REPO, Daemon


@pytest.fixture(scope="module")
def daemon():
    d = Daemon("--threads", "2", "--max-num-seqs", "4", "--max-context", "1024", "--kv-cache-tokens", "16384")
    yield d
    d.stop()


def stats(daemon) -> dict:
    with urllib.request.urlopen(daemon.url + "/v1/ds4d/stats", timeout=30) as resp:
        return json.loads(resp.read())


def run_bench(*args: str) -> subprocess.CompletedProcess:
    """``ds4d bench ARGS`` in a subprocess; fails the test unless it exits 0."""
    proc = subprocess.run([sys.executable, "-m", "ds4d.cli", "bench", *args],
                          check=False, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_percentile_small_samples():
    assert percentile([], 0.5) is None
    assert percentile([7.0], 0.99) == 7.0
    assert percentile([3.0, 1.0], 0.5) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0.9) == pytest.approx(4.6)
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 1.0) == 5.0


def test_bench_serve_with_cancellations_leaves_the_daemon_clean(daemon, tmp_path):
    out = tmp_path / "out.json"
    proc = run_bench("serve", "--url", daemon.url, "--requests", "12", "--concurrency", "4", "--max-tokens", "8",
                     "--prompt-words", "40", "--cancel-fraction", "0.25", "--json", str(out))
    assert proc.stdout.rstrip().splitlines()[-3].startswith("| ok | cancelled | failed |")

    summary = json.loads(out.read_text())["summary"]
    assert summary["requests"] == 12
    assert summary["failed"] == 0 and summary["failures"] == []
    assert summary["ok"] + summary["cancelled"] == 12
    assert summary["ok"] >= 1 and summary["cancelled"] >= 1  # seed 0 cancels some of the 12
    for p in summary["ttft_ms"].values():
        assert isinstance(p, float) and p > 0
    assert summary["ttft_ms"]["p50"] <= summary["ttft_ms"]["p90"] <= summary["ttft_ms"]["p99"]
    assert summary["goodput_tok_s"] > 0
    assert 0 < summary["cached_fraction_mean"] < 1  # the shared system prefix is reused, the user part is not

    # every stream is over on the server side: cancelled ones were aborted, not left running
    deadline = time.monotonic() + 10
    while (requests := stats(daemon)["requests"])["running"] or requests["waiting"]:
        assert time.monotonic() < deadline, requests
        time.sleep(0.2)
    assert requests["finished_total"] >= 12
    assert "finish=abort" in daemon.log

    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model_id = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "Say hello."}],
                                           max_tokens=8, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens >= 1
    assert stats(daemon)["requests"]["running"] == 0


def test_bench_agent_reuses_the_previous_step(daemon, tmp_path):
    """`ds4d bench agent`: step 2 reuses step 1's prompt and reply; the cold copy reuses nothing."""
    out = tmp_path / "agent.json"
    proc = run_bench("agent", "--url", daemon.url, "--reused-words", "300", "--new-words", "60", "--max-tokens", "6",
                     "--repeats", "2", "--json", str(out))
    assert proc.stdout.rstrip().splitlines()[-1].startswith("| median |")
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2
    for row in rows:
        assert row["cold_cached_tokens"] == 0
        assert row["step2_prompt_tokens"] > row["step2_cached_tokens"] > 0
        assert row["reused_share_of_step1"] >= 0.9  # all full blocks of step 1's prompt and reply
        assert row["ttft_reused_ms"] > 0 and row["ttft_cold_ms"] > 0


def test_bench_agent_between_request_moves_the_reuse_to_ram(tmp_path):
    """With another session's request between the steps and a KV pool too small for both, step 2's
    reuse comes from the RAM tier (promoted blocks) and is still all of step 1; the cold copy
    reuses nothing (the bench exits non-zero when it does)."""
    small = Daemon("--threads", "2", "--max-num-seqs", "2", "--max-context", "1024", "--kv-cache-tokens", "1024")
    try:
        out = tmp_path / "agent.json"
        proc = run_bench("agent", "--url", small.url, "--reused-words", "300", "--new-words", "60",
                         "--between-words", "700", "--max-tokens", "6", "--repeats", "1", "--json", str(out))
        assert "700 words of another session in between" in proc.stdout
        row = json.loads(out.read_text())["rows"][0]
        assert row["cold_cached_tokens"] == 0
        assert row["reused_share_of_step1"] >= 0.9
        assert row["step2_cached_by_tier"]["ram"] > 0
        assert sum(row["step2_cached_by_tier"].values()) == row["step2_cached_tokens"]
    finally:
        small.stop()
