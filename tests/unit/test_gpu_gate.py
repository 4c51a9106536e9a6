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
