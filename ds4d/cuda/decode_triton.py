"""A DeepSeek-V4 decode step's attention-layer work in Triton kernels (``ds4d.cuda.decode_kernels``), for the
batched decode path of ``ds4d.models.deepseek_v4.decode`` (``ForwardPaths.decode_kernel``).

They take the step's device tensors as they are (positions, state slots and block table may be strided
columns of the packed rows), read no value back to the host and launch a grid fixed by the batch, so a
decode step that uses them is captured in a CUDA graph like the torch path.  With ``TRITON_INTERPRET=1``
they run on CPU tensors: that is how the tests compare them with the torch path.

* :func:`decode_attention`: the scores, softmax (with the per-head sink) and weighted sum over a row's
  window ring and compressed entries (every visible one, or the indexer's picks), read where they sit, the
  keys split into parts over programs and the parts merged by a second kernel;
* :func:`decode_qkv_norms`: the query's and the KV's norms after their low-rank projections, the KV's RoPE and
  its write into the window ring;
* :func:`decode_compress`: a compressor's step: the token's projections into its tail ring, and the entry
  of a window the token closes pooled, normed, rotated and written to the row's block.
"""

from __future__ import annotations

import torch

from ds4d.cuda.devices import triton_can_launch

DECODE_TUNING = {"block_heads": 16, "block_keys": 32, "block_d": 64, "d_out": 64, "chunk": 32, "warps": 4,
                 "stages": 1}
"""Heads per program, keys or entries per tile, columns of a score summed at a time, output columns per
program, keys per part (a program's share of a row's keys), launch settings of :func:`decode_attention`
(``tests/gpu/decode_kernel_sweep.py``; the kernel spills nothing at sm_90, ``tests/gpu/decode_kernels_compile.py``):
a decode row's 64 heads of 512 columns are 32 programs for each part of its keys."""
COMBINE_TUNING = {"block_heads": 4, "d_out": 128, "block_parts": 8, "warps": 4}
"""Heads and output columns per program of the merge of the parts, parts a load, warps."""
QKV_TUNING = {"warps": 4}
"""Warps of :func:`decode_qkv_norms`'s programs (not swept)."""
COMPRESS_TUNING = {"chunk": 8, "warps": 4, "stages": 1}
"""Ring slots pooled at a time and warps of :func:`decode_compress`'s one program a row."""
NO_ENTRIES, EVERY_ENTRY, PICKED_ENTRIES = 0, 1, 2
"""What a decode row attends to besides its window: nothing (no compressor), every visible entry of its block
table in id order (HCA, or CSA while the indexer keeps them all), or the indexer's picks."""
_state: dict[str, object] = {}


def _kernels():
    if "kernels" not in _state:
        from ds4d.cuda import decode_kernels

        _state["kernels"] = decode_kernels
    return _state["kernels"]


def available() -> bool:
    """Triton is importable and the kernels can launch here (a CUDA device, or the interpreter)."""
    if "available" not in _state:
        _state["available"] = triton_can_launch(_kernels)
    return bool(_state["available"])


