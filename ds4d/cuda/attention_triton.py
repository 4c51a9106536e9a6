"""A prefill chunk's V4 attention in one Triton kernel, without score tensors in memory.

V4 attention is multi-query: every head reads the same keys, and the keys are
also the values.  A query at position ``p`` sees the window keys at positions
``p - window + 1 .. p``, the compressed entries its mask lets through (all
closed entries of an HCA layer, or the indexer's picks of a CSA layer), and a
per-head sink logit that joins the softmax with no value.  The torch path
(``ds4d.models.deepseek_v4.attention._attend_local``, the reference) builds
``[queries, heads, keys]`` score tensors, masks, concatenations and two
batched matmuls per block.  Here one program takes one query and a block of
heads and walks its window keys and then its entries in tiles, with an online
softmax that starts from the sink (running maximum = the sink logit, running
sum = 1), so nothing larger than a tile is written.

Scores and sums are float32; the probabilities meet the keys in the keys'
dtype (bf16 on the GPU), as in flash attention.  Float32 inputs multiply in full
float32 (not TF32), so float32 models keep their accuracy.  With ``TRITON_INTERPRET=1``
the kernel runs on CPU tensors: that is how the tests compare it with the
torch reference.
"""

from __future__ import annotations

import torch

from ds4d.cuda.devices import triton_can_launch, triton_launches_on

TUNING = {"block_heads": 64, "block_keys": 32, "warps": 8, "stages": 2}
"""Heads per program, keys or entries per tile, launch settings (``tests/gpu/attention_sweep.py`` on an H200)."""
PER_REQUEST = ["n_keys", "first", "start", "n_entries", "smn"]
"""Arguments that change with every prompt (its length, its offset, how many entries it sees): compiled
once for any value, not once per value class (Triton would otherwise specialise on 1 and on multiples of
16, and a prompt at a new offset would compile a new kernel while its caller waits)."""
_state: dict[str, object] = {}


def _kernels():
    if "kernel" not in _state:
        import triton
        import triton.language as tl

        @triton.jit(do_not_specialize=PER_REQUEST)
        def attention_kernel(q_ptr, keys_ptr, ent_ptr, emask_ptr, sink_ptr, out_ptr, heads, n_keys, first, start,
                             window, n_entries, scale, sqn, sqh, skn, sen, sek, smn, smk, son, soh,
                             d: tl.constexpr, block_h: tl.constexpr, block_k: tl.constexpr, window_tiles: tl.constexpr,
                             extra: tl.constexpr, precision: tl.constexpr):
            query = tl.program_id(0)
            h = tl.program_id(1) * block_h + tl.arange(0, block_h)
            live_h = h < heads
            dims = tl.arange(0, d)
            q = tl.load(q_ptr + query * sqn + h[:, None] * sqh + dims[None, :], mask=live_h[:, None], other=0.0)
            m = tl.load(sink_ptr + h, mask=live_h, other=0.0).to(tl.float32)  # the sink: exp(sink - m) = 1
            s_sum = tl.full([block_h], 1.0, tl.float32)
            acc = tl.zeros([block_h, d], dtype=tl.float32)
            pos = start + query
            lo = tl.maximum(pos - window + 1 - first, 0)  # window keys: key j sits at position first + j
            hi = tl.minimum(pos - first + 1, n_keys)
            for tile in range(window_tiles):  # a fixed count (tiles past ``hi`` are masked off)
                idx = lo + tile * block_k + tl.arange(0, block_k)
                live = idx < hi
                k_tile = tl.load(keys_ptr + idx[:, None] * skn + dims[None, :], mask=live[:, None], other=0.0)
                logits = tl.dot(q, tl.trans(k_tile.to(q.dtype)), input_precision=precision).to(tl.float32) * scale
                logits = tl.where(live[None, :], logits, float("-inf"))
                top = tl.maximum(m, tl.max(logits, axis=1))  # online softmax: rescale what came before
                p = tl.exp(logits - top[:, None])
                alpha = tl.exp(m - top)
                s_sum = s_sum * alpha + tl.sum(p, axis=1)
                acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), k_tile.to(q.dtype), input_precision=precision)
                m = top
            if extra != 0:  # 1: entries [E, d] shared by all queries; 2: each query's own [n, E, d]
                base = ent_ptr + (query * sen if extra == 2 else 0)
                start_k = 0
                while start_k < n_entries:  # a bound read at run time (a ``for`` over one fails in the interpreter)
                    idx = start_k + tl.arange(0, block_k)
                    start_k += block_k
                    live = idx < n_entries
                    add = tl.load(emask_ptr + query * smn + idx * smk, mask=live, other=float("-inf")).to(tl.float32)
                    e_tile = tl.load(base + idx[:, None] * sek + dims[None, :], mask=live[:, None], other=0.0)
                    e_tile = e_tile.to(q.dtype)
                    logits = tl.dot(q, tl.trans(e_tile), input_precision=precision).to(tl.float32) * scale + add[None, :]
                    top = tl.maximum(m, tl.max(logits, axis=1))
                    p = tl.exp(logits - top[:, None])
                    alpha = tl.exp(m - top)
                    s_sum = s_sum * alpha + tl.sum(p, axis=1)
                    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), e_tile, input_precision=precision)
                    m = top
            out = acc / s_sum[:, None]
            tl.store(out_ptr + query * son + h[:, None] * soh + dims[None, :], out.to(out_ptr.dtype.element_ty),
                     mask=live_h[:, None])

        _state["kernel"] = attention_kernel
    return _state["kernel"]


