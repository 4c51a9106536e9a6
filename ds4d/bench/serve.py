"""`ds4d bench serve`: a load and soak driver against a running OpenAI-compatible server.

Workers keep ``--concurrency`` streaming chat requests in flight until ``--requests``
have been sent or ``--duration`` seconds have passed (whichever comes first; requests
in flight at the deadline run to their end).  Every prompt is a system message shared
by all requests (half of ``--prompt-words``, so a prefix cache has something to reuse)
followed by a user message of words drawn with the request's own seed.  A
``--cancel-fraction`` of the requests closes its stream after a random number of
received tokens, as a client that goes away would; the server should abort them.

Per request: TTFT (send to first content or reasoning token), TPOT ((last token time -
first token time) / (tokens - 1)), output tokens (the usage chunk's count, else the
token chunks received), prompt and cached prompt tokens from the usage chunk, and the
outcome: ok, cancelled, or failed (HTTP status and body, an error event, a timeout,
or a stream that ended without ``[DONE]``).  Goodput counts only the output tokens
of ok requests, over the wall time of the whole run.  Exit status 1 when any request
that was not cancelled failed.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

WORDS = (
    "river", "bridge", "market", "harbour", "salt", "cloth", "story", "trader", "street", "stone", "city",
    "village", "mountain", "forest", "winter", "summer", "morning", "evening", "lantern", "window", "garden",
    "orchard", "wheat", "bread", "cheese", "apple", "copper", "iron", "silver", "ship", "sail", "anchor",
    "island", "coast", "storm", "rain", "cloud", "wind", "sun", "moon", "star", "road", "wagon", "horse",
    "mill", "tower", "wall", "gate", "square", "fountain", "bell", "clock", "school", "library", "letter",
    "ink", "paper", "candle", "kettle", "fire", "field", "farmer", "shepherd", "wool", "loom", "weaver",
    "baker", "smith", "mason", "carpenter", "merchant", "sailor",
)
FAILURES_SHOWN = 5


def add_server_args(p) -> None:
    """Where the server is and how to ask it (``ds4d bench serve`` and ``agent``)."""
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (without /v1)")
    p.add_argument("--api-key", default=os.environ.get("DS4D_API_KEY", "none"),
                   help="Bearer key (default: $DS4D_API_KEY or 'none')")
    p.add_argument("--model", default="", help="model id (default: the first id from GET /v1/models)")


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="concurrent streaming chat load against a running server")
    add_server_args(p)
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    p.add_argument("--requests", type=int, default=None,
                   help="requests to send in all (default 64, unlimited when only --duration is given)")
    p.add_argument("--duration", type=float, default=None, help="stop sending new requests after this many seconds")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-words", type=int, default=200,
                   help="words per prompt; the first half is a system prefix shared by every request")
    p.add_argument("--cancel-fraction", type=float, default=0.1,
                   help="fraction of requests that close their stream after a random number of tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds allowed per request")
    p.add_argument("--json", default="", help="also write the results to this JSON file")
    p.set_defaults(run=run)


@dataclass
class RequestResult:
    index: int
    status: str = "failed"  # ok | cancelled | failed
    error: str = ""
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    cached_by_tier: dict[str, int] | None = None
    """ds4d's usage extension: cached prompt tokens per cache tier (gpu, ram, disk)."""
    latency_ms: float = 0.0
    text: str = ""
    """The content the stream delivered (an agent's next turn sends it back)."""
    reasoning: str = ""
    """The reasoning_content the stream delivered."""


@dataclass(frozen=True)
class RequestPlan:
    """What one request sends and when it gives up on its stream (None = read to the end)."""

    index: int
    body: dict
    cancel_after_tokens: int | None


