"""The GPU regression gate's comparison (tests/gpu/gate.py): verdicts, exit status, baseline updates."""

from __future__ import annotations

import json
from pathlib import Path

from tests.gpu import gate

B1, B8, PREFILL = "decode b1 @1K", "decode b8 @1K", "prefill 2048 tok, b1"
EAGER = "decode b1 @1K (no graphs)"


def write_result(path: Path, rows: dict[str, float | None]) -> Path:
    path.write_text(json.dumps({"rows": [{"case": case, "ds4d": value} for case, value in rows.items()]}))
    return path


def test_verdicts_against_the_baseline():
    baseline = {f"a: {B1}": 100.0, f"a: {B8}": 100.0, f"a: {PREFILL}": 100.0, f"a: {EAGER}": 100.0}
    got = {f"a: {B1}": 91.0, f"a: {B8}": 89.9, f"a: {PREFILL}": 120.0, f"b: {B1}": 5.0, f"a: {EAGER}": 10.0}
    table = {key: verdict for key, _, _, verdict in gate.compare(got, baseline, 0.10)}
    assert table == {f"a: {B1}": "ok", f"a: {B8}": "REGRESSED", f"a: {PREFILL}": "better", f"b: {B1}": "new",
                     f"a: {EAGER}": "not gated"}


def test_gate_fails_on_a_regression_and_never_writes_it(tmp_path, capsys):
    result = write_result(tmp_path / "layers4.json", {B1: 80.0, PREFILL: 1200.0, EAGER: 1.0, "failed row": None})
    baseline = tmp_path / "h200.json"
    baseline.write_text(json.dumps({"machine": "H200", "figures": {f"layers4: {B1}": 100.0,
                                                                   f"layers4: {PREFILL}": 1000.0}}))
    assert gate.main([str(result), "--baseline", str(baseline), "--update"]) == 1
    stored = json.loads(baseline.read_text())
    assert stored["machine"] == "H200"
    assert stored["figures"] == {f"layers4: {B1}": 100.0, f"layers4: {PREFILL}": 1200.0}
    out = capsys.readouterr().out
    assert "REGRESSED" in out and "not gated" in out and "failed row" not in out


def test_gate_passes_within_tolerance_and_starts_a_missing_baseline(tmp_path):
    result = write_result(tmp_path / "layers16.json", {B8: 950.0, EAGER: 3.0})
    baseline = tmp_path / "bench" / "h200.json"
    assert gate.main([str(result), "--baseline", str(baseline)]) == 0
    assert not baseline.exists()
    assert gate.main([str(result), "--baseline", str(baseline), "--update"]) == 0
    assert json.loads(baseline.read_text())["figures"] == {f"layers16: {B8}": 950.0}


def test_per_layer_cost_from_two_depths(tmp_path, capsys):
    """The baseline's first run (4 and 16 layers, decode b1 queued ahead: 820 and 238 tok/s, floors 2,013
    and 798): (1/238 - 1/820) / 12 = 0.249 ms per layer against (1/798 - 1/2,013) / 12 = 0.063 ms.  A
    batch-8 row's step is 8 tokens; prefill rows have no per-layer line."""
    def rows(path, values):
        path.write_text(json.dumps({"rows": [{"case": c, "ds4d": v, "floor": f} for c, (v, f) in values.items()]}))
        return path

    ahead = "decode b1 @1K (graphs, steps queued ahead)"
    shallow = rows(tmp_path / "layers4.json", {ahead: (820.0, 2013.0), B8: (2400.0, 8000.0), PREFILL: (7e4, 3e5)})
    deep = rows(tmp_path / "layers16.json", {ahead: (238.0, 798.0), B8: (800.0, 2400.0), PREFILL: (1.5e4, 8e4)})
    got = {label: (ms, floor) for label, ms, floor in gate.per_layer([deep, shallow])}
    assert set(got) == {ahead, B8}
    assert abs(got[ahead][0] - (1 / 238 - 1 / 820) / 12 * 1e3) < 1e-9
    assert abs(got[ahead][0] - 0.249) < 0.001 and abs(got[ahead][1] - 0.063) < 0.001
    assert abs(got[B8][0] - (8 / 800 - 8 / 2400) / 12 * 1e3) < 1e-9
    assert gate.per_layer([shallow]) == []
    baseline = tmp_path / "h200.json"
    assert gate.main([str(shallow), str(deep), "--baseline", str(baseline)]) == 0
    assert "per layer (decode step, from the two depths)" in capsys.readouterr().out


