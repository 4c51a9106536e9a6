"""The prefill step's Triton kernels (``ds4d.cuda.prefill_triton``) against the torch reference.

On the CPU the kernels run in Triton's interpreter (tests/conftest.py); on a GPU
machine the same checks run on the device.  Bounds are a few units in the last
place of the dtype (at the result's largest magnitude): in bf16 that checks that
each kernel rounds where the reference rounds, not just bf16's error over a
whole computation.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ds4d.models.deepseek_v4.hyper import _collapse, _mixes, hc_boundary, hc_post, hc_pre
from ds4d.models.deepseek_v4.moe import combine_sorted
from ds4d.models.deepseek_v4.ops import apply_rope, linear_f32, linear_split, rms_norm, split_bf16, unweighted_rms_norm
from ds4d.models.deepseek_v4.weights import HyperWeights

prefill_triton = pytest.importorskip("ds4d.cuda.prefill_triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not prefill_triton.available(), reason="needs Triton (a GPU or the interpreter)")
DTYPES = [torch.float32, torch.bfloat16]
TRUNCATES = DEVICE == "cpu"
"""Triton's interpreter converts float32 to bf16 by truncation, not to nearest as the GPU does, so on
the CPU each bf16 rounding may miss by up to one more unit."""


def _bound(dtype, roundings: int) -> float:
    """Units in the last place a result may be off after ``roundings`` bf16 roundings in a row."""
    if dtype == torch.float32:
        return 8
    return roundings * (2 if TRUNCATES else 1)


def _ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference in units of the last place of ``want``'s dtype at the largest magnitude."""
    assert got.dtype == want.dtype and got.shape == want.shape
    scale = want.float().abs().max().item() * torch.finfo(want.dtype).eps
    return ((got.float() - want.float()).abs().max() / scale).item()


def _hc_case(tokens: int, m: int, d: int, seed: int, dtype):
    gen = torch.Generator().manual_seed(seed)
    streams = torch.randn(tokens, m, d, generator=gen) * 2
    output = torch.randn(tokens, d, generator=gen)
    post = 2 * torch.rand(tokens, m, generator=gen)
    comb = torch.rand(tokens, m, m, generator=gen).softmax(dim=-1)
    weights = HyperWeights(fn=torch.randn((2 + m) * m, m * d, generator=gen) * (m * d) ** -0.5,
                           base=torch.randn((2 + m) * m, generator=gen) * 0.5,
                           scale=1 + 0.2 * torch.randn(3, generator=gen))
    return (streams.to(DEVICE, dtype), output.to(DEVICE, dtype), post.to(DEVICE), comb.to(DEVICE),
            HyperWeights(*(t.to(DEVICE) for t in (weights.fn, weights.base, weights.scale))))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "m", "d"), [(20, 4, 96), (3, 2, 200), (17, 4, 1100)])
