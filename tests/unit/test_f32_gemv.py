"""The float32 GEMV of a few rows (``ds4d.cuda.f32_gemv``) against torch.

On the CPU the kernel runs in Triton's interpreter (tests/conftest.py); on a GPU
machine the same checks run on the device.
"""

from __future__ import annotations

import pytest
import torch

f32_gemv = pytest.importorskip("ds4d.cuda.f32_gemv")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not f32_gemv.available(), reason="needs Triton (a GPU or the interpreter)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "n", "k"), [(1, 64, 512), (3, 37, 300), (8, 5, 5000)])
def test_rows_times_a_float32_weight(dtype, rows, n, k):
    """Each output is the float32 dot product of a row (widened) with a weight row; ``k`` past one step
    (5000 > 4096 inputs) and column counts that leave a program's columns partly empty included."""
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    x = torch.randn(rows, k, generator=gen).to(DEVICE, dtype)
    weight = (torch.randn(n, k, generator=gen) * k**-0.5).to(DEVICE)
    got = f32_gemv.rows_f32(x, weight)
    want = x.float() @ weight.t()
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # a row's result is its own: the same row alone gives the same values, bit for bit
    assert torch.equal(f32_gemv.rows_f32(x[-1:], weight), got[-1:])


def test_two_weights_sharing_the_rows_in_one_launch():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 640, generator=gen).to(DEVICE, torch.bfloat16)
    kv, gate = (torch.randn(n, 640, generator=gen).to(DEVICE) for n in (96, 33))
    got_kv, got_gate = f32_gemv.rows_f32(x, kv, gate)
    assert torch.equal(got_kv, f32_gemv.rows_f32(x, kv)) and torch.equal(got_gate, f32_gemv.rows_f32(x, gate))
    torch.testing.assert_close(got_gate, x.float() @ gate.t(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="width"):
        f32_gemv.rows_f32(x, kv, gate[:, :320])


def test_usable_for_a_few_cuda_rows_of_a_float32_weight():
    weight = torch.zeros(4, 16)
    assert not f32_gemv.usable(torch.zeros(1, 16), weight)  # CPU rows keep torch's product (the reference path)
    if torch.cuda.is_available():
        cuda_weight = weight.cuda()
        assert f32_gemv.usable(torch.zeros(f32_gemv.MAX_ROWS, 16, device="cuda"), cuda_weight)
        assert not f32_gemv.usable(torch.zeros(f32_gemv.MAX_ROWS + 1, 16, device="cuda"), cuda_weight)
        assert not f32_gemv.usable(torch.zeros(1, 16, device="cuda"), cuda_weight.to(torch.bfloat16))
