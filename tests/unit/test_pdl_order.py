"""The kernels a decode step launches as programmatic dependent launches (``devices.LAUNCH["pdl"]``), compiled
for an H200 (sm_90) on this machine (``tests/gpu/pdl_order.py``, in a process of its own: the tests run Triton's
interpreter, which compiles nothing): before their wait for the kernel before they write nothing and read
only weights, so running beside that kernel cannot race with it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
    pytest.skip("this Triton carries no NVIDIA tools", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
WEIGHTS = {"fp8_rows": {"w_ptr", "s_ptr"}, "f32_rows": {"a_ptr", "b_ptr"}, "mxfp4_rows": set(),
           "boundary_mixes": set(), "boundary_collapse": set()}
"""What each kernel may read before its wait: the FP8 and float32 GEMVs their first weight tile (and the FP8
one its scales); the expert GEMV (whose experts the router chose) and the boundary kernels nothing."""


@pytest.fixture(scope="module")
def compiled() -> dict[tuple[str, bool], dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "gpu" / "pdl_order.py")], env=env,
                         capture_output=True, text=True, check=True, timeout=600).stdout
    cases = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {(case["kernel"], case["pdl"]): case for case in cases}


def test_every_kernel_waits_once_before_it_writes_and_then_lets_the_next_launch(compiled):
    assert set(compiled) == {(kernel, pdl) for kernel in WEIGHTS for pdl in (False, True)}
    for kernel in WEIGHTS:
        on, off = compiled[kernel, True], compiled[kernel, False]
        assert (off["waits"], off["launches"]) == (0, 0), off
        assert (on["waits"], on["launches"], on["launch_after_wait"]) == (1, 1, True), on
        assert on["stores_before_wait"] == 0 and off["stores_before_wait"] > 0, (on, off)


def test_only_weights_are_read_before_the_wait_and_the_fixed_ones_are(compiled):
    """Off, the whole kernel comes "before the wait", so its inputs' loads show there: the trace sees them."""
    for kernel, weights in WEIGHTS.items():
        read = set().union(*map(set, compiled[kernel, True]["loads_before_wait"]))
        assert read == weights, (kernel, read)
        everything = set().union(*map(set, compiled[kernel, False]["loads_before_wait"]))
        assert everything - weights, (kernel, everything)  # an input the kernel before wrote
