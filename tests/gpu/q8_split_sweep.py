"""Would Q8_0 linears read faster split out of their blocks?  A Q8_0 block is 34 bytes (a float16 scale, then 32
int8 values), so a row's values sit at 2-byte alignment and the block-wise GEMV (``gguf_blockwise``) reads them
in 16-bit words.  This experiment splits a matrix's blocks into its int8 values ``[N, K]`` (rows 16-byte
aligned, read in 16-byte vectors) and its scales ``[N, K / 32]`` (the same bytes), and times a one-row GEMV on
that layout against ``gguf_matmul.gemv`` on the blocks and cuBLAS on the bf16 matrix, at the shapes of the q2
recipe's Q8_0 linears (V4-Flash widths), in CUDA graphs over enough distinct weights to fill the L2 four times
(``do_bench`` median).  The model does not use the split layout; this says whether it should.

    PYTHONPATH=. python3 tests/gpu/q8_split_sweep.py
    TRITON_INTERPRET=1 PYTHONPATH=. python3 tests/gpu/q8_split_sweep.py --check   # the sums, any machine
"""

from __future__ import annotations

import itertools
import sys

import torch
import triton
import triton.language as tl

from ds4d.cuda import gguf_matmul
from tests.unit.test_gguf_kernels import random_blocks

CASES = [("wq_b [32768, 1024]", 32768, 1024), ("wkv [512, 4096]", 512, 4096), ("wo_b [4096, 8192]", 4096, 8192),
         ("shared w1+w3 [4096, 4096]", 4096, 4096), ("shared w2 [4096, 2048]", 4096, 2048)]
LAUNCHES = [{"block_n": n, "block_k": k, "warps": w} for n, k, w in itertools.product((4, 8, 16), (256, 512), (4, 8))]
L2_BYTES = 50 << 20


