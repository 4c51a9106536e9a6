"""Time ``gguf_matmul.gemv`` on one GPU for the ds4 q2 recipe's types at DeepSeek-V4-Flash shapes: the
block-by-block kernels (``gguf_gemv``) over candidate launches, the element-wise kernel, and cuBLAS on the
bf16 weight of the same shape.

Each case is a CUDA graph of one call per weight over enough distinct weights (or expert banks) to fill
several times the 50 MB L2, replayed; a call's time is the replay's over the calls (``do_bench`` median).
Cases: Q8_0 linears of one row (``wq_b`` [32768, 1024], ``wkv`` [512, 4096]: few weight rows, so few programs,
``wo_b`` [4096, 8192]) and of eight, and the routed
experts of a batch-1 decode step: six rows, each its own expert of a bank of 64 (gate/up IQ2_XXS
[4096 (w1 over w3), 4096], down Q2_K [4096, 2048]).  GB/s counts the weight bytes the call reads (the six
experts' matrices for the banks).  Prints each candidate, then a table of the best per type against the
element-wise kernel and cuBLAS, and the best launches as ``gguf_matmul.BLOCKWISE`` takes them.

    python3 tests/gpu/gguf_gemv_sweep.py [LAUNCHES.json]   # also writes the best launches there
    python3 tests/gpu/gguf_gemv_sweep.py LAUNCHES.json --types IQ2_XXS,Q2_K   # only those types' cases
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
import triton

from ds4d.cuda import gguf_matmul
from tests.unit.test_gguf_kernels import random_blocks

CASES = [  # (label, type, N, K, rows, experts in the bank; 0: one matrix)
    ("wq_b [32768, 1024], 1 row", "Q8_0", 32768, 1024, 1, 0),
    ("wkv [512, 4096], 1 row", "Q8_0", 512, 4096, 1, 0),
    ("wo_b [4096, 8192], 1 row", "Q8_0", 4096, 8192, 1, 0),
    ("wo_b [4096, 8192], 8 rows", "Q8_0", 4096, 8192, 8, 0),
    ("gate/up [4096, 4096], 6 rows by expert", "IQ2_XXS", 4096, 4096, 6, 64),
    ("down [4096, 2048], 6 rows by expert", "Q2_K", 4096, 2048, 6, 64),
]
UNWEIGHED = {"wkv [512, 4096], 1 row"}
"""Cases timed and shown but left out of the choice of launches: a small matrix's time per byte would outweigh
the others'."""
LAUNCHES = [{"block_n": b, "supers": s, "warps": 4, "stages": p}
            for (b, s), p in itertools.product(((4, 4), (8, 1), (8, 2), (16, 1), (16, 2)), (1, 3))]
LAUNCHES += [{"block_n": b, "supers": s, "warps": 4, "stages": 0} for b, s in ((8, 2), (16, 1))]
"""Stages 0 (every trip written out): compiled for sm_90, the most bytes a thread has in flight grows 1.3-3x at
these two launches (``gguf_sass_count.py --stages 0``), for some more registers."""
LAUNCHES += [{"block_n": b, "supers": s, "warps": w, "stages": 1}
             for b, s, w in ((1, 8, 4), (2, 4, 4), (2, 8, 4), (1, 16, 4), (2, 16, 4), (2, 16, 8), (4, 8, 8))]
"""Few weight rows and wide trips: a 4,096-column row of the q2 experts is 16 blocks, so at 16 a trip a program
reads its whole row at once (one trip, all its loads in flight) and more programs fit each multiprocessor."""
L2_BYTES = 50 << 20


