"""The GPU machine's scripts (tests/gpu) parse and import here, so a broken one is found before it costs a device
call: every shell script passes ``bash -n``, every Python script compiles, and the ones that read no command line
when imported import (their own imports resolve, their module-level code runs)."""

from __future__ import annotations

import importlib
import py_compile
import shutil
import subprocess
from pathlib import Path

import pytest

GPU = Path(__file__).resolve().parents[1] / "gpu"
SHELL = sorted(GPU.glob("*.sh"))
PYTHON = sorted(p for p in GPU.glob("*.py") if not p.name.startswith("test_") and p.name != "__init__.py")
READ_ARGV_ON_IMPORT = {"first_use.py", "first_use_shapes.py"}
"""Scripts that read their arguments at module level: compiled, not imported."""


def test_the_scripts_are_found():
    assert {"gate.sh", "gguf_session.sh"} <= {p.name for p in SHELL}
    assert {"gguf_gemv_sweep.py", "gguf_tiles_sweep.py", "with_launches.py"} <= {p.name for p in PYTHON}


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash here")
@pytest.mark.parametrize("script", SHELL, ids=lambda p: p.name)
def test_shell_scripts_parse(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("script", PYTHON, ids=lambda p: p.name)
def test_python_scripts_compile_and_import(script, tmp_path):
    py_compile.compile(str(script), cfile=str(tmp_path / "script.pyc"), doraise=True)
    if script.name not in READ_ARGV_ON_IMPORT:
        pytest.importorskip("triton")  # the GGUF scripts import the Triton kernels' modules
        importlib.import_module(f"tests.gpu.{script.stem}")
