"""Time ``gguf_matmul.tiles`` on one GPU for a prefill's routed experts at DeepSeek-V4-Flash shapes: the
block-wise tiles (``gguf_blockwise.tiles_kernel``) over candidate launches, the element-wise ones, and cuBLAS
multiplying the same rows by one bf16 matrix of the same shape (the tensor cores' rate at these shapes, which the
experts' product could reach only if decoding cost nothing).

A case is a prompt step of 2,048 tokens (and one of 4,096, the default ``prefill_chunk``) routed to 6 of 256
experts a token, uniformly at random (12,288 rows, about 48 an expert; 96 at 4,096), sorted by expert: gate/up
IQ2_XXS [4096 (w1 over w3), 4096], down Q2_K [4096, 2048], and the gate/up of a Q8_0 file.  A call's time is
``do_bench``'s median; TFLOP/s counts 2 x rows x N x K.  Prints each candidate, a table of the best per type and
step against the element-wise tiles and cuBLAS, and the best launches (the least time per FLOP summed over the
two steps) as ``gguf_matmul.BLOCKWISE_TILES`` takes them (``with_launches.py`` applies the JSON).

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

STEPS, TOP_K, EXPERTS = (2048, 4096), 6, 256
CASES = [  # (label, type, N, K)
    ("gate/up [4096, 4096]", "IQ2_XXS", 4096, 4096),
    ("down [4096, 2048]", "Q2_K", 4096, 2048),
    ("gate/up [4096, 4096]", "Q8_0", 4096, 4096),
]
LAUNCHES = [{"block_m": m, "block_n": n, "supers": 1, "warps": w, "stages": p}
            for m, n, w, p in ((64, 64, 8, 1), (64, 32, 4, 1), (64, 32, 8, 1), (128, 64, 8, 1), (32, 64, 4, 1),
                               (64, 128, 8, 1), (64, 64, 8, 2), (64, 64, 8, 3))]
"""Candidates (input rows, weight rows, warps, pipeline stages).  Compiled for sm_90 (Triton 3.9), 64 x 64 with 8
warps spills no register for any of the three types; some of the others do for some types (64 x 128: Q8_0 and
IQ2_XXS; 128 x 64: Q8_0; 32 x 64: IQ2_XXS; 64 x 32 with 4 warps: Q8_0); 2 and 3 stages copy a trip's blocks and
inputs ahead into shared memory (at most 160 KiB a program)."""


def routed_offsets(tokens: int) -> torch.Tensor:
    """Group ends of a prompt step's rows sorted by expert: each token's ``TOP_K`` distinct experts."""
    choice = torch.rand(tokens, EXPERTS, device="cuda").topk(TOP_K, dim=1).indices.flatten()
    return torch.cumsum(torch.bincount(choice, minlength=EXPERTS), 0).to(torch.int32)


def bench(call) -> float:
    """Seconds a call (``do_bench`` median)."""
    return triton.testing.do_bench(call, warmup=5, rep=60, return_mode="median") / 1e3


def main() -> None:
    print(f"{torch.cuda.get_device_name()}: steps of {STEPS} tokens x top-{TOP_K} of {EXPERTS} experts, "
          "do_bench median")
    torch.manual_seed(0)
    routes = {tokens: routed_offsets(tokens) for tokens in STEPS}
    for tokens, offsets in routes.items():
        counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
        print(f"{tokens} tokens: {int(offsets[-1])} rows, {int(counts.min())}-{int(counts.max())} an expert")
    best, table = {}, []
    for label, qtype, n, k in CASES:
        one = torch.from_numpy(random_blocks(qtype, n, k, seed=n + k)).cuda()
        bank = one.expand(EXPERTS, -1, -1).contiguous()
        per_flop: dict[str, float] = {}  # launch -> seconds per FLOP, summed over the steps
        for tokens, offsets in routes.items():
            rows = int(offsets[-1])
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            flops = 2.0 * rows * n * k
            times = {}
            for launch in LAUNCHES:
                gguf_matmul.BLOCKWISE_TILES[qtype] = launch
                try:
                    s = bench(lambda x=x, bank=bank, qtype=qtype, o=offsets: gguf_matmul.tiles(x, bank, qtype, o))
                except Exception as error:  # noqa: BLE001 - a launch that does not compile is reported and skipped
                    print(f"  {qtype} {label} {launch}: failed: {type(error).__name__}: {str(error)[:120]}")
                    continue
                times[json.dumps(launch)] = s
                per_flop[json.dumps(launch)] = per_flop.get(json.dumps(launch), 0.0) + s / flops
                print(f"  {qtype} {label} {tokens} tokens {launch}: {s * 1e3:.2f} ms, {flops / s / 1e12:.1f} TFLOP/s")
            plain = bench(lambda x=x, bank=bank, qtype=qtype, o=offsets:
                          gguf_matmul.tiles(x, bank, qtype, o, blockwise=False))
            dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            cublas = bench(lambda x=x, dense=dense: x @ dense.T)
            key = min(times, key=times.get)
            table.append((label, qtype, tokens, key, times[key], plain, cublas, flops))
        best[qtype] = json.loads(min(per_flop, key=per_flop.get))
    print("\n| case | type | step tokens | best launch | block-wise ms | TFLOP/s | element-wise ms | TFLOP/s | "
          "bf16 cuBLAS, one matrix, ms | TFLOP/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label, qtype, tokens, key, s, plain, cublas, flops in table:
        launch = json.loads(key)
        print(f"| {label} | {qtype} | {tokens} | {launch['block_m']} x {launch['block_n']}, {launch['warps']} | "
              f"{s * 1e3:.2f} | {flops / s / 1e12:.1f} | {plain * 1e3:.2f} | {flops / plain / 1e12:.1f} | "
              f"{cublas * 1e3:.2f} | {flops / cublas / 1e12:.1f} |")
    print(f"\nbest tiles launches (time per FLOP summed over the steps): {json.dumps(best)}")
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(json.dumps({"tiles": best}))


if __name__ == "__main__":
    main()
