"""Prefix-cache tiers through a live daemon on the embedded model: RAM, disk, restart, agent turns.

The KV pool is kept tiny so that a few other prompts push a prompt's blocks out
of it; the RAM tier is a few blocks, so some of them go on to the disk tier.
"""

from __future__ import annotations

import json
import urllib.request

import openai
import pytest

from tests.daemon import Daemon

SYSTEM = "You are a careful assistant. Answer briefly and precisely."
TOPICS = ["the history of the lighthouse keepers on the northern coast",
          "how bread dough rises and why bakers fold it several times",
          "the migration routes of arctic terns between the poles",
          "how a mechanical clock escapement keeps time"]


def prompt(topic: str) -> list[dict]:
    text = (f"Here are some notes about {topic}. " * 6) + "Write one sentence about it."
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]


def start(disk_dir) -> Daemon:
    # 20 blocks of 16 tokens; a ~700 KiB block each in fp32: 8 MiB of RAM holds 11 of them
    return Daemon("--max-context", "320", "--kv-cache-tokens", "320", "--max-num-seqs", "1", "--threads", "2",
                  "--cache-ram-gib", str(8 / 1024), "--cache-disk-dir", str(disk_dir), "--cache-disk-gib", "1",
                  "--mem-watermark-gib", "0", "--mem-floor-gib", "0")


def client_for(d: Daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=d.url + "/v1", api_key="x", max_retries=0, timeout=120)


def ask(c: openai.OpenAI, messages, max_tokens=12):
    resp = c.chat.completions.create(model=c.models.list().data[0].id, messages=messages, temperature=0,
                                     max_tokens=max_tokens)
    by_tier = resp.usage.model_dump()["ds4d"]["cached_tokens_by_tier"]
    return resp, by_tier


def stats(d: Daemon) -> dict:
    with urllib.request.urlopen(d.url + "/v1/ds4d/stats", timeout=10) as r:
        return json.loads(r.read())["cache"]


def metrics(d: Daemon) -> str:
    with urllib.request.urlopen(d.url + "/metrics", timeout=10) as r:
        return r.read().decode()


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("ds4d-disk-cache")


def test_evicted_prompt_comes_back_from_ram_and_disk_then_survives_restart(disk_dir):
    d = start(disk_dir)
    try:
        c = client_for(d)
        first, by_tier = ask(c, prompt(TOPICS[0]))
        assert first.usage.prompt_tokens > 100 and sum(by_tier.values()) == 0
        for topic in TOPICS[1:]:
            ask(c, prompt(topic))               # each needs most of the pool: evicts the others' blocks
        again, by_tier = ask(c, prompt(TOPICS[0]))
        assert again.choices[0].message.content == first.choices[0].message.content
        cached = again.usage.prompt_tokens_details.cached_tokens
        assert cached == sum(by_tier.values()) and cached >= first.usage.prompt_tokens - 16
        assert by_tier["ram"] + by_tier["disk"] > 0, by_tier
        s = stats(d)
        assert set(s["tiers"]) == {"gpu", "ram", "disk"}
        assert s["tiers"]["ram"]["hits"] + s["tiers"]["disk"]["hits"] > 0
        assert s["tiers"]["disk"]["blocks"] > 0 and s["tiers"]["ram"]["bytes"] <= 8 * 1024**2
        assert s["last_miss"]
        text = metrics(d)
        assert 'ds4d_cache_tier_hits_total{tier="ram"}' in text
        assert 'ds4d_cache_tier_bytes_in_total{tier="disk"}' in text
        assert any(f"reused (gpu {by_tier['gpu']}, ram {by_tier['ram']}, disk {by_tier['disk']})" in line
                   for line in d.log_lines)
        reply = again.choices[0].message.content
    finally:
        assert d.stop() == 0
    assert any("flushed" in line for line in d.log_lines), d.log

    restarted = start(disk_dir)
    try:
        c = client_for(restarted)
        resp, by_tier = ask(c, prompt(TOPICS[0]))
        assert resp.choices[0].message.content == reply
        assert by_tier["disk"] >= resp.usage.prompt_tokens - 16 - 16 and by_tier["gpu"] == 0, by_tier
        s = stats(restarted)
        assert s["tiers"]["disk"]["hits"] > 0
        # the disk blocks were read on the tier's reader threads, then promoted
        assert s["promotions"]["completed_blocks"] == s["tiers"]["disk"]["hits"], s["promotions"]
        assert s["promotions"]["pending_blocks"] == 0 and s["promotions"]["background_read_bytes"] > 0
        assert "ds4d_cache_promotions_completed_total" in metrics(restarted)
    finally:
        restarted.stop()


def test_agent_second_turn_reuses_through_the_previous_reply(tmp_path):
    d = start(tmp_path)
    try:
        c = client_for(d)
        turn1 = [{"role": "system", "content": SYSTEM},
                 {"role": "user", "content": "Explain in five long sentences how a mechanical clock keeps time."}]
        first, _ = ask(c, turn1, max_tokens=48)
        reply = first.choices[0].message.content
        fed = first.usage.prompt_tokens + first.usage.completion_tokens - 1
        turn2 = turn1 + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Shorter, please."}]
        second, by_tier = ask(c, turn2, max_tokens=8)
        cached = second.usage.prompt_tokens_details.cached_tokens
        # every full block of what turn 1 fed to the model (prompt and reply) is reused
        assert fed // 16 * 16 > first.usage.prompt_tokens, reply   # the reply fills at least one block
        assert cached >= fed // 16 * 16, (cached, fed, reply)
        assert cached == by_tier["gpu"]
    finally:
        d.stop()
