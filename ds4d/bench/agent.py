"""`ds4d bench agent`: time to first token of an agent's next step, reused against cold, on a running server.

(``--trace``: several sessions interleaved with titles and subagents, ``ds4d.bench.agent_trace``.)

A coding agent resends its whole conversation every step.  Per repeat (each with
its own ``cache_salt``, so repeats and the cold runs share nothing):

1. step 1: a long system prompt (``--reused-words``, standing for the agent's
   instructions, tool schemas and earlier turns) plus a task; the reply is kept;
2. with ``--between-words``, another session's request of that many words (its
   own salt): on a server whose GPU KV pool holds less than both, it pushes
   step 1's blocks down to the RAM (or disk) tier, as other agents do on a
   shared server, so that step 2's reuse is served by a promotion;
3. step 2, as the agent sends it: the same messages, the reply as an assistant
   message and a new user message (``--new-words``, standing for tool output),
   with the same salt and session id: the server may reuse all of step 1;
4. the same step-2 request under a fresh salt: nothing to reuse (cold).

Every request declares one tool (``--no-tools``: none), as coding agents do; with
tools DeepSeek-V4 keeps earlier reasoning in the prompt, so step 2 (which sends
step 1's reasoning back as ``reasoning_content``) can reuse step 1's whole reply.

Reported per repeat: step 2's prompt tokens and cached tokens (from the usage
chunk, with ds4d's per-tier breakdown), the share of step 1's prompt + output
that was reused, and TTFT of the reused and the cold step 2; medians last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

from ds4d.bench.agent_trace import add_arguments as add_trace_arguments
from ds4d.bench.agent_trace import run_trace
from ds4d.bench.serve import WORDS, RequestPlan, add_server_args, first_model_id, send_request


def add_parser(sub) -> None:
    p = sub.add_parser("agent", help="TTFT of an agent's next step with prefix reuse against the same prompt cold")
    add_server_args(p)
    p.add_argument("--reused-words", type=int, default=3000, help="words of step 1's system prompt")
    p.add_argument("--new-words", type=int, default=1000, help="words the agent adds in step 2")
    p.add_argument("--between-words", type=int, default=0,
                   help="words of another session's request sent between step 1 and step 2 (0 = none)")
    p.add_argument("--tools", action=argparse.BooleanOptionalAction, default=True,
                   help="declare one tool in every request, as an agent does")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per reply")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per request")
    p.add_argument("--json", default="", help="also write the results to this JSON file")
    add_trace_arguments(p)
    p.set_defaults(run=run)


READ_TOOL = {"type": "function", "function": {
    "name": "read", "description": "Read a file of the project",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}


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
    if args.tools:
        base["tools"] = [READ_TOOL]
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=None)) as session:
        first = await _step(session, url, 4 * repeat, {**base, "messages": messages}, salt, args.timeout)
        if args.between_words:
            other = [{"role": "user", "content": "Other notes: " + _words(args.between_words, rng)}]
            await _step(session, url, 4 * repeat + 1, {**base, "messages": other, "max_tokens": 1},
                        salt + "-other", args.timeout)
        reply = {"role": "assistant", "content": first.text}
        if first.reasoning:
            reply["reasoning_content"] = first.reasoning
        messages = messages + [reply,
                               {"role": "user", "content": "Tool output: " + _words(args.new_words, rng)}]
        reused = await _step(session, url, 4 * repeat + 2, {**base, "messages": messages}, salt, args.timeout)
        cold = await _step(session, url, 4 * repeat + 3, {**base, "messages": messages}, salt + "-cold", args.timeout)
    previous = (first.prompt_tokens or 0) + first.output_tokens
    return {"step1_prompt_tokens": first.prompt_tokens, "step1_output_tokens": first.output_tokens,
            "step2_prompt_tokens": reused.prompt_tokens, "step2_cached_tokens": reused.cached_tokens,
            "step2_cached_by_tier": reused.cached_by_tier or {},
            "reused_share_of_step1": (reused.cached_tokens or 0) / previous if previous else None,
            "cold_cached_tokens": cold.cached_tokens, "ttft_reused_ms": reused.ttft_ms, "ttft_cold_ms": cold.ttft_ms}


def run(args: argparse.Namespace) -> int:
    if args.trace:
        return run_trace(args)

    async def main() -> tuple[str, list[dict]]:
        import aiohttp

        url = args.url.rstrip("/")
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {args.api_key}"}) as session:
            model = args.model or await first_model_id(session, url)
        return model, [await _repeat(args, url, model, r) for r in range(args.repeats)]

    model, rows = asyncio.run(main())
    between = f", {args.between_words} words of another session in between" if args.between_words else ""
    print(f"# ds4d bench agent — {model} at {args.url}, {time.strftime('%Y-%m-%d')}: step 2 of an agent "
          f"session ({args.reused_words} + {args.new_words} words{between}), reused vs the same prompt cold")
    print("| repeat | step 2 prompt tokens | cached | cached gpu / ram / disk | reused / step 1 prompt + output | "
          "TTFT reused ms | TTFT cold ms | cold / reused |")
    print("|---|---|---|---|---|---|---|---|")
    for index, row in enumerate(rows):
        tiers = " / ".join(f"{row['step2_cached_by_tier'].get(t, 0):,}" for t in ("gpu", "ram", "disk"))
        print(f"| {index} | {row['step2_prompt_tokens']:,} | {row['step2_cached_tokens']:,} | {tiers} | "
              f"{row['reused_share_of_step1']:.1%} | {row['ttft_reused_ms']:,.0f} | {row['ttft_cold_ms']:,.0f} | "
              f"{row['ttft_cold_ms'] / row['ttft_reused_ms']:.1f}x |")
    warm = statistics.median(r["ttft_reused_ms"] for r in rows)
    cold = statistics.median(r["ttft_cold_ms"] for r in rows)
    print(f"| median | | | | | {warm:,.0f} | {cold:,.0f} | {cold / warm:.1f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": model, "rows": rows}, indent=1))
    return 0 if all(r["cold_cached_tokens"] == 0 for r in rows) else 1
