"""The Triton prefill attention kernel (``ds4d.cuda.attention_triton``) against the torch reference.

On the CPU the kernel runs in Triton's interpreter (tests/conftest.py); on a GPU
machine the same checks run on the device, in bf16 too.
"""

from __future__ import annotations

import pytest
import torch

from ds4d.models.deepseek_v4.attention import _attend_local

attention_triton = pytest.importorskip("ds4d.cuda.attention_triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not attention_triton.available(), reason="needs Triton (a GPU or the interpreter)")


def _case(n, heads, d, held, entries, kind, seed, dtype=torch.float32):
    """Queries of a chunk at positions ``held ..``; keys from position 0 (``held`` keys before the
    chunk, then the chunk's own); sinks; compressed entries shared with a causal mask (kind 1) or
    each query's own with some masked (kind 2)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, heads, d, generator=gen)
    keys = torch.randn(held + n, d, generator=gen)
    sink = torch.randn(heads, generator=gen)
    extra = None
    if kind == 1:
        ratio = 4
        ent = torch.randn(entries, d, generator=gen)
        positions = held + torch.arange(n)
        closed = torch.arange(entries)[None, :] < ((positions + 1) // ratio)[:, None]
        extra = (ent, torch.zeros(closed.shape).masked_fill_(~closed, float("-inf")))
    elif kind == 2:
        ent = torch.randn(n, entries, d, generator=gen)
        valid = torch.rand(n, entries, generator=gen) < 0.7
        extra = (ent, torch.zeros(valid.shape).masked_fill_(~valid, float("-inf")))
    extra = None if extra is None else (extra[0].to(DEVICE, dtype), extra[1].to(DEVICE))
    return q.to(DEVICE, dtype), keys.to(DEVICE, dtype), sink.to(DEVICE, dtype), extra


@pytest.mark.parametrize(("n", "heads", "d", "window", "held", "entries", "kind"), [
    (37, 8, 64, 8, 0, 0, 0),      # first chunk of a prompt: window keys only, heads fewer than a block
    (40, 20, 32, 16, 15, 0, 0),   # a later chunk: held keys of the window, heads not a power of two
    (33, 8, 64, 8, 7, 10, 1),     # shared compressed entries with a causal mask (HCA, dense CSA)
    (21, 4, 16, 8, 7, 9, 2),      # each query's own entries (sparse CSA)
])
def test_window_attention_matches_the_reference(n, heads, d, window, held, entries, kind):
    q, keys, sink, extra = _case(n, heads, d, held, entries, kind, seed=n + heads)
    start, first = held, 0
    want = _attend_local(q, keys, first, start, extra, sink, d**-0.5, window)
    got = attention_triton.window_attention(q, keys, first, start, window, sink, d**-0.5, extra)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < 1e-4 * max(1.0, want.abs().max().item())


def test_window_attention_writes_into_a_view_of_the_output():
    q, keys, sink, extra = _case(24, 8, 32, 8, 10, 1, seed=5)
    out = torch.full((30, 8, 32), 7.0, device=DEVICE)
    attention_triton.window_attention(q, keys, 0, 8, 8, sink, 0.2, extra, out=out[3:27])
    want = _attend_local(q, keys, 0, 8, extra, sink, 0.2, 8)
    assert (out[3:27] - want).abs().max().item() < 1e-4 * max(1.0, want.abs().max().item())
    assert bool((out[:3] == 7).all()) and bool((out[27:] == 7).all())


@pytest.mark.skipif(DEVICE != "cuda", reason="bf16 tensor cores: the device")
def test_window_attention_bf16_against_float32():
    q, keys, sink, extra = _case(300, 64, 512, 0, 75, 1, seed=9)
    want = _attend_local(q, keys, 0, 0, extra, sink, 512**-0.5, 128)
    got = attention_triton.window_attention(q.bfloat16(), keys.bfloat16(), 0, 0, 128, sink, 512**-0.5,
                                            (extra[0].bfloat16(), extra[1]))
    assert (got.float() - want).abs().max().item() < 2e-2 * want.abs().max().item()