def shared_prefix(prompt_words: int, seed: int) -> str:
    rng = random.Random(seed)
    words = " ".join(rng.choice(WORDS) for _ in range(prompt_words // 2))
    return f"You are a careful assistant. Reference notes follow. {words}"


def plan_request(index: int, args: argparse.Namespace, model: str, system: str) -> RequestPlan:
    rng = random.Random(args.seed * 1_000_003 + index)
    words = " ".join(rng.choice(WORDS) for _ in range(args.prompt_words - args.prompt_words // 2))
    body = {"model": model, "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": args.max_tokens,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": f"Write a short story using these words: {words}"}]}
    cancel = None
    if rng.random() < args.cancel_fraction:
        cancel = rng.randint(1, max(1, args.max_tokens - 1))
    return RequestPlan(index, body, cancel)


async def send_request(session, url: str, plan: RequestPlan, timeout_s: float,
                       headers: dict | None = None) -> RequestResult:
    import aiohttp

    result = RequestResult(plan.index)
    start = time.perf_counter()
    first = last = None
    token_chunks = 0
    usage_tokens = None
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(url + "/v1/chat/completions", json=plan.body, headers=headers) as resp:
                if resp.status != 200:
                    result.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                    return result
                done = False
                async for raw in resp.content:
                    line = raw.decode("utf-8", "replace").strip()
                    if not line.startswith("data:"):
                        continue  # blank separators and ": keepalive" comments
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    chunk = json.loads(data)
                    if not isinstance(chunk, dict):
                        result.error = f"not a JSON object: {data[:300]}"
                        return result
                    if "error" in chunk:
                        result.error = f"error event: {json.dumps(chunk['error'])[:300]}"
                        return result
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                        usage_tokens = usage.get("completion_tokens")
                        result.prompt_tokens = usage.get("prompt_tokens")
                        result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                        result.cached_by_tier = (usage.get("ds4d") or {}).get("cached_tokens_by_tier")
                    result.text += "".join(c.get("delta", {}).get("content") or "" for c in chunk.get("choices") or ())
                    result.reasoning += "".join(c.get("delta", {}).get("reasoning_content") or ""
                                                for c in chunk.get("choices") or ())
                    if any(c.get("delta", {}).get("content") or c.get("delta", {}).get("reasoning_content")
                           for c in chunk.get("choices") or ()):
                        last = time.perf_counter()
                        if first is None:
                            first = last
                        token_chunks += 1
                        if plan.cancel_after_tokens is not None and token_chunks >= plan.cancel_after_tokens:
                            resp.close()  # drop the connection, as a client that goes away
                            result.status = "cancelled"
                            break
                if result.status != "cancelled":
                    if done:
                        result.status = "ok"
                    else:
                        result.error = "stream ended without [DONE]"
    except TimeoutError:
        result.error = f"timed out after {timeout_s:g} s"
    except (aiohttp.ClientError, OSError, ValueError) as exc:  # ValueError covers malformed JSON
        result.error = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        result.latency_ms = (time.perf_counter() - start) * 1000
        result.output_tokens = usage_tokens if usage_tokens is not None else token_chunks
        if first is not None:
            result.ttft_ms = (first - start) * 1000
            if result.output_tokens > 1:
                result.tpot_ms = (last - first) * 1000 / (result.output_tokens - 1)
    return result


async def first_model_id(session, url: str) -> str:
    async with session.get(url + "/v1/models") as resp:
        resp.raise_for_status()
        return (await resp.json())["data"][0]["id"]


async def drive(args: argparse.Namespace) -> tuple[str, list[RequestResult], float]:
    """Run the load; returns the model id, the results in request order, and the wall time in seconds."""
    import aiohttp

    url = args.url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"}
    total = args.requests if args.requests is not None else (None if args.duration else 64)
    connector = aiohttp.TCPConnector(limit=args.concurrency)
    async with aiohttp.ClientSession(headers=headers, connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        model = args.model or await first_model_id(session, url)
        system = shared_prefix(args.prompt_words, args.seed)
        indices = itertools.count()
        results: list[RequestResult] = []
        start = time.perf_counter()
        deadline = start + args.duration if args.duration else None

        async def worker() -> None:
            while deadline is None or time.perf_counter() < deadline:
                index = next(indices)
                if total is not None and index >= total:
                    return
                results.append(await send_request(session, url, plan_request(index, args, model, system),
                                                  args.timeout))

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        wall_s = time.perf_counter() - start
    return model, sorted(results, key=lambda r: r.index), wall_s


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between the closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(results: list[RequestResult], wall_s: float) -> dict:
    by_status = {s: [r for r in results if r.status == s] for s in ("ok", "cancelled", "failed")}
    ttft = [r.ttft_ms for r in results if r.ttft_ms is not None]
    tpot = [r.tpot_ms for r in results if r.tpot_ms is not None]
    cached = [r.cached_tokens / r.prompt_tokens for r in by_status["ok"]
              if r.prompt_tokens and r.cached_tokens is not None]
    return {
        "requests": len(results), **{s: len(rs) for s, rs in by_status.items()}, "wall_s": wall_s,
        "goodput_tok_s": sum(r.output_tokens for r in by_status["ok"]) / wall_s if wall_s else 0.0,
        "output_tok_s": sum(r.output_tokens for r in results) / wall_s if wall_s else 0.0,
        "ttft_ms": {f"p{q}": percentile(ttft, q / 100) for q in (50, 90, 99)},
        "tpot_ms": {f"p{q}": percentile(tpot, q / 100) for q in (50, 90, 99)},
        "cached_fraction_mean": sum(cached) / len(cached) if cached else None,
        "failures": [f"request {r.index}: {r.error}" for r in by_status["failed"]],
    }


def run(args: argparse.Namespace) -> int:
    import aiohttp

    try:
        model, results, wall_s = asyncio.run(drive(args))
    except (aiohttp.ClientError, OSError, KeyError, IndexError) as exc:
        print(f"ds4d bench serve: no model list from {args.url}: {type(exc).__name__}: {exc}")
        return 1
    summary = summarize(results, wall_s)
    if args.json:
        config = {k: v for k, v in vars(args).items() if k not in ("api_key", "json") and not callable(v)}
        Path(args.json).write_text(json.dumps({"config": {**config, "model": model}, "summary": summary,
                                               "results": [asdict(r) for r in results]}, indent=2))
    print()
    print(f"# ds4d bench serve — {args.url}, model {model}, concurrency {args.concurrency}, {_limit(args)}, "
          f"max_tokens {args.max_tokens}, {args.prompt_words} prompt words, cancel fraction {args.cancel_fraction:g}, "
          f"seed {args.seed}, {time.strftime('%Y-%m-%d')}")
    for failure in summary["failures"][:FAILURES_SHOWN]:
        print(f"failed: {failure}")
    if len(summary["failures"]) > FAILURES_SHOWN:
        print(f"... and {len(summary['failures']) - FAILURES_SHOWN} more failures")
    print("| ok | cancelled | failed | wall s | goodput tok/s | output tok/s | TTFT ms p50 / p90 / p99 "
          "| TPOT ms p50 / p90 / p99 | cached prompt fraction |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| {summary['ok']} | {summary['cancelled']} | {summary['failed']} | {wall_s:.1f} "
          f"| {summary['goodput_tok_s']:.1f} | {summary['output_tok_s']:.1f} | {_triple(summary['ttft_ms'])} "
          f"| {_triple(summary['tpot_ms'])} | {_fmt(summary['cached_fraction_mean'], '.2f')} |")
    return 1 if summary["failed"] else 0


def _limit(args: argparse.Namespace) -> str:
    parts = [f"{args.requests} requests"] if args.requests is not None else []
    parts += [f"{args.duration:g} s"] if args.duration else []
    return " or ".join(parts) or "64 requests"


def _triple(p: dict) -> str:
    return " / ".join(_fmt(p[k], ".0f" if (p[k] or 0) >= 10 else ".1f") for k in ("p50", "p90", "p99"))


def _fmt(v: float | None, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)
