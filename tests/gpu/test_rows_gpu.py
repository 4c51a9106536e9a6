"""On CUDA, inside ``row_classes`` a product runs on its rows padded to their class, and gives the rows
it was asked for: the same values as the unpadded product up to the matmul's own rounding."""

from __future__ import annotations

import pytest
import torch

from ds4d.cuda.rows import padded_product, row_class, row_classes

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("rows", [1, 17, 257, 1441, 4097])
def test_padded_rows_on_cuda(rows):
    x = torch.randn(rows, 512, device="cuda")
    weight = torch.randn(384, 512, device="cuda")
    seen = []

    def product(inputs):
        seen.append(inputs.shape[0])
        return inputs @ weight.t()

    with row_classes():
        out = padded_product(x, product)
    outside = padded_product(x, product)
    assert seen == [row_class(rows), rows] and out.shape == (rows, 384)
    torch.testing.assert_close(out, outside, rtol=1e-4, atol=1e-3)
