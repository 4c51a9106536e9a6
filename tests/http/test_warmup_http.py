"""``warmup = on``: a daemon runs its warm-up before /ready, says so, and serves with an untouched cache.

A tiny DeepSeek-V4 checkpoint on the CPU (where ``auto`` would skip the warm-up): the log line and
``/v1/ds4d/stats`` report what ran (requests, the tokens the resumed ones reused from the warm-up's
own cache); the real prefix cache and counters start empty, and an agent's second turn then reuses
its first as on a daemon without the warm-up.
"""

from __future__ import annotations

import json
import urllib.request

import openai
import pytest

from ds4d.models.deepseek_v4 import write_tiny_checkpoint
from tests.daemon import Daemon


@pytest.fixture(scope="module")
def tiny_v4(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", layers=[0, 4, 128], seed=3)


def _stats(daemon) -> dict:
    with urllib.request.urlopen(daemon.url + "/v1/ds4d/stats", timeout=30) as resp:
        return json.load(resp)


def test_a_warmed_daemon_reports_the_warmup_and_starts_with_an_empty_cache(tiny_v4):
    daemon = Daemon("--model", str(tiny_v4), "--warmup", "on", "--threads", "1", "--kv-cache-tokens", "4096",
                    "--prefill-chunk", "256", "--max-num-seqs", "2", "--device", "cpu", "--dtype", "float32")
    try:
        assert "warm-up: " in daemon.log and " reused), " in daemon.log
        stats = _stats(daemon)
        warmup = stats["warmup"]
        assert warmup["requests"] > 0 and warmup["prompt_tokens"] > 0 and warmup["reused_tokens"] > 0
        assert stats["requests"]["finished_total"] == 0
        assert stats["kv"]["cached_blocks"] == 0 and stats["cache"]["cached_tokens_total"] == 0
        assert stats["throughput"]["prefill_tokens_total"] == 0

        client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="x", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        messages = [{"role": "system", "content": "You are terse. " * 40}, {"role": "user", "content": "hi"}]
        first = client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0,
                                               extra_body={"ignore_eos": True})
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        messages += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                     {"role": "user", "content": "and again"}]
        second = client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0,
                                                extra_body={"ignore_eos": True})
        assert second.usage.prompt_tokens_details.cached_tokens > 0
    finally:
        daemon.stop()


def test_auto_skips_the_warmup_on_the_cpu(tiny_v4):
    daemon = Daemon("--model", str(tiny_v4), "--threads", "1", "--kv-cache-tokens", "1024", "--max-num-seqs", "1",
                    "--device", "cpu", "--dtype", "float32")
    try:
        assert "warm-up" not in daemon.log and _stats(daemon)["warmup"] is None
    finally:
        daemon.stop()
