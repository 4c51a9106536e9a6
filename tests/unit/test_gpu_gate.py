"""The GPU regression gate's comparison (tests/gpu/gate.py): verdicts, exit status, baseline updates."""

from __future__ import annotations

import json
from pathlib import Path

from tests.gpu import gate


def write_result(path: Path, rows: dict[str, float | None]) -> Path:
    path.write_text(json.dumps({"rows": [{"case": case, "ds4d": value} for case, value in rows.items()]}))
    return path


def test_verdicts_against_the_baseline():
    baseline = {"a: x": 100.0, "a: y": 100.0, "a: z": 100.0}
    table = {key: verdict for key, _, _, verdict in
             gate.compare({"a: x": 91.0, "a: y": 89.9, "a: z": 120.0, "a: w": 5.0}, baseline, 0.10)}
    assert table == {"a: x": "ok", "a: y": "REGRESSED", "a: z": "better", "a: w": "new"}


def test_gate_fails_on_a_regression_and_never_writes_it(tmp_path, capsys):
    result = write_result(tmp_path / "layers4.json", {"decode b1 @1K": 80.0, "prefill 2048 tok, b1": 1200.0,
                                                      "failed row": None})
    baseline = tmp_path / "h200.json"
    baseline.write_text(json.dumps({"machine": "H200", "figures": {"layers4: decode b1 @1K": 100.0,
                                                                   "layers4: prefill 2048 tok, b1": 1000.0}}))
    assert gate.main([str(result), "--baseline", str(baseline), "--update"]) == 1
    stored = json.loads(baseline.read_text())
    assert stored["machine"] == "H200"
    assert stored["figures"] == {"layers4: decode b1 @1K": 100.0, "layers4: prefill 2048 tok, b1": 1200.0}
    out = capsys.readouterr().out
    assert "REGRESSED" in out and "failed row" not in out


def test_gate_passes_within_tolerance_and_starts_a_missing_baseline(tmp_path):
    result = write_result(tmp_path / "layers16.json", {"decode b8 @1K": 950.0})
    baseline = tmp_path / "bench" / "h200.json"
    assert gate.main([str(result), "--baseline", str(baseline)]) == 0
    assert not baseline.exists()
    assert gate.main([str(result), "--baseline", str(baseline), "--update"]) == 0
    assert json.loads(baseline.read_text())["figures"] == {"layers16: decode b8 @1K": 950.0}
