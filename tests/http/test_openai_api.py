"""The OpenAI API through the real openai SDK against a live daemon on the embedded model."""

from __future__ import annotations

import concurrent.futures as cf
import json
import urllib.error
import urllib.request

import openai
import pytest

SYSTEM = "You are a helpful assistant."
PARIS = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the capital of France?"}]


def post(daemon, path: str, body: bytes | dict, headers: dict | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(daemon.url + path, data=data, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def get_text(daemon, path: str) -> str:
    with urllib.request.urlopen(daemon.url + path, timeout=30) as resp:
        return resp.read().decode()


def chat(client, model_id, messages, **kw):
    return client.chat.completions.create(model=model_id, messages=messages, temperature=0, **kw)


def stream_text(client, model_id, messages, **kw) -> tuple[str, object]:
    parts, usage = [], None
    for chunk in client.chat.completions.create(model=model_id, messages=messages, temperature=0, stream=True,
                                                stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.content:
                parts.append(c.delta.content)
    return "".join(parts), usage


def test_paris_stream_and_non_stream_agree(client, model_id):
    full = chat(client, model_id, PARIS, max_tokens=24)
    text = full.choices[0].message.content
    assert "Paris" in text
    streamed, usage = stream_text(client, model_id, PARIS, max_tokens=24)
    assert streamed == text
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens


def test_usage_matches_tokenize(daemon, client, model_id):
    status, tok = post(daemon, "/tokenize", {"model": model_id, "messages": PARIS})
    assert status == 200 and tok["count"] == len(tok["tokens"])
    assert "What is the capital of France?" in tok["prompt"]
    resp = chat(client, model_id, PARIS, max_tokens=5)
    assert resp.usage.prompt_tokens == tok["count"]
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert resp.usage.prompt_tokens_details.cached_tokens is not None
    status, detok = post(daemon, "/detokenize", {"tokens": tok["tokens"]})
    assert status == 200 and detok["prompt"] == tok["prompt"]


def _computed_prompt_tokens(daemon) -> int:
    for line in get_text(daemon, "/metrics").splitlines():
        if line.startswith("ds4d_prompt_tokens_computed_total "):
            return int(float(line.split()[1]))
    raise AssertionError("metric missing")


def test_repeated_request_reuses_prefix(daemon, client, model_id):
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "List three colours of the rainbow, please, in one short line."}]
    first = chat(client, model_id, messages, max_tokens=4)
    before = _computed_prompt_tokens(daemon)
    second = chat(client, model_id, messages, max_tokens=4)
    computed = _computed_prompt_tokens(daemon) - before
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0
    assert computed == second.usage.prompt_tokens - cached
    assert second.choices[0].message.content == first.choices[0].message.content


def test_stop_strings_and_max_tokens(client, model_id):
    base = chat(client, model_id, PARIS, max_tokens=24).choices[0].message.content
    assert "Paris" in base
    cut = chat(client, model_id, PARIS, max_tokens=24, stop=["Paris"])
    assert cut.choices[0].message.content == base[:base.index("Paris")]
    assert cut.choices[0].finish_reason == "stop"
    short = chat(client, model_id, PARIS, max_tokens=3)
    assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "length"
    streamed, _ = stream_text(client, model_id, PARIS, max_tokens=24, stop=["Paris"])
    assert streamed == cut.choices[0].message.content


def test_concurrent_streams_equal_solo_outputs(client, model_id):
    questions = ["Name a large animal.", "What is 2 plus 2?", "Say hello in French.", "Name a planet."]
    convs = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in questions]
    solo = [stream_text(client, model_id, c, max_tokens=16)[0] for c in convs]
    with cf.ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda c: stream_text(client, model_id, c, max_tokens=16)[0], convs))
    assert together == solo
    assert all(solo)


def test_echo_logprobs_one_entry_per_prompt_token(daemon, client, model_id):
    prompt = "The quick brown fox jumps over the lazy dog"
    status, tok = post(daemon, "/tokenize", {"prompt": prompt})
    resp = client.completions.create(model=model_id, prompt=prompt, max_tokens=1, echo=True, logprobs=2,
                                     temperature=0)
    lp = resp.choices[0].logprobs
    n_prompt = tok["count"]
    assert len(lp.token_logprobs) == n_prompt + 1
    assert lp.token_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert resp.choices[0].text.startswith(prompt)
    ids = client.completions.create(model=model_id, prompt=tok["tokens"], max_tokens=0, echo=True, logprobs=0)
    assert ids.choices[0].logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:n_prompt], abs=1e-5)


def test_sampling_with_seed_is_reproducible(client, model_id):
    kw = dict(model=model_id, messages=PARIS, max_tokens=12, temperature=0.9, top_p=0.9, seed=1234)
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    assert a == b


def test_chat_logprobs(client, model_id):
    resp = chat(client, model_id, PARIS, max_tokens=4, logprobs=True, top_logprobs=3)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    assert all(len(e.top_logprobs) == 3 and e.logprob <= 0 for e in content)


# --------------------------------------------------------------------------- errors


def _assert_error(status, body, expected_status, param=None, code=None):
    assert status == expected_status, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and isinstance(err["code"], str)
    assert "Traceback" not in err["message"] and "/work" not in err["message"]
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code


def test_bad_requests_get_openai_errors_and_daemon_keeps_serving(daemon, client, model_id):
    status, body = post(daemon, "/v1/chat/completions", b"{not json")
    _assert_error(status, body, 400, code="invalid_json")
    status, body = post(daemon, "/v1/chat/completions",
                        {"model": model_id, "messages": PARIS, "temperature": "hot", "unknown_field": {"x": 1}})
    _assert_error(status, body, 400, param="temperature")
    status, body = post(daemon, "/v1/chat/completions", {"model": model_id, "messages": []})
    _assert_error(status, body, 400, param="messages")
    status, body = post(daemon, "/v1/chat/completions", {"model": "no-such-model", "messages": PARIS})
    _assert_error(status, body, 404, param="model", code="model_not_found")
    long_text = "word " * 1500
    status, body = post(daemon, "/v1/chat/completions",
                        {"model": model_id, "messages": [{"role": "user", "content": long_text}]})
    _assert_error(status, body, 400, code="context_length_exceeded")
    assert "maximum context length is 1024 tokens" in body["error"]["message"]
    status, body = post(daemon, "/v1/completions", {"model": model_id, "prompt": [1, 2, 10**9]})
    _assert_error(status, body, 400, param="prompt")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=PARIS)
    # still serving
    assert "Paris" in chat(client, model_id, PARIS, max_tokens=24).choices[0].message.content


def test_admin_endpoints(daemon):
    with urllib.request.urlopen(daemon.url + "/health", timeout=10) as resp:
        assert json.loads(resp.read())["status"] == "ok"
    with urllib.request.urlopen(daemon.url + "/v1/ds4d/stats", timeout=10) as resp:
        stats = json.loads(resp.read())
    for key in ("running", "waiting"):
        assert isinstance(stats["requests"][key], int)
    assert stats["kv"]["total_blocks"] >= stats["kv"]["free_blocks"] > 0
    assert "prefill_tok_s" in stats["throughput"] and "decode_tok_s" in stats["throughput"]
    assert stats["host"]["mem_available_bytes"] > 0
    assert stats["gpus"] == []
    assert stats["config"]["non_default"]["max_context"]["value"] == 1024
    metrics = get_text(daemon, "/metrics")
    assert "ds4d_kv_blocks_total" in metrics and "ds4d_engine_alive 1" in metrics
    status, body = post(daemon, "/v1/nothing-here", {})
    _assert_error(status, body, 404)
