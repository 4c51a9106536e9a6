"""The GPU paths' arithmetic, checked on the CPU: fast path against the reference path.

``ForwardPaths.fast_path`` (grouped experts, batched decode attention) is plain torch, so it
runs on the CPU too (the grouped matmul falls back to a batched product over
per-row weights).  Here it must reproduce the reference path's logits in float32
while sequences mix prefill chunks and batched decode steps, padding rows
included; the same comparison runs on CUDA when a GPU is present.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from ds4d.contracts import ForwardBatch, SeqChunk
from ds4d.models.deepseek_v4 import load_model, write_tiny_checkpoint
from ds4d.models.deepseek_v4.paths import ForwardPaths

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


pytestmark = pytest.mark.usefixtures("one_torch_thread")



@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("fast"), seed=5, layers=[0, 4, 128, 4])


@pytest.mark.parametrize("device", DEVICES)
def test_decode_path_matches_reference(checkpoint, device):
    model = load_model(checkpoint, device=device)
    if device == "cpu":
        model = model.with_paths(ForwardPaths(fast_path=True))
    rng = random.Random(1)
    ids = [rng.randrange(1000, 50000) for _ in range(300)]
    other = [rng.randrange(1000, 50000) for _ in range(200)]
    reference = model.with_paths(ForwardPaths()).logits_for(ids)  # the reference path on this device

    model.allocate_cache(16, 3)  # the device's own paths (on the CPU: fast_path alone)
    got = [model.forward(ForwardBatch((SeqChunk(0, tuple(ids[:140]), 0, (3, 7), 140),)))]
    model.forward(ForwardBatch((SeqChunk(1, tuple(other[:5]), 0, (9,), 1),)))
    for pos in range(140, 300):
        mine = (3, 7, 11)[: -(-(pos + 1) // 128)]
        theirs_pos = 5 + pos - 140
        theirs = (9, 12)[: -(-(theirs_pos + 1) // 128)]
        logits = model.forward(
            ForwardBatch((SeqChunk(0, (ids[pos],), pos, mine, 1), SeqChunk(1, (other[theirs_pos],), theirs_pos, theirs, 1)))
        )
        got.append(logits[:1])
    got = torch.cat(got)
    assert (got - reference).abs().max().item() < 2e-4
    assert torch.equal(got.argmax(-1), reference.argmax(-1))


KERNEL_CASES = ([("cpu", torch.float32, "off"), ("cpu", torch.float32, "padded")]
                * (os.environ.get("TRITON_INTERPRET") == "1")
                + [("cuda", dtype, graphs) for dtype in (torch.float32, torch.bfloat16)
                   for graphs in ("off", "padded", "compiled")] * torch.cuda.is_available())
"""The CPU only in Triton's interpreter: without it a kernel handed CPU tensors may still run on a GPU that
reads host memory, unordered with the CPU's work.  ``compiled``: CUDA graphs of steps through ``torch.compile``,
which hands the kernels their arguments its own way (a Python float as float64)."""


def _decode_logits(model, paths: ForwardPaths) -> torch.Tensor:
    """Float32 CPU logits of a prompt step and 60 two-row decode steps: one row from position 100 past the
    window's wrap and the HCA layer's first entry (128), the other from position 5 (a ring not yet full, few
    entries), the CSA layers' indexer picks (the block table holds more entries than it keeps)."""
    rng = random.Random(2)
    ids = [rng.randrange(1000, 50000) for _ in range(160)]
    other = [rng.randrange(1000, 50000) for _ in range(65)]
    run = model.with_paths(paths)
    run.allocate_cache(16, 3)
    got = [run.forward(ForwardBatch((SeqChunk(0, tuple(ids[:100]), 0, (3,), 1),)))]
    run.forward(ForwardBatch((SeqChunk(1, tuple(other[:5]), 0, (9,), 1),)))
    for pos in range(100, 160):
        batch = (SeqChunk(0, (ids[pos],), pos, (3, 7)[: -(-(pos + 1) // 128)], 1),
                 SeqChunk(1, (other[pos - 95],), pos - 95, (9,), 1))
        got.append(run.forward(ForwardBatch(batch)))
    return torch.cat(got).float().cpu()


@pytest.mark.parametrize(("device", "dtype", "graphs"), KERNEL_CASES)
def test_decode_attention_in_one_kernel_matches_the_torch_decode_path(checkpoint, device, dtype, graphs):
    """``decode_kernel``: a decode step's compressor steps and attention in ``decode_triton``'s kernels (Triton's
    interpreter on the CPU) give the torch decode path's logits, with padded rows too (``padded``: the buckets
    the CUDA graphs replay; ``compiled``: those graphs captured, through ``torch.compile``).  In float32 within
    1e-4 of the largest logit, the same greedy tokens.  In bfloat16 (CUDA) the torch path rounds its scores to
    bfloat16 and the kernel keeps them in float32, so each is compared with the float32 torch path
    (:func:`_assert_decodes_as_the_torch_path`)."""
    model = load_model(checkpoint, dtype=dtype, device=device)
    assert model.cfg.index_topk < 100 // 4 and model.cfg.sliding_window == 128
    _assert_decodes_as_the_torch_path(checkpoint, model, _base_paths(graphs), {"decode_kernel": True})


def _base_paths(graphs: str) -> ForwardPaths:
    return (ForwardPaths(fast_path=True, decode_graphs="cuda", compile_decode=True, graph_fallback=False)
            if graphs == "compiled" else ForwardPaths(fast_path=True, decode_graphs=graphs))


def _assert_decodes_as_the_torch_path(checkpoint, model, base: ForwardPaths, change: dict) -> None:
    """``base.replace(**change)`` against ``base`` on :func:`_decode_logits`: in float32 within 1e-4 of the
    largest logit and the same greedy tokens; in bfloat16 each against the float32 fast path, the changed
    path's largest and mean differences each at most 1.5x ``base``'s.

    Greedy tokens are not compared in bfloat16: in this random tiny model 88 of the 121 rows have their two
    largest float32 logits less than 0.25 apart (46 less than 0.1; float32 on the CPU), while either bfloat16
    path is up to about 2 off, so which rows keep their greedy token is chance (on an H100 the torch path kept
    118 and the decode kernels 111, the kernels' largest difference the smaller, 1.66 against 2.06).  Where the
    rounding falls moves the mean difference by more than a quarter between paths that are both right: on an
    H100 torch's operators gave 0.0120 eagerly and 0.0194 through ``torch.compile``, the decode kernels 0.0168
    and 0.0129.  The float32 cases are what bound the arithmetic (1e-4 of the largest logit)."""
    torch_path = _decode_logits(model, base)
    changed = _decode_logits(model, base.replace(**change))
    if model.dtype == torch.float32:
        assert (changed - torch_path).abs().max().item() < 1e-4 * torch_path.abs().max().item()
        assert torch.equal(changed.argmax(-1), torch_path.argmax(-1))
        return
    exact = _decode_logits(load_model(checkpoint, dtype=torch.float32, device=model.device),
                           ForwardPaths(fast_path=True))
    largest = {name: (got - exact).abs().max().item() for name, got in (("torch", torch_path), ("changed", changed))}
    mean = {name: (got - exact).abs().mean().item() for name, got in (("torch", torch_path), ("changed", changed))}
    assert largest["changed"] <= 1.5 * largest["torch"], (largest, mean)
    assert mean["changed"] <= 1.5 * mean["torch"], (largest, mean)


@pytest.mark.parametrize(("device", "dtype", "graphs"), KERNEL_CASES)
def test_the_shared_expert_on_a_second_stream_decodes_as_on_one(checkpoint, device, dtype, graphs):
    """``shared_beside``: a decode step's shared expert on a second CUDA stream (``ds4d.cuda.streams``; in the
    graphs a branch of its own), its SwiGLU in Triton, gives the one-stream path's logits (on the CPU the
    stream calls are plain calls: the SwiGLU kernel in Triton's interpreter is what differs)."""
    model = load_model(checkpoint, dtype=dtype, device=device)
    _assert_decodes_as_the_torch_path(checkpoint, model, _base_paths(graphs), {"shared_beside": True})


@pytest.mark.parametrize(("device", "dtype", "graphs"), KERNEL_CASES)
def test_routing_in_one_kernel_decodes_as_the_torch_routing(checkpoint, device, dtype, graphs):
    """``route_kernel``: a decode step's routing after the router's logits in one launch (``route_triton``) gives
    the torch path's logits: two hash-routed layers (the table's experts) and two score-routed (the pick by score
    plus bias), the picked experts in the order picked, which ``torch.topk(sorted=False)`` does not promise."""
    model = load_model(checkpoint, dtype=dtype, device=device)
    assert model.cfg.num_hash_layers == 2 and model.cfg.num_hidden_layers == 4
    _assert_decodes_as_the_torch_path(checkpoint, model, _base_paths(graphs), {"route_kernel": True})


def test_grouped_experts_match_the_expert_loop(checkpoint):
    from ds4d.models.deepseek_v4.moe import moe_forward

    model = load_model(checkpoint)
    layer = model.weights.layers[3].ffn  # score-routed, MXFP4 experts
    x = torch.randn(37, model.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    token_ids = torch.randint(0, 1000, (37,))
    loop = moe_forward(x, token_ids, layer, model.cfg, grouped=False)
    grouped = moe_forward(x, token_ids, layer, model.cfg, grouped=True)
    assert (loop - grouped).abs().max().item() < 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens", [1, 5, 37])
def test_row_by_row_experts_equal_the_sorted_route(checkpoint, tokens, device, monkeypatch):
    """Where each (token, expert) row is its own product, the rows are not sorted by expert; the
    result is the sorted route's bit for bit (per-row products, the same sum over the slots).  On
    CUDA in bf16 that is the MXFP4 GEMV, on the CPU the batched product."""
    from ds4d.models.deepseek_v4 import moe

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = load_model(checkpoint, dtype=dtype, device=device)
    layer = model.weights.layers[3].ffn
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, model.cfg.hidden_size, generator=gen).to(device=device, dtype=dtype)
    token_ids = torch.randint(0, 1000, (tokens,), generator=gen).to(device)
    calls = []
    real = moe._row_by_row
    monkeypatch.setattr(moe, "_row_by_row", lambda *a: calls.append(real(*a)) or calls[-1])
    direct = moe.moe_forward(x, token_ids, layer, model.cfg, grouped=True)
    monkeypatch.setattr(moe, "_row_by_row", lambda *a: False)
    grouped = moe.moe_forward(x, token_ids, layer, model.cfg, grouped=True)
    assert calls == [True] and torch.equal(direct, grouped)


@pytest.mark.parametrize("window", [128, 8])
def test_block_local_prefill_matches_dense(tmp_path, window):
    path = write_tiny_checkpoint(tmp_path, seed=3, layers=[0, 4, 128], sliding_window=window, index_topk=3)
    model = load_model(path)
    rng = random.Random(window)
    ids = [rng.randrange(1000, 50000) for _ in range(333)]
    dense = model.logits_for(ids)
    local = model.with_paths(ForwardPaths(fast_path=True)).logits_for(ids)
    assert (local - dense).abs().max().item() < 2e-4
    assert torch.equal(local.argmax(-1), dense.argmax(-1))


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_through_the_attention_kernel_matches_dense(tmp_path, device):
    """Chunks longer than the window through the Triton attention kernel (on the CPU: its interpreter),
    a prompt in three chunks (held window keys, compressed entries closed in earlier chunks, the
    indexer's picks), the first step shared with another sequence's prompt: the dense reference's
    logits in float32."""
    from ds4d.cuda import attention_triton

    if not attention_triton.usable(torch.empty(1, 1, 16, device=device)):
        pytest.skip("needs Triton on this device (a GPU, or the interpreter for the CPU)")
    path = write_tiny_checkpoint(tmp_path, seed=3, layers=[0, 4, 128], sliding_window=8, index_topk=3)
    model = load_model(path, device=device)
    rng = random.Random(8)
    ids = [rng.randrange(1000, 50000) for _ in range(300)]
    other = [rng.randrange(1000, 50000) for _ in range(60)]
    dense, dense_other = model.logits_for(ids), model.logits_for(other)
    model = model.with_paths(model.paths.replace(fast_path=True, fused_attention=True))
    calls = []
    real = attention_triton.window_attention
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(attention_triton, "window_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
        model.allocate_cache(8, 2)
        got = []
        for begin, end in ((0, 100), (100, 230), (230, 300)):
            blocks = tuple(range(-(-end // 128)))
            chunks = (SeqChunk(0, tuple(ids[begin:end]), begin, blocks, end - begin),)
            if begin == 0:
                chunks += (SeqChunk(1, tuple(other), 0, (7,), len(other)),)
            logits = model.forward(ForwardBatch(chunks))
            got.append(logits[: end - begin])
            if begin == 0:
                got_other = logits[end - begin :]
    got = torch.cat(got)
    assert len(calls) == 4 * 3  # every chunk, every layer
    assert (got - dense).abs().max().item() < 2e-4
    assert torch.equal(got.argmax(-1), dense.argmax(-1))
    assert (got_other - dense_other).abs().max().item() < 2e-4


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_through_the_token_wise_kernels_matches_dense(tmp_path, device):
    """A prompt in three chunks with the prefill's token-wise Triton kernels (on the CPU: the
    interpreter): logits of every row of the first chunk, none of the second (its last layer stops
    after attention), five of the third (the last feed-forward runs on those rows alone); the dense
    reference's logits in float32."""
    from ds4d.cuda import hc_triton, prefill_triton

    if not (prefill_triton.usable(torch.empty(1, device=device)) and hc_triton.available()):
        pytest.skip("needs Triton on this device (a GPU, or the interpreter for the CPU)")
    path = write_tiny_checkpoint(tmp_path, seed=3, layers=[0, 4, 128], sliding_window=8, index_topk=3)
    model = load_model(path, device=device)
    rng = random.Random(9)
    ids = [rng.randrange(1000, 50000) for _ in range(300)]
    dense = model.logits_for(ids)
    model = model.with_paths(model.paths.replace(fast_path=True, fused_prefill=True))
    calls = {name: 0 for name in ("hc_update", "head_norm_rope", "swiglu")}
    with pytest.MonkeyPatch.context() as patch:
        for name in calls:
            real = getattr(prefill_triton, name)
            patch.setattr(prefill_triton, name,
                          lambda *a, _real=real, _name=name, **k: calls.__setitem__(_name, calls[_name] + 1) or _real(*a, **k))
        model.allocate_cache(8, 1)
        got = []
        for (begin, end), wanted in zip(((0, 100), (100, 230), (230, 300)), (100, 0, 5)):
            blocks = tuple(range(-(-end // 128)))
            logits = model.forward(ForwardBatch((SeqChunk(0, tuple(ids[begin:end]), begin, blocks, wanted),)))
            assert logits.shape == (wanted, model.info.vocab_size)
            got.append(logits)
    got = torch.cat(got)
    want = torch.cat([dense[:100], dense[295:]])
    assert calls["hc_update"] == 6 + 5 + 6  # two per layer; the second chunk's last layer stops early
    assert calls["head_norm_rope"] == 2 * 3 * 3 + 3 * 3  # queries and keys, output; 3 layers, 3 chunks
    assert calls["swiglu"] >= 3 + 2 + 3  # the shared expert's of each feed-forward (and where experts are grouped, theirs)
    assert (got - want).abs().max().item() < 2e-4
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("fast", [False, True])
def test_chunks_without_logits_still_write_the_cache(checkpoint, fast):
    """The engine asks for no logits on a prompt's inner chunks; their KV and state must still be written."""
    model = load_model(checkpoint, paths=ForwardPaths(fast_path=fast))
    rng = random.Random(4)
    ids = [rng.randrange(1000, 50000) for _ in range(300)]
    whole = model.logits_for(ids)
    model.allocate_cache(8, 1)
    for begin in range(0, 256, 128):
        blocks = tuple(range(-(-(begin + 128) // 128)))
        empty = model.forward(ForwardBatch((SeqChunk(0, tuple(ids[begin : begin + 128]), begin, blocks, 0),)))
        assert empty.shape == (0, model.info.vocab_size)
    last = model.forward(ForwardBatch((SeqChunk(0, tuple(ids[256:]), 256, (0, 1, 2), 1),)))
    assert (last - whole[-1:]).abs().max().item() < 2e-4
