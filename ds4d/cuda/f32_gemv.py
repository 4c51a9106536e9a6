"""Triton kernel: a few rows times the float32 weights a decode step reads whole.

DeepSeek-V4 keeps a few matrices in float32 and multiplies by them in float32:
the router (``[E, D]``) and each compressor's kv and gate projections.  In a
decode step of a small batch, cuBLAS's float32 GEMV read them at 0.9-2.1 TB/s on
an H100 (3.0 TB/s copy ceiling), each after a kernel of its own had widened the
bf16 rows to float32.  Here one launch takes the rows as they are (widened in
registers) and up to two weights sharing those rows (a compressor's two
projections), a program per row and ``block_n`` output columns, each program
reading its weight rows in one wave of loads.

Each output is a float32 dot product of one row with one weight row, so a row's
result does not depend on the other rows; it differs from cuBLAS's only in the
order of the float32 sums.  Triton is imported on first use; with
``TRITON_INTERPRET=1`` it runs on CPU tensors (how the tests compare it with torch).
"""

from __future__ import annotations

import torch

from ds4d.cuda.devices import pdl_launch, pdl_options, triton_can_launch

MAX_ROWS = 8
"""Rows up to which the float32 products of ``ops.linear_f32`` and the compressors take this kernel."""
TUNING = {"block_n": 2, "block_k": 4096, "warps": 4, "warps_one_row": 4}
"""Weight rows a program, inputs a step (at most the weight's width), warps a program (``warps_one_row`` for
a single row).  ``tests/gpu/decode_fusions_time.py`` on an H100 timed these against torch at V4-Flash
shapes; it also found one weight row a program with 8 warps (one row) or 2 (eight rows) faster by up
to 1.4 us a call, not yet run in a whole model."""
_state: dict[str, object] = {}


def _kernel():
    if "kernel" not in _state:
        import triton
        import triton.language as tl

        @triton.jit
        def rows_kernel(x_ptr, a_ptr, b_ptr, out_a, out_b, n_a, n_b, k: tl.constexpr, sx, sa, sb, soa, sob,
                        blocks_a, block_n: tl.constexpr, block_k: tl.constexpr, pdl: tl.constexpr):
            row = tl.program_id(0).to(tl.int64)
            block = tl.program_id(1)
            second = block >= blocks_a  # the second weight's columns follow the first's
            first_cols = block * block_n + tl.arange(0, block_n)
            second_cols = (block - blocks_a) * block_n + tl.arange(0, block_n)
            cols = tl.where(second, second_cols, first_cols)
            live_cols = cols < tl.where(second, n_b, n_a)
            w_rows = tl.where(second, b_ptr + cols[:, None] * sb, a_ptr + cols[:, None] * sa)
            # the first step's weights (which no kernel writes) before waiting for the kernel before (pdl)
            ks = tl.arange(0, block_k)
            ws = tl.load(w_rows + ks[None, :], mask=live_cols[:, None] & (ks[None, :] < k), other=0.0)
            if pdl:  # pdl_kernels.wait_then_release: a name local to _kernel() the interpreter would not find
                tl.extra.cuda.gdc_wait()
                tl.extra.cuda.gdc_launch_dependents()
            xs = tl.load(x_ptr + row * sx + ks, mask=ks < k, other=0.0).to(tl.float32)
            acc = tl.sum(ws.to(tl.float32) * xs[None, :], axis=1)
            for k0 in range(block_k, k, block_k):
                ks = k0 + tl.arange(0, block_k)
                xs = tl.load(x_ptr + row * sx + ks, mask=ks < k, other=0.0).to(tl.float32)
                ws = tl.load(w_rows + ks[None, :], mask=live_cols[:, None] & (ks[None, :] < k), other=0.0)
                acc += tl.sum(ws.to(tl.float32) * xs[None, :], axis=1)
            out = tl.where(second, out_b + row * sob + cols, out_a + row * soa + cols)
            tl.store(out, acc, mask=live_cols)

        _state["kernel"] = rows_kernel
    return _state["kernel"]


def available() -> bool:
    """Triton is importable and can launch here (a CUDA device, or the interpreter)."""
    if "available" not in _state:
        _state["available"] = triton_can_launch(_kernel)
    return bool(_state["available"])


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`rows_f32` takes ``x`` times ``weight`` here: a few rows on CUDA, a float32
    weight of the rows' width."""
    return (x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and weight.dtype == torch.float32
            and weight.dim() == 2 and weight.shape[1] == x.shape[1] and available())


@torch.compiler.disable  # launched as is; torch.compile and CUDA graph capture see one kernel
def rows_f32(x: torch.Tensor, first: torch.Tensor, second: torch.Tensor | None = None):
    """``x [R, K] @ first[N, K]^T`` in float32 (``[R, N]``); with ``second [N2, K]``, the pair of
    products of one launch."""
    import triton

    weights = (first,) if second is None else (first, second)
    if x.stride(1) != 1 or any(w.stride(1) != 1 or w.shape[1] != x.shape[1] for w in weights):
        raise ValueError("rows_f32 needs weights of the rows' width, each contiguous in its last dimension")
    rows, k = x.shape
    outs = [torch.empty(rows, w.shape[0], dtype=torch.float32, device=x.device) for w in weights]
    if rows:
        t = TUNING
        block_n, block_k = t["block_n"], min(t["block_k"], triton.next_power_of_2(k))
        blocks = [triton.cdiv(w.shape[0], block_n) for w in weights]
        a, b = weights[0], weights[-1]
        pdl = pdl_launch(x)
        _kernel()[(rows, sum(blocks))](x, a, b, outs[0], outs[-1], a.shape[0], b.shape[0], k, x.stride(0),
                                       a.stride(0), b.stride(0), outs[0].stride(0), outs[-1].stride(0), blocks[0],
                                       block_n=block_n, block_k=block_k, pdl=pdl,
                                       num_warps=t["warps_one_row"] if rows == 1 else t["warps"], **pdl_options(pdl))
    return outs[0] if second is None else (outs[0], outs[1])
