"""DeepSeek-V4.1 forward paths: the kernel paths compute what the reference path computes.

On the oracle fixtures' tiny models, V4's Triton kernels (here in Triton's CPU
interpreter) and the batched decode of several sequences, against the same
weights on the reference path.  These random models amplify any rounding
difference (tests/unit/test_dsv41_bf16.py says how: a flipped FP8/FP4 code, a
changed top-k pick), so whole prompts through two paths that round differently
do not stay within 1e-5; each piece is compared on the same inputs instead,
and decode steps from the same states (taken from the reference after each
step), which is where a decode step's own error shows.  The serving step runs
the batched decode only, so its prefill chunks are the reference's own.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ds4d.contracts import ForwardBatch, SeqChunk
from ds4d.models.deepseek_v41 import DeepseekV41Model
from ds4d.models.deepseek_v41.paths import ForwardPaths
from ds4d.models.deepseek_v41.serving import DeepseekV41Serving

pytest.importorskip("triton")

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "dsv41"
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


@pytest.fixture(scope="module", params=("tiny_a", "tiny_b"))
def models(request) -> tuple[DeepseekV41Model, DeepseekV41Model]:
    from ds4d.cuda import hc_triton, moe_gemv

    if not (hc_triton.available() and moe_gemv.available()):
        pytest.skip("the Triton kernels cannot run here (no CUDA device, no interpreter)")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: tests/gpu/test_dsv41_gpu.py runs the compiled kernels")
    reference = DeepseekV41Model.from_pretrained(FIXTURES / request.param)
    kernels = DeepseekV41Model(reference.cfg, reference.weights, reference.hasher, paths=ForwardPaths.all_kernels())
    return reference, kernels


def prompt(model: DeepseekV41Model, length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.cfg.vocab_size, (length,), generator=gen).tolist()


def test_the_cpu_keeps_the_reference_path():
    assert ForwardPaths.for_device("cpu") == ForwardPaths()
    model = DeepseekV41Model.from_pretrained(FIXTURES / "tiny_a")
    assert model.paths == ForwardPaths() and model.paths.decode_graphs == "off"
    assert not any(value for name, value in model.paths.as_dict().items() if name != "decode_graphs")


def test_the_hyper_connection_kernels_equal_the_reference(models):
    from ds4d.models.deepseek_v41.hyper import site_weights

    reference, _ = models
    cfg = reference.cfg
    gen = torch.Generator().manual_seed(1)
    for rows in (5, 80):  # the few-rows kernel and, past hc_triton.MAX_TOKENS, the matmul
        streams = torch.randn(rows, cfg.hc_mult, cfg.hidden_size, generator=gen)
        for layer in reference.weights.layers:
            for weights in (layer.hc_attn, layer.hc_ffn):
                want = site_weights(streams, weights, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
                got = site_weights(streams, weights, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps, True)
                for a, b in zip(got, want):
                    assert a.shape == b.shape and (a - b).abs().max() < 1e-6


def test_the_expert_kernel_equals_the_reference(models):
    from ds4d.cuda import moe_gemv
    from ds4d.models.deepseek_v41.moe import moe_forward

    reference, _ = models
    cfg = reference.cfg
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, cfg.hidden_size, generator=gen)
    assert x.shape[0] * cfg.num_experts_per_tok <= moe_gemv.MAX_ROWS
    for layer in reference.weights.layers[:2]:
        want = moe_forward(x, layer.ffn, cfg)
        got = moe_forward(x, layer.ffn, cfg, expert_rows=True)
        assert relative_error(got, want) < 1e-5


def test_grouped_experts_equal_the_reference(models):
    """More (row, expert) pairs than the row kernel takes: sorted by expert, one grouped matmul per
    projection (and the row kernel's path declines them)."""
    from ds4d.cuda import moe_gemv
    from ds4d.models.deepseek_v41.moe import grouped_available, moe_forward

    reference, _ = models
    cfg = reference.cfg
    x = torch.randn(moe_gemv.MAX_ROWS // cfg.num_experts_per_tok + 7, cfg.hidden_size,
                    generator=torch.Generator().manual_seed(3))
    assert grouped_available(x)
    for layer in reference.weights.layers:
        want = moe_forward(x, layer.ffn, cfg)
        assert relative_error(moe_forward(x, layer.ffn, cfg, grouped=True), want) < 1e-5
        assert relative_error(moe_forward(x, layer.ffn, cfg, expert_rows=True, grouped=True), want) < 1e-5
        assert torch.equal(moe_forward(x, layer.ffn, cfg, expert_rows=True), want)  # too many pairs: the loop


@pytest.mark.parametrize("chunk,last_only", [(None, False), (7, False), (None, True)])
def test_the_window_kernel_equals_the_reference_attention(models, monkeypatch, chunk, last_only):
    check_window_kernel(models[0], monkeypatch, chunk, last_only, tolerance=1e-5)


def check_window_kernel(reference: DeepseekV41Model, monkeypatch, chunk: int | None, last_only: bool,
                        tolerance: float) -> None:
    """Every multi-query attention core of a prefill (whole, in chunks after a window history, on the
    triangle's fewer query rows), run again on a copy of its state through V4's Triton kernel: the same
    output within ``tolerance`` (relative to its largest), and the same state afterwards."""
    import copy

    from ds4d.cuda import attention_triton
    from ds4d.models.deepseek_v41 import attention

    core, compared, launched = attention.attention_core, [], []
    kernel = attention_triton.window_attention

    def counted(q, keys, *args, **kwargs):
        launched.append(q.shape[0])
        return kernel(q, keys, *args, **kwargs)

    def both(x, projected, plan, w, cfg, state, shared, rows, window_kernel=False):
        twin, twin_shared = state.clone(), copy.copy(shared)
        want = core(x, projected, plan, w, cfg, state, shared, rows)
        if projected.q.shape[0] > 1:
            got = core(x, projected, plan, w, cfg, twin, twin_shared, rows, window_kernel=True)
            compared.append((plan.layer, projected.q.shape[0]))
            assert got.shape == want.shape and relative_error(got.float(), want.float()) < tolerance, plan.layer
            assert all(torch.equal(a, b) for a, b in zip(twin.windows, state.windows))
            for source, group in state.groups.items():
                assert twin.groups[source].entries.count == group.entries.count
        return want

    ids = prompt(reference, 3 * reference.cfg.sliding_window + 2, seed=4)
    with monkeypatch.context() as patch:
        patch.setattr(attention, "attention_core", both)
        patch.setattr(attention_triton, "window_attention", counted)
        reference.prefill(reference.new_state(), ids, chunk, last_only=last_only)
    layers = {layer for layer, _ in compared}
    assert layers == set(range(reference.cfg.num_hidden_layers)) or last_only and len(layers) > 1
    assert launched == [queries for _, queries in compared]  # every one went through the kernel
    if last_only:  # the layers past the last KV source attend with fewer queries than the step's rows
        assert min(launched) < len(ids)


def test_decode_steps_on_every_path_equal_the_reference(models):
    """Three sequences at different depths (one past two windows, where the top-k selects), decoded
    together from the reference's states, step after step."""
    reference, kernels = models
    prompts = [prompt(reference, n, seed=n) for n in (3, 2 * reference.cfg.sliding_window + 1, 20)]
    states = [reference.new_state() for _ in prompts]
    nxt = [int(reference.prefill(state, ids)[-1].argmax()) for state, ids in zip(states, prompts)]
    for _ in range(2):
        copies = [state.clone() for state in states]
        want = torch.stack([reference.decode(state, token) for state, token in zip(states, nxt)])
        got = kernels.decode_many(copies, nxt)
        assert got.shape == want.shape and relative_error(got, want) < 1e-5
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        for a, b in zip(states, copies):
            assert a.position == b.position and torch.equal(a.engram_ids, b.engram_ids)
            assert max(relative_error(rb, ra) for ra, rb in zip(a.windows, b.windows)) < 1e-5
            for source, group in a.groups.items():
                assert group.entries.count == b.groups[source].entries.count
        nxt = want.argmax(-1).tolist()


def test_decode_many_refuses_a_state_twice(models):
    _, kernels = models
    state = kernels.new_state()
    kernels.prefill(state, [5, 6])
    with pytest.raises(ValueError, match="each state once"):
        kernels.decode_many([state, state], [1, 2])
    with pytest.raises(ValueError, match="one token per state"):
        kernels.decode_many([state], [1, 2])


def test_a_serving_step_of_decodes_and_a_prefill_keeps_chunk_order(models):
    reference, _ = models
    batched = DeepseekV41Model(reference.cfg, reference.weights, reference.hasher,
                               paths=ForwardPaths(batched_decode=True))
    servings = [DeepseekV41Serving(model, tokenizer=None, block_tokens=16) for model in (reference, batched)]
    prompts = [prompt(reference, n, seed=10 + n) for n in (9, 17, 30)]
    late = prompt(reference, 12, seed=99)
    tables = [tuple(range(8 * s, 8 * s + 8)) for s in range(4)]
    outputs = []
    for serving in servings:
        serving.allocate_cache(32, 4)
        firsts = []
        for slot, ids in enumerate(prompts):
            logits = serving.forward(ForwardBatch((SeqChunk(slot, tuple(ids), 0, tables[slot], 1),)))
            firsts.append(int(logits[-1].argmax()))
        chunks = (SeqChunk(0, (firsts[0],), len(prompts[0]), tables[0], 1),
                  SeqChunk(3, tuple(late), 0, tables[3], 2),
                  SeqChunk(1, (firsts[1],), len(prompts[1]), tables[1], 1),
                  SeqChunk(2, (firsts[2],), len(prompts[2]), tables[2], 0))
        outputs.append(serving.forward(ForwardBatch(chunks)))
    want, got = outputs
    assert got.shape == want.shape == (4, reference.cfg.vocab_size)
    assert relative_error(got, want) < 1e-5