def test_a_gguf_run_is_gated_by_its_own_keys_and_left_out_of_the_per_layer_cost(tmp_path):
    """``GGUF=1 gate.sh`` adds ``q2layers4.json`` (the q2 recipe at 4 layers): its rows are keyed by that name,
    new until the baseline has them, and it is not taken for a depth beside ``layers4`` and ``layers16``."""
    def rows(path, values):
        path.write_text(json.dumps({"rows": [{"case": c, "ds4d": v, "floor": f} for c, (v, f) in values.items()]}))
        return path

    native = rows(tmp_path / "layers4.json", {B1: (820.0, 2013.0)})
    q2 = rows(tmp_path / "q2layers4.json", {B1: (580.0, 2118.0), PREFILL: (16000.0, 326000.0)})
    assert gate.per_layer([native, q2]) == []
    got = gate.figures(q2)
    assert got == {f"q2layers4: {B1}": 580.0, f"q2layers4: {PREFILL}": 16000.0}
    baseline = {f"layers4: {B1}": 820.0, f"q2layers4: {B1}": 700.0}
    table = {key: verdict for key, _, _, verdict in gate.compare(got, baseline, 0.10)}
    assert table == {f"q2layers4: {B1}": "REGRESSED", f"q2layers4: {PREFILL}": "new"}


def test_full_depth_offload_rows_are_gated_by_their_case_after_the_placement(tmp_path):
    """``gate.sh --full`` writes ``full.json`` (``bench model --expert-gpu-fraction``): each row's label
    starts with its placement; the gated part is the case after it."""
    long, blocks = "prefill 32768 tok, b1", "prefill 32768 tok, b1 (one step, layer by layer)"
    full = write_result(tmp_path / "full.json", {f"88% on device: {PREFILL}": 2181.0, f"88% on device: {B1}": 38.9,
                                                 f"88% on device: {long}": 1567.0, f"88% on device: {blocks}": 2917.0,
                                                 "88% on device: copies per second": 3.0})
    got = gate.figures(full)
    baseline = {f"full: 88% on device: {B1}": 50.0, f"full: 88% on device: {long}": 1500.0}
    table = {key: verdict for key, _, _, verdict in gate.compare(got, baseline, 0.10)}
    assert table == {f"full: 88% on device: {PREFILL}": "new", f"full: 88% on device: {B1}": "REGRESSED",
                     f"full: 88% on device: {long}": "better", f"full: 88% on device: {blocks}": "new",
                     "full: 88% on device: copies per second": "not gated"}


def test_agent_results_give_step_two_prompt_rates_reused_and_cold(tmp_path):
    """``gate.sh --agent`` gates ``bench agent --json`` (agent_gpu.json, agent_ram.json): step 2's prompt
    tokens over its time to first token, the median over the repeats, with the prefix reused and cold."""
    rows = [{"step2_prompt_tokens": 1000, "ttft_reused_ms": 100.0, "ttft_cold_ms": 1000.0},
            {"step2_prompt_tokens": 2000, "ttft_reused_ms": 100.0, "ttft_cold_ms": 1000.0},
            {"step2_prompt_tokens": 3000, "ttft_reused_ms": 1000.0, "ttft_cold_ms": 1500.0}]
    path = tmp_path / "agent_ram.json"
    path.write_text(json.dumps({"model": "m", "rows": rows}))
    got = gate.figures(path)
    assert got == {f"agent_ram: {gate.AGENT_REUSED}": 10_000.0, f"agent_ram: {gate.AGENT_COLD}": 2000.0}
    table = {key: verdict for key, _, _, verdict in gate.compare(got, {f"agent_ram: {gate.AGENT_REUSED}": 12_000.0}, 0.10)}
    assert table == {f"agent_ram: {gate.AGENT_REUSED}": "REGRESSED", f"agent_ram: {gate.AGENT_COLD}": "new"}


def test_rows_timed_several_times_show_their_lowest_and_highest_beside_the_median(tmp_path, capsys):
    """``bench model --repeats``: a row's figure is the median of its runs; the gate gates that and prints
    the runs' range beside it (a row timed once shows none)."""
    result = tmp_path / "layers4.json"
    result.write_text(json.dumps({"rows": [
        {"case": B1, "ds4d": 700.0, "extra": {"layer_ms": 0.2, "runs": 5, "lowest": 650.5, "highest": 710.4}},
        {"case": PREFILL, "ds4d": 60000.0, "extra": {}}]}))
    assert gate.spreads(result) == {f"layers4: {B1}": (650.5, 710.4)}
    baseline = tmp_path / "h100.json"
    baseline.write_text(json.dumps({"figures": {f"layers4: {B1}": 760.0, f"layers4: {PREFILL}": 60000.0}}))
    assert gate.main([str(result), "--baseline", str(baseline)]) == 0  # 700 is within 10% of 760
    lines = {line.split()[1]: line for line in capsys.readouterr().out.splitlines() if line.startswith("layers4:")}
    assert "650.5-710.4" in lines["decode"] and lines["decode"].endswith("ok")
    assert lines["prefill"].split()[-2:] == ["-", "ok"]
