"""`ds4d bench agent --trace`: several agent sessions interleaved on one server, as OpenCode sends them.

Built from OpenCode's recorded requests (``--requests-dir``, default the copies under
tests/fixtures/reference/opencode/requests): its agent system prompt and its ten tool
declarations, and its title-generator request.  Each of ``--sessions`` sessions:

* **title**: the title request, sent beside the session's first step (concurrently);
* **first**: the system prompt, the tools and a task of the session's own;
* **next**: each later step sends the whole conversation again: the previous reply as
  an assistant message (content and reasoning as streamed) and a tool result of a varied
  size (log-uniform between ``--min-tool-words`` and ``--tool-words`` words), as a user
  message: the assistant turn is exactly what the model wrote, so all of it can be reused;
* **subagent first / subagent next**: after its first step, every session spawns
  ``--subagents`` subagents (OpenCode's ``task`` tool): the same system prompt and tools,
  a task of their own, ``--subagent-steps`` steps each.

Steps are interleaved round by round: every live session and subagent sends its next step,
one after another (``--concurrency`` 1) or that many at once, so each session's blocks have to
survive the others' traffic.  Every request has its session's ``x-session-id`` and no
``cache_salt``: what sessions share (the system prompt and tools) may be reused across them.

Reported per step kind: requests, TTFT p50 and p99, the cached fraction (cached prompt
tokens over prompt tokens) and the cached tokens per tier; the same over the first steps of
the sessions after the first (``first, later sessions``: how much of an earlier session's
system prompt and tools a new session reuses) and over every step after each session's first
(``next``, ``subagent first``, ``subagent next``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from ds4d.bench.serve import WORDS, RequestPlan, RequestResult, first_model_id, percentile, send_request

DEFAULT_REQUESTS = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "reference" / "opencode" / "requests"
AGENT_REQUEST = "run2_tool_read_002_POST_v1_chat_completions.json"
TITLE_REQUEST = "run2_tool_read_001_POST_v1_chat_completions.json"
KINDS = ("title", "first", "next", "subagent first", "subagent next")
AFTER_FIRST = ("next", "subagent first", "subagent next")
LATER_FIRST = "first, later sessions"
"""The first steps of every session but the trace's first: what a new session reuses of an earlier one's prompt."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", action="store_true",
                   help="several OpenCode sessions interleaved, with titles and subagents (see ds4d.bench.agent_trace)")
    p.add_argument("--requests-dir", default=str(DEFAULT_REQUESTS), help="--trace: OpenCode's recorded requests")
    p.add_argument("--sessions", type=int, default=3, help="--trace: agent sessions")
    p.add_argument("--steps", type=int, default=6, help="--trace: steps per session")
    p.add_argument("--subagents", type=int, default=1, help="--trace: subagents each session spawns after step 1")
    p.add_argument("--subagent-steps", type=int, default=3, help="--trace: steps per subagent")
    p.add_argument("--tool-words", type=int, default=3000, help="--trace: largest tool result, in words")
    p.add_argument("--min-tool-words", type=int, default=50, help="--trace: smallest tool result, in words")
    p.add_argument("--system-chars", type=int, default=0,
                   help="--trace: keep only this many characters of the system prompt (0 = all; for small models)")
    p.add_argument("--max-tools", type=int, default=-1, help="--trace: declare only the first N tools (-1 = all)")
    p.add_argument("--concurrency", type=int, default=1, help="--trace: steps in flight at once")


@dataclass
class Conversation:
    """One agent session or subagent: its id, kind prefix and messages so far."""

    session_id: str
    subagent: bool
    steps_left: int
    messages: list[dict]
    steps_done: int = 0

    @property
    def kind(self) -> str:
        return ("subagent " if self.subagent else "") + ("next" if self.steps_done else "first")


@dataclass
class Recorded:
    kind: str
    result: RequestResult


