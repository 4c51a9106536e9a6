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
    # the links, timed on the ranks: an all-reduce a layer when the experts are split, hand-ons between stages
    ep = rows["ep (1 x 2, 2 processes)"]["link"]
    assert set(ep) == {"prefill", "decode b1", "decode b2"}
    assert all(t["all_reduce"] > 0 and t["streams"] is None and t["logits"] is None for t in ep.values()), ep
    assert all(t["step"] == 2 * t["all_reduce"] for t in ep.values()), ep  # two layers
    staged = rows[f"{pp} 2"]["link"]
    assert all(t["all_reduce"] is None and t["streams"] > 0 and t["logits"] > 0 for t in staged.values()), staged
    assert all(t["step"] == t["streams"] + t["logits"] for t in staged.values()), staged
    for name in ("ep (1 x 2, 2 processes)", f"{pp} 2"):
        for case, floor in rows[name]["floors"].items():
            assert 0 < floor["with_link"] <= floor["floor"], (name, case, floor)
    assert "link" not in rows["1 process"] and "link" not in rows["1 process, sharded step"]


def test_bench_parallel_at_a_configs_full_depth_against_one_process_offloading(tmp_path):
    """``--depth full`` takes every layer of ``--config`` (its compress ratios less the MTP layer's entry); with
    ``--expert-gpu-fraction`` the one-process row keeps only that share of the experts on its device, and the
    split rows still give its logits."""
    from ds4d.bench.random_v4 import base_config

    config = {**base_config(True), "num_hidden_layers": 3, "compress_ratios": [4, 128, 0, 0]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = tmp_path / "parallel.json"
    command = [sys.executable, "-m", "ds4d.cli", "bench", "parallel", "--config", str(tmp_path / "config.json"),
               "--depth", "full", "--gpus", "cpu:2", "--expert-gpu-fraction", "0.5", "--dtype", "float32",
               "--batches", "1", "--decode-tokens", "2", "--prefill", "32", "--context", "32", "--link-reps", "2",
               "--json", str(out)]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "layers [4, 128, 0])" in done.stdout
    rows = {row["layout"]: row for row in json.loads(out.read_text())["rows"]}
    experts = 3 * config["n_routed_experts"]
    one = f"1 process, {experts // 2}/{experts} experts on it, the rest in host RAM"
    assert set(rows) == {one, "ep (1 x 2, 2 processes)", "pp (2 x 1, 2 processes), pipeline_microbatches 2",
                         "pp (2 x 1, 2 processes), pipeline_microbatches 1"}, set(rows)
    assert rows[one]["expert_gpu_fraction"] == 0.5
    for name, row in rows.items():
        if row["max_diff"] is not None:
            assert row["max_diff"] < 1e-4 and row["argmax_same"] == 1.0, (name, row)


def test_bench_parallel_without_a_one_process_row(tmp_path):
    """``--no-single`` (a model no single process can hold): the floors come from the config's shapes alone, the
    first split layout's logits are the reference and the others must give them."""
    out = tmp_path / "parallel.json"
    command = [sys.executable, "-m", "ds4d.cli", "bench", "parallel", "--tiny", "--gpus", "cpu:2", "--no-single",
               "--layouts", "ep,pp", "--layers", "0,4", "--dtype", "float32", "--batches", "1", "--decode-tokens", "2",
               "--prefill", "32", "--context", "32", "--link-reps", "2", "--json", str(out)]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [row["layout"] for row in rows] == ["ep (1 x 2, 2 processes)",
                                               "pp (2 x 1, 2 processes), pipeline_microbatches 2",
                                               "pp (2 x 1, 2 processes), pipeline_microbatches 1"]
    assert rows[0]["max_diff"] is None
    assert all(row["max_diff"] < 1e-4 and row["argmax_same"] == 1.0 for row in rows[1:]), rows
    floor = rows[0]["floors"]["decode b1"]["floor"]
    # each of ep's two ranks reads half the experts, each stage all of its own: the layer split's floor is lower
    assert floor > 0 and rows[1]["floors"]["decode b1"]["floor"] < floor
