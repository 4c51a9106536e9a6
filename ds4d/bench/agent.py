"""`ds4d bench agent`: time to first token of an agent's next step, reused against cold, on a running server.

A coding agent resends its whole conversation every step.  Per repeat (each with
its own ``cache_salt``, so repeats and the cold runs share nothing):

1. step 1: a long system prompt (``--reused-words``, standing for the agent's
   instructions, tool schemas and earlier turns) plus a task; the reply is kept;
2. step 2, as the agent sends it: the same messages, the reply as an assistant
   message and a new user message (``--new-words``, standing for tool output),
   with the same salt and session id: the server may reuse all of step 1;
3. the same step-2 request under a fresh salt: nothing to reuse (cold).

Reported per repeat: step 2's prompt tokens and cached tokens (from the usage
chunk), the share of step 1's prompt + output that was reused, and TTFT of the
reused and the cold step 2; medians last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

from ds4d.bench.serve import WORDS, RequestPlan, add_server_args, first_model_id, send_request


def add_parser(sub) -> None:
    p = sub.add_parser("agent", help="TTFT of an agent's next step with prefix reuse against the same prompt cold")
    add_server_args(p)
    p.add_argument("--reused-words", type=int, default=3000, help="words of step 1's system prompt")
    p.add_argument("--new-words", type=int, default=1000, help="words the agent adds in step 2")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per reply")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per request")
    p.add_argument("--json", default="", help="also write the results to this JSON file")
    p.set_defaults(run=run)


def _words(count: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


async def _step(session, url: str, index: int, body: dict, salt: str, timeout: float):
    result = await send_request(session, url, RequestPlan(index, {**body, "cache_salt": salt}, None), timeout)
    if result.status != "ok" or result.ttft_ms is None:
        raise RuntimeError(f"request {index} failed: {result.error or 'no token streamed'}")
    return result


async def _repeat(args: argparse.Namespace, url: str, model: str, repeat: int) -> dict:
    import aiohttp

    rng = random.Random(args.seed * 1_000_003 + repeat)
    salt = f"bench-agent-{time.time_ns()}-{repeat}"
    headers = {"Authorization": f"Bearer {args.api_key}", "x-session-id": salt}
    messages = [{"role": "system", "content": "You are a coding agent. Notes: " + _words(args.reused_words, rng)},
                {"role": "user", "content": "Summarise the notes in one sentence."}]
    base = {"model": model, "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}  # every reply has max_tokens
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=None)) as session:
        first = await _step(session, url, 3 * repeat, {**base, "messages": messages}, salt, args.timeout)
        messages = messages + [{"role": "assistant", "content": first.text},
                               {"role": "user", "content": "Tool output: " + _words(args.new_words, rng)}]
        reused = await _step(session, url, 3 * repeat + 1, {**base, "messages": messages}, salt, args.timeout)
        cold = await _step(session, url, 3 * repeat + 2, {**base, "messages": messages}, salt + "-cold", args.timeout)
    previous = (first.prompt_tokens or 0) + first.output_tokens
    return {"step1_prompt_tokens": first.prompt_tokens, "step1_output_tokens": first.output_tokens,
            "step2_prompt_tokens": reused.prompt_tokens, "step2_cached_tokens": reused.cached_tokens,
            "reused_share_of_step1": (reused.cached_tokens or 0) / previous if previous else None,
            "cold_cached_tokens": cold.cached_tokens, "ttft_reused_ms": reused.ttft_ms, "ttft_cold_ms": cold.ttft_ms}


def run(args: argparse.Namespace) -> int:
    async def main() -> tuple[str, list[dict]]:
        import aiohttp

        url = args.url.rstrip("/")
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {args.api_key}"}) as session:
            model = args.model or await first_model_id(session, url)
        return model, [await _repeat(args, url, model, r) for r in range(args.repeats)]

    model, rows = asyncio.run(main())
    print(f"# ds4d bench agent — {model} at {args.url}, {time.strftime('%Y-%m-%d')}: step 2 of an agent "
          f"session ({args.reused_words} + {args.new_words} words), reused vs the same prompt cold")
    print("| repeat | step 2 prompt tokens | cached | reused / step 1 prompt + output | TTFT reused ms | "
          "TTFT cold ms | cold / reused |")
    print("|---|---|---|---|---|---|---|")
    for index, row in enumerate(rows):
        print(f"| {index} | {row['step2_prompt_tokens']} | {row['step2_cached_tokens']} | "
              f"{row['reused_share_of_step1']:.1%} | {row['ttft_reused_ms']:,.0f} | {row['ttft_cold_ms']:,.0f} | "
              f"{row['ttft_cold_ms'] / row['ttft_reused_ms']:.1f}x |")
    warm = statistics.median(r["ttft_reused_ms"] for r in rows)
    cold = statistics.median(r["ttft_cold_ms"] for r in rows)
    print(f"| median | | | | {warm:,.0f} | {cold:,.0f} | {cold / warm:.1f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": model, "rows": rows}, indent=1))
    return 0 if all(r["cold_cached_tokens"] == 0 for r in rows) else 1
