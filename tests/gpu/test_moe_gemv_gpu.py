"""The Triton expert GEMV on a CUDA GPU against a float32 product and the grouped matmul it replaces.

bfloat16 inputs as in serving: within bf16 output rounding of the float32
product of the same bf16 values (2e-2 of the largest output), a row's result
bit-identical whether computed alone or with other rows, and the MoE layer's
small-batch path (``moe._grouped_linear``) taking it.
"""

from __future__ import annotations

import pytest
import torch

from ds4d.cuda import moe_gemv
from ds4d.models.deepseek_v4 import moe

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("rows", [1, 6, 50, moe_gemv.MAX_ROWS])
@pytest.mark.parametrize(("n", "k"), [(512, 1024), (1024, 512), (304, 1504)])  # grouped_mm needs 16-byte rows
def test_against_float32_and_grouped_mm(rows, n, k):
    assert moe_gemv.available()
    gen = torch.Generator(device="cuda").manual_seed(rows + n)
    weight = (torch.randn(16, n, k, device="cuda", generator=gen) * 0.05).to(torch.bfloat16)
    x = torch.randn(rows, k, device="cuda", generator=gen).to(torch.bfloat16)
    ids = torch.sort(torch.randint(0, 16, (rows,), device="cuda", generator=gen)).values
    got = moe_gemv.expert_rows(x, weight, ids)
    want = torch.einsum("rnk,rk->rn", weight[ids].float(), x.float())
    scale = want.abs().max().item()
    assert (got.float() - want).abs().max().item() < 2e-2 * scale
    offsets = torch.cumsum(torch.bincount(ids, minlength=16), 0).to(torch.int32)
    grouped = moe._GROUPED_MM(x, weight.transpose(-2, -1), offs=offsets)
    assert (got.float() - grouped.float()).abs().max().item() < 2e-2 * scale
    for r in {0, rows // 2, rows - 1}:
        assert torch.equal(moe_gemv.expert_rows(x[r:r + 1], weight, ids[r:r + 1])[0], got[r])


def test_small_batches_take_the_gemv(monkeypatch):
    calls = []
    real = moe_gemv.expert_rows
    monkeypatch.setattr(moe_gemv, "expert_rows", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    weight = torch.randn(8, 64, 128, device="cuda").to(torch.bfloat16)
    for rows in (6, moe_gemv.MAX_ROWS + 1):
        x = torch.randn(rows, 128, device="cuda").to(torch.bfloat16)
        ids = torch.sort(torch.randint(0, 8, (rows,), device="cuda")).values
        offsets = torch.cumsum(torch.bincount(ids, minlength=8), 0).to(torch.int32)
        moe._grouped_linear(x, weight, offsets, ids, rows)
    assert calls == [6]
