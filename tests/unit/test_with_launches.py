"""``tests/gpu/with_launches.py``: the sweeps' JSON files applied in the process that runs ``ds4d`` (the GPU
session times the model with them), GEMV launches by type and the tiles' under ``"tiles"``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

from ds4d.cuda import gguf_matmul

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, str(ROOT / "tests" / "gpu" / "with_launches.py"), *args], env=env,
                          capture_output=True, text=True, check=True, timeout=300).stdout


def test_two_sweeps_files_are_applied_before_ds4d_runs(tmp_path):
    gemv = {"Q8_0": {"block_n": 4, "supers": 4, "warps": 4, "stages": 3}}
    tiles = {"tiles": {"Q2_K": {"block_m": 128, "block_n": 64, "supers": 1, "warps": 8, "stages": 2}}}
    (tmp_path / "launches.json").write_text(json.dumps(gemv))
    (tmp_path / "tiles.json").write_text(json.dumps(tiles))
    out = run(f"{tmp_path / 'launches.json'},{tmp_path / 'tiles.json'}", "config")
    line = next(line for line in out.splitlines() if line.startswith("GGUF block-wise launches: "))
    gemv_part, tiles_part = line.removeprefix("GGUF block-wise launches: ").split(", tiles ")
    applied, applied_tiles = json.loads(gemv_part), json.loads(tiles_part)
    assert applied == dict(gguf_matmul.BLOCKWISE, Q8_0=gemv["Q8_0"])  # the other types keep their defaults
    assert applied_tiles == dict(gguf_matmul.BLOCKWISE_TILES, Q2_K=tiles["tiles"]["Q2_K"])
    assert "model" in out  # ds4d config ran after


def test_a_dash_keeps_the_defaults():
    out = run("-", "config")
    assert "GGUF block-wise launches" not in out and "model" in out
