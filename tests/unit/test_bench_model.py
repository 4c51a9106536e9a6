"""`ds4d bench model` (DeepSeek-V4) on tiny widths, on the CPU: the decode rows' time per layer against
the floor's per layer, as printed and as written to the JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def test_decode_rows_report_their_time_and_floor_per_layer(tmp_path):
    out = tmp_path / "v4.json"
    run = subprocess.run(
        [sys.executable, "-m", "ds4d.cli", "bench", "model", "--tiny", "--device", "cpu", "--dtype", "float32",
         "--no-hf", "--no-reference", "--main-only", "--batches", "1,2", "--decode-tokens", "3", "--layers", "0,4",
         "--json", str(out)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    decode = [row for row in result["rows"] if row["case"].startswith("decode")]
    assert [row["case"] for row in decode] == ["decode b1 @1K", "decode b2 @1K"]
    for row, batch in zip(decode, (1, 2), strict=True):
        extra = row["extra"]
        # what the step takes beyond its layers' share is the same for the measured time and for the floor:
        # the head at its floor
        head_from_time = batch / row["ds4d"] * 1e3 - 2 * extra["layer_ms"]
        head_from_floor = batch / row["floor"] * 1e3 - 2 * extra["layer_floor_ms"]
        assert head_from_time == pytest.approx(head_from_floor, rel=1e-9)
        assert head_from_floor > 0 and extra["layer_floor_ms"] > 0
        assert f"| {row['case']} | {extra['layer_ms']:.3f} | {extra['layer_floor_ms']:.3f} |" in run.stdout
    prefill = [row for row in result["rows"] if row["case"].startswith("prefill")]
    assert prefill and all(not row["extra"] for row in prefill)
