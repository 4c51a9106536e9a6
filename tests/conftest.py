"""Session-wide test setup and shared fixtures.

Without a CUDA device, Triton kernels run in Triton's CPU interpreter, which
must be chosen before Triton is first imported (tests/unit/test_moe_gemv.py).

OpenMP threads waiting for work sleep instead of spinning (``OMP_WAIT_POLICY``,
read when torch is first imported, and inherited by the daemons the tests
start): the test processes share a few cores, and a spinning thread holds a
core the thread it waits for needs.  Where the work runs and what it computes
is unchanged.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny matrices: one intra-op thread is several times faster than two contending.
    Modules of tiny-model tests use it with ``pytest.mark.usefixtures("one_torch_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
