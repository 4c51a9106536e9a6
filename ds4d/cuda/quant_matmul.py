"""Triton kernels that multiply by DeepSeek-V4's stored weight formats without widening them first.

The release keeps dense linears as FP8 e4m3 with one power-of-two scale per
128 x 128 block (DeepSeek-V4.1: 32 x 32; the kernels take the block edge), and
routed experts as MXFP4 (two e2m1 codes a byte, low nibble first, one ue8m0
scale per 32 inputs).  Widening a weight to bf16
before each product reads its bytes once and writes and reads twice as many
again; these kernels read the stored bytes and widen them in registers, so a
decode step reads half (FP8) or about a quarter (MXFP4) of the bf16 bytes.

* :func:`fp8_linear`: ``x [M, K] @ W[N, K]^T``, bf16 activations, FP8 weights,
  float32 block scales.  One row: a GEMV that sums each block's inputs and
  scales them; a batch: tensor-core tiles stepping through ``K`` one
  scale block at a time, each step scaled per output column; a prefill: the
  weight decoded by a Triton kernel, then cuBLAS.
* :func:`mxfp4_rows`: one row times its own expert's matrix (small-batch decode;
  the rows of one MoE call each pick an expert by index), a GEMV per row; the
  kernel finds each expert through an address table (:func:`mxfp4_rows_at`), so
  an expert may also sit in page-locked host memory the GPU reads in place.
* :func:`gather_cold`: the experts of a few rows that sit in host memory
  copied whole into device scratch by one kernel (large reads), so the GEMV
  then reads device memory; :func:`fetch_rows`: the same for the rows a mask
  names, in as many programs a row as asked (a copy run beside other work).
* :func:`mxfp4_grouped`: rows sorted by expert times their expert's matrix
  (prefill and large batches), tiles of rows of one expert each, tensor cores.

Every product accumulates in float32 and stores in ``x``'s dtype.  Decoding
of the codes is exact (e4m3 and e2m1 values and power-of-two scales are all
bf16 values), so the result differs from "decode, then matmul" only by the
order of the float32 sums.  With ``TRITON_INTERPRET=1`` the kernels run on CPU
tensors: that is how the tests compare them with plain torch.
"""

from __future__ import annotations

import torch

from ds4d.cuda.devices import pdl_launch, pdl_options, triton_can_launch

_state: dict[str, object] = {}


def available() -> bool:
    """Triton is importable and can launch here (a CUDA device, or the interpreter)."""
    if "available" not in _state:
        _state["available"] = triton_can_launch(_kernels)
    return bool(_state["available"])


def _kernels():
    if "kernels" not in _state:
        from ds4d.cuda import quant_kernels

        _state["kernels"] = quant_kernels
    return _state["kernels"]


# ---------------------------------------------------------------------- tunables (``ds4d bench model --sweep``)

TUNING = {
    "fp8_rows": {"most_rows": 1, "block_n": 4, "block_k": 2048, "warps": 2},
    "fp8_rows_shapes": {"32768x1024": {"block_n": 2, "block_k": 1024, "warps": 2},  # wq_b
                        "4096x8192": {"block_n": 2, "block_k": 4096, "warps": 1},  # wo_b
                        "4096x4096": {"block_n": 1, "block_k": 1024, "warps": 1},  # shared w1 + w3
                        "1536x4096": {"block_n": 4, "block_k": 4096, "warps": 4}},  # wq_a + wkv
    "fp8_tiles": {"block_n": 128, "warps": 4, "stages": 3, "programs": 256},
    "fp8_dense_from": 257,
    "mxfp4_rows": {"block_n": 32, "block_b": 256, "warps": 4, "ptx_decode": True},
    "mxfp4_rows_shapes": {"4096x4096": {"block_n": 8, "block_b": 2048, "warps": 8, "ptx_decode": True},  # gate/up
                          "4096x2048": {"block_n": 4, "block_b": 1024, "warps": 2, "ptx_decode": True}},  # down
    "mxfp4_grouped": {"block_m": 64, "block_n": 128, "block_b": 64, "warps": 4, "stages": 3},
}
"""Tile shapes and launch settings (chosen by ``ds4d bench model --sweep`` on an H200).  ``*_shapes``: for
a weight of N rows of K inputs (key ``"NxK"``), settings that replace the kernel's own
(``tests/gpu/rows_shape_sweep.py``; ``--sweep`` sets them aside while it times the kernel's own).  On an
H100 the FP8 ones took wq_b from 14.7 to 13.9 us, wo_b 16.8 to 14.9, the shared expert's w1 + w3 9.6 to
8.4 and wq_a + wkv 6.3 to 4.8 (each half of a pair alone takes the pair's setting: ``fp8_linear``'s
``setting_rows``).  The MXFP4 ones (``--mxfp4-only``, which tries up to the whole row a step, on
an H100, 6 rows by expert): the experts' gate/up 28.3 to 26.8 us and down 16.3 to 14.9."""


