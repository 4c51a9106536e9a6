"""Where a V4 step spends its GPU time: per-step wall times and the top kernels.

    PYTHONPATH=. python3 tests/gpu/profile_dsv4.py [--tiny] [--native] [--layers 0,0,4,128] [--out DIR]

Builds the same random model as ``ds4d bench model`` and, for a 2K prefill, a
16K prefill (chunks of 2K), and batch-1 decode after 1K tokens, prints each
engine step's wall time and a torch.profiler table of the CUDA kernels of one
representative step.  A tool for reading, not a test.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from ds4d.bench import model as bench
from ds4d.bench import random_v4
from ds4d.contracts import ForwardBatch, SeqChunk


def _steps(model, ids: list[int], chunk: int, decode: int) -> list[tuple[str, float]]:
    """Prefill ``ids`` in chunks, then decode greedily; wall time of every forward."""
    model.allocate_cache(-(-(len(ids) + decode + 8) // 128) + 1, 1)
    times, pos = [], 0
    logits = None
    while pos < len(ids):
        piece = ids[pos : pos + chunk]
        blocks = tuple(range(-(-(pos + len(piece)) // 128)))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        logits = model.forward(ForwardBatch((SeqChunk(0, tuple(piece), pos, blocks, 1),)))
        torch.cuda.synchronize()
        times.append((f"prefill@{pos}", time.perf_counter() - t0))
        pos += len(piece)
    for _ in range(decode):
        token = int(logits[-1].argmax())
        blocks = tuple(range(-(-(pos + 1) // 128)))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        logits = model.forward(ForwardBatch((SeqChunk(0, (token,), pos, blocks, 1),)))
        torch.cuda.synchronize()
        times.append((f"decode@{pos}", time.perf_counter() - t0))
        pos += 1
    assert torch.isfinite(logits).all(), "non-finite logits"
    return times


def _profile(label: str, fn, out: Path | None) -> None:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60)
    print(f"\n## {label}\n{table}", flush=True)
    if out is not None:
        (out / f"profile_{label}.txt").write_text(prof.key_averages().table(sort_by="cuda_time_total", row_limit=60))
        bench._write_trace(prof, 1 << 20, out / f"trace_{label}.tsv")  # every kernel of the step, in order


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--native", action="store_true", help="FP8 linears and MXFP4 experts")
    parser.add_argument("--layers", default="", help="as bench model's --layers (its default: 0,0,4,128)")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    out = Path(args.out) if args.out else None
    bench_parser = argparse.ArgumentParser()
    bench.add_parser(bench_parser.add_subparsers())
    build_args = bench_parser.parse_args(["model", "--no-hf"] + ["--tiny"] * args.tiny + ["--native"] * args.native
                                         + ["--layers", args.layers] * bool(args.layers))
    cfg, _, built, _, _ = random_v4.build(torch, build_args, torch.device("cuda"))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(100, cfg.vocab_size, (16384,), generator=gen).tolist()
    for path in ("graphs", "eager"):
        model = random_v4.on_path(built, path, built.paths)
        _steps(model, ids[:2048], 2048, 4)  # warm
        times = _steps(model, ids[:2048], 2048, 8) + _steps(model, ids, 2048, 0)
        print(f"# {path}: " + ", ".join(f"{name} {t * 1e3:.1f} ms" for name, t in times), flush=True)
    model = random_v4.on_path(built, "eager", built.paths)
    model.allocate_cache(40, 1)
    first = ForwardBatch((SeqChunk(0, tuple(ids[:2048]), 0, tuple(range(16)), 1),))
    later = ForwardBatch((SeqChunk(0, tuple(ids[2048:4096]), 2048, tuple(range(32)), 1),))
    step = ForwardBatch((SeqChunk(0, (ids[4096],), 4096, tuple(range(33)), 1),))
    _profile("prefill_first_2k", lambda: model.forward(first), out)
    _profile("prefill_second_2k", lambda: model.forward(later), out)
    _profile("decode_b1_eager", lambda: model.forward(step), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
