"""The warm-up before serving (``ds4d.engine.warmup``): what it runs, and that it leaves nothing behind.

On the CPU the decode graphs are the padded decode step run eagerly (``decode_graphs = padded``: the
same buckets, ``EagerBuckets`` records which ran), so the tests see every bucket prepared.  A model
warmed up must then give a real engine exactly the tokens an untouched model gives, prefix reuse
included: the warm-up's blocks, checkpoints and state slots are not the real engine's.
"""

from __future__ import annotations

import pytest
import torch

from ds4d.cache.blocks import BlockPool
from ds4d.cache.manager import PrefixCache
from ds4d.cuda.graphs import EagerBuckets, decode_buckets
from ds4d.engine.offline import OfflineEngine, default_policy
from ds4d.cuda.rows import row_class, row_classes_up_to
from ds4d.engine.warmup import RESUMED_NEW_TOKENS, SALT, fresh_lengths, warm_up, warmup_waves
from ds4d.models.deepseek_v4.paths import ForwardPaths
from ds4d.models.deepseek_v41.family import load_model
from ds4d.models.deepseek_v41.paths import ForwardPaths as V41Paths
from tests.unit.test_dsv4_model import _tokens, checkpoint, model  # noqa: F401 - fixtures
from tests.unit.test_dsv41_serving import BLOCK, checkpoint_dir
from tests.unit.test_engine import req, run

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("max_context,pool_tokens,chunk,seqs", [(4096, 16384, 512, 4), (256, 512, 64, 3), (48, 64, 16, 1)])
def test_the_waves_fit_and_meet_each_path(max_context, pool_tokens, chunk, seqs):
    waves = warmup_waves(1000, prefill_chunk=chunk, max_context=max_context, max_num_seqs=seqs,
                         pool_tokens=pool_tokens, step_tokens=2 * chunk)
    requests = [r for wave in waves for r in wave]
    assert all(r.cache_salt == SALT for r in requests)
    assert len({r.request_id for r in requests}) == len(requests)
    for wave in waves:
        assert all(len(r.prompt_ids) + r.params.max_tokens <= max_context for r in wave)
        assert sum(len(r.prompt_ids) + r.params.max_tokens for r in wave) <= pool_tokens
        assert len(wave) <= seqs
    long = waves[0][0].prompt_ids
    budget = min(max_context, pool_tokens // 2)
    assert len(long) == max(min(2 * chunk + 809, budget // 2), 1)
    fresh = sorted(len(r.prompt_ids) for w in waves[1:] for r in w if len(w) == 1 and r.params.max_tokens == 2
                   and r.prompt_ids[:len(long)] != long)
    assert fresh == [n for n in fresh_lengths(chunk) if n + 2 <= budget] and fresh[0] == 1
    assert all(row_class(n) == n for n in fresh[1:]) and (budget < chunk + 2 or fresh[-1] == chunk)
    # steps of the row classes past one chunk: several prompts whose first chunks fill one step
    filled = sorted(sum(len(r.prompt_ids) for r in w) for w in waves[1:] if len(w) > 1
                    and all(r.params.max_tokens == 2 for r in w))
    wanted = [n for n in row_classes_up_to(2 * chunk) if chunk < n <= 2 * chunk and n + 4 <= budget and seqs >= 2]
    assert filled == wanted
    resumed = [r for r in requests[1:] if r.prompt_ids[:len(long)] == long and len(r.prompt_ids) > len(long)]
    assert [len(r.prompt_ids) - len(long) for r in resumed] == [
        n for n in RESUMED_NEW_TOKENS if len(long) + n + 2 <= budget]
    assert 1 in RESUMED_NEW_TOKENS and len(resumed) >= 1  # a one-token step after a prefix hit, at least
    if len(long) > chunk and seqs > 1:
        assert len(waves[0]) == 2  # the long prompt's second chunk beside a decoding row
    params = [r.params for r in requests]
    assert any(p.temperature > 0 and p.top_p < 1 and p.top_k and p.seed is not None for p in params)
    assert any(p.logprobs and p.prompt_logprobs for p in params)
    assert any(p.constraint is not None for p in params)
    batches = [len(w) for w in waves[1:] if all(r.params.max_tokens == 6 for r in w)]
    assert batches == sorted({min(2 ** n, seqs) for n in range(1, seqs.bit_length() + 1)} - {1})


def _engine(model, seqs, chunk, blocks):
    """An engine whose prefix cache copies the stateful model's blocks (so turns reuse each other)."""
    info = model.info
    cache = PrefixCache(BlockPool(blocks, info.block_size_tokens), model=model, block_bytes=info.cache_bytes_per_block)
    return OfflineEngine(model, max_num_seqs=seqs, prefill_chunk=chunk, cache=cache)


def _turns(engine, prompt, follow):
    """Greedy tokens of ``prompt``, then of ``prompt + its output + follow``, and the prompt tokens the
    second reused."""
    first = run(engine, engine.outputs, [req("a", prompt, 6, ignore_eos=True)])[0]["a"]
    second = run(engine, engine.outputs, [req("b", prompt + first + follow, 6, ignore_eos=True)])[0]["b"]
    cached = max(o.cached_tokens for o in engine.outputs if o.request_id == "b")
    return first, second, cached


def test_a_warmed_v4_gives_the_same_tokens_and_prepared_every_bucket(model):  # noqa: F811
    padded = model.with_paths(ForwardPaths(fast_path=True, decode_graphs="padded"))
    prompt, follow = _tokens(model, 90, 1), _tokens(model, 20, 2)
    blocks, seqs, context = 40, 3, 512
    cold = _engine(padded, seqs, 64, blocks)
    expected = _turns(cold, prompt, follow)
    assert expected[2] > 0  # the second turn reuses the first

    warmed = model.with_paths(ForwardPaths(fast_path=True, decode_graphs="padded"))
    warmed.allocate_cache(blocks, seqs)
    report = warm_up(warmed, default_policy(), num_blocks=blocks, max_num_seqs=seqs, step_tokens=256,
                     prefill_chunk=64, max_context=context, lookahead=True)
    buckets = decode_buckets(seqs, -(-context // model.info.block_size_tokens))
    assert report.decode_buckets == len(buckets) and warmed._graphs.keys == set(buckets)
    assert report.requests == sum(len(w) for w in warmup_waves(
        model.info.vocab_size, prefill_chunk=64, max_context=context, max_num_seqs=seqs,
        pool_tokens=blocks * model.info.block_size_tokens, step_tokens=256))
    assert report.reused_tokens > 0 and report.prompt_tokens > 0 and report.seconds > 0
    engine = _engine(warmed, seqs, 64, blocks)
    assert _turns(engine, prompt, follow) == expected


def test_a_warmed_v41_gives_the_same_tokens(tmp_path):
    path = checkpoint_dir("tiny_b", tmp_path / "tiny_b")
    blocks, seqs, context = 48, 2, 256

    def fresh():
        return load_model(path, block_tokens=BLOCK, paths=V41Paths(decode_graphs="padded"))

    prompt, follow = list(range(5, 75)), list(range(200, 230))
    expected = _turns(_engine(fresh(), seqs, 32, blocks), prompt, follow)
    assert expected[2] > 0
    warmed = fresh()
    warmed.allocate_cache(blocks, seqs)
    report = warm_up(warmed, default_policy(), num_blocks=blocks, max_num_seqs=seqs, step_tokens=128,
                     prefill_chunk=32, max_context=context, lookahead=False)
    buckets = decode_buckets(seqs, -(-context // BLOCK))
    assert report.decode_buckets == len(buckets) and warmed.graphs.keys == set(buckets)
    assert report.reused_tokens > 0
    assert _turns(_engine(warmed, seqs, 32, blocks),
                  prompt, follow) == expected


def _run_out_of_memory_from(graphs, width: int):
    """``graphs.run`` that runs out of device memory for buckets of ``width`` blocks or more."""
    run = graphs.run

    def limited(key, *inputs):
        if key[1] >= width:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return run(key, *inputs)

    graphs.run = limited


def test_a_bucket_that_does_not_fit_ends_the_warmup_of_larger_ones_only(model, tmp_path):  # noqa: F811
    """A decode bucket whose capture runs out of memory during the warm-up leaves the graphs on (it and
    the larger ones are captured when first needed), where a failed capture while serving turns them off."""
    v4 = model.with_paths(ForwardPaths(fast_path=True, decode_graphs="padded"))
    v4.allocate_cache(40, 3)
    _run_out_of_memory_from(v4._graphs, 16)
    assert v4.warm_decode(3, 40) == len(decode_buckets(3, 8))
    assert v4.graph_failure is None

    v41 = load_model(checkpoint_dir("tiny_b", tmp_path / "tiny_b"), block_tokens=BLOCK,
                     paths=V41Paths(decode_graphs="cuda"))
    v41.allocate_cache(48, 2)
    v41.graphs = EagerBuckets(v41.fixed.step)  # the CUDA path's bookkeeping, the step run eagerly
    v41._capturable = lambda rows: True
    _run_out_of_memory_from(v41.graphs, 16)
    assert v41.warm_decode(2, 48) == len(decode_buckets(2, 8)) and v41.graph_failure is None
