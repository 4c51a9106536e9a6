"""Contract tests every registered scheduler policy must pass (built-in table and entry points).

A policy is constructed as ``Factory(ctx, options)`` and only orders waiting
requests and picks preemption victims; the engine keeps the progress guarantee
whatever it picks.  Each policy drives the toy model through an
:class:`OfflineEngine`: outputs are those of the plain-torch reference, under
memory pressure (preemption) too, and a long prompt with a tiny per-step budget
finishes while short requests keep arriving.  Two deliberately bad policies
(the oldest, or the longest, running request as the victim: the vLLM
chunked-prefill livelock) must pass the same tests.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest

from ds4d.config import Config
from ds4d.contracts import PluginContext, SchedulerPolicy
from ds4d.engine.offline import OfflineEngine
from ds4d.engine.request import EngineRequest, FinishReason, SamplingParams
from ds4d.registry import available
from tests.toy_model import ToyModel, reference_tokens

CTX = PluginContext(Config(device="cpu", dtype="float32"), logging.getLogger("t"))
GREEDY = dict(temperature=0.0, ignore_eos=True)


class OldestVictimPolicy:
    """Admits in arrival order and always asks to preempt the oldest running request."""

    name = "oldest_victim"

    def __init__(self, ctx, options=None) -> None:
        pass

    def order_waiting(self, waiting):
        return sorted(waiting, key=lambda r: r.arrival_time)

    def choose_victim(self, running):
        return min(running, key=lambda r: r.arrival_time)


class LongestVictimPolicy(OldestVictimPolicy):
    """Always asks to preempt the running request with the longest prompt."""

    name = "longest_victim"

    def choose_victim(self, running):
        return max(running, key=lambda r: (r.num_prompt_tokens, -r.arrival_time))


BAD = {"oldest_victim": OldestVictimPolicy, "longest_victim": LongestVictimPolicy}
REGISTERED = sorted(available("scheduler_policy"))


def policy_of(name: str) -> SchedulerPolicy:
    factory = BAD[name] if name in BAD else available("scheduler_policy")[name].load()
    return factory(CTX, {})


def engine(policy: SchedulerPolicy, *, num_blocks=64, max_num_seqs=8, step_tokens=64, prefill_chunk=16):
    return OfflineEngine(ToyModel(4), max_num_seqs=max_num_seqs, num_blocks=num_blocks, step_tokens=step_tokens,
                         prefill_chunk=prefill_chunk, prefix_caching=False, policy=policy, namespace=b"toy")


def req(rid: str, prompt: list[int], n: int) -> EngineRequest:
    return EngineRequest(rid, tuple(prompt), SamplingParams(max_tokens=n, **GREEDY))


def tokens_by_request(outputs) -> tuple[dict[str, list[int]], dict[str, FinishReason]]:
    tokens, finish = {}, {}
    for o in outputs:
        tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        if o.finish_reason:
            finish[o.request_id] = o.finish_reason
    return tokens, finish


@dataclass
class Waiting:
    """What a policy sees of a request (``SchedulableRequest``)."""

    request_id: str
    arrival_time: float
    num_prompt_tokens: int
    num_computed_tokens: int = 0


@pytest.mark.parametrize("name", REGISTERED)
def test_policy_orders_and_picks_among_what_it_is_given(name):
    policy = policy_of(name)
    assert policy.name == name
    requests = [Waiting(f"r{i}", arrival_time=float(t), num_prompt_tokens=10 * i + 3)
                for i, t in enumerate([5, 1, 3, 2])]
    given = list(requests)
    ordered = policy.order_waiting(given)
    assert given == requests  # not reordered in place
    assert sorted(map(id, ordered)) == sorted(map(id, requests))
    for k in range(1, len(requests) + 1):
        assert any(policy.choose_victim(requests[:k]) is r for r in requests[:k])


@pytest.mark.parametrize("name", REGISTERED + sorted(BAD))
def test_outputs_are_the_reference_with_and_without_preemption(name):
    prompts = {f"r{i}": [i + 1] * (3 + 5 * i) for i in range(6)}
    e = engine(policy_of(name))
    for rid, prompt in prompts.items():
        e.submit(req(rid, prompt, 8))
    e.run_until_idle(10_000)
    tokens, finish = tokens_by_request(e.outputs)
    assert tokens == {rid: reference_tokens(p, 8) for rid, p in prompts.items()}
    assert set(finish.values()) == {FinishReason.LENGTH}
    # 12 blocks of 4 tokens; three requests that each end at 8 + 20 tokens cannot all fit
    e = engine(policy_of(name), num_blocks=12)
    prompts = {k: [j + 3] * 8 for j, k in enumerate("abc")}
    for rid, prompt in prompts.items():
        e.submit(req(rid, prompt, 20))
    e.run_until_idle(10_000)
    tokens, finish = tokens_by_request(e.outputs)
    assert e.scheduler.preemptions_total > 0
    assert tokens == {rid: reference_tokens(p, 20) for rid, p in prompts.items()}
    assert e.scheduler.pool.num_free == e.scheduler.pool.num_blocks


@pytest.mark.parametrize("name", REGISTERED + sorted(BAD))
def test_a_long_prompt_with_a_tiny_budget_finishes_while_short_requests_keep_arriving(name):
    """The long prompt is the oldest request and needs most of the pool; a short request arrives
    every few steps, so blocks run short again and again.  Were the long prompt ever a victim it
    would restart its prefill each time and never finish (both bad policies do that to it on a
    scheduler that takes any victim a policy names)."""
    e = engine(policy_of(name), num_blocks=32, max_num_seqs=4, step_tokens=8, prefill_chunk=4)
    long_prompt = [3] * 100
    e.submit(req("long", long_prompt, 4))
    steps = arrived = 0
    while "long" not in tokens_by_request(e.outputs)[1]:
        if steps % 4 == 0:
            e.submit(req(f"s{arrived}", [arrived % 7 + 5] * 8, 30))
            arrived += 1
        e.step()
        steps += 1
        assert steps < 2_000, f"the long prompt did not finish ({e.scheduler.preemptions_total} preemptions)"
    e.run_until_idle(100_000)
    tokens, finish = tokens_by_request(e.outputs)
    assert e.scheduler.preemptions_total > 0  # the pool really ran short
    assert tokens["long"] == reference_tokens(long_prompt, 4)
    assert len(finish) == arrived + 1
    for i in range(arrived):
        assert tokens[f"s{i}"] == reference_tokens([i % 7 + 5] * 8, 30)
