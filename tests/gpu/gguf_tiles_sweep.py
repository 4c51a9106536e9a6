"""Time ``gguf_matmul.tiles`` on one GPU for a prefill's routed experts at DeepSeek-V4-Flash shapes: the
block-wise tiles (``gguf_blockwise.tiles_kernel``) over candidate launches, the element-wise ones, and cuBLAS
multiplying the same rows by one bf16 matrix of the same shape (the tensor cores' rate at these shapes, which the
experts' product could reach only if decoding cost nothing).

A case is a 2,048-token prompt step routed to 6 of 256 experts a token, uniformly at random (12,288 rows, about
48 an expert), sorted by expert: gate/up IQ2_XXS [4096 (w1 over w3), 4096], down Q2_K [4096, 2048], and the
gate/up of a Q8_0 file.  A call's time is ``do_bench``'s median; TFLOP/s counts 2 x rows x N x K.  Prints each
candidate, a table of the best per type against the element-wise tiles and cuBLAS, and the best launches as
``gguf_matmul.BLOCKWISE_TILES`` takes them (``with_launches.py`` applies the JSON).

    python3 tests/gpu/gguf_tiles_sweep.py [TILES.json]   # also writes {"tiles": best launches} there
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import triton

from ds4d.cuda import gguf_matmul
from tests.unit.test_gguf_kernels import random_blocks

TOKENS, TOP_K, EXPERTS = 2048, 6, 256
CASES = [  # (label, type, N, K)
    ("gate/up [4096, 4096]", "IQ2_XXS", 4096, 4096),
    ("down [4096, 2048]", "Q2_K", 4096, 2048),
    ("gate/up [4096, 4096]", "Q8_0", 4096, 4096),
]
LAUNCHES = [{"block_m": m, "block_n": n, "supers": 1, "warps": w, "stages": 1}
            for m, n, w in ((64, 64, 8), (64, 32, 4), (64, 32, 8), (128, 64, 8), (32, 64, 4), (64, 128, 8))]


def routed_offsets() -> torch.Tensor:
    """Group ends of a prompt step's rows sorted by expert: each token's ``TOP_K`` distinct experts."""
    choice = torch.rand(TOKENS, EXPERTS, device="cuda").topk(TOP_K, dim=1).indices.flatten()
    return torch.cumsum(torch.bincount(choice, minlength=EXPERTS), 0).to(torch.int32)


def bench(call) -> float:
    """Seconds a call (``do_bench`` median)."""
    return triton.testing.do_bench(call, warmup=5, rep=60, return_mode="median") / 1e3


def main() -> None:
    print(f"{torch.cuda.get_device_name()}: {TOKENS} tokens x top-{TOP_K} of {EXPERTS} experts, do_bench median")
    torch.manual_seed(0)
    offsets = routed_offsets()
    rows = int(offsets[-1])
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
    print(f"{rows} rows, {int(counts.min())}-{int(counts.max())} an expert")
    best, table = {}, []
    for label, qtype, n, k in CASES:
        one = torch.from_numpy(random_blocks(qtype, n, k, seed=n + k)).cuda()
        bank = one.expand(EXPERTS, -1, -1).contiguous()
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        flops = 2.0 * rows * n * k
        times = {}
        for launch in LAUNCHES:
            gguf_matmul.BLOCKWISE_TILES[qtype] = launch
            try:
                s = bench(lambda x=x, bank=bank, qtype=qtype: gguf_matmul.tiles(x, bank, qtype, offsets))
            except Exception as error:  # noqa: BLE001 - a launch that does not compile is reported and skipped
                print(f"  {qtype} {label} {launch}: failed: {type(error).__name__}: {str(error)[:120]}")
                continue
            times[json.dumps(launch)] = s
            print(f"  {qtype} {label} {launch}: {s * 1e3:.2f} ms, {flops / s / 1e12:.1f} TFLOP/s")
        plain = bench(lambda x=x, bank=bank, qtype=qtype: gguf_matmul.tiles(x, bank, qtype, offsets, blockwise=False))
        dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        cublas = bench(lambda x=x, dense=dense: x @ dense.T)
        key = min(times, key=times.get)
        best[qtype] = json.loads(key)
        table.append((label, qtype, times[key], plain, cublas, flops))
    print("\n| case | type | block-wise ms | TFLOP/s | element-wise ms | TFLOP/s | bf16 cuBLAS, one matrix, ms | "
          "TFLOP/s |")
    print("|---|---|---|---|---|---|---|---|")
    for label, qtype, s, plain, cublas, flops in table:
        print(f"| {label} | {qtype} | {s * 1e3:.2f} | {flops / s / 1e12:.1f} | {plain * 1e3:.2f} | "
              f"{flops / plain / 1e12:.1f} | {cublas * 1e3:.2f} | {flops / cublas / 1e12:.1f} |")
    print(f"\nbest tiles launches: {json.dumps(best)}")
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(json.dumps({"tiles": best}))


if __name__ == "__main__":
    main()
