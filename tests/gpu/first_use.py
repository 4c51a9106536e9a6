"""A fresh daemon's first request of each kind against the same request warm (run by first_use.sh).

Usage: python tests/gpu/first_use.py PORT LABEL JSON_OUT   (SCALE=0.1: every prompt length a tenth, a quick check)

Each kind is sent once ("first": nothing of its kind ran in this daemon before, only the kinds listed
above it), then twice more with fresh random tokens of the same lengths ("warm": the better of the two).
Prompts are token ids through /v1/completions, streamed, each under its own ``cache_salt`` unless the
kind is about reuse; times are client-side (HTTP included, a plain HTTP client: see ``stream``).  TTFT kinds report the time to the first
token, decode kinds the time from the first token to the last.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import sys
import time

import openai

PORT, LABEL, OUT = sys.argv[1], sys.argv[2], sys.argv[3]
MODEL = openai.OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="x", max_retries=0).models.list().data[0].id
rng = random.Random(LABEL)
salts = iter(range(1_000_000))
SCALE = float(os.environ.get("SCALE", "1"))


def n(tokens: int) -> int:
    return max(int(tokens * SCALE), 1) if tokens > 1 else tokens


def ids(count: int) -> list[int]:
    return [rng.randrange(1000, 120000) for _ in range(n(count))]


def stream(prompt: list[int], max_tokens: int, salt: str | None = None, **params) -> tuple[float, float, int]:
    """(seconds to the first token, seconds from the first token to the last, cached prompt tokens).

    A plain HTTP client: the ``openai`` SDK spends tens of milliseconds preparing a request of thousands of
    token ids (its parameter transform walks the list in Python), which would hide the server's time."""
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                       "stream_options": {"include_usage": True}, "temperature": params.pop("temperature", 0),
                       "ignore_eos": True, "cache_salt": salt or f"s{next(salts)}", **params})
    connection = http.client.HTTPConnection("127.0.0.1", int(PORT), timeout=600)
    began = time.perf_counter()
    connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
    first = last = None
    cached = 0
    for line in response:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        now = time.perf_counter()
        chunk = json.loads(line[6:])
        if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
            first = first or now
            last = now
        if chunk.get("usage"):
            cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    connection.close()
    return first - began, last - first, cached


def concurrent(n: int, prompt_len: int, max_tokens: int) -> float:
    """Wall seconds of ``n`` requests sent at once."""
    from concurrent.futures import ThreadPoolExecutor

    began = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        list(pool.map(lambda _: stream(ids(prompt_len), max_tokens), range(n)))
    return time.perf_counter() - began


def resumed(prefix_len: int, new: int) -> tuple[float, int]:
    """TTFT of a prompt resumed from a cached ``prefix_len``-token prompt, with ``new`` new tokens."""
    salt = f"r{next(salts)}"
    prefix = ids(prefix_len)
    stream(prefix, 1, salt)
    ttft, _, cached = stream(prefix + ids(new), 1, salt)
    return ttft, cached


KINDS = [
    ("prompt 64, TTFT", lambda: stream(ids(64), 1)[0]),
    ("decode 64 tokens after 64", lambda: stream(ids(64), 65)[1]),
    ("prompt 2,048, TTFT", lambda: stream(ids(2048), 1)[0]),
    ("prompt 9,000 (3 chunks), TTFT", lambda: stream(ids(9000), 1)[0]),
    ("8,000 reused + 1,441 new, TTFT", lambda: resumed(8000, 1441)[0]),
    ("8,000 reused + 1 new, TTFT", lambda: resumed(8000, 1)[0]),
    ("5,000 reused + 2,600 new, TTFT", lambda: resumed(5000, 2600)[0]),
    ("prompt 3,300, TTFT", lambda: stream(ids(3300), 1)[0]),
    ("sampled decode 64 (T 0.8, top-p 0.95)", lambda: stream(ids(64), 65, temperature=0.8, top_p=0.95)[1]),
    ("logprobs 5, decode 32", lambda: stream(ids(64), 33, logprobs=5)[1]),
    ("4 at once, 256 + 32 tokens each, wall", lambda: concurrent(4, 256, 32)),
    ("decode 32 after 20,000", lambda: stream(ids(20000), 33)[1]),
]

rows = []
for name, measure in KINDS:
    first = measure()
    warm = min(measure() for _ in range(2))
    rows.append({"kind": name, "first_s": first, "warm_s": warm, "ratio": first / warm})
json.dump({"label": LABEL, "rows": rows}, open(OUT, "w"), indent=1)
print(f"| {LABEL}: kind | first | warm | first / warm |\n|---|---|---|---|")
for r in rows:
    print(f"| {r['kind']} | {r['first_s'] * 1000:,.0f} ms | {r['warm_s'] * 1000:,.0f} ms | {r['ratio']:.2f}x |")
