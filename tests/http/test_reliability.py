"""Progress, preemption, admission of what can never fit, and client disconnects, on a live daemon
with a tiny KV pool (16 blocks of 16 tokens), 16-token prefill chunks and a 32-token step budget."""

from __future__ import annotations

import concurrent.futures as cf
import http.client
import json
import time
import urllib.request

import openai
import pytest

from tests.daemon import Daemon

# an abort lands within one engine step (well under a second here when the machine is idle); the bound
# is loose for loaded CI machines, and far below the hundreds of steps the requests would otherwise run
ABORT_WITHIN_S = 10.0
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "


@pytest.fixture(scope="module")
def small():
    d = Daemon("--max-context", "256", "--kv-cache-tokens", "256", "--prefill-chunk", "16", "--step-tokens", "32",
               "--max-num-seqs", "4", "--threads", "2", "--mem-watermark-gib", "1", "--mem-floor-gib", "0.5")
    yield d
    d.stop()


@pytest.fixture(scope="module")
def sdk(small) -> openai.OpenAI:
    return openai.OpenAI(base_url=small.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(sdk) -> str:
    return sdk.models.list().data[0].id


def get_json(daemon, path: str) -> dict:
    with urllib.request.urlopen(daemon.url + path, timeout=30) as resp:
        return json.loads(resp.read())


def metric(daemon, name: str) -> float:
    with urllib.request.urlopen(daemon.url + "/metrics", timeout=30) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} missing")


def wait_idle(daemon, baseline_used: int, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = get_json(daemon, "/v1/ds4d/stats")
        if stats["requests"]["running"] == 0 and stats["requests"]["waiting"] == 0 \
                and stats["kv"]["used_blocks"] == baseline_used:
            return stats
        assert time.monotonic() < deadline, stats["requests"]
        time.sleep(0.05)


def test_long_prompt_with_tiny_step_budget_finishes(sdk, model):
    prompt = WORDS * 8  # ~220 tokens: more than ten 16-token prefill chunks
    resp = sdk.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
    assert resp.usage.prompt_tokens > 10 * 16 and resp.usage.completion_tokens == 8


def test_request_that_can_never_fit_is_refused_before_any_stream(sdk, model):
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            sdk.completions.create(model=model, prompt=WORDS * 40, max_tokens=4, stream=stream)
        err = info.value.body
        assert err["code"] == "context_length_exceeded"
        assert "maximum context length is 256 tokens" in err["message"]


@pytest.mark.parametrize("field, value", [("max_tokens", 2**70), ("max_tokens", 2**63), ("max_completion_tokens", 2**64),
                                          ("seed", 2**64), ("seed", -(2**63) - 1), ("top_k", 2**63)])
def test_integers_no_api_type_holds_are_refused(sdk, model, field, value):
    """A count or seed beyond int64 (uint64 for seeds) is a 400 naming the field, not clamped; the
    daemon keeps serving."""
    calls = [lambda: sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                 extra_body={field: value})]
    if field != "max_completion_tokens":
        calls.append(lambda: sdk.completions.create(model=model, prompt="hi", extra_body={field: value}))
    for call in calls:
        with pytest.raises(openai.BadRequestError) as info:
            call()
        err = info.value.body
        assert err["code"] == "invalid_value" and err["param"] == field, err
    # the largest int64 is an ordinary over-long value: clamped to what the context leaves (a prompt near the
    # 256-token context, so that is a few dozen tokens, whatever the machine's speed)
    resp = sdk.completions.create(model=model, prompt=WORDS * 8, temperature=0,
                                  max_tokens=2**63 - 1 if field == "max_tokens" else 2)
    assert 1 <= resp.usage.completion_tokens <= 256 - resp.usage.prompt_tokens


def test_pool_pressure_preempts_and_every_request_finishes(small, sdk, model):
    before = metric(small, "ds4d_preemptions_total")
    prompts = [f"{i} " + WORDS * 2 for i in range(2)]  # ~55 tokens + 90 generated each: 2 x 10 blocks > 16

    def run(prompt: str):
        return sdk.completions.create(model=model, prompt=prompt, max_tokens=90, temperature=0,
                                      extra_body={"ignore_eos": True})

    with cf.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(run, prompts))
    assert [r.usage.completion_tokens for r in results] == [90, 90]
    assert metric(small, "ds4d_preemptions_total") > before
    solo = run(prompts[1])  # preemption by recompute does not change greedy output
    assert solo.choices[0].text == results[1].choices[0].text


def aborted_in_log(daemon) -> int:
    """How many requests the daemon has logged as ended by an abort (its one line per finished request)."""
    return sum("finish=abort" in line for line in list(daemon.log_lines))


def wait_aborted(daemon, count: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while aborted_in_log(daemon) < count:
        assert time.monotonic() < deadline, daemon.log
        time.sleep(0.05)


def test_client_disconnect_aborts_and_frees_blocks(small, sdk, model):
    baseline = wait_idle(small, get_json(small, "/v1/ds4d/stats")["kv"]["used_blocks"], 30)["kv"]["used_blocks"]
    aborted = aborted_in_log(small)
    stream = sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": "Count to a thousand."}],
                                         max_tokens=230, stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    for _ in range(3):
        next(chunks)
    assert get_json(small, "/v1/ds4d/stats")["requests"]["running"] == 1
    stream.close()
    wait_idle(small, baseline, ABORT_WITHIN_S)
    wait_aborted(small, aborted + 1, ABORT_WITHIN_S)  # ended by the abort, not by running out its tokens

    body = json.dumps({"model": model, "prompt": WORDS, "max_tokens": 200, "ignore_eos": True}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", small.port, timeout=30)
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    deadline = time.monotonic() + 30
    while get_json(small, "/v1/ds4d/stats")["requests"]["running"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    conn.close()  # a non-streaming client that gives up
    wait_idle(small, baseline, ABORT_WITHIN_S)
    wait_aborted(small, aborted + 2, ABORT_WITHIN_S)
    assert metric(small, "ds4d_requests_running") == 0
