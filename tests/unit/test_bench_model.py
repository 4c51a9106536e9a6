"""`ds4d bench model` (DeepSeek-V4) on tiny widths, on the CPU: the decode rows' time per layer against
the floor's per layer, as printed and as written to the JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def test_decode_rows_report_their_time_and_floor_per_layer(tmp_path):
    from ds4d.bench.model import _fmt

    out = tmp_path / "v4.json"
    run = subprocess.run(
        [sys.executable, "-m", "ds4d.cli", "bench", "model", "--tiny", "--device", "cpu", "--dtype", "float32",
         "--no-hf", "--no-reference", "--main-only", "--batches", "1,2", "--decode-tokens", "3", "--layers", "0,4",
         "--decode-context", "160", "--prefill-tokens", "256", "--decode-kernel", "--route-kernel", "--pdl",
         "--repeats", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    decode = [row for row in result["rows"] if row["case"].startswith("decode")]
    kernel = " (graphs, decode kernels)"  # the rows of decode_triton's kernels (Triton's interpreter here)
    route = " (graphs, routing in one kernel)"  # route_triton's kernel, in the interpreter too
    pdl = " (graphs, GEMVs as dependent launches)"  # launched plainly on the CPU: the rows' names and runs
    assert [row["case"] for row in decode] == [
        f"decode b{b} @160{note}" for b in (1, 2) for note in ("", kernel, route, pdl)]
    assert all(row["ds4d"] > 0 for row in decode)
    decode = [row for row in decode if row["case"] in ("decode b1 @160", "decode b2 @160")]
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
    assert [row["case"] for row in prefill] == ["prefill 256 tok, b1"]
    assert all(set(row["extra"]) == {"runs", "lowest", "highest"} for row in prefill)
    for row in result["rows"]:  # --repeats 2: the median of two runs lies between them
        extra = row["extra"]
        assert extra["runs"] == 2 and extra["lowest"] <= row["ds4d"] <= extra["highest"]
        assert f"| {row['case']} | {_fmt(extra['lowest'])} | {_fmt(extra['highest'])} |" in run.stdout


def test_offload_rows_are_written_for_the_gate(tmp_path):
    """``bench model --expert-gpu-fraction --json`` (``gate.sh --full``): per placement, prefill 2K, decode b1,
    the long prompt in chunks and as one step layer by layer, each with its floor and the GB it copied;
    the gate reads them keyed by placement and gates them by their case."""
    from tests.gpu import gate

    out = tmp_path / "full.json"
    run = subprocess.run(
        [sys.executable, "-m", "ds4d.cli", "bench", "model", "--tiny", "--device", "cpu", "--dtype", "float32",
         "--no-hf", "--no-reference", "--decode-tokens", "2", "--layers", "0,4", "--expert-gpu-fraction", "0.5",
         "--stream-experts", "--context", "512", "--prefill-block", "256", "--json", str(out)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {row["case"]: row for row in json.loads(out.read_text())["rows"]}
    cases = ["prefill 2048 tok, b1", "decode b1 @1K", "prefill 512 tok, b1", "prefill 512 tok, b1 (one step, layer by layer)"]
    assert list(rows) == [f"50% on device: {case}" for case in cases]
    for row in rows.values():
        assert row["ds4d"] > 0 and row["floor"] > 0
    # half the experts in host RAM: every prefill copies some over (as its table row says)
    assert all(row["gb_copied"] > 0 for case, row in rows.items() if "prefill" in case)
    figures = gate.figures(out)
    assert set(figures) == {f"full: {case}" for case in rows}
    gated = [key for key, *_, verdict in gate.compare(figures, {}, 0.1) if verdict == "new"]
    assert gated == sorted(f"full: {case}" for case in rows if "512" not in case)  # the gate's long rows are 32K


def test_a_row_whose_decode_graphs_fell_back_to_eager_is_an_error_not_a_time(tmp_path):
    """A decode graph capture that fails leaves the model decoding eagerly (``graph_fallback``); a bench row
    timed that way would stand under its graphs label, so ``_ds4d`` raises instead (``_guarded`` then prints
    the row as failed, naming why)."""
    import torch

    from ds4d.bench.model import _ds4d, _guarded
    from ds4d.models.deepseek_v4 import load_model, write_tiny_checkpoint

    model = load_model(write_tiny_checkpoint(tmp_path / "tiny", seed=3, layers=[0, 4]))
    prompts = [[5, 6, 7, 8]]
    runs = _ds4d(torch, model, prompts, 2, chunk=64, sync=lambda: None, repeats=2)
    assert len(runs) == 2 and all(run.decode_tok_s > 0 and run.prefill_tokens == 4 for run in runs)
    model._graph_failure = "RuntimeError: capture refused"  # as DeepseekV4Model records a failed capture
    with pytest.raises(RuntimeError, match="graph capture failed.*capture refused"):
        _ds4d(torch, model, prompts, 2, chunk=64, sync=lambda: None)
    assert _guarded(torch, "decode b1", lambda: _ds4d(torch, model, prompts, 2, chunk=64,
                                                       sync=lambda: None)) == "error"


def test_a_row_timed_several_times_is_their_median_with_the_lowest_and_highest_beside_it():
    """``--repeats``: the row's figure is the median of the runs' rates; its ``extra`` keeps the spread (the
    gate's rows that wait on the host move by more than its tolerance from one run to the next)."""
    from ds4d.bench.harness import RunTiming
    from ds4d.bench.model import median_rate

    runs = [RunTiming(100, 0.5, 10, s) for s in (1.0, 0.5, 2.0, 0.25, 4.0)]  # 10, 20, 5, 40, 2.5 tok/s
    assert median_rate(runs, "decode_tok_s") == (10.0, {"runs": 5, "lowest": 2.5, "highest": 40.0})
    assert median_rate(runs, "prefill_tok_s") == (200.0, {"runs": 5, "lowest": 200.0, "highest": 200.0})
    assert median_rate(runs[1:2], "decode_tok_s") == (20.0, {})  # one run: its rate, no spread


def test_profile_trace_writes_the_last_steps_kernels_in_the_order_they_ran(tmp_path, capsys):
    """``--profile-trace``: the last ``count`` device kernels the profiler saw, by start time, with each one's
    time and the gap after the one before (host events and zero-length records left out), and prints them by
    layer and kind (``trace_layers``: here no boundary kernel, so one segment)."""
    from types import SimpleNamespace

    from ds4d.bench.model import _write_trace

    def event(name: str, start: float, end: float, device: str = "CUDA") -> SimpleNamespace:
        span = SimpleNamespace(start=start, end=end, elapsed_us=lambda: end - start)
        return SimpleNamespace(name=name, time_range=span, device_type=SimpleNamespace(name=device))

    events = [event("c", 30.0, 34.5), event("host", 31.0, 40.0, device="CPU"), event("a", 10.0, 12.0),
              event("b", 20.0, 21.0), event("empty", 25.0, 25.0), event("d", 40.0, 41.0)]
    path = tmp_path / "trace.tsv"
    _write_trace(SimpleNamespace(events=lambda: events), 3, path)
    assert path.read_text().splitlines() == ["start_us\ttime_us\tgap_us\tname", "0.0\t1.0\t0.0\tb",
                                             "10.0\t4.5\t9.0\tc", "20.0\t1.0\t5.5\td"]
    printed = capsys.readouterr().out
    assert "| other, each under 2.2 us | 2.0 |" in printed and "| other: c | 4.5 |" in printed
    assert "| gaps | 14.5 |" in printed and "| kernels: count, us | 3, 6.5 |" in printed
    _write_trace(SimpleNamespace(events=lambda: events), 0, path)  # none asked for: a header only
    assert path.read_text().splitlines() == ["start_us\ttime_us\tgap_us\tname"]


def test_inductor_options_are_read_as_json_and_set_only_where_the_config_has_them(monkeypatch):
    torch_config = pytest.importorskip("torch._inductor.config")
    from ds4d.bench.model import inductor_options, set_inductor_option

    options = inductor_options(["combo_kernels=true", "triton.cudagraphs=false", "max_fusion_size = 32", "x=plain"])
    assert options == {"combo_kernels": True, "triton.cudagraphs": False, "max_fusion_size": 32, "x": "plain"}
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        inductor_options(["combo_kernels"])
    monkeypatch.setattr(torch_config, "combo_kernels", False)
    monkeypatch.setattr(torch_config.triton, "cudagraphs", True)
    set_inductor_option("combo_kernels", True)
    set_inductor_option("triton.cudagraphs", False)
    assert torch_config.combo_kernels is True and torch_config.triton.cudagraphs is False
    for missing in ("no_such_option", "no_section.cudagraphs"):
        with pytest.raises(SystemExit, match="has no"):
            set_inductor_option(missing, 1)


def test_the_pdl_rows_launch_their_gemvs_as_dependents_and_the_others_plainly(monkeypatch):
    from ds4d.bench.model import PATH_NOTES, gemv_launches
    from ds4d.bench.random_v4 import GRAPH_PATHS
    from ds4d.cuda import devices

    monkeypatch.setitem(devices.LAUNCH, "pdl", False)
    for path, launched in (("pdl", True), ("pdl-lookahead", True), ("graphs", False), ("lookahead", False)):
        assert path in PATH_NOTES and path in GRAPH_PATHS
        with gemv_launches(path):
            assert devices.LAUNCH["pdl"] is launched
        assert devices.LAUNCH["pdl"] is False
    monkeypatch.setitem(devices.LAUNCH, "pdl", True)
    with pytest.raises(RuntimeError), gemv_launches("graphs"):
        assert devices.LAUNCH["pdl"] is False
        raise RuntimeError("a row that failed")
    assert devices.LAUNCH["pdl"] is True
