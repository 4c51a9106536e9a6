"""`ds4d bench parallel` on the CPU: the split rows run the very model the single process runs.

Two gloo processes stand in for two GPUs (tiny widths, float32).  Every row
must have its figures, and the split models' logits on the check prompt must
equal the single-process model's to float rounding, which holds only if each
rank drew exactly its share of the same random weights.
"""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_parallel_on_two_cpu_processes(tmp_path):
    out = tmp_path / "parallel.json"
    command = [sys.executable, "-m", "ds4d.cli", "bench", "parallel", "--tiny", "--gpus", "cpu:2",
               "--layouts", "1,ep,pp", "--layers", "0,4", "--dtype", "float32", "--batches", "1,2",
               "--decode-tokens", "3", "--prefill", "64", "--context", "64", "--json", str(out)]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {row["layout"]: row for row in json.loads(out.read_text())["rows"]}
    pp = "pp (2 x 1, 2 processes), pipeline_microbatches"
    assert set(rows) == {"1 process", "1 process, sharded step", "ep (1 x 2, 2 processes)", f"{pp} 2", f"{pp} 1"}
    for name, row in rows.items():
        # the same split model with its prompt steps whole (pipeline_microbatches 1): the prefill only
        for case in ("prefill",) if name == f"{pp} 1" else ("prefill", "decode b1", "decode b2"):
            assert isinstance(row[case], float) and row[case] > 0, (name, case, row[case])
        if row["max_diff"] is not None:
            assert row["max_diff"] < 1e-4 and row["argmax_same"] == 1.0, (name, row)
    assert f"| {pp} 2 | decode b2 |" in done.stdout
