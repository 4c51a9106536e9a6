"""Engine mechanics on the toy model: batching, chunking, prefix reuse, preemption, progress."""

from __future__ import annotations

import time

import pytest

from ds4d.engine.offline import OfflineEngine
from ds4d.engine.request import EngineRequest, FinishReason, SamplingParams
from tests.toy_model import ToyModel, reference_tokens

GREEDY = dict(temperature=0.0, ignore_eos=True)


def make_engine(num_blocks=64, block_size=4, max_num_seqs=8, step_tokens=64, prefill_chunk=16, prefix=True,
                lookahead=False, policy=None):
    model = ToyModel(block_size)
    engine = OfflineEngine(model, max_num_seqs=max_num_seqs, num_blocks=num_blocks, step_tokens=step_tokens,
                           prefill_chunk=prefill_chunk, prefix_caching=prefix, policy=policy, namespace=b"toy",
                           eos_token_ids=frozenset({0}), lookahead=lookahead)
    return engine, engine.outputs, model


def run(engine, outputs, requests, max_steps=10_000):
    for r in requests:
        engine.submit(r)
    steps = engine.run_until_idle(max_steps)
    tokens = {}
    finish = {}
    for o in outputs:
        tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        if o.finish_reason:
            finish[o.request_id] = o.finish_reason
    return tokens, finish, steps


def req(rid, prompt, n, **kw):
    return EngineRequest(rid, tuple(prompt), SamplingParams(max_tokens=n, **{**GREEDY, **kw}))


def test_single_request_matches_reference():
    engine, outputs, _ = make_engine()
    prompt = list(range(1, 30))
    tokens, finish, _ = run(engine, outputs, [req("a", prompt, 10)])
    assert tokens["a"] == reference_tokens(prompt, 10)
    assert finish["a"] is FinishReason.LENGTH


def test_a_prompt_longer_than_the_whole_pool_is_refused_at_submit():
    """It could never be scheduled (the engine would wait for room forever); a prompt that fits the pool
    is taken and runs."""
    engine, outputs, _ = make_engine(num_blocks=8, block_size=4, max_num_seqs=1)
    with pytest.raises(ValueError, match="33 tokens can never fit the KV pool .32 tokens"):
        engine.submit(req("long", list(range(1, 34)), 1))
    assert not engine.has_work
    tokens, finish, _ = run(engine, outputs, [req("fits", list(range(1, 32)), 1)])
    assert tokens["fits"] == reference_tokens(list(range(1, 32)), 1) and finish["fits"] is FinishReason.LENGTH


@pytest.mark.parametrize("chunk", [1, 3, 4, 16, 1000])
def test_chunk_size_does_not_change_output(chunk):
    engine, outputs, _ = make_engine(prefill_chunk=chunk)
    prompt = [5, 9, 2, 7] * 9
    tokens, _, _ = run(engine, outputs, [req("a", prompt, 6)])
    assert tokens["a"] == reference_tokens(prompt, 6)


def test_batch_equals_solo_and_all_finish():
    engine, outputs, _ = make_engine()
    prompts = {f"r{i}": [i + 1] * (3 + 5 * i) for i in range(6)}
    tokens, finish, _ = run(engine, outputs, [req(k, p, 8) for k, p in prompts.items()])
    for k, p in prompts.items():
        assert tokens[k] == reference_tokens(p, 8)
        assert finish[k] is FinishReason.LENGTH
    assert engine.scheduler.pool.num_free == engine.scheduler.pool.num_blocks


def test_prefix_reuse_is_counted_and_exact():
    engine, outputs, model = make_engine()
    prompt = list(range(1, 23))  # 5 full blocks of 4 + 2
    run(engine, outputs, [req("a", prompt, 3)])
    outputs.clear()
    tokens, _, _ = run(engine, outputs, [req("b", prompt, 3)])
    assert tokens["b"] == reference_tokens(prompt, 3)
    cached = max(o.cached_tokens for o in outputs)
    assert cached == 20
    first_b = model.forward_calls[-3].chunks[0]
    assert first_b.start_pos == 20 and len(first_b.token_ids) == 2


def test_cache_salt_isolates_prefixes():
    engine, outputs, _ = make_engine()
    prompt = list(range(1, 23))
    run(engine, outputs, [EngineRequest("a", tuple(prompt), SamplingParams(max_tokens=2, **GREEDY), cache_salt="x")])
    outputs.clear()
    run(engine, outputs, [EngineRequest("b", tuple(prompt), SamplingParams(max_tokens=2, **GREEDY), cache_salt="y")])
    assert max(o.cached_tokens for o in outputs) == 0


def test_full_prompt_hit_still_computes_last_token():
    engine, outputs, _ = make_engine()
    prompt = list(range(1, 17))  # exactly 4 blocks
    run(engine, outputs, [req("a", prompt, 2)])
    outputs.clear()
    tokens, _, _ = run(engine, outputs, [req("b", prompt, 2)])
    assert tokens["b"] == reference_tokens(prompt, 2)
    assert max(o.cached_tokens for o in outputs) == 12


