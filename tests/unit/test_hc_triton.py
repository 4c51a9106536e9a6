"""The Triton hyper-connection kernels (``ds4d.cuda.hc_triton``) against the torch reference.

On the CPU the kernels run in Triton's interpreter (tests/conftest.py); on a GPU
machine the same checks run on the device.
"""

from __future__ import annotations

import pytest
import torch

from ds4d.models.deepseek_v4.hyper import _mixes, hc_boundary, hc_head, hc_pre
from ds4d.models.deepseek_v4.weights import HyperWeights

hc_triton = pytest.importorskip("ds4d.cuda.hc_triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not hc_triton.available(), reason="needs Triton (a GPU or the interpreter)")


def _case(m: int, tokens: int, d: int, seed: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    streams = (torch.randn(tokens, m, d, generator=gen) * 3).to(dtype)
    weights = HyperWeights(fn=torch.randn((2 + m) * m, m * d, generator=gen) * (m * d) ** -0.5,
                           base=torch.randn((2 + m) * m, generator=gen) * 0.5,
                           scale=1 + 0.2 * torch.randn(3, generator=gen))
    return streams.to(DEVICE), HyperWeights(*(t.to(DEVICE) for t in (weights.fn, weights.base, weights.scale)))


@pytest.mark.parametrize(("m", "tokens", "d", "iters"), [(4, 1, 1024, 20), (4, 20, 96, 20), (2, 5, 3000, 3),
                                                         (8, 3, 64, 7)])
def test_hc_mix_matches_the_reference(m, tokens, d, iters):
    streams, weights = _case(m, tokens, d, seed=m * 100 + tokens)
    collapsed, post, comb = hc_pre(streams, weights, iters, 1e-6, 1e-6)  # the torch reference
    pre_k, post_k, comb_k = hc_triton.hc_mix(streams, weights.fn, weights.base, weights.scale, 1e-6, iters, 1e-6)
    collapsed_k = (pre_k.unsqueeze(-1) * streams).sum(dim=-2)
    for name, got, want in (("collapsed", collapsed_k, collapsed), ("post", post_k, post), ("comb", comb_k, comb)):
        assert got.shape == want.shape, name
        assert (got - want).abs().max().item() < 1e-5 * max(1.0, want.abs().max().item()), name
    # a doubly-stochastic comb: the check above would also pass for a comb the reference got wrong the same way
    assert torch.allclose(comb_k.sum(dim=-2), torch.ones(tokens, m, device=DEVICE), atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_mixes_fold_the_norm_into_the_projection(dtype):
    streams, weights = _case(4, 3, 2500, seed=3, dtype=dtype)
    want = _mixes(streams, weights.fn, 1e-6)
    got = hc_triton.hc_mixes(streams, weights.fn, 1e-6)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert (got - want).abs().max().item() < 1e-4 * want.abs().max().item()
    head = HyperWeights(weights.fn[:4].contiguous(), weights.base[:4], weights.scale[:1])
    torch.testing.assert_close(hc_head(streams.to(DEVICE), head, 1e-6, 1e-6, fused="triton"),
                               hc_head(streams, head, 1e-6, 1e-6), rtol=2e-2 if dtype == torch.bfloat16 else 1e-4,
                               atol=1e-3)


def test_usable_only_for_a_few_tokens_and_power_of_two_streams():
    assert hc_triton.usable(1, 4) and hc_triton.usable(hc_triton.MAX_TOKENS, 4)
    assert not hc_triton.usable(hc_triton.MAX_TOKENS + 1, 4)
    assert not hc_triton.usable(3, 3) and not hc_triton.usable(0, 4)


def _boundary_case(tokens: int, m: int, d: int, seed: int, dtype):
    gen = torch.Generator().manual_seed(seed)
    streams = torch.randn(tokens, m, d, generator=gen) * 2
    output = torch.randn(tokens, d, generator=gen)
    post = 2 * torch.rand(tokens, m, generator=gen)
    comb = torch.rand(tokens, m, m, generator=gen).softmax(dim=-1)
    norm = 1 + 0.3 * torch.randn(d, generator=gen)
    weights = HyperWeights(fn=torch.randn((2 + m) * m, m * d, generator=gen) * (m * d) ** -0.5,
                           base=torch.randn((2 + m) * m, generator=gen) * 0.5,
                           scale=1 + 0.2 * torch.randn(3, generator=gen))
    return ((streams.to(DEVICE, dtype), output.to(DEVICE, dtype), post.to(DEVICE), comb.to(DEVICE)), norm.to(DEVICE),
            HyperWeights(*(t.to(DEVICE) for t in (weights.fn, weights.base, weights.scale))))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "m", "d", "first"), [(1, 4, 256, False), (3, 4, 300, False), (2, 2, 96, False),
                                                         (1, 4, 256, True), (2, 8, 64, True)])
def test_the_boundary_in_two_launches_is_the_torch_boundary(dtype, tokens, m, d, first):
    """``hc_boundary_step`` against ``hyper.hc_boundary`` in torch: the streams after the update (each
    rounding where ``hc_post`` rounds), post and comb, and the normed input of the next sub-layer;
    ``first``: before the first sub-layer (no output to take in; the streams are only read)."""
    (streams, output, post, comb), norm, weights = _boundary_case(tokens, m, d, seed=tokens * 7 + d, dtype=dtype)
    before = None if first else (output, post, comb)
    args = (*(before or (None, None, None)),)
    want = hc_boundary(args[0], streams, args[1], args[2], weights, norm, 20, 1e-6, 1e-6)
    got = hc_triton.hc_boundary_step(streams, *args, weights.fn, weights.base, weights.scale, norm, 1e-6, 20, 1e-6)
    assert [t.shape for t in got] == [t.shape for t in want]
    assert got[0].dtype == dtype and got[1].dtype == dtype and got[2].dtype == got[3].dtype == torch.float32
    if first:
        assert got[1] is streams
    # the streams: the same roundings (a unit in the last place apart where the interpreter truncates to bf16)
    scale = want[1].float().abs().max().item() * torch.finfo(dtype).eps
    assert (got[1].float() - want[1].float()).abs().max().item() <= (8 if dtype == torch.float32 else 6) * scale
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    for name, g, w in (("input", got[0], want[0]), ("post", got[2], want[2]), ("comb", got[3], want[3])):
        assert (g.float() - w.float()).abs().max().item() < tolerance * w.float().abs().max().item(), name
    assert torch.allclose(got[3].sum(dim=-2), torch.ones(tokens, m, device=DEVICE), atol=1e-3)
    if DEVICE == "cuda":  # the model's call: hc_boundary with the boundary kernels picks them
        through = hc_boundary(args[0], streams, args[1], args[2], weights, norm, 20, 1e-6, 1e-6, fused="boundary")
        for g, t in zip(got, through):
            assert torch.equal(g, t)


def test_the_boundary_kernels_take_a_few_tokens_of_bounded_width():
    assert hc_triton.boundary_usable(1, 4, 4096) and hc_triton.boundary_usable(hc_triton.MAX_TOKENS, 4, 7168)
    assert not hc_triton.boundary_usable(1, 4, hc_triton.MAX_BOUNDARY_D + 1)
    assert not hc_triton.boundary_usable(hc_triton.MAX_TOKENS + 1, 4, 4096) and not hc_triton.boundary_usable(1, 3, 64)