def available() -> bool:
    """Triton is importable and can launch here (a CUDA device, or the interpreter)."""
    if "available" not in _state:
        _state["available"] = triton_can_launch(_kernels)
    return bool(_state["available"])


def usable(q: torch.Tensor) -> bool:
    """Whether :func:`window_attention` takes queries ``[n, heads, d]`` like ``q``: ``d`` a power of
    two of at least 16, on a CUDA device (or on the CPU in Triton's interpreter), and Triton can launch."""
    d = q.shape[-1]
    return d >= 16 and d & (d - 1) == 0 and triton_launches_on(q) and available()


def window_attention(q: torch.Tensor, keys: torch.Tensor, first: int, start: int, window: int, sink: torch.Tensor,
                     scale: float, extra: tuple[torch.Tensor, torch.Tensor] | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """``q [n, heads, d]`` at positions ``start ..``; ``keys [K, d]`` (also the values) at positions
    ``first ..``, each query seeing those within ``window`` before it; ``sink [heads]`` logits;
    ``extra``: compressed entries ``[E, d]`` shared by all queries with an additive mask ``[n, E]``
    (0 or -inf), or each query's own ``[n, E, d]`` with mask ``[n, E]``.  Writes ``[n, heads, d]``
    into ``out`` (a fresh tensor if None) and returns it."""
    n, heads, d = q.shape
    q = q if q.stride(2) == 1 else q.contiguous()
    keys = keys if keys.stride(1) == 1 else keys.contiguous()
    out = torch.empty_like(q) if out is None else out
    if out.stride(2) != 1:
        raise ValueError("window_attention writes rows of d contiguous values")
    if n == 0:
        return out
    kind, entries, mask = 0, keys, keys  # unused pointers when there are no entries
    if extra is not None:
        entries, mask = extra
        kind = 2 if entries.dim() == 3 else 1
        if entries.stride(-1) != 1:
            entries = entries.contiguous()
    t = TUNING
    block_h = max(16, min(t["block_heads"], 1 << (heads - 1).bit_length()))
    sen = entries.stride(0) if kind == 2 else 0
    sek = entries.stride(-2) if kind else 0
    smn, smk = (mask.stride(0), mask.stride(1)) if kind else (0, 0)
    n_entries = entries.shape[-2] if kind else 0
    grid = (n, -(-heads // block_h))
    _kernels()[grid](q, keys, entries, mask, sink, out, heads, keys.shape[0], first, start, window, n_entries,
                     float(scale), q.stride(0), q.stride(1), keys.stride(0), sen, sek, smn, smk, out.stride(0),
                     out.stride(1), d=d, block_h=block_h, block_k=t["block_keys"],
                     window_tiles=-(-window // t["block_keys"]),
                     extra=kind, precision="ieee" if q.dtype == torch.float32 else "tf32",
                     num_warps=t["warps"], num_stages=t["stages"])
    return out
