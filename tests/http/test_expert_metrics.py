"""Expert offload seen from outside: a live daemon on a tiny DeepSeek-V4 with every routed expert in
host RAM (a VRAM budget too small for one), on the CPU.  After a chat completion the per-layer
counters are in /metrics (``layer`` label) and in /v1/ds4d/stats, and agree with each other."""

from __future__ import annotations

import json
import re
import urllib.request

import openai
import pytest

from ds4d.models.deepseek_v4 import write_tiny_checkpoint
from tests.daemon import Daemon


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("tinyv4-offload"), layers=[0, 4], seed=3)
    d = Daemon("--model", str(path), "--threads", "2", "--kv-cache-tokens", "4096", "--max-num-seqs", "2",
               "--expert-vram-gib", "0.000001", "--expert-placement", "static")
    try:
        yield d
    finally:
        d.stop()


def _get(daemon, path: str) -> str:
    with urllib.request.urlopen(daemon.url + path, timeout=30) as response:
        return response.read().decode()


def test_expert_counters_in_metrics_and_stats(daemon):
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="none")
    reply = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=4,
                                           messages=[{"role": "user", "content": "Name three colours."}])
    assert reply.usage.completion_tokens >= 1
    experts = json.loads(_get(daemon, "/v1/ds4d/stats"))["experts"]
    assert experts["gpu_experts"] == 0 and experts["ram_experts"] == 2 * 8
    metrics = _get(daemon, "/metrics")
    assert re.search(r"^ds4d_experts_in_ram 16$", metrics, re.M)
    assert experts["host_experts"] == 16 and experts["host_ram_bytes"] > 0
    assert re.search(rf"^ds4d_expert_host_ram_bytes {experts['host_ram_bytes']}$", metrics, re.M)
    copied = {int(layer): float(value) for layer, value in
              re.findall(r'^ds4d_expert_bytes_copied_total\{layer="(\d+)"\} (\S+)$', metrics, re.M)}
    assert copied == {row["layer"]: float(row["bytes_copied"]) for row in experts["layers"]}
    assert all(value > 0 for value in copied.values())  # every layer copied the experts it used
    hit_rates = re.findall(r'^ds4d_expert_gpu_hit_rate\{layer="\d+"\} (\S+)$', metrics, re.M)
    assert hit_rates and all(float(rate) == 0.0 for rate in hit_rates)  # nothing is on the device
    assert "# TYPE ds4d_expert_bytes_skipped_total counter" in metrics


def test_memory_plan_at_start_names_vram_and_host_ram(daemon):
    """The start-up log's memory plan: the dense weights on the device, the routed experts' host RAM
    (every expert cold here) with the same bytes the stats report."""
    experts = json.loads(_get(daemon, "/v1/ds4d/stats"))["experts"]
    plan = [line for line in daemon.log_lines if "memory plan:" in line]
    assert any("dense weights" in line and "vram" in line for line in plan), plan
    host = [line for line in plan if "host RAM, pinned" in line]
    assert len(host) == 1 and "experts 16" in host[0], plan
    assert f"ram {experts['host_ram_bytes'] / 2**30:.2f} GiB" in host[0]