def decode_attention(q: torch.Tensor, ring: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                     sink: torch.Tensor, scale: float, pool: torch.Tensor | None = None,
                     table: torch.Tensor | None = None, ratio: int = 0, picks: torch.Tensor | None = None,
                     out: torch.Tensor | None = None,
                     unrotate: tuple[torch.Tensor, torch.Tensor] | None = None,
                     norm_rope: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> torch.Tensor:
    """A decode step's attention in two launches: a program per row, block of heads, block of output columns and
    part of the row's keys (``DECODE_TUNING["chunk"]`` of them) writes the part's softmax state to a float32
    scratch; a second merges the parts with the sink into the output.

    ``q [B, heads, d]``: one query per row, at ``positions [B]``; ``ring [S, window, d]``: the window rings,
    row ``b`` reading ``ring[slots[b]]`` (the step's own KV already written into it), slot ``j`` holding position
    ``p - ((p - j) mod window)`` when that is not negative; ``sink [heads]``.  With ``pool [NB, per_block, d]``
    (a compressor's entries), ``table [B, MB]`` (each row's blocks) and ``ratio``: the row also sees entries
    ``0 .. (p + 1) // ratio - 1`` of its blocks, all of them, or with ``picks [B, k]`` those picked (ids of
    the row's entry slots; one past the visible ones is left out).  Keys are the values; scores and sums in
    float32, the probabilities meeting the keys in ``q``'s dtype.  ``unrotate`` (``cos``, ``sin`` ``[B, r / 2]``
    float32): the output's last ``r`` columns, once rounded to its dtype, are rotated back pairwise in the second
    launch, as ``prefill_triton.head_norm_rope(inverse=True)`` would after it.  ``norm_rope`` (``cos``, ``sin``,
    ``eps``): ``q`` as projected, each query RMS-normed and rotated as it is read, the values
    ``prefill_triton.head_norm_rope(q, cos, sin, eps)`` would write (``q`` itself is left as it is).  Fixed shapes
    and no host reads: it can be captured in a CUDA graph."""
    batch, heads, d = q.shape
    q = q if q.stride(2) == 1 else q.contiguous()
    out = torch.empty_like(q) if out is None else out
    if out.stride(2) != 1 or ring.stride(2) != 1:
        raise ValueError("decode_attention reads and writes rows of d contiguous values")
    if batch == 0:
        return out
    entries = NO_ENTRIES if pool is None else (PICKED_ENTRIES if picks is not None else EVERY_ENTRY)
    if entries and (table is None or ratio <= 0 or pool.stride(2) != 1):
        raise ValueError("entries need a block table, a compress ratio and rows of d contiguous values")
    if entries:  # the kernel steps along a row of the table and of the picks one element at a time
        table = table if table.stride(1) == 1 else table.contiguous()
        picks = picks if picks is None or picks.stride(1) == 1 else picks.contiguous()
    pool = ring if pool is None else pool  # unused pointers where there is nothing for them to read
    table = slots[:, None] if table is None else table
    picks = table if picks is None else picks
    t = DECODE_TUNING
    block_h = max(16, min(t["block_heads"], 1 << (heads - 1).bit_length()))
    window = ring.shape[1]
    per_block = pool.shape[1] if entries else 1
    n_slots = table.shape[1] * per_block if entries else 0
    n_picks = picks.shape[1] if entries == PICKED_ENTRIES else 0
    d_out = min(t["d_out"], d)
    block_k = t["block_keys"]
    chunk = -(-t["chunk"] // block_k) * block_k
    window_parts = -(-window // chunk)
    parts = window_parts + -(-(n_picks if entries == PICKED_ENTRIES else n_slots) // chunk)
    o = torch.empty(batch, parts, heads, d, dtype=torch.float32, device=q.device)
    m = torch.empty(batch, parts, heads, dtype=torch.float32, device=q.device)
    s = torch.empty_like(m)
    block_d = min(t["block_d"], d)
    q_cos, q_sin, q_eps = m, m, 0.0  # unread without ``norm_rope``
    if norm_rope is not None:
        (q_cos, q_sin), q_eps = _rope_rows(*norm_rope[:2], batch, d), norm_rope[2]
        if d % block_d or 2 * q_cos.shape[1] > block_d:
            raise ValueError(f"decode_attention: queries of {d} with {2 * q_cos.shape[1]} rotated columns read "
                             f"{block_d} columns at a time (the rotated ones must lie in the last of them)")
    k = _kernels()
    k.decode_attention_kernel[(batch, -(-heads // block_h) * (d // d_out), parts)](
        q, ring, slots, positions, pool, table, picks, o, m, s, q_cos, q_sin, heads, window, max(ratio, 1), per_block,
        n_slots, n_picks, window_parts, float(scale), float(q_eps), q.stride(0), q.stride(1), positions.stride(0),
        slots.stride(0), ring.stride(0), ring.stride(1), pool.stride(0), pool.stride(1), table.stride(0),
        picks.stride(0), q_cos.stride(0), d=d, block_h=block_h, block_k=block_k, block_d=block_d, d_out=d_out,
        chunk=chunk, entries=entries, precision="ieee" if q.dtype == torch.float32 else "tf32",
        rope_pairs=0 if norm_rope is None else q_cos.shape[1], num_warps=t["warps"], num_stages=t["stages"])
    c = COMBINE_TUNING
    c_out = min(c["d_out"], d)
    cos, sin = (m, m) if unrotate is None else _rope_rows(*unrotate, batch, d)  # unread without ``unrotate``
    k.combine_kernel[(batch, -(-heads // c["block_heads"]), d // c_out)](
        o, m, s, sink, out, cos, sin, heads, parts, out.stride(0), out.stride(1), cos.stride(0), d=d,
        block_h=c["block_heads"], d_out=c_out, block_p=c["block_parts"],
        rope_pairs=0 if unrotate is None else cos.shape[1], num_warps=c["warps"])
    return out


def _rope_rows(cos: torch.Tensor, sin: torch.Tensor, batch: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``/``sin`` as float32 ``[batch, r / 2]`` rows of contiguous values, sharing strides, for rows of ``d``."""
    cos, sin = cos.float(), sin.float()
    if cos.shape != sin.shape or cos.shape[0] != batch or not 0 < 2 * cos.shape[1] <= d or cos.stride(1) != 1 \
            or sin.stride() != cos.stride():
        raise ValueError(f"cos/sin {tuple(cos.shape)} for {batch} rows of {d} columns")
    return cos, sin


def decode_qkv_norms(q_low: torch.Tensor, kv_low: torch.Tensor, q_norm: torch.Tensor, kv_norm: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, ring: torch.Tensor, slots: torch.Tensor,
                     positions: torch.Tensor, eps: float) -> torch.Tensor:
    """A decode step's query and KV after their low-rank projections, in one launch: returns the query's
    ``rms_norm(q_low [B, R], q_norm)`` (``q_low``'s dtype), and writes ``apply_rope(rms_norm(kv_low [B, d],
    kv_norm), cos, sin)`` (``cos``/``sin`` ``[B, r / 2]`` float32, the last ``r`` columns rotated) to slot
    ``positions[b] % window`` of ring ``slots[b]`` of ``ring [S, window, d]``, each rounded where ``ops`` rounds.
    Two programs a row, one for each; fixed shapes and no host reads."""
    batch, rank = q_low.shape
    d = kv_low.shape[1]
    if q_low.stride(1) != 1 or kv_low.stride(1) != 1 or ring.stride(2) != 1 or d & (d - 1) or ring.shape[2] != d:
        raise ValueError("decode_qkv_norms takes rows of contiguous values and a power-of-two KV width")
    cos, sin = _rope_rows(cos, sin, batch, d)
    q_residual = torch.empty(batch, rank, dtype=q_low.dtype, device=q_low.device)
    if batch:
        _kernels().qkv_norms_kernel[(batch, 2)](
            q_low, kv_low, q_norm, kv_norm, cos, sin, ring, slots, positions, q_residual, ring.shape[1], float(eps),
            q_low.stride(0), kv_low.stride(0), cos.stride(0), q_residual.stride(0), ring.stride(0), ring.stride(1),
            positions.stride(0), slots.stride(0), rank=rank, block_r=1 << (rank - 1).bit_length(), d=d,
            rope_pairs=cos.shape[1], num_warps=QKV_TUNING["warps"])
    return q_residual


def decode_compress(kv: torch.Tensor, score: torch.Tensor, tail_kv: torch.Tensor, tail_score: torch.Tensor,
                    slots: torch.Tensor, positions: torch.Tensor, table: torch.Tensor, pool: torch.Tensor,
                    norm: torch.Tensor, inv_freq: torch.Tensor, ratio: int, overlap: bool, eps: float) -> None:
    """One decode token a row into a compressor: ``kv``, ``score [B, (1 + overlap) * d]`` (float32, the score
    with its slot bias) go to slot ``p % ring`` of ``tail_kv``, ``tail_score [S, ring, (1 + overlap) * d]``
    (row ``slots[b]``); when ``p + 1`` is a multiple of ``ratio``, window ``w = p // ratio``'s entry (the
    softmax over its slots of their scores, column by column, weighting their projections; with ``overlap``
    the window before's first ``d`` columns join the window's last ``d``), RMS-normed by ``norm [d]`` and its
    last ``2 * len(inv_freq)`` columns rotated pairwise by position ``w * ratio`` (``inv_freq``: the compressed
    layers' RoPE frequencies), is written to ``pool[table[b, w // per_block], w % per_block]``.  Rows whose
    window stays open write no entry."""
    batch = kv.shape[0]
    dim = pool.shape[-1]
    width = dim * (2 if overlap else 1)
    if kv.shape[1] != width or score.shape[1] != width or tail_kv.shape[-1] != width:
        raise ValueError(f"decode_compress: projections of {kv.shape[1]} columns for entries of {dim}")
    if ratio & (ratio - 1) or dim & (dim - 1) or min(kv.stride(1), score.stride(1), pool.stride(2)) != 1:
        raise ValueError("decode_compress takes power-of-two ratios and widths, rows of contiguous columns")
    if tail_kv.stride() != tail_score.stride() or tail_kv.stride(2) != 1:
        raise ValueError("decode_compress reads both tail rings at the same offsets")
    if batch == 0:
        return
    table = table if table.stride(1) == 1 else table.contiguous()
    t = COMPRESS_TUNING
    _kernels().compress_kernel[(batch,)](
        kv, score, tail_kv, tail_score, slots, positions, table, pool, norm, inv_freq, tail_kv.shape[1],
        pool.shape[1], table.shape[1], float(eps), kv.stride(0), score.stride(0), tail_kv.stride(0),
        tail_kv.stride(1), positions.stride(0), slots.stride(0), table.stride(0), pool.stride(0), pool.stride(1),
        ratio=ratio, dim=dim, overlap=bool(overlap), rope_pairs=inv_freq.shape[0], chunk=min(t["chunk"], ratio),
        num_warps=t["warps"], num_stages=t["stages"])
