"""The batch-1 FP8 and MXFP4 GEMVs' launch settings swept shape by shape (``bench model --sweep`` picks one
setting for all shapes together; ``quant_matmul.TUNING["*_shapes"]`` holds per-shape ones): for each weight a
V4-Flash decode step reads, the current setting's time and the three best candidates, weights cold (cycled
through copies, as ``bench.kernels``).  A tool for reading, not a test.

    PYTHONPATH=. python3 tests/gpu/rows_shape_sweep.py [--write FILE] [--mxfp4-only]

``--write FILE``: after each shape, the settings at least 3% faster than the current ones, as JSON
(``{"fp8_rows_shapes": {...}, "mxfp4_rows_shapes": {...}}``, the form of ``quant_matmul.TUNING``).
"""

from __future__ import annotations

import json
import sys

import torch

from ds4d.bench.kernels import _timed_over, cold_copies, routed_rows
from ds4d.cuda import quant_matmul as qm
from ds4d.models.deepseek_v4.quant import quantize_fp8_block

FP8_CANDIDATES = [{"most_rows": 1, "block_n": bn, "block_k": bk, "warps": w}
                  for bn in (1, 2, 4, 8) for bk in (1024, 2048, 4096) for w in (1, 2, 4)]


def mxfp4_candidates(k: int) -> list[dict]:
    """Settings for ``k`` inputs a row: a few rows a program over many bytes a step, up to the whole row (every
    load issued before the first sum, as the fastest FP8 settings), at least one 16-byte load a thread a step."""
    return [{"block_n": bn, "block_b": bb, "warps": w, "ptx_decode": True}
            for bn in (1, 2, 4, 8, 16, 32) for bb in (256, 512, 1024, 2048) for w in (1, 2, 4, 8)
            if bb <= k // 2 and bn * bb // (32 * w) >= 16 and bn * bb <= 16384]


FASTER = {"fp8_rows_shapes": {}, "mxfp4_rows_shapes": {}}
"""Per shape, the settings at least 3% faster than the current ones."""


def sweep(kernel: str, candidates: list[dict], fn, sets, nbytes: int, name: str, key: str) -> None:
    """Time ``kernel``'s settings for one weight shape through ``TUNING[kernel + "_shapes"][key]``."""
    shapes = qm.TUNING[f"{kernel}_shapes"]
    before = shapes.pop(key, None)
    default = dict(before or qm.TUNING[kernel])
    results = []
    try:
        for candidate in [default, *candidates]:
            shapes[key] = candidate
            try:
                results.append((_timed_over(torch, fn, sets, reps=10), candidate))
            except Exception as exc:  # noqa: BLE001 - a setting the compiler refuses: skip it
                print(f"  {name} {candidate}: {type(exc).__name__}")
        base = results[0][0]
        print(f"| {name} ({key}) | default | {base * 1e6:.1f} | {nbytes / base / 1e12:.2f} | {default} |")
        best = sorted(results[1:], key=lambda r: r[0])
        for us, candidate in best[:3]:
            print(f"| {name} ({key}) | best | {us * 1e6:.1f} | {nbytes / us / 1e12:.2f} | {candidate} |", flush=True)
        if best and best[0][0] < 0.97 * base:
            shapes[key] = default
            want = fn(*sets[0]).float()
            shapes[key] = best[0][1]
            diff = ((fn(*sets[0]).float() - want).abs().max() / want.abs().max()).item()
            print(f"| {name} ({key}) | the best against the current | rel. diff {diff:.1e} | | |")
            if diff < 1e-2:
                FASTER[f"{kernel}_shapes"][key] = best[0][1]
    finally:  # the shape's settings as they were
        shapes.pop(key, None)
        if before is not None:
            shapes[key] = before
    if "--write" in sys.argv:
        with open(sys.argv[sys.argv.index("--write") + 1], "w") as f:
            json.dump(FASTER, f, indent=1)


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}\n| weight | setting | us | TB/s | |\n|---|---|---|---|---|")
    experts = 256
    for name, n, k in (("experts gate/up, 6 rows", 4096, 4096), ("experts down, 6 rows", 4096, 2048)):
        packed = torch.randint(0, 256, (experts, n, k // 2), device="cuda", dtype=torch.uint8, generator=gen)
        scales = torch.randint(118, 124, (experts, n, k // 32), device="cuda", dtype=torch.uint8, generator=gen)
        x = torch.randn(6, k, device="cuda", generator=gen).to(torch.bfloat16)
        picks = [routed_rows(torch, gen, experts, 6, 1, "cuda")[0] for _ in range(cold_copies(6 * n * k // 2))]
        sets = [(x, packed, scales, rows) for rows in picks]
        sweep("mxfp4_rows", mxfp4_candidates(k), qm.mxfp4_rows, sets, 6 * n * (k // 2 + k // 32), name, f"{n}x{k}")
        del packed, scales, sets
    if "--mxfp4-only" in sys.argv:
        return
    for name, n, k in (("wq_b", 32768, 1024), ("wo_b", 4096, 8192), ("shared w1 + w3", 4096, 4096),
                       ("shared w2", 4096, 2048), ("wq_a + wkv", 1536, 4096)):
        weight, scale = quantize_fp8_block(torch.randn(n, k, device="cuda", generator=gen) * k**-0.5)
        factors = scale.view(torch.uint8).int().sub(127).float().exp2()
        x = torch.randn(1, k, device="cuda", generator=gen).to(torch.bfloat16)
        sets = [(x, weight.clone(), factors.clone()) for _ in range(cold_copies(n * k))]
        sweep("fp8_rows", FP8_CANDIDATES, qm.fp8_linear, sets, n * k + factors.numel() * 4, name, f"{n}x{k}")
        del sets

if __name__ == "__main__":
    main()