def test_preemption_under_memory_pressure_keeps_outputs_exact():
    # 12 blocks of 4 = 48 tokens; three requests that each end at 8 + 20 = 28 tokens cannot all fit
    engine, outputs, _ = make_engine(num_blocks=12, prefix=False)
    prompts = {k: [j + 3] * 8 for j, k in enumerate("abc")}
    tokens, finish, _ = run(engine, outputs, [req(k, p, 20) for k, p in prompts.items()])
    assert engine.scheduler.preemptions_total > 0
    for k, p in prompts.items():
        assert tokens[k] == reference_tokens(p, 20), k
        assert finish[k] is FinishReason.LENGTH


def test_long_prompt_with_tiny_budget_finishes():
    engine, outputs, _ = make_engine(step_tokens=8, prefill_chunk=2, max_num_seqs=4)
    prompt = [3] * 200
    other = [req(f"o{i}", [i + 1] * 5, 30) for i in range(3)]
    tokens, finish, steps = run(engine, outputs, [req("long", prompt, 4), *other])
    assert tokens["long"] == reference_tokens(prompt, 4)
    assert len(finish) == 4


def test_eos_and_stop_token_ids_finish():
    engine, outputs, _ = make_engine()
    prompt = [1, 2, 3]
    first = reference_tokens(prompt, 1)[0]
    r = EngineRequest("a", tuple(prompt), SamplingParams(max_tokens=50, temperature=0.0,
                                                         stop_token_ids=frozenset({first})))
    tokens, finish, _ = run(engine, outputs, [r])
    assert tokens["a"] == [first] and finish["a"] is FinishReason.STOP


def test_prompt_logprobs_one_entry_per_prompt_token_across_chunks():
    engine, outputs, _ = make_engine(prefill_chunk=5)
    prompt = list(range(1, 18))
    r = EngineRequest("a", tuple(prompt), SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2))
    run(engine, outputs, [r])
    entries = [e for o in outputs for e in o.prompt_logprobs]
    assert len(entries) == len(prompt)
    assert entries[0] is None
    assert [e.token_id for e in entries[1:]] == prompt[1:]
    assert all(len(e.top) == 2 for e in entries[1:])


def test_abort_frees_blocks():
    engine, outputs, _ = make_engine()
    engine.submit(req("a", [1] * 30, 1000))
    for _ in range(5):
        engine.step()
    assert engine.scheduler.pool.num_used > 0
    engine.abort("a")
    assert not engine.scheduler.has_work
    assert engine.scheduler.pool.num_used == 0


def test_seeded_sampling_is_reproducible_and_batch_independent():
    def sample(extra):
        engine, outputs, _ = make_engine()
        r = EngineRequest("s", (1, 2, 3), SamplingParams(max_tokens=12, temperature=1.5, seed=7, ignore_eos=True))
        tokens, _, _ = run(engine, outputs, [r, *extra])
        return tokens["s"]

    assert sample([]) == sample([req("x", [4, 5], 12)])


class ExplodingModel(ToyModel):
    def forward(self, batch):
        raise RuntimeError("device lost")


def test_engine_death_fails_requests_and_reports_reason():
    engine, outputs, _ = make_engine()
    model = ExplodingModel()
    model.allocate_cache(64, 8)
    engine.runner.model = model
    core = engine.core  # the engine thread, as the daemon runs it
    core.start()
    core.submit(req("a", [1, 2, 3], 5))
    deadline = time.monotonic() + 10
    while not any(o.request_id == "a" for o in outputs):  # published by the engine thread as it dies
        assert time.monotonic() < deadline, "the engine thread neither died nor answered"
        time.sleep(0.01)
    assert not core.alive
    assert "device lost" in core.dead_reason
    assert [o.finish_reason for o in outputs if o.request_id == "a"] == [FinishReason.ERROR]
    assert "device lost" in outputs[-1].error


class OnlyToken:
    """Allows one token id, then anything."""

    def __init__(self, token_id):
        self.token_id = token_id
        self.accepted = []

    def allowed_mask(self, vocab_size):
        import torch

        if self.accepted:
            return None
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        mask[self.token_id] = True
        return mask

    def accept(self, token_id):
        self.accepted.append(token_id)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_token_constraint_is_applied_then_released(temperature):
    engine, outputs, _ = make_engine()
    constraint = OnlyToken(42)
    prompt = [1, 2, 3]
    r = EngineRequest("c", tuple(prompt), SamplingParams(max_tokens=3, temperature=temperature, ignore_eos=True,
                                                         constraint=constraint, seed=3))
    tokens, _, _ = run(engine, outputs, [r])
    assert tokens["c"][0] == 42
    assert constraint.accepted == tokens["c"]
    if temperature == 0.0:
        assert tokens["c"][1:] == reference_tokens(prompt + [42], 2)


def lookahead_engine(**kw):
    return make_engine(lookahead=True, **kw)