# ---------------------------------------------------------------------- FP8 linears


def _precision(x: torch.Tensor) -> str:
    """Tensor-core input precision for rows like ``x``: float32 rows stay float32 (not TF32)."""
    return "ieee" if x.dtype == torch.float32 else "tf32"


def _fp8_split(n: int, k: int, block_n: int, programs: int, block: int = 128) -> tuple[int, int]:
    """(splits of K, ``block``-input steps per split): enough programs to keep the GPU busy at few rows."""
    blocks = -(-k // block)
    splits = max(1, min(blocks, programs // max(1, -(-n // block_n))))
    steps = -(-blocks // splits)
    return -(-blocks // steps), steps


@torch.compiler.disable  # launched as is; torch.compile and CUDA graph capture see one kernel
def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: int = 128,
               gated: float | None = None, setting_rows: int | None = None) -> torch.Tensor:
    """``x [M, K] @ weight[N, K]^T``: ``weight`` float8_e4m3fn, ``scale`` float32 ``[ceil(N/B), ceil(K/B)]``
    for square scale blocks of edge ``B = block`` (a power of two from 16 to 128).

    By row count M (the choice, and so each row's sums, depend only on M's bucket):

    * up to ``most_rows`` (batch-1 decode): a GEMV per row reading the weight in long runs;
    * up to ``fp8_dense_from - 1`` (batched decode): tensor-core tiles of 16/32/64 rows,
      K split so that about ``programs`` programs run, float32 partials added after;
    * more (prefill): the weight decoded to bf16 by a Triton kernel, then cuBLAS (a few
      microseconds of decoding against a product that is bound by compute).

    ``gated`` (a SwiGLU limit, 0 for no clamp; rows that take the GEMV only, :func:`fp8_gated_fits`): the
    weight's first half of rows are gates and the second their up rows, and the result is the SwiGLU of the two
    halves of the product, ``[M, N/2]``, in the GEMV's launch (as :func:`mxfp4_rows_at`).  ``setting_rows``: the
    GEMV's per-shape setting is the one of a weight of that many rows (default N), so that a weight whose rows are
    part of a larger one (``stored.fuse_rows``) sums each row as the larger one does."""
    import triton

    m, k = x.shape
    n = weight.shape[0]
    if x.stride(1) != 1 or weight.stride(1) != 1 or scale.stride(1) != 1:
        raise ValueError("fp8_linear needs the last dimension of x, weight and scale contiguous")
    if block not in (16, 32, 64, 128):
        raise ValueError(f"fp8_linear takes scale blocks of 16, 32, 64 or 128, not {block}")
    if gated is not None and not fp8_gated_fits(m, n):
        raise ValueError(f"fp8_linear: no gated product of {m} rows by {n} weight rows")
    if not m:
        return torch.empty(0, n, dtype=x.dtype, device=x.device)
    kernels = _kernels()
    if m >= TUNING["fp8_dense_from"]:
        return torch.nn.functional.linear(x, fp8_dequant(weight, scale, x.dtype, block))
    rows = TUNING["fp8_rows"]
    if m <= rows["most_rows"]:
        rows = dict(TUNING["fp8_rows_shapes"].get(f"{setting_rows or n}x{k}", rows))
        width = n if gated is None else n // 2
        if gated is not None:
            rows["block_n"] = _paired(rows["block_n"])
        out = torch.empty(m, width, dtype=x.dtype, device=x.device)
        grid = (m, triton.cdiv(n, rows["block_n"]))
        pdl = pdl_launch(x)
        limit = 0.0 if gated is None else float(gated)
        kernels.fp8_rows_kernel[grid](x, weight, scale, out, width, k, x.stride(0), weight.stride(0),
                                      scale.stride(0), out.stride(0), block_n=rows["block_n"],
                                      block_k=rows["block_k"], block=block, pdl=pdl, gated=gated is not None,
                                      limit=limit, clamp=limit > 0, num_warps=rows["warps"], **pdl_options(pdl))
        return out
    tiles = TUNING["fp8_tiles"]
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    splits, steps = _fp8_split(n, k, tiles["block_n"], tiles["programs"], block)
    partial = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, tiles["block_n"]), splits)
    kernels.fp8_tiles_kernel[grid](x, weight, scale, partial, m, n, k, x.stride(0), weight.stride(0),
                                   scale.stride(0), partial.stride(0), partial.stride(1), block_m=block_m,
                                   block_n=tiles["block_n"], steps=steps, block=block, precision=_precision(x),
                                   num_warps=tiles["warps"], num_stages=tiles["stages"])
    return (partial[0] if splits == 1 else partial.sum(0)).to(x.dtype)


def fp8_gated_fits(m: int, n: int) -> bool:
    """Whether :func:`fp8_linear` takes ``gated`` for ``m`` rows by ``n`` weight rows: rows that take the GEMV
    (``most_rows`` at most, at least one) and an even ``n``."""
    return 0 < m <= TUNING["fp8_rows"]["most_rows"] and n % 2 == 0


def fp8_dequant(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, block: int = 128) -> torch.Tensor:
    """The decoded ``[N, K]`` weight in ``dtype`` (exact for bf16 and float32)."""
    import triton

    n, k = weight.shape
    out = torch.empty(n, k, dtype=dtype, device=weight.device)
    _kernels().fp8_dequant_kernel[(triton.cdiv(n, 128), triton.cdiv(k, 128))](
        weight, scale, out, n, k, weight.stride(0), scale.stride(0), out.stride(0), block=block)
    return out


# ---------------------------------------------------------------------- MXFP4 experts


_TABLES: dict[tuple, torch.Tensor] = {}


def expert_table(matrices: torch.Tensor) -> torch.Tensor:
    """int64 ``[E]``: the address of each expert's matrix in ``matrices [E, ...]`` (a uint8 tensor).

    Cached per (address, experts, stride, device): the values are a function of those alone.  A
    miss while a CUDA graph is being captured is computed on the device and not kept."""
    key = (matrices.data_ptr(), matrices.shape[0], matrices.stride(0), str(matrices.device))
    table = _TABLES.get(key)
    if table is None:
        index = torch.arange(matrices.shape[0], dtype=torch.int64, device=matrices.device)
        table = index * (matrices.stride(0) * matrices.element_size()) + matrices.data_ptr()
        capturing = matrices.is_cuda and torch.cuda.is_current_stream_capturing()
        if not capturing:
            if len(_TABLES) > 512:
                _TABLES.clear()
            _TABLES[key] = table
    return table


@torch.compiler.disable
def mxfp4_rows(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, experts: torch.Tensor,
               gated: float | None = None) -> torch.Tensor:
    """``[R, N]``: row ``r`` of ``x [R, K]`` times expert ``experts[r]`` of ``packed [E, N, K/2]``
    (uint8 e2m1 pairs) with ``scales [E, N, K/32]`` (uint8 ue8m0).  ``gated`` (a SwiGLU limit, 0 for none):
    the SwiGLU of the two halves of each product, ``[R, N/2]`` (:func:`mxfp4_rows_at`)."""
    if packed.stride(2) != 1 or scales.stride(2) != 1:
        raise ValueError("mxfp4_rows needs the last dimension of packed and scales contiguous")
    aligned = all(v % 16 == 0 for v in (packed.data_ptr(), packed.stride(0), scales.data_ptr(), scales.stride(0)))
    return mxfp4_rows_at(x, expert_table(packed), expert_table(scales), experts, packed.shape[1],
                         packed.stride(1), scales.stride(1), aligned=aligned, gated=gated)


def _paired(block_n: int) -> int:
    """A gated launch's tile rows: ``block_n`` made even, so that each gate row has its up row beside it."""
    return block_n + block_n % 2


@torch.compiler.disable
def mxfp4_rows_at(x: torch.Tensor, w_table: torch.Tensor, s_table: torch.Tensor, experts: torch.Tensor, n: int,
                  w_row_stride: int, s_row_stride: int, *, aligned: bool = False,
                  gated: float | None = None) -> torch.Tensor:
    """:func:`mxfp4_rows` with each expert found by address (``w_table[e]``, ``s_table[e]``): its
    ``[N, K/2]`` bytes and ``[N, K/32]`` scales with the given row strides, wherever they sit (device
    memory, or host memory the device can read).  The same arithmetic as :func:`mxfp4_rows`.
    ``aligned``: the caller promises every address in both tables is a multiple of 16 (the kernel
    then reads 16-byte vectors, about twice as fast; a false promise reads wrong bytes).

    ``gated`` (a SwiGLU limit; 0 or less: no clamp): rows ``[0, N/2)`` are gates and ``[N/2, N)`` their up
    rows, and the result is ``prefill_triton.swiglu`` of the two halves of the plain product, ``[R, N/2]``,
    bit for bit in the interpreter and wherever the tile's rows are summed alike, in one launch.  Its
    programs take the setting's ``block_n`` rows, rounded up to even: half of them outputs."""
    import triton

    rows, k = x.shape
    if x.stride(1) != 1:
        raise ValueError("mxfp4_rows needs the last dimension of x contiguous")
    if gated is not None and n % 2:
        raise ValueError(f"mxfp4_rows: a gated product of {n} rows (gate rows over as many up rows)")
    t = dict(TUNING["mxfp4_rows_shapes"].get(f"{n}x{k}", TUNING["mxfp4_rows"]))
    width = n if gated is None else n // 2
    if gated is not None:
        t["block_n"] = _paired(t["block_n"])
    out = torch.empty(rows, width, dtype=x.dtype, device=x.device)
    if rows:
        ptx = t["ptx_decode"] and x.is_cuda and torch.version.hip is None  # NVIDIA PTX: not the interpreter
        grid = (rows, triton.cdiv(n, t["block_n"]))  # gated: block_n / 2 of the n / 2 outputs a program
        anchor = out.view(-1).view(torch.uint8)  # a fresh allocation: aligned to the allocator's 512 bytes
        pdl = pdl_launch(x)
        limit = 0.0 if gated is None else float(gated)
        _kernels().mxfp4_rows_kernel[grid](x, w_table, s_table, out, anchor, anchor.data_ptr(), experts, width, k,
                                           x.stride(0), w_row_stride, s_row_stride, out.stride(0),
                                           block_n=t["block_n"], block_b=t["block_b"], ptx_decode=ptx,
                                           aligned=aligned and anchor.data_ptr() % 16 == 0, pdl=pdl,
                                           gated=gated is not None, limit=limit, clamp=limit > 0,
                                           num_warps=t["warps"], **pdl_options(pdl))
    return out


@torch.compiler.disable
def gather_cold(src_table: torch.Tensor, on_host: torch.Tensor, experts: torch.Tensor, dst: torch.Tensor) -> None:
    """For each row ``r`` whose expert ``experts[r]`` is on the host (``on_host[e] != 0``), copy
    ``dst.shape[1]`` int64 words from address ``src_table[e]`` into ``dst[r]`` (``dst``: int64
    ``[rows >= len(experts), words]`` on the device).  No host read: capturable in a CUDA graph."""
    import triton

    rows, words = experts.shape[0], dst.shape[1]
    if rows:
        block = 4096
        _kernels().gather_cold_kernel[(rows, triton.cdiv(words, block))](
            src_table, on_host, experts, dst, words, dst.stride(0), block=block, num_warps=8)


@torch.compiler.disable
def fetch_rows(src_table: torch.Tensor, need: torch.Tensor, experts: torch.Tensor, dst: torch.Tensor,
               programs: int = 0) -> None:
    """For each row ``r`` with ``need[r] != 0``, copy ``dst.shape[1]`` int64 words from address
    ``src_table[experts[r]]`` into ``dst[r]``; ``programs`` a row (0: a program per 4,096 words, as
    :func:`gather_cold`).  No host read: capturable in a CUDA graph."""
    import triton

    rows, words, block = experts.shape[0], dst.shape[1], 4096
    if rows:
        parts = programs or triton.cdiv(words, block)
        span = triton.cdiv(triton.cdiv(words, parts), block) * block
        _kernels().fetch_rows_kernel[(rows, triton.cdiv(words, span))](
            src_table, need, experts, dst, words, dst.stride(0), span, block=block, num_warps=8)


def expert_tiles(offsets: torch.Tensor, rows: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tiles of at most ``block_m`` rows of one expert each, for rows sorted by expert with group
    ends ``offsets [E]``: (expert, first row, end row) per tile, ``rows // block_m + E`` tiles
    (the most there can be; the spare ones have first row == end row).  Device ops only."""
    experts = offsets.shape[0]
    ends = offsets.to(torch.int64)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    tiles = (ends - starts + block_m - 1) // block_m
    tile_ends = torch.cumsum(tiles, 0)
    count = rows // block_m + experts
    index = torch.arange(count, device=offsets.device)
    expert = torch.searchsorted(tile_ends, index, right=True).clamp(max=experts - 1)
    first = starts[expert] + (index - (tile_ends[expert] - tiles[expert])) * block_m
    spare = index >= tile_ends[-1]
    first = torch.where(spare, ends[-1], first)
    end = torch.where(spare, ends[-1], torch.minimum(first + block_m, ends[expert]))
    return expert.to(torch.int32), first.to(torch.int32), end.to(torch.int32)


@torch.compiler.disable
def mxfp4_grouped(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows of ``x [R, K]`` sorted by expert (group ends ``offsets [E]``) times their expert's
    matrix in ``packed [E, N, K/2]`` / ``scales [E, N, K/32]``."""
    import triton

    rows, k = x.shape
    n = packed.shape[1]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows:
        t = TUNING["mxfp4_grouped"]
        pairs = x.view(rows, k // 2, 2)
        even, odd = pairs[..., 0].contiguous(), pairs[..., 1].contiguous()
        expert, first, end = expert_tiles(offsets, rows, t["block_m"])
        grid = (expert.shape[0], triton.cdiv(n, t["block_n"]))
        _kernels().mxfp4_grouped_kernel[grid](even, odd, packed, scales, out, expert, first, end, n, k,
                                              even.stride(0), packed.stride(0), packed.stride(1), scales.stride(0),
                                              scales.stride(1), out.stride(0), block_m=t["block_m"],
                                              block_n=t["block_n"], block_b=t["block_b"], precision=_precision(x),
                                              num_warps=t["warps"], num_stages=t["stages"])
    return out