@dataclass
class Trace:
    args: argparse.Namespace
    model: str
    system: str
    tools: list
    title_system: str
    rng: random.Random
    records: list[Recorded] = field(default_factory=list)

    def base(self) -> dict:
        body = {"model": self.model, "stream": True, "stream_options": {"include_usage": True},
                "max_tokens": self.args.max_tokens, "temperature": 0, "ignore_eos": True}
        if self.tools:
            body.update(tools=self.tools, tool_choice="auto")
        return body

    def task(self, who: str) -> str:
        return f"{who}: read the files of module {self.rng.choice(WORDS)} and {' '.join(self.rng.sample(WORDS, 8))}"

    def tool_output(self) -> str:
        low, high = max(1, self.args.min_tool_words), max(self.args.min_tool_words, self.args.tool_words)
        count = int(math.exp(self.rng.uniform(math.log(low), math.log(high))))
        return "Tool output:\n" + " ".join(self.rng.choice(WORDS) for _ in range(count))


def load_recorded(directory: Path, system_chars: int, max_tools: int) -> tuple[str, list, str]:
    """(agent system prompt, tools, title-generator system prompt) from OpenCode's recorded requests."""
    agent = json.loads((directory / AGENT_REQUEST).read_text())["body"]
    title = json.loads((directory / TITLE_REQUEST).read_text())["body"]
    system = next(m["content"] for m in agent["messages"] if m["role"] == "system")
    title_system = next(m["content"] for m in title["messages"] if m["role"] == "system")
    tools = agent.get("tools", [])
    if system_chars:
        system, title_system = system[:system_chars], title_system[:system_chars]
    return system, tools[:max_tools] if max_tools >= 0 else tools, title_system


async def _send(trace: Trace, session, url: str, conversation: Conversation | None, body: dict, kind: str,
                headers: dict) -> RequestResult:
    index = len(trace.records)
    trace.records.append(Recorded(kind, RequestResult(index)))
    result = await send_request(session, url, RequestPlan(index, body, None), trace.args.timeout, headers=headers)
    trace.records[index].result = result
    if result.status != "ok" or result.ttft_ms is None:
        raise RuntimeError(f"{kind} request {index} failed: {result.error or 'no token streamed'}")
    return result


async def _step(trace: Trace, session, url: str, conversation: Conversation) -> Conversation | None:
    """Send the conversation's next step; its reply and a tool result join the messages."""
    kind = conversation.kind
    headers = {"x-session-id": conversation.session_id}
    body = {**trace.base(), "messages": conversation.messages}
    if kind == "first" and not conversation.subagent:
        first_message = next(m["content"] for m in conversation.messages if m["role"] == "user")
        title = {**trace.base(), "messages": [{"role": "system", "content": trace.title_system},
                                              {"role": "user", "content": "Generate a title for this conversation:\n"},
                                              {"role": "user", "content": first_message}]}
        title.pop("tools", None), title.pop("tool_choice", None)
        result, _ = await asyncio.gather(_send(trace, session, url, conversation, body, kind, headers),
                                         _send(trace, session, url, None, title, "title", headers))
    else:
        result = await _send(trace, session, url, conversation, body, kind, headers)
    reply = {"role": "assistant", "content": result.text}
    if result.reasoning:
        reply["reasoning_content"] = result.reasoning
    conversation.messages = conversation.messages + [reply, {"role": "user", "content": trace.tool_output()}]
    conversation.steps_done += 1
    conversation.steps_left -= 1
    return conversation


