"""Row classes of a prompt step's matmuls (``ds4d.cuda.rows``): few, tight, and nothing changes off CUDA."""

from __future__ import annotations

import torch

from ds4d.cuda.rows import padded_product, row_class, row_classes, row_classes_up_to


def test_row_classes_are_few_and_waste_at_most_a_quarter():
    classes = row_classes_up_to(8192)
    assert len(classes) == 36 and classes[-1] == 8192 and classes == sorted(set(classes))
    assert classes[:3] == [16, 32, 48] and 320 in classes and 1536 in classes and 4096 in classes
    for rows in range(1, 8193):
        target = row_class(rows)
        assert target in classes and target >= rows
        assert target <= max(16, rows + 15) if rows <= 256 else target <= 1.25 * rows
        assert row_class(target) == target


def test_padded_product_passes_through_off_cuda():
    x = torch.randn(37, 8)
    weight = torch.randn(5, 8)
    seen = []

    def product(rows):
        seen.append(rows.shape[0])
        return rows @ weight.t()

    with row_classes():
        out = padded_product(x, product)
    assert seen == [37] and torch.equal(out, x @ weight.t())
