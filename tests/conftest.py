"""Session-wide test setup.

Without a CUDA device, Triton kernels run in Triton's CPU interpreter, which
must be chosen before Triton is first imported (tests/unit/test_moe_gemv.py).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