@triton.jit
def split_gemv_kernel(x_ptr, q_ptr, d_ptr, out_ptr, n, k: tl.constexpr, block_n: tl.constexpr,
                      block_k: tl.constexpr):
    """``out[0, rows] = x[0] . w[rows]`` for ``block_n`` weight rows: int8 values ``q [N, K]`` (read as 32-bit
    words of four) times their block's float16 scale ``d [N, K / 32]``.  A trip holds ``[block_n, block_k / 32,
    8, 4]`` values (a block's 8 words, a word's 4 bytes split where it sits) and adds value x input x scale into
    a running tile; the sums across the tile happen once, after the loop."""
    rows = tl.program_id(0) * block_n + tl.arange(0, block_n)
    safe = tl.where(rows < n, rows, 0).to(tl.int64)
    nb: tl.constexpr = block_k // 32
    words = q_ptr.to(tl.pointer_type(tl.int32))
    blk = tl.arange(0, nb)
    word = tl.arange(0, 8)
    acc = tl.zeros([block_n, nb, 8, 4], dtype=tl.float32)
    for start in range(0, k, block_k):
        at = start // 4 + blk[:, None] * 8 + word[None, :]  # [nb, 8] word offsets in the row
        w = tl.load(words + safe[:, None, None] * (k // 4) + at[None, :, :])
        q = tl.join(tl.join(w << 24 >> 24, w << 8 >> 24), tl.join(w << 16 >> 24, w >> 24))  # [.., a, i]: byte 2a + i
        q = tl.reshape(q, (block_n, nb, 8, 4)).to(tl.float32)
        x = tl.load(x_ptr + (at * 4)[:, :, None] + tl.arange(0, 4)[None, None, :]).to(tl.float32)
        scales = tl.load(d_ptr + safe[:, None] * (k // 32) + start // 32 + blk[None, :]).to(tl.float32)
        acc += q * x[None, :, :, :] * scales[:, :, None, None]
    tl.store(out_ptr + rows, tl.sum(tl.sum(tl.sum(acc, axis=3), axis=2), axis=1), mask=rows < n)


def split(raw: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 blocks ``[N, K / 32 * 34]`` as (int8 values ``[N, K]``, float16 scales ``[N, K / 32]``)."""
    blocks = raw.view(raw.shape[0], k // 32, 34)
    scales = blocks[:, :, :2].contiguous().view(torch.float16).view(raw.shape[0], k // 32)
    values = blocks[:, :, 2:].contiguous().view(torch.int8).view(raw.shape[0], k)
    return values, scales


def split_gemv(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, launch: dict) -> torch.Tensor:
    n, k = values.shape
    out = torch.empty(1, n, dtype=torch.float32, device=x.device)
    block_k = min(launch["block_k"], k)
    split_gemv_kernel[(-(-n // launch["block_n"]),)](x, values, scales, out, n, k=k, block_n=launch["block_n"],
                                                      block_k=block_k, num_warps=launch["warps"])
    return out


def check() -> None:
    """The split GEMV against the block-wise one on the same blocks, at each launch: within float32 rounding."""
    raw = torch.from_numpy(random_blocks("Q8_0", 24, 1024, seed=1))
    x = torch.randn(1, 1024)
    want = gguf_matmul.gemv(x, raw, "Q8_0")
    values, scales = split(raw, 1024)
    for launch in LAUNCHES:
        got = split_gemv(x, values, scales, launch)
        error = (got - want).abs().max().item() / want.abs().max().item()
        print(f"{launch}: largest difference {error:.1e} of the largest sum")
        assert error < 1e-5, (launch, error)


def main() -> None:
    if "--check" in sys.argv:
        return check()
    from tests.gpu.gguf_gemv_sweep import graph_time

    print(f"{torch.cuda.get_device_name()}: one-row Q8_0 GEMV, CUDA graphs over distinct weights, do_bench median")
    table = []
    for label, n, k in CASES:
        raw = torch.from_numpy(random_blocks("Q8_0", n, k, seed=n + k)).cuda()
        copies = max(2, -(-4 * L2_BYTES // raw.nbytes))
        weights = [raw] + [raw.clone() for _ in range(copies - 1)]
        splits = [split(w, k) for w in weights]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        as_blocks = graph_time([lambda w=w, x=x: gguf_matmul.gemv(x, w, "Q8_0") for w in weights])
        want = gguf_matmul.gemv(x, raw, "Q8_0")
        best = None
        for launch in LAUNCHES:
            try:
                got = split_gemv(x, *splits[0], launch)
                error = (got - want).abs().max().item() / want.abs().max().item()
                seconds = graph_time([lambda s=s, x=x, launch=launch: split_gemv(x, *s, launch) for s in splits])
            except Exception as exc:  # noqa: BLE001 - a launch that does not compile is reported and skipped
                print(f"  {label} {launch}: failed: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            print(f"  {label} {launch}: {seconds * 1e6:.1f} us, {raw.nbytes / seconds / 1e9:.0f} GB/s, "
                  f"error {error:.1e}")
            if best is None or seconds < best[0]:
                best = (seconds, launch)
        dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        dense_copies = [dense] + [dense.clone() for _ in range(max(1, -(-4 * L2_BYTES // dense.nbytes)) - 1)]
        cublas = graph_time([lambda d=d, x=x: x @ d.T for d in dense_copies])
        table.append((label, raw.nbytes, as_blocks, best, cublas, dense.nbytes))
    print("\n| case | Q8_0 bytes | blocks us | GB/s | split us | GB/s | split launch | bf16 cuBLAS us | GB/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, nbytes, as_blocks, (seconds, launch), cublas, dense_bytes in table:
        print(f"| {label} | {nbytes / 2**20:.1f} MiB | {as_blocks * 1e6:.1f} | {nbytes / as_blocks / 1e9:,.0f} | "
              f"{seconds * 1e6:.1f} | {nbytes / seconds / 1e9:,.0f} | {launch} | {cublas * 1e6:.1f} | "
              f"{dense_bytes / cublas / 1e9:,.0f} |")


if __name__ == "__main__":
    main()