def test_lookahead_gives_the_same_tokens_and_overlaps_decode_steps():
    """Decode steps queued behind their predecessor, fed its tokens on the device: the same tokens
    as step by step, whatever ends where (length, stop token mid-stream), with requests arriving
    while others decode and seeded sampling."""
    prompts = {k: [j + 3] * (5 + 3 * j) for j, k in enumerate("abcde")}
    stop_at = reference_tokens(prompts["c"], 7)[-1]

    def requests():
        out = [req(k, p, 9 + 2 * j) for j, (k, p) in enumerate(prompts.items()) if k not in "cd"]
        out.append(EngineRequest("c", tuple(prompts["c"]), SamplingParams(max_tokens=40, temperature=0.0,
                                                                            stop_token_ids=frozenset({stop_at}))))
        out.append(EngineRequest("d", tuple(prompts["d"]), SamplingParams(max_tokens=15, temperature=1.3, seed=5,
                                                                            ignore_eos=True)))
        return out

    def serve(engine, outputs):
        first, *rest = requests()
        engine.submit(first)
        for _ in range(6):  # the first request decodes alone for a while, then the others arrive
            engine.step()
        return run(engine, outputs, rest)

    want, want_finish, _ = serve(*make_engine()[:2])
    engine, outputs, _ = lookahead_engine()
    got, got_finish, _ = serve(engine, outputs)
    assert engine.steps_ahead > 10
    assert got == want and got_finish == want_finish
    assert got["c"][-1] == stop_at and len(got["c"]) == 7 and got_finish["c"] is FinishReason.STOP
    assert engine.scheduler.pool.num_used == 0 and not engine.scheduler.running


def test_lookahead_under_memory_pressure_and_aborts():
    engine, outputs, _ = lookahead_engine(num_blocks=12, prefix=False)
    prompts = {k: [j + 3] * 8 for j, k in enumerate("abc")}
    tokens, finish, _ = run(engine, outputs, [req(k, p, 20) for k, p in prompts.items()])
    for k, p in prompts.items():
        assert tokens[k] == reference_tokens(p, 20), k
    assert engine.steps_ahead > 0
    # an abort between two steps, while a step is queued ahead: blocks come back, nothing else moves
    engine, outputs, _ = lookahead_engine()
    engine.submit(req("a", [1] * 30, 1000))
    engine.submit(req("b", [2] * 9, 12))
    for _ in range(8):
        engine.step()
    assert engine.core.step_queued_ahead
    engine.abort("a")
    tokens, finish, _ = run(engine, outputs, [])
    assert tokens["b"] == reference_tokens([2] * 9, 12) and "a" not in finish
    assert engine.scheduler.pool.num_used == 0


def test_lookahead_stays_off_where_the_host_must_see_each_token():
    """Logprobs, constraints and models that cannot be fed device tokens decode step by step."""
    engine, outputs, _ = lookahead_engine()
    run(engine, outputs, [req("a", [1, 2, 3], 12, logprobs=2)])
    assert engine.steps_ahead == 0
    model = ToyModel(4)
    model.accepts_input_tokens = False
    assert not OfflineEngine(model, max_num_seqs=1, num_blocks=8, prefill_chunk=4, lookahead=True).lookahead


def test_tokens_between_is_a_slice_of_all_tokens():
    from ds4d.engine.request import Sequence

    seq = Sequence(req("a", [5, 6, 7, 8], 10))
    seq.output_ids = [9, 10, 11]
    whole = seq.all_token_ids
    for start in range(len(whole) + 1):
        for end in range(start, len(whole) + 1):
            assert seq.tokens_between(start, end) == whole[start:end], (start, end)


def test_block_key_chain_grows_as_hashing_from_the_start_would():
    from ds4d.cache.blocks import block_keys
    from ds4d.engine.request import Sequence

    engine, _, _ = make_engine()
    sched = engine.scheduler
    seq = Sequence(EngineRequest("a", tuple(range(1, 11)), SamplingParams(max_tokens=50), cache_salt="s"))
    for blocks, more in ((1, [20, 21]), (3, [22, 23, 24, 25, 26]), (4, []), (2, [])):
        seq.output_ids += more
        whole = block_keys(seq.all_token_ids[: blocks * 4], 4, b"toy" + b"s")  # the namespace, then the salt
        assert sched.full_block_keys(seq, blocks) == whole
    assert len(seq.block_key_chain) == 4  # hashed once each, kept


def test_lookahead_while_requests_wait_for_a_slot():
    """Every state slot taken and more requests queued: the running ones still decode with steps
    queued ahead, and each waiting request is admitted as a slot frees, with the same tokens."""
    prompts = {f"r{j}": [j + 2] * (4 + j) for j in range(6)}
    want, _, _ = run(*make_engine(max_num_seqs=2)[:2], [req(k, p, 8 + k.count("3")) for k, p in prompts.items()])
    engine, outputs, _ = lookahead_engine(max_num_seqs=2)
    got, finish, _ = run(engine, outputs, [req(k, p, 8 + k.count("3")) for k, p in prompts.items()])
    assert got == want and len(finish) == 6 and engine.steps_ahead > 6
    assert all(got[k] == reference_tokens(p, len(got[k])) for k, p in prompts.items())
