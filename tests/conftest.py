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

import inspect
import os
import threading

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TEMP_GIB = 4
"""Free space the suite wants in the temporary directory: its tiny checkpoints, GGUF files and cache tiers peaked
at 1.6 GB there in a run of two processes (3.7 GB before a passing test's directory went as it passed)."""


def pytest_configure(config):
    """A warning (in the summary) where the temporary directory is short of :data:`TEMP_GIB`: tests that write
    files then fail with "No space left on device", which names no cause in the suite."""
    import shutil
    import tempfile

    where = tempfile.gettempdir()
    free = shutil.disk_usage(where).free / 2**30
    if free < TEMP_GIB and not hasattr(config, "workerinput"):  # once, in the process that reports
        config.issue_config_time_warning(pytest.PytestConfigWarning(
            f"{where} has {free:.1f} GiB free; the suite writes about 2 GiB there at its peak"), stacklevel=2)


_NESTED_CALL = ("def __call__(self, *args, **kwargs): # This is a device function call _patch_lang(self.fn) "
                "fn = self.rewrite() try: return fn(*args, **kwargs) except Exception as e: "
                "raise InterpreterError(repr(e)) from e")
"""The source of ``InterpretedFunction.__call__`` in Triton 3.9's interpreter (spaces collapsed), which
``nested_call`` below replaces."""


def _patch_the_language_once_per_launch() -> None:
    """Triton's interpreter patches ``triton.language`` for each kernel launch, and patches it again at
    every call of a nested ``@triton.jit`` function (without undoing it), though the launch's patches
    already cover the modules the helper sees.  Here a nested call patches only language modules the
    launch has not yet patched, so each launch patches each module once; the kernels run the same
    operations on the same values.  Left as it is where Triton's interpreter is not the one this
    was written for."""
    try:
        from triton import language as tl
        from triton.runtime import interpreter
        nested = " ".join(inspect.getsource(interpreter.InterpretedFunction.__call__).split())
        launch = inspect.getsource(interpreter.GridExecutor.__call__)
    except (ImportError, AttributeError, OSError, TypeError):
        return
    if nested != _NESTED_CALL or "patch_scope = _patch_lang(self.fn)" not in launch:
        return
    patch_lang, run_launch = interpreter._patch_lang, interpreter.GridExecutor.__call__
    state, modules = threading.local(), {}

    def langs(fn) -> frozenset[int]:
        if fn not in modules:
            modules[fn] = frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)
        return modules[fn]

    def patch_recorded(fn):
        scope = patch_lang(fn)
        patched = getattr(state, "patched", None)
        if patched is not None:
            patched |= langs(fn)
        return scope

    def launch_call(self, *args, **kwargs):
        outer, state.patched = getattr(state, "patched", None), set()
        try:
            return run_launch(self, *args, **kwargs)
        finally:
            state.patched = outer

    def nested_call(self, *args, **kwargs):
        patched = getattr(state, "patched", None)
        if patched is None or not langs(self.fn) or not langs(self.fn) <= patched:
            patch_recorded(self.fn)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    interpreter._patch_lang = patch_recorded
    interpreter.GridExecutor.__call__ = launch_call
    interpreter.InterpretedFunction.__call__ = nested_call


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_the_language_once_per_launch()


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny matrices: one intra-op thread is several times faster than two contending.
    Modules of tiny-model tests use it with ``pytest.mark.usefixtures("one_torch_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def wide_gguf_gemv_programs():
    """The block-wise GGUF GEMV (``gguf_matmul.BLOCKWISE``) at 32 weight rows a program, where its GPU launches
    take 4-16.  Triton's interpreter runs one program at a time, each costing about the same whatever its rows,
    so a tiny model's decode step takes a quarter of the time.  A row's sums come from the same loop either way;
    tests/unit/test_gguf_kernels.py checks the kernel at the GPU's launches.  Modules of GGUF model tests in the
    interpreter use it with ``pytest.mark.usefixtures("wide_gguf_gemv_programs")``."""
    from ds4d.cuda import gguf_matmul

    with pytest.MonkeyPatch.context() as patch:
        for qtype, launch in gguf_matmul.BLOCKWISE.items():
            patch.setitem(gguf_matmul.BLOCKWISE, qtype, dict(launch, block_n=32))
        yield
