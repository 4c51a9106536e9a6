"""Time a batch-1 FP8 pair (V4-Flash's wq_a + wkv, and the shared expert's w1 + w3) as two GEMV launches and as
one (``stored.fuse_rows``), each replayed from a CUDA graph of 96 calls; weights cycled through 8 copies so
reads come from memory, not L2.  A tool for reading, not a test.

    PYTHONPATH=. python3 tests/gpu/fp8_pair_time.py
"""

from __future__ import annotations

import torch

from ds4d.models.deepseek_v4.ops import linear, linear_pair
from ds4d.models.deepseek_v4.quant import quantize_fp8_block
from ds4d.models.deepseek_v4.stored import Fp8Weight, fuse_rows

COPIES, CALLS = 8, 100


def graph_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS // COPIES):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    best = float("inf")
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / (CALLS // COPIES * COPIES))
    return best


def main() -> None:
    x = torch.randn(1, 4096, device="cuda").to(torch.bfloat16)
    print(f"{torch.cuda.get_device_name()}: one input row, {COPIES} copies of the weights cycled")
    print("| pair | two launches us | one launch us | ratio |")
    print("|---|---|---|---|")
    for name, first, second in (("wq_a + wkv", 1024, 512), ("w1 + w3", 2048, 2048)):
        pairs = []
        for _ in range(COPIES):
            weights = [Fp8Weight.from_stored(*quantize_fp8_block(torch.randn(n, 4096, device="cuda") * 0.02),
                                             torch.bfloat16) for n in (first, second)]
            apart = [Fp8Weight(w.data.clone(), w.scale.clone(), w.dtype, w.block) for w in weights]
            pairs.append((apart, weights, fuse_rows(*weights)))

        def two():
            for apart, _, _ in pairs:
                linear(x, apart[0])
                linear(x, apart[1])

        def one():
            for _, weights, both in pairs:
                linear_pair(x, *weights, both)

        a, b = graph_us(two), graph_us(one)
        print(f"| {name} | {a:.2f} | {b:.2f} | {b / a:.2f}x |")


if __name__ == "__main__":
    main()
