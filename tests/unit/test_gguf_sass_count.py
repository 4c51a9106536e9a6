"""The GGUF block-wise GEMV compiled for an H200 (sm_90) on this machine, by the ptxas Triton's wheel
carries (``tests/gpu/gguf_sass_count.py``, in a process of its own: the tests run Triton's interpreter,
which compiles nothing): its decoders spend next to no int-to-float conversion on a weight value."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")):
    pytest.skip("this Triton carries no NVIDIA tools", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]


def test_the_decoders_loops_convert_next_to_no_value():
    """Every type and launch of the tool's table: a loop is found, and it converts fewer than one value in 16
    (IQ2_XXS converts one 4-bit scale per group of 32 values); a conversion issues at an eighth of the rate of
    the float add that replaces it."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "gpu" / "gguf_sass_count.py"), "--json"], env=env,
                         capture_output=True, text=True, check=True, timeout=600).stdout
    cases = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert {c["qtype"] for c in cases} == {"Q8_0", "Q2_K", "IQ2_XXS"}
    for case in cases:
        assert case["instructions"] > 1, case  # the loop was found
        assert case["conversions"] < 1 / 16, case


def test_the_block_wise_tiles_decode_a_value_once_for_a_tile_of_rows():
    """The prefill's expert tiles (``--tiles``): for each type, the block-wise tiles at their default launch spend
    under a quarter of the element-wise tiles' instructions per weight value and input row (their decoders are
    the GEMV's, a trip's values decoded once for 64 or 128 rows, not 32), and at 64 x 64 rows with 8 warps spill
    no register.  (The defaults were chosen by their time on an H200; IQ2_XXS's 128 x 64 spills a few and is
    still the fastest there.)"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "gpu" / "gguf_sass_count.py"), "--tiles", "--json"],
                         env=env, capture_output=True, text=True, check=True, timeout=600).stdout
    cases = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    for qtype in ("Q8_0", "Q2_K", "IQ2_XXS"):
        plain = next(c for c in cases if c["qtype"] == qtype and c["kernel"] == "element-wise")
        default = next(c for c in cases if c["qtype"] == qtype and c["kernel"] == "block-wise (default)")
        assert plain["mma"] > 0 and default["mma"] > 0, (plain, default)  # the loops were found
        assert default["per_row"] < plain["per_row"] / 4, (qtype, default, plain)
        square = next(c for c in cases if c["qtype"] == qtype and c["kernel"].startswith("block-wise")
                      and (c["block_m"], c["block_n"], c["warps"]) == (64, 64, 8))
        assert square["spills"] == 0, square
