"""The Triton expert GEMV (``ds4d.cuda.moe_gemv``) in Triton's CPU interpreter, against plain torch.

Same kernel source as on the GPU; here in float32 on CPU tensors.  Shapes that
are not multiples of the block sizes, rows sharing an expert, a row whose result
must not depend on the other rows, and an empty batch.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from ds4d.cuda import moe_gemv


@pytest.fixture
def interpreted():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("a CUDA device is present: tests/gpu/test_moe_gemv_gpu.py checks the compiled kernel")
    assert moe_gemv.available()
    return moe_gemv.expert_rows


@pytest.mark.parametrize(("experts", "n", "k", "rows"), [(5, 13, 3000, 7), (3, 8, 1024, 1), (16, 6, 100, 20)])
def test_matches_torch(interpreted, experts, n, k, rows):
    gen = torch.Generator().manual_seed(experts * 1000 + k)
    weight = torch.randn(experts, n, k, generator=gen)
    x = torch.randn(rows, k, generator=gen)
    ids = torch.sort(torch.randint(0, experts, (rows,), generator=gen)).values
    got = interpreted(x, weight, ids)
    want = torch.einsum("rnk,rk->rn", weight[ids], x)
    assert got.shape == (rows, n) and got.dtype == x.dtype
    assert (got - want).abs().max().item() < 1e-4 * want.abs().max().item() + 1e-5


def test_a_row_does_not_depend_on_the_others(interpreted):
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(4, 10, 1500, generator=gen)
    x = torch.randn(6, 1500, generator=gen)
    ids = torch.tensor([0, 1, 1, 2, 3, 3])
    together = interpreted(x, weight, ids)
    for r in range(6):
        assert torch.equal(interpreted(x[r:r + 1], weight, ids[r:r + 1])[0], together[r])


def test_empty_batch_and_layout_checks(interpreted):
    weight = torch.randn(2, 4, 64)
    assert interpreted(torch.empty(0, 64), weight, torch.empty(0, dtype=torch.long)).shape == (0, 4)
    with pytest.raises(ValueError, match="contiguous"):
        interpreted(torch.randn(1, 64), weight.transpose(1, 2).contiguous().transpose(1, 2), torch.tensor([0]))