def test_hc_update_is_hc_post_with_the_sums_of_squares(dtype, tokens, m, d):
    streams, output, post, comb, _ = _hc_case(tokens, m, d, seed=tokens + d, dtype=dtype)
    want_streams = hc_post(output, streams, post, comb)
    new, squares = prefill_triton.hc_update(streams, output, post, comb)
    assert _ulps(new, want_streams) <= _bound(dtype, 3)
    torch.testing.assert_close(squares, new.float().square().sum(dim=(1, 2)), rtol=1e-5, atol=1e-5)
    # no update: the streams as given, only read
    same, first = prefill_triton.hc_update(streams)
    assert same is streams
    torch.testing.assert_close(first, streams.float().square().sum(dim=(1, 2)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_hc_boundary_through_the_kernels_matches_torch(dtype):
    """The whole boundary between two sub-layers (``hyper.hc_boundary``): update, mixing logits (bf16
    streams through the split ``fn``), Sinkhorn weights, collapse and norm."""
    streams, output, post, comb, weights = _hc_case(24, 4, 256, seed=7, dtype=dtype)
    if dtype == torch.bfloat16:
        weights.fn_split = split_bf16(weights.fn)
    norm = (1 + 0.3 * torch.randn(256, generator=torch.Generator().manual_seed(8))).to(DEVICE)
    want = hc_boundary(output, streams, post, comb, weights, norm, 20, 1e-6, 1e-6)
    got = hc_boundary(output, streams, post, comb, weights, norm, 20, 1e-6, 1e-6, kernels=True)
    assert _ulps(got[1], want[1]) <= _bound(dtype, 3)  # the streams
    for name, g, w in (("post", got[2], want[2]), ("comb", got[3], want[3])):
        # in bf16, the logits of the kernel's own streams, a few units in the last place off the reference's
        # (rounded differently in the interpreter; on a GPU, cuBLAS may sum the reference's bf16 products in bf16)
        tolerance = 1e-5 if dtype == torch.float32 else 3e-2
        assert (g - w).abs().max().item() < tolerance * w.abs().max().item(), name
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    assert (got[0].float() - want[0].float()).abs().max().item() < tolerance * want[0].float().abs().max().item()


def test_split_bf16_weights_multiply_bf16_activations_in_float32():
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(9, 300, generator=gen).to(DEVICE, torch.bfloat16)
    w = torch.randn(40, 300, generator=gen).to(DEVICE)
    want = x.float() @ w.t()
    got = linear_split(x, split_bf16(w))
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert (got - want).abs().max().item() < 1e-4 * want.abs().max().item()
    # a weight that holds bf16 values loses nothing: only the summation order differs
    exact = w.to(torch.bfloat16).float()
    torch.testing.assert_close(linear_split(x, split_bf16(exact)), x.float() @ exact.t(), rtol=1e-5, atol=1e-5)
    assert torch.equal(linear_f32(x.float(), w, split_bf16(w)), torch.nn.functional.linear(x.float(), w))


@pytest.mark.parametrize("dtype", DTYPES)
def test_hc_collapse_norm_is_the_collapse_then_the_rms_norm(dtype):
    streams, _, _, _, weights = _hc_case(9, 4, 300, seed=5, dtype=dtype)
    gen = torch.Generator().manual_seed(6)
    pre = torch.rand(9, 4, generator=gen).to(DEVICE)
    norm = (1 + 0.3 * torch.randn(300, generator=gen)).to(DEVICE, dtype)
    want = rms_norm(_collapse(pre, streams), norm, 1e-6)
    got = prefill_triton.hc_collapse_norm(streams, pre, norm, 1e-6)
    assert _ulps(got, want) <= _bound(dtype, 2)
    # and through hc_pre's own pre weights
    x, _, _ = hc_pre(streams, weights, 20, 1e-6, 1e-6)
    pre_ref = torch.sigmoid(_mixes(streams, weights.fn, 1e-6)[:, :4] * weights.scale[0] + weights.base[:4]) + 1e-6
    torch.testing.assert_close(prefill_triton.hc_collapse_norm(streams, pre_ref, norm, 1e-6),
                               rms_norm(x, norm, 1e-6), rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [5, 16])
def test_head_norm_rope_in_place(dtype, heads):
    gen = torch.Generator().manual_seed(heads)
    x = (torch.randn(7, heads, 64, generator=gen) * 3).to(DEVICE, dtype)
    angles = torch.rand(7, 8, generator=gen) * 6
    cos, sin = angles.cos().to(DEVICE), angles.sin().to(DEVICE)
    want = apply_rope(unweighted_rms_norm(x, 1e-6), cos, sin)
    got = prefill_triton.head_norm_rope(x.clone(), cos, sin, 1e-6)
    assert _ulps(got, want) <= _bound(dtype, 2)
    # the inverse rotation, without the norm, leaves the unrotated channels as they are
    back = prefill_triton.head_norm_rope(want.clone(), cos, sin, norm=False, inverse=True)
    assert _ulps(back, apply_rope(want, cos, -sin)) <= _bound(dtype, 1)
    assert torch.equal(back[..., :48], want[..., :48])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("limit", [0.0, 1.5])
def test_swiglu_of_the_halves_of_one_product(dtype, limit):
    gen = torch.Generator().manual_seed(3)
    hidden = (torch.randn(11, 2 * 80, generator=gen) * 2).to(DEVICE, dtype)
    gate, up = hidden.chunk(2, dim=-1)
    if limit > 0:
        want = F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)
    else:
        want = F.silu(gate) * up
    got = prefill_triton.swiglu(gate, up, limit)
    assert _ulps(got, want) <= _bound(dtype, 2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_combine_is_combine_sorted(dtype):
    gen = torch.Generator().manual_seed(4)
    tokens, k, d = 10, 3, 70
    experts = torch.randint(0, 5, (tokens * k,), generator=gen)
    order = torch.sort(experts, stable=True).indices.to(DEVICE)
    rows = torch.randn(tokens * k, d, generator=gen).to(DEVICE, dtype)
    weights = torch.rand(tokens, k, generator=gen).to(DEVICE)
    want = combine_sorted(rows, order, weights, tokens, k, dtype)
    got = prefill_triton.combine(rows, order, weights, dtype)
    assert _ulps(got, want) <= _bound(dtype, 1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_combine_of_rows_in_slot_order_plus_a_term(dtype):
    """``order=None`` (row ``t * k + j`` is token ``t``'s slot ``j``, a decode step's pairs) with ``add``: the sum
    rounded to ``dtype``, then the term added, as ``combine_sorted(...) + add``."""
    gen = torch.Generator().manual_seed(5)
    tokens, k, d = 3, 6, 70
    rows = torch.randn(tokens * k, d, generator=gen).to(DEVICE, dtype)
    weights = torch.rand(tokens, k, generator=gen).to(DEVICE)
    add = torch.randn(tokens, d, generator=gen).to(DEVICE, dtype)
    in_order = torch.arange(tokens * k, device=DEVICE)
    routed = combine_sorted(rows, in_order, weights, tokens, k, dtype)
    got = prefill_triton.combine(rows, None, weights, dtype, add=add)
    assert _ulps(prefill_triton.combine(rows, None, weights, dtype), routed) <= _bound(dtype, 1)
    assert _ulps(got, routed + add) <= _bound(dtype, 2)
    assert _ulps(got, routed) > _bound(dtype, 2)
