"""Compare `ds4d bench model --json` and `ds4d bench agent --json` results with the committed baseline
of the machine (docs/bench/h200.json, docs/bench/h100.json: ``gate.sh`` picks it by the GPU's name).

    python3 tests/gpu/gate.py RESULT.json [RESULT.json ...] [--baseline docs/bench/h200.json]
                              [--tolerance 0.10] [--update]

Each result file is named ``<depth>.json`` (e.g. ``layers4.json``, ``full.json``, ``agent_gpu.json``); its
rows' ``ds4d`` figures (tok/s, higher is better) are keyed ``<depth>: <row label>``.  The gated rows are
the headline paths (``GATED``: decode b1/b8 through graphs, with and without steps queued ahead,
prefill 2K and 32K, an offload row's decode and prefills, an agent's next step with its prefix reused
and cold); a gated figure more than ``--tolerance`` below its baseline is a regression: the table marks
it and the exit status is 1.  The ablation rows (torch or Numba hyper-connections, no graphs, torch
attention, ...) are printed for reference and never gate: they are host-bound and swing by more
than 10% between runs of the same tree on the H200 (the no-graphs decode row gave 48, 72 and 80
tok/s).  A key without a baseline is reported as new.  ``--update`` writes every gated figure that
is new or better into the baseline (regressions are never written) and exits 0 unless a regression
was found.  ``gate.sh`` has ``bench model`` time each row five times (``--repeats``) and gates their median:
single runs of the rows that wait on the host between steps (one step at a time, prefill) moved 5-23%
minutes apart on one H100, both ways, on code neither run changed.  With results of two depths it also prints each decode row's cost per layer against
that of its floor (the deeper run's step time minus the shallower's, over the layers between).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

DEFAULT_BASELINE = Path(__file__).resolve().parents[2] / "docs" / "bench" / "h200.json"
AGENT_REUSED = "step 2 prompt tok/s to first token, prefix reused"
AGENT_COLD = "step 2 prompt tok/s to first token, cold"
GATED = frozenset({"decode b1 @1K", "decode b1 @1K (graphs, steps queued ahead)", "decode b8 @1K",
                   "decode b8 @1K (graphs, steps queued ahead)", "prefill 2048 tok, b1",
                   "prefill 32768 tok, b1", "prefill 32768 tok, b1 (one step, layer by layer)",
                   AGENT_REUSED, AGENT_COLD})


def figures(path: Path) -> dict[str, float]:
    """``{"<name>: <label>": tok/s}`` for the rows of one bench result that produced a number: ``bench
    model --json`` rows (the offload rows' labels start with their placement, "88% on device: ..."), or
    ``bench agent --json`` (its step 2's prompt tokens over its time to first token, medians over the
    repeats, with the prefix reused and cold)."""
    data = json.loads(path.read_text())
    rows = data["rows"]
    if rows and "ttft_reused_ms" in rows[0]:
        def rate(ms_key: str) -> float:
            return statistics.median(row["step2_prompt_tokens"] / (row[ms_key] / 1e3) for row in rows)
        return {f"{path.stem}: {AGENT_REUSED}": rate("ttft_reused_ms"), f"{path.stem}: {AGENT_COLD}": rate("ttft_cold_ms")}
    return {f"{path.stem}: {row['case']}": float(row["ds4d"]) for row in rows if row.get("ds4d")}


def spreads(path: Path) -> dict[str, tuple[float, float]]:
    """``{"<name>: <label>": (lowest, highest)}`` for the ``bench model --json`` rows timed more than once
    (``--repeats``: the row's figure is their median)."""
    rows = json.loads(path.read_text())["rows"]
    return {f"{path.stem}: {row['case']}": (row["extra"]["lowest"], row["extra"]["highest"])
            for row in rows if "runs" in row.get("extra", {})}


def compare(got: dict[str, float], baseline: dict[str, float], tolerance: float) -> list[tuple[str, float, float | None, str]]:
    """One (key, now, before, verdict) per figure measured now; verdicts: ok, better, REGRESSED, new,
    and "not gated" for the rows outside ``GATED``."""
    table = []
    for key, now in sorted(got.items()):
        before = baseline.get(key)
        if key.rsplit(": ", 1)[-1] not in GATED:  # "full: 88% on device: decode b1 @1K" -> "decode b1 @1K"
            verdict = "not gated"
        elif before is None:
            verdict = "new"
        elif now < (1 - tolerance) * before:
            verdict = "REGRESSED"
        elif now > before:
            verdict = "better"
        else:
            verdict = "ok"
        table.append((key, now, before, verdict))
    return table


def _depth(path: Path) -> int | None:
    """4 for ``layers4.json``; None for a name that gives no depth."""
    digits = path.stem.removeprefix("layers")
    return int(digits) if digits.isdigit() else None


def _batch(label: str) -> int | None:
    """8 for ``decode b8 @1K ...``; None for a row that is not a decode row."""
    if not label.startswith("decode b"):
        return None
    return int(label.split()[1][1:])


def per_layer(results: list[Path]) -> list[tuple[str, float, float]]:
    """(decode row, ms per layer, its floor in ms per layer) from the shallowest and deepest results:
    the step time of the deeper run minus the shallower's, over the layers between them (the head, the
    embedding and the sampler cancel out).  Needs two result files of different depths."""
    runs = sorted((d, path) for path in results if (d := _depth(path)) is not None)
    if len(runs) < 2 or runs[0][0] == runs[-1][0]:
        return []
    (low, shallow), (high, deep) = runs[0], runs[-1]
    rows = {depth: {row["case"]: row for row in json.loads(path.read_text())["rows"]}
            for depth, path in ((low, shallow), (high, deep))}
    out = []
    for label, row in rows[high].items():
        batch, other = _batch(label), rows[low].get(label)
        if batch is None or other is None or not (row.get("ds4d") and other.get("ds4d")):
            continue
        step = lambda r: batch / r  # seconds per step at r tok/s over the batch  # noqa: E731
        ms = (step(row["ds4d"]) - step(other["ds4d"])) / (high - low) * 1e3
        floor = ((step(row["floor"]) - step(other["floor"])) / (high - low) * 1e3
                 if row.get("floor") and other.get("floor") else float("nan"))
        out.append((label, ms, floor))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", type=Path)
    parser.add_argument("--baseline", type=Path, default=DEFAULT_BASELINE)
    parser.add_argument("--tolerance", type=float, default=0.10)
    parser.add_argument("--update", action="store_true", help="write new and better figures into the baseline")
    args = parser.parse_args(argv)

    got: dict[str, float] = {}
    spread: dict[str, tuple[float, float]] = {}
    for path in args.results:
        got.update(figures(path))
        spread.update(spreads(path))
    stored = json.loads(args.baseline.read_text()) if args.baseline.is_file() else {"figures": {}}
    baseline = stored["figures"]
    table = compare(got, baseline, args.tolerance)
    width = max((len(key) for key, *_ in table), default=10)
    print(f"{'figure (tok/s)':<{width}}  {'now':>10}  {'baseline':>10}  {'ratio':>6}  {'runs (low-high)':>21}  verdict")
    for key, now, before, verdict in table:
        ratio = f"{now / before:6.2f}" if before else "     -"
        before_text = f"{before:10.1f}" if before else "         -"
        low_high = f"{spread[key][0]:.1f}-{spread[key][1]:.1f}" if key in spread else "-"
        print(f"{key:<{width}}  {now:10.1f}  {before_text}  {ratio}  {low_high:>21}  {verdict}")
    layers = per_layer(args.results)
    if layers:
        print(f"\n{'per layer (decode step, from the two depths)':<{width}}  {'ms':>10}  {'floor ms':>10}  {'x floor':>7}")
        for label, ms, floor in layers:
            print(f"{label:<{width}}  {ms:10.3f}  {floor:10.3f}  {ms / floor:7.2f}")
    regressed = [key for key, *_, verdict in table if verdict == "REGRESSED"]
    if args.update:
        for key, now, before, verdict in table:
            if verdict in ("new", "better"):
                baseline[key] = round(now, 1)
        args.baseline.parent.mkdir(parents=True, exist_ok=True)
        args.baseline.write_text(json.dumps({**stored, "figures": dict(sorted(baseline.items()))}, indent=1) + "\n")
    if regressed:
        print(f"{len(regressed)} figure(s) more than {args.tolerance:.0%} below the baseline", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
