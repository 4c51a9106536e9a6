"""Time ``gguf_matmul.gemv`` (one row) per quant type at DeepSeek-V4-Flash expert shapes, against the
bf16 matmul of the same weight, on one GPU.  Random blocks (finite float16 scale fields); each case
is the median of 20 timed calls after 3 warm ones.  Prints a table: bytes read, time, GB/s.

    python3 tests/gpu/gguf_gemv_sweep.py
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ds4d.cuda import gguf_matmul
from tests.unit.test_gguf_kernels import random_blocks

SHAPES = {"gate/up [4096, 4096]": (4096, 4096), "down [4096, 2048]": (4096, 2048)}


def timed(fn) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    seconds = []
    for _ in range(20):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return float(np.median(seconds))


def main() -> None:
    print(f"{torch.cuda.get_device_name()}: one row, median of 20")
    print("| weight | type | bytes | time | GB/s |")
    print("|---|---|---|---|---|")
    for label, (n, k) in SHAPES.items():
        x = torch.randn(1, k, device="cuda")
        dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        xb = x.bfloat16()
        s = timed(lambda: xb @ dense.T)
        print(f"| {label} | bf16 (cuBLAS) | {dense.nbytes / 2**20:.1f} MiB | {s * 1e6:.1f} us | {dense.nbytes / s / 1e9:.0f} |")
        for qtype in sorted(gguf_matmul.TYPES):
            raw = torch.from_numpy(random_blocks(qtype, n, k, seed=1)).cuda()
            s = timed(lambda: gguf_matmul.gemv(x, raw, qtype))
            print(f"| {label} | {qtype} | {raw.nbytes / 2**20:.1f} MiB | {s * 1e6:.1f} us | {raw.nbytes / s / 1e9:.0f} |")


if __name__ == "__main__":
    main()
