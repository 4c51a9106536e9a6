"""Triton kernel: routed-expert products for a few rows, reading each row's expert weights by index.

In a decode step of a small batch, each (token, expert) row multiplies its
vector by one expert's matrix: a GEMV per row, bound by the bytes of the
selected experts.  A grouped matmul over the whole 256-expert bank reaches
about half the memory bandwidth there (tiles built for many rows per group);
this kernel reads each row's expert matrix once, in long contiguous runs, and
reaches 3.9-4.5 TB/s on an H200 (``ds4d bench model --profile``; BENCHMARKS.md).

``out[r] = weight[expert[r]] @ x[r]`` for ``x [R, K]``, ``weight [E, N, K]``,
accumulated in float32, stored in ``x``'s dtype.  One program computes
``BLOCK_N`` outputs of one row.  Rows are independent: a row's result does not
depend on the other rows.  Rows that share an expert read it again (the caller
uses the kernel only up to ``MAX_ROWS`` rows, where that costs less than the
grouped matmul's inefficiency).

Triton is imported on first use; :func:`available` says whether the kernel can
run here.  With ``TRITON_INTERPRET=1`` it runs on CPU tensors (that is how the
tests check it against plain torch).
"""

from __future__ import annotations

import torch

from ds4d.cuda.devices import triton_can_launch

MAX_ROWS = 96
BLOCK_N = 2
BLOCK_K = 1024
NUM_WARPS = 4
_state: dict[str, object] = {}


def _kernel():
    if "kernel" not in _state:
        import triton
        import triton.language as tl

        @triton.jit
        def expert_rows(x_ptr, w_ptr, out_ptr, expert_ptr, n, k: tl.constexpr, stride_we, stride_wn, stride_xr,
                        stride_or, block_n: tl.constexpr, block_k: tl.constexpr):
            row = tl.program_id(0)
            cols = tl.program_id(1) * block_n + tl.arange(0, block_n)
            expert = tl.load(expert_ptr + row).to(tl.int64)
            base = w_ptr + expert * stride_we
            acc = tl.zeros([block_n], dtype=tl.float32)
            for k0 in range(0, k, block_k):
                ks = k0 + tl.arange(0, block_k)
                xs = tl.load(x_ptr + row * stride_xr + ks, mask=ks < k, other=0.0).to(tl.float32)
                ws = tl.load(base + cols[:, None] * stride_wn + ks[None, :],
                             mask=(cols[:, None] < n) & (ks[None, :] < k), other=0.0).to(tl.float32)
                acc += tl.sum(ws * xs[None, :], axis=1)
            tl.store(out_ptr + row * stride_or + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < n)

        _state["kernel"] = expert_rows
    return _state["kernel"]


def available() -> bool:
    """Triton is importable and can launch on this process's CUDA device (or in the interpreter)."""
    if "available" not in _state:
        _state["available"] = triton_can_launch(_kernel)
    return bool(_state["available"])


@torch.compiler.disable  # launched as is; torch.compile and CUDA graph capture see one kernel
def expert_rows(x: torch.Tensor, weight: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """``[R, N]``: row ``r`` of ``x [R, K]`` times ``weight[experts[r]] [N, K]``."""
    import triton

    rows, k = x.shape
    n = weight.shape[1]
    if weight.stride(2) != 1 or x.stride(1) != 1:
        raise ValueError("expert_rows needs the last dimension of x and weight contiguous")
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows:
        grid = (rows, triton.cdiv(n, BLOCK_N))
        _kernel()[grid](x, weight, out, experts, n, k, weight.stride(0), weight.stride(1), x.stride(0), out.stride(0),
                        block_n=BLOCK_N, block_k=BLOCK_K, num_warps=NUM_WARPS)
    return out
