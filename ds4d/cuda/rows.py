"""A prompt step's matmul rows rounded up to a few classes on CUDA.

cuBLAS chooses a kernel the first time it meets a (rows, columns, depth) shape, for about half a
millisecond of host time (measured on an H200: ``tests/gpu/first_use_shapes.py``), and a prompt step
of DeepSeek-V4 meets some forty matmul shapes per distinct row count.  Left alone, every prompt whose
token count the daemon had not met before paid 20-50 ms for it.  Inside :func:`row_classes` (the model's
prompt steps), :func:`padded_product` rounds the rows up to :func:`row_class` (multiples of 16 up to
256, then four classes per doubling: at most a quarter more rows) with zero rows that are sliced off
after, so a step meets one of 36 row counts up to 8192, which the warm-up runs once each
(``ds4d.engine.warmup``).  Decode steps (CUDA graphs) and the CPU are left as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from contextvars import ContextVar

import torch

_ON: ContextVar[bool] = ContextVar("ds4d_row_classes", default=False)


def row_class(rows: int) -> int:
    """The row count ``rows`` rounds up to: a multiple of 16 up to 256, above that the next of
    ``2^p * (1 + k / 4)`` (k = 1..4)."""
    if rows <= 256:
        return max(16, -(-rows // 16) * 16)
    step = 1 << (rows.bit_length() - 3)
    return -(-rows // step) * step


def row_classes_up_to(most: int) -> list[int]:
    """Every row class from 1 row to ``most`` rows, in order (the last one at least ``most``)."""
    classes, rows = [], 1
    while True:
        classes.append(row_class(rows))
        if classes[-1] >= most:
            return classes
        rows = classes[-1] + 1


@contextmanager
def row_classes():
    """Within this block, :func:`padded_product` rounds CUDA rows up to :func:`row_class`."""
    token = _ON.set(True)
    try:
        yield
    finally:
        _ON.reset(token)


def padded_product(x: torch.Tensor, product: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``product(x)`` for a 2-D ``x`` whose rows ``product`` treats independently; inside
    :func:`row_classes` on CUDA, computed on ``x`` padded with zero rows to its row class."""
    if not _ON.get() or not x.is_cuda or x.dim() != 2:
        return product(x)
    rows = x.shape[0]
    target = row_class(rows)
    if target == rows:
        return product(x)
    return product(torch.nn.functional.pad(x, (0, 0, 0, target - rows)))[:rows]