async def drive_trace(args: argparse.Namespace) -> tuple[str, Trace, float]:
    import aiohttp

    url = args.url.rstrip("/")
    system, tools, title_system = load_recorded(Path(args.requests_dir), args.system_chars, args.max_tools)
    stamp = time.time_ns()
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {args.api_key}"},
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        model = args.model or await first_model_id(session, url)
        trace = Trace(args, model, system, tools, title_system, random.Random(args.seed))
        live = [Conversation(f"trace-{stamp}-s{s}", False, args.steps,
                             [{"role": "system", "content": system}, {"role": "user", "content": trace.task(f"s{s}")}])
                for s in range(args.sessions)]
        began = time.perf_counter()
        while live:
            spawned = []
            for at in range(0, len(live), max(1, args.concurrency)):
                group = live[at: at + max(1, args.concurrency)]
                await asyncio.gather(*(_step(trace, session, url, c) for c in group))
                for c in group:
                    if not c.subagent and c.steps_done == 1:
                        spawned += [Conversation(f"{c.session_id}-sub{k}", True, args.subagent_steps,
                                                 [{"role": "system", "content": system},
                                                  {"role": "user", "content": trace.task(f"{c.session_id} sub{k}")}])
                                    for k in range(args.subagents)]
            live = [c for c in live if c.steps_left > 0] + spawned
        return model, trace, time.perf_counter() - began


def summarise(records: list[Recorded]) -> dict:
    """Per step kind (and over the steps after each session's first): counts, TTFT, cached fraction, tiers."""
    by_kind: dict[str, list[RequestResult]] = defaultdict(list)
    for record in records:
        by_kind[record.kind].append(record.result)
    by_kind["after first"] = [r.result for r in records if r.kind in AFTER_FIRST]
    by_kind[LATER_FIRST] = by_kind.get("first", [])[1:]
    out = {}
    for kind in (*KINDS[:2], LATER_FIRST, *KINDS[2:], "after first"):
        results = by_kind.get(kind, [])
        if not results:
            continue
        prompt = sum(r.prompt_tokens or 0 for r in results)
        cached = sum(r.cached_tokens or 0 for r in results)
        tiers: dict[str, int] = defaultdict(int)
        for r in results:
            for tier, count in (r.cached_by_tier or {}).items():
                tiers[tier] += count
        ttft = [r.ttft_ms for r in results if r.ttft_ms is not None]
        out[kind] = {"requests": len(results), "prompt_tokens": prompt, "cached_tokens": cached,
                     "cached_fraction": cached / prompt if prompt else 0.0, "cached_by_tier": dict(tiers),
                     "ttft_ms": {"p50": percentile(ttft, 0.5), "p99": percentile(ttft, 0.99)}}
    return out


def run_trace(args: argparse.Namespace) -> int:
    model, trace, wall_s = asyncio.run(drive_trace(args))
    summary = summarise(trace.records)
    print(f"# ds4d bench agent --trace — {model} at {args.url}, {time.strftime('%Y-%m-%d')}: {args.sessions} sessions "
          f"x {args.steps} steps, {args.subagents} subagent(s) x {args.subagent_steps} steps each, tool results "
          f"{args.min_tool_words}-{args.tool_words} words, concurrency {args.concurrency}; {len(trace.records)} "
          f"requests in {wall_s:.1f} s")
    print("| step kind | requests | prompt tokens | cached | cached fraction | gpu / ram / disk | TTFT p50 ms | TTFT p99 ms |")
    print("|---|---|---|---|---|---|---|---|")
    for kind, row in summary.items():
        tiers = " / ".join(f"{row['cached_by_tier'].get(t, 0):,}" for t in ("gpu", "ram", "disk"))
        print(f"| {kind} | {row['requests']} | {row['prompt_tokens']:,} | {row['cached_tokens']:,} | "
              f"{row['cached_fraction']:.3f} | {tiers} | {row['ttft_ms']['p50']:,.0f} | {row['ttft_ms']['p99']:,.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": model, "wall_s": wall_s, "summary": summary,
                                               "requests": [{"kind": r.kind, "prompt_tokens": r.result.prompt_tokens,
                                                             "cached_tokens": r.result.cached_tokens,
                                                             "cached_by_tier": r.result.cached_by_tier,
                                                             "ttft_ms": r.result.ttft_ms}
                                                            for r in trace.records]}, indent=1))
    return 0