def graph_time(calls) -> float:
    """Seconds per call of a CUDA graph replaying ``calls`` (a list of thunks)."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return triton.testing.do_bench(graph.replay, warmup=5, rep=40, return_mode="median") / 1e3 / len(calls)


def case_inputs(qtype: str, n: int, k: int, rows: int, experts: int):
    """(weights, x, expert ids, bytes one call reads): enough distinct weights to overflow the L2."""
    one = random_blocks(qtype, n * max(experts, 1), k, seed=n + k)
    raw = torch.from_numpy(one).cuda()
    if experts:
        raw = raw.view(experts, n, -1)
        read = rows * raw[0].nbytes
    else:
        read = raw.nbytes
    copies = max(2, -(-4 * L2_BYTES // raw.nbytes))
    weights = [raw] + [raw.clone() for _ in range(copies - 1)]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    ids = torch.randperm(experts, device="cuda")[:rows].int() if experts else None
    return weights, x, ids, read


def best_launches(timed: dict[str, dict[str, float]], rows: list[tuple]) -> dict[str, dict]:
    """Each type's launch with the least time per byte summed over its cases (not those of :data:`UNWEIGHED`):
    ``timed``: case label -> launch (JSON) -> seconds a call; ``rows``: ``(label, type, bytes read, ...)`` a case."""
    chosen = {}
    for qtype in sorted({row[1] for row in rows}):
        weighed = [(label, read) for label, q, read, *_ in rows if q == qtype and label not in UNWEIGHED]
        score = {key: sum(timed[label].get(key, float("inf")) / read for label, read in weighed)
                 for key in timed[weighed[0][0]]}
        chosen[qtype] = json.loads(min(score, key=score.get))
    return chosen


def report_launches(chosen: dict[str, dict], path: str | None) -> None:
    """Print the chosen launches, and write them (JSON) to ``path`` where given."""
    print(f"\nbest launches (each type's cases, time per byte summed): {json.dumps(chosen)}")
    if path:
        Path(path).write_text(json.dumps(chosen))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("launches", nargs="?", help="write the best launches (JSON) here")
    parser.add_argument("--types", help="only these types' cases, comma-separated (default: every case)")
    args = parser.parse_args()
    cases = [case for case in CASES if args.types is None or case[1] in args.types.split(",")]
    print(f"{torch.cuda.get_device_name()}: CUDA graphs over distinct weights, do_bench median")
    timed: dict[str, dict[str, float]] = {}  # case label -> launch (JSON) -> seconds a call
    rows_out = []
    for label, qtype, n, k, rows, experts in cases:
        weights, x, ids, read = case_inputs(qtype, n, k, rows, experts)
        times = timed[label] = {}
        for launch in LAUNCHES:
            gguf_matmul.BLOCKWISE[qtype] = launch
            try:
                s = graph_time([lambda w=w, x=x, q=qtype, e=ids: gguf_matmul.gemv(x, w, q, e) for w in weights])
            except Exception as error:  # noqa: BLE001 - a launch that does not compile is reported and skipped
                print(f"  {label} {launch}: failed: {type(error).__name__}: {str(error)[:120]}")
                continue
            times[json.dumps(launch)] = s
            print(f"  {label} {launch}: {s * 1e6:.1f} us, {read / s / 1e9:.0f} GB/s")
        plain = graph_time([lambda w=w, x=x, q=qtype, e=ids: gguf_matmul.gemv(x, w, q, e, blockwise=False)
                            for w in weights])
        dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        dense_copies = [dense] + [dense.clone() for _ in range(max(1, -(-4 * L2_BYTES // dense.nbytes)) - 1)]
        cublas = graph_time([lambda d=d, x=x: x @ d.T for d in dense_copies])
        dense_read = dense.nbytes * (rows if experts else 1)
        if experts:  # cuBLAS multiplies all rows by one matrix: the per-expert bytes are rows x that
            cublas *= rows
        rows_out.append((label, qtype, read, min(times.values()), plain, dense_read, cublas))
    print("\n| case | type | bytes | block-wise us | GB/s | element-wise us | GB/s | bf16 cuBLAS us | GB/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, qtype, read, s, plain, dense_read, cublas in rows_out:
        print(f"| {label} | {qtype} | {read / 2**20:.1f} MiB | {s * 1e6:.1f} | {read / s / 1e9:,.0f} | "
              f"{plain * 1e6:.1f} | {read / plain / 1e9:,.0f} | {cublas * 1e6:.1f} | {dense_read / cublas / 1e9:,.0f} |")
    report_launches(best_launches(timed, rows_out), args.launches)


if __name__ == "__main__":
    main()
