"""The decode kernels (``ds4d.cuda.decode_triton``) without a GPU: compiled for an H200 (sm_90) on this machine
by the ptxas Triton's wheel carries (``tests/gpu/decode_kernels_compile.py``, in a process of its own: the tests
run Triton's interpreter, which compiles nothing), the attention for every kind of entries and the compressor
step for V4-Flash's three compressors, in bfloat16 and float32, at their default launches, spill no register;
and what they take out of a decode step's attention layer, counted on the CPU (``tests/gpu/decode_op_count.py``)."""

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


def test_the_decode_kernels_compile_for_sm90_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "gpu" / "decode_kernels_compile.py")], env=env,
                         capture_output=True, text=True, check=True, timeout=600).stdout
    cases = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    kinds = {(c["kernel"], c.get("entries", c.get("ratio")), c.get("rope"), c.get("dim"), c["dtype"]) for c in cases}
    assert kinds == {(kernel, kind, rope, dim, dtype) for dtype in ("bf16", "fp32")
                     for kernel, kind, rope, dim in (
                         ("attention", 0, None, None), ("attention", 1, None, None), ("attention", 2, None, None),
                         ("attention", 0, 0, None), ("combine", None, None, None), ("combine", None, 32, None),
                         ("qkv", None, None, None), ("compress", 4, None, 512), ("compress", 4, None, 128),
                         ("compress", 128, None, 512))}
    for case in cases:
        assert case["spilled_bytes"] == 0 and 0 < case["registers"] <= 255, case


def test_the_decode_kernels_take_most_of_the_attention_layers_operators_away():
    """``tests/gpu/decode_op_count.py`` (a decode step on the CPU, Triton's interpreter): each layer kind's attention
    layer dispatches fewer torch operators plus Triton launches with ``decode_kernel`` than without; at least
    half fewer where compressors run (a CSA layer has two, with its indexer's)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "gpu" / "decode_op_count.py")], env=env,
                         capture_output=True, text=True, check=True, timeout=600).stdout
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 3 and cells[1].isdigit():
            ops, launches = (int(x) for x in cells[2].split(" + "))
            rows[cells[0]] = (int(cells[1]), ops + launches)
    assert set(rows) == {"sliding window only", "CSA (ratio 4, with its indexer)", "HCA (ratio 128)"}, out
    assert all(fused < plain for plain, fused in rows.values()), rows
    plain, fused = rows["CSA (ratio 4, with its indexer)"]
    assert fused <= plain / 2, rows
