"""The GGUF GEMV on int8-quantised inputs (``gguf_matmul.dot_gemv``) against the float one (``gemv``, its default
launch) at the q2 recipe's decode shapes (``gguf_gemv_sweep.CASES``), in CUDA graphs over enough distinct
weights to overflow the L2, ``do_bench`` median.  The int8 GEMV's time includes the inputs' quantisation (a
launch of its own).  Each launch of :data:`LAUNCHES` is timed and its result checked against the float GEMV's
(the inputs' rounding: a few 1e-3 of the largest sum); then a table of the best per case, and the launch with
the least time per byte summed over each type's cases.

    PYTHONPATH=. python3 tests/gpu/gguf_dot_sweep.py [BEST.json] [--types IQ2_XXS,Q2_K] [--launches N] [--rows] [--wide]

``--rows``: instead, Q8_0 linears at 2, 4 and 8 input rows of one matrix (a batch's decode step), the launches
of ``gguf_matmul.DOT_ROWS`` (each weight word read once for a program's rows).  IQ2_XXS's cases also time each
launch with the sign bytes computed, and with the grid read as selectors too (:data:`SIGNS`).  ``--wide``:
instead, each launch with the type's default options, its inputs read 8 and 16 bytes a load (``wide_inputs``).
"""

from __future__ import annotations

import argparse
import json

import torch

from ds4d.cuda import gguf_matmul
from tests.gpu.gguf_gemv_sweep import CASES, best_launches, case_inputs, graph_time, report_launches

LAUNCHES = [{"block_n": b, "groups": g, "warps": w}
            for b, g, w in ((8, 16, 4), (16, 8, 4), (4, 32, 4), (8, 8, 2), (32, 8, 8), (16, 16, 8), (64, 4, 8),
                            (32, 4, 4))]
"""``gguf_matmul.DOT``'s launches: weight rows a program, groups of each a trip, warps."""
SIGNS = [dict(launch, computed_signs=True, selector_grid=grid) for grid in (False, True) for launch in LAUNCHES]
"""IQ2_XXS's launches again with its sign bytes computed from the pattern's bits (``gguf_dot.sign_bytes``), and
with its grid read as selectors as well (``gguf_dot.grid_bytes``)."""
ROWS_CASES = [(f"{name} [{n}, {k}], {rows} rows", "Q8_0", n, k, rows, 0)
              for name, n, k in (("wq_b", 32768, 1024), ("wo_b", 4096, 8192)) for rows in (2, 4, 8)]
"""``--rows``: the q2 recipe's largest Q8_0 linears at a batch's rows."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("launches", nargs="?", help="write the best launches (JSON) here")
    parser.add_argument("--types", help="only these types' cases, comma-separated (default: every case)")
    parser.add_argument("--launches", dest="count", type=int, default=len(LAUNCHES), help="only the first N launches")
    parser.add_argument("--rows", action="store_true", help="Q8_0 at several rows of one matrix (DOT_ROWS)")
    parser.add_argument("--wide", action="store_true", help="each launch reading its inputs 8 and 16 bytes a load")
    args = parser.parse_args()
    cases = ROWS_CASES if args.rows else CASES
    cases = [case for case in cases if args.types is None or case[1] in args.types.split(",")]
    launches = gguf_matmul.DOT_ROWS if args.rows else gguf_matmul.DOT
    print(f"{torch.cuda.get_device_name()}: CUDA graphs over distinct weights, do_bench median")
    timed: dict[str, dict[str, float]] = {}
    table = []
    for label, qtype, n, k, rows, experts in cases:
        weights, x, ids, read = case_inputs(qtype, n, k, rows, experts)
        floats = graph_time([lambda w=w, x=x, q=qtype, e=ids: gguf_matmul.gemv(x, w, q, e) for w in weights])
        want = gguf_matmul.gemv(x, weights[0], qtype, ids)
        times = timed[label] = {}
        errors = {}
        variants = [launch for launch in SIGNS if LAUNCHES.index({k: launch[k] for k in LAUNCHES[0]}) < args.count]
        tried = LAUNCHES[:args.count] + (variants if qtype == "IQ2_XXS" and not args.rows else [])
        if args.wide:  # each launch with the type's default options, reading its inputs a word a load and two
            extras = {k: v for k, v in gguf_matmul.DOT[qtype].items() if k not in LAUNCHES[0]}
            tried = [{**launch, **extras, "wide_inputs": wide} for launch in LAUNCHES[:args.count]
                     for wide in (False, True)]
        for launch in tried:
            launches[qtype] = launch
            try:
                got = gguf_matmul.dot_gemv(x, weights[0], qtype, ids)
                error = ((got - want).abs().max() / want.abs().max()).item()
                s = graph_time([lambda w=w, x=x, q=qtype, e=ids: gguf_matmul.dot_gemv(x, w, q, e) for w in weights])
            except Exception as exc:  # noqa: BLE001 - a launch that does not compile is reported and skipped
                print(f"  {label} {launch}: failed: {type(exc).__name__}: {str(exc)[:160]}")
                continue
            times[json.dumps(launch)] = s
            errors[json.dumps(launch)] = error
            print(f"  {label} {launch}: {s * 1e6:.1f} us, {read / s / 1e9:.0f} GB/s, "
                  f"against the float GEMV {error:.1e}")
        best = min(times, key=times.get)
        q8 = graph_time([lambda x=x: gguf_matmul.quantize_rows(x)] * len(weights))
        table.append((label, qtype, read, floats, times[best], errors[best], best, q8))
    print("\n| case | type | bytes | float GEMV us | GB/s | int8 GEMV us | GB/s | float / int8 | difference "
          "| quantise us | launch |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for label, qtype, read, floats, s, error, best, q8 in table:
        print(f"| {label} | {qtype} | {read / 2**20:.1f} MiB | {floats * 1e6:.1f} | {read / floats / 1e9:,.0f} | "
              f"{s * 1e6:.1f} | {read / s / 1e9:,.0f} | {floats / s:.2f}x | {error:.1e} | {q8 * 1e6:.1f} | {best} |")
    report_launches(best_launches(timed, table), args.launches)


if __name__ == "__main__":
    main()
