"""Triton kernels that read GGUF quantised blocks as llama.cpp writes them, without widening first.

A GGUF weight ``[N, K]`` is ``N`` rows of ``K / block_size`` blocks, each block the bytes of its
type (``gguf.GGML_QUANT_SIZES``); here it is a ``uint8`` tensor ``[N, K / block_size *
type_size]`` on the device (the file's bytes, unchanged).  The types of the DeepSeek-V4 quants
people run (the ds4 q2 recipe: IQ2_XXS gate/up, Q2_K down, Q8_0 the rest; the K-quants of the
q2-q4 and Q*_K_M files; IQ4_XS, IQ3_XXS, IQ2_XS; llama.cpp's MXFP4 for the official FP4 experts)
have decoders in ``gguf_kernels`` (:data:`TYPES`):

* :func:`dequantize`: every element in float32, bit for bit the ``gguf`` package's numpy
  dequantiser (the reference for each block layout);
* :func:`gemv`: ``x [M, K] @ W^T`` for a few rows (decode), a row at a time, each weight
  element decoded in registers and the products summed in float32; with ``experts`` each row
  takes its own expert's matrix from a bank ``[E, N, row_bytes]`` (a decode step's (row, expert)
  pairs);
* :func:`dot_gemv`: the GEMV of the q2 recipe's types on inputs rounded to int8, four byte products
  at a time (``gguf_dot``; :func:`gemv`'s ``int8_inputs`` sends its one-row and by-expert calls there, and
  Q8_0's calls for a few rows of one matrix);
* :func:`tiles`: the same product on tensor cores for a batch of rows (the weight decoded into the
  rows' dtype a tile at a time), and with ``offsets`` for rows sorted by expert (a prefill's
  pairs), tiles of one expert's rows each (the ds4 q2 recipe's types by ``gguf_blockwise``).

With ``TRITON_INTERPRET=1`` the kernels run on CPU tensors: that is how the tests compare them
with the numpy dequantisers.
"""

from __future__ import annotations

import torch

from ds4d.cuda.devices import triton_can_launch

TYPES = {"Q8_0": 0, "Q2_K": 1, "IQ2_XXS": 2, "Q4_K": 3, "Q6_K": 4, "Q5_K": 5, "Q3_K": 6, "IQ4_XS": 7, "IQ3_XXS": 8,
         "IQ2_XS": 9, "MXFP4": 10}
"""The quant types with a decoder, by name (``gguf.GGMLQuantizationType`` names)."""

BLOCKWISE = {"Q8_0": {"block_n": 4, "supers": 4, "warps": 4, "stages": 1},
             "Q2_K": {"block_n": 16, "supers": 1, "warps": 4, "stages": 1},
             "IQ2_XXS": {"block_n": 8, "supers": 2, "warps": 4, "stages": 1}}
"""Types with block-by-block kernels (``gguf_blockwise``) and their GEMV's launch: weight rows per program, blocks of
256 values per trip of its loop, warps, software pipeline stages of the loop (1: none; 0: no loop, every trip
written out); the best of ``tests/gpu/gguf_gemv_sweep.py`` on an H200 (docs/BENCHMARKS.md).  Q8_0's from a later
sweep that timed only the Q8_0 cases before its time ran out: against 8 rows a program and 2 blocks a trip, wq_b
20.7 us (23.5), wkv 5.5 (9.5), wo_b 29.6 (33.2) at one input row, wo_b 77.1 (76.9) at eight; the same launch
pipelined in 3 stages took 59.3 us at eight rows but is left off: on an H100 the test that stages 0 and 3 sum
as 1 bit for bit failed once for IQ2_XXS and passed on a rerun, cause not found (docs/BENCHMARKS.md)."""

MULTI_ROWS = 8
"""Input rows a block-wise GEMV program takes at most (each weight tile decoded once for all of them)."""

_state: dict[str, object] = {}


def available() -> bool:
    """Triton is importable and can launch here (a CUDA device, or the interpreter)."""
    if "available" not in _state:
        _state["available"] = triton_can_launch(_kernels)
    return bool(_state["available"])


def _kernels():
    if "kernels" not in _state:
        from ds4d.cuda import gguf_kernels

        _state["kernels"] = gguf_kernels
    return _state["kernels"]


def _blockwise():
    if "blockwise" not in _state:
        from ds4d.cuda import gguf_blockwise

        _state["blockwise"] = gguf_blockwise
    return _state["blockwise"]


def block_shape(qtype: str) -> tuple[int, int]:
    """(values per block, bytes per block) of ``qtype``."""
    import gguf

    if qtype not in TYPES:
        raise ValueError(f"no GGUF kernel for {qtype}; these have one: {', '.join(TYPES)}")
    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]


def _tables(device: torch.device, qtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(the type's lookup table as float32, the IQ types' 128 sign bytes), from the ``gguf`` package,
    on ``device``: an IQ grid ``[entries, values]``, the 16 values of IQ4_XS's and MXFP4's indices,
    or one unused value."""
    key = ("tables", qtype, str(device))
    if key not in _state:
        import numpy as np
        from gguf import quants

        table = np.zeros(1, dtype=np.float32)
        if qtype in ("IQ2_XXS", "IQ2_XS", "IQ3_XXS"):
            kind = getattr(quants, qtype)
            kind.init_grid()
            table = kind.grid.reshape(kind.grid_shape)
        elif qtype == "IQ4_XS":
            table = np.array(quants.IQ4_NL.kvalues, dtype=np.float32)
        elif qtype == "MXFP4":
            table = np.array(quants.MXFP4.kvalues, dtype=np.float32)
        values = torch.from_numpy(np.ascontiguousarray(table, dtype=np.float32))
        signs = torch.frombuffer(bytearray(quants.IQ2_XXS.ksigns), dtype=torch.uint8)
        _state[key] = (values.to(device), signs.to(device))
    return _state[key]


def _grid_words(device: torch.device) -> torch.Tensor:
    """IQ2_XXS's grid as ``gguf_blockwise`` reads it: int32 ``[256, 2]``, entry ``e``'s eight values as
    bytes, little-endian (value ``i`` in byte ``i % 4`` of word ``i // 4``), from the ``gguf`` package's grid."""
    key = ("words", str(device))
    if key not in _state:
        grid = _tables(torch.device("cpu"), "IQ2_XXS")[0]
        if not bool(((grid >= 0) & (grid < 256) & (grid == grid.round())).all()):
            raise ValueError("the gguf package's IQ2_XXS grid holds values that are not bytes")
        _state[key] = grid.to(torch.uint8).contiguous().view(torch.int32).to(device)
    return _state[key]


def _grid_selectors(device: torch.device) -> torch.Tensor:
    """IQ2_XXS's grid as ``gguf_dot.grid_bytes`` reads it: int32 ``[256]``, value ``i`` of entry ``e`` in nibble
    ``i``: 0, 1 or 2 where it is the first, second or third of the ``gguf`` package's ``grid_map``."""
    key = ("selectors", str(device))
    if key not in _state:
        from gguf import quants

        grid = _tables(torch.device("cpu"), "IQ2_XXS")[0].reshape(256, 8)
        magnitudes = torch.tensor(quants.IQ2_XXS.grid_map, dtype=grid.dtype)
        if tuple(magnitudes.tolist()) != (8, 25, 43) or not bool(torch.isin(grid, magnitudes).all()):
            raise ValueError("the gguf package's IQ2_XXS grid is not made of 8, 25 and 43")
        selectors = (grid[:, :, None] == magnitudes).to(torch.int64).argmax(dim=2)  # [256, 8] in 0..2
        words = (selectors << (4 * torch.arange(8))).sum(dim=1)
        _state[key] = words.to(torch.int32).to(device)
    return _state[key]


WORD_BYTES = {"Q8_0": 2, "Q2_K": 4, "IQ2_XXS": 2}
"""The block-wise kernels read their blocks in words of this many bytes: a matrix starts at a multiple of it
(as every allocation does, and every row, since the rows are whole blocks: 34, 84 and 66 bytes)."""


def _check_word_aligned(raw: torch.Tensor, qtype: str) -> None:
    if raw.data_ptr() % WORD_BYTES[qtype]:
        raise ValueError(f"{qtype} blocks must start at a multiple of {WORD_BYTES[qtype]} bytes for the block-wise "
                         "kernels")


def row_bytes_of(qtype: str, cols: int) -> int:
    """Bytes of a row of ``cols`` values in ``qtype`` blocks (a whole number of blocks, checked)."""
    values, nbytes = block_shape(qtype)
    if cols % values:
        raise ValueError(f"{qtype} rows hold multiples of {values} values, not {cols}")
    return cols // values * nbytes


def _check(raw: torch.Tensor, qtype: str, cols: int) -> int:
    """Bytes per row of ``raw`` for ``cols`` values of ``qtype`` (checked)."""
    row_bytes = row_bytes_of(qtype, cols)
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != row_bytes or not raw.is_contiguous():
        raise ValueError(f"{qtype} weight of {cols} columns: want contiguous uint8 [N, {row_bytes}], "
                         f"got {raw.dtype} {list(raw.shape)}")
    return row_bytes


def dequantize(raw: torch.Tensor, qtype: str, cols: int, *, blockwise: bool = True) -> torch.Tensor:
    """float32 ``[N, cols]``: the values of ``raw``'s blocks (the types of :data:`BLOCKWISE` by
    ``gguf_blockwise``'s decoders unless ``blockwise`` is False)."""
    row_bytes = _check(raw, qtype, cols)
    k = _kernels()
    grid_table, signs = _tables(raw.device, qtype)
    n = raw.shape[0]
    out = torch.empty(n, cols, dtype=torch.float32, device=raw.device)
    if blockwise and qtype in BLOCKWISE:
        _check_word_aligned(raw, qtype)
        block_n = 16
        table = _grid_words(raw.device) if qtype == "IQ2_XXS" else grid_table
        _blockwise().dequant_kernel[(-(-n // block_n), -(-cols // 256))](
            raw, out, table, n, cols, row_bytes, out.stride(0), qtype=TYPES[qtype], block_n=block_n,
            enable_fp_fusion=False)
        return out
    block_n, block_k = 16, 256
    grid = (-(-n // block_n), -(-cols // block_k))
    k.dequant_kernel[grid](raw, out, grid_table, signs, n, cols, row_bytes, out.stride(0), qtype=TYPES[qtype],
                           block_n=block_n, block_k=block_k, enable_fp_fusion=False)
    return out


def _bank(raw: torch.Tensor, qtype: str, cols: int) -> tuple[torch.Tensor, int, int]:
    """(``raw`` as ``[rows, row_bytes]``, bytes per row, bytes per expert) of a matrix ``[N, row_bytes]``
    or a bank ``[E, N, row_bytes]``."""
    if raw.dim() == 3:
        flat = raw.reshape(-1, raw.shape[-1]) if raw.is_contiguous() else raw
        return flat, _check(flat, qtype, cols), raw.shape[1] * raw.shape[2]
    return raw, _check(raw, qtype, cols), 0


def gemv(x: torch.Tensor, raw: torch.Tensor, qtype: str, experts: torch.Tensor | None = None, *,
         blockwise: bool = True, out_dtype: torch.dtype = torch.float32, int8_inputs: bool = False) -> torch.Tensor:
    """``[M, N]`` in ``out_dtype``: each row of ``x [M, K]`` times every weight row of ``raw`` (``N`` rows of
    ``K`` values in ``qtype`` blocks), summed in float32 and rounded once to ``out_dtype`` as the kernel stores
    it (as ``.to(out_dtype)`` of the float32 result, without its launch); with ``experts [M]`` (int), ``raw`` is
    a bank ``[E, N, row_bytes]`` and row ``m`` takes expert ``experts[m]``'s matrix.  The types of
    :data:`BLOCKWISE` take a kernel of their own (``gguf_blockwise``) unless ``blockwise`` is False.
    ``int8_inputs``: a type of :data:`DOT` multiplies one row, rows by expert, and (types of :data:`DOT_ROWS`)
    several rows of one matrix on its inputs rounded to int8 (:func:`dot_gemv`: llama.cpp's numerics; the result
    differs from the float GEMV's by that rounding); other types' rows of one matrix stay on the float GEMV, which
    decodes a tile once for up to :data:`MULTI_ROWS` of them."""
    if blockwise and int8_inputs and qtype in DOT and (experts is not None or x.shape[0] == 1 or qtype in DOT_ROWS):
        return dot_gemv(x, raw, qtype, experts, out_dtype=out_dtype)
    cols = x.shape[-1]
    flat, row_bytes, expert_bytes = _bank(raw, qtype, cols)
    if (experts is None) != (raw.dim() == 2):
        raise ValueError("gemv takes a matrix [N, row_bytes], or a bank [E, N, row_bytes] with experts")
    if x.stride(-1) != 1:
        x = x.contiguous()
    n = raw.shape[-2]
    chosen = experts.to(device=raw.device, dtype=torch.int32) if experts is not None else None
    return _launch_gemv(x, flat, qtype, n, row_bytes, expert_bytes, chosen, blockwise=blockwise, out_dtype=out_dtype)


def _launch_gemv(x: torch.Tensor, flat: torch.Tensor, qtype: str, n: int, row_bytes: int, expert_bytes: int,
                 chosen: torch.Tensor | None, *, blockwise: bool = True,
                 out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The GEMV kernels over weight rows at ``flat``; ``chosen`` (None: one matrix): per row of ``x``, the
    index of its matrix, ``expert_bytes`` apart from ``flat``."""
    cols, m = x.shape[-1], x.shape[0]
    grid_table, signs = _tables(flat.device, qtype)
    out = torch.empty(m, n, dtype=out_dtype, device=flat.device)
    by_expert = chosen is not None
    chosen = chosen if by_expert else signs
    if blockwise and qtype in BLOCKWISE:
        _check_word_aligned(flat, qtype)
        launch = BLOCKWISE[qtype]
        rows_per = 1 if by_expert else min(MULTI_ROWS, 1 << (m - 1).bit_length())
        table = _grid_words(flat.device) if qtype == "IQ2_XXS" else grid_table
        _blockwise().gemv_kernel[(-(-n // launch["block_n"]), -(-m // rows_per))](
            x, flat, out, table, chosen, n, m, cols, row_bytes, expert_bytes, x.stride(0), out.stride(0),
            qtype=TYPES[qtype], by_expert=by_expert, block_n=launch["block_n"], supers=launch["supers"],
            rows_per=rows_per, stages=launch["stages"], num_warps=launch["warps"], enable_fp_fusion=False)
        return out
    block_k = 256 if cols % 256 == 0 else 32
    block_n = 16
    _kernels().gemv_kernel[(-(-n // block_n), m)](x, flat, out, grid_table, signs, chosen, n, cols, row_bytes,
                                                  expert_bytes, x.stride(0), out.stride(0), qtype=TYPES[qtype],
                                                  by_expert=by_expert, block_n=block_n, block_k=block_k,
                                                  enable_fp_fusion=False)
    return out


def gemv_at(x: torch.Tensor, addresses: torch.Tensor, qtype: str, n: int, *, aligned: bool = False,
            out_dtype: torch.dtype = torch.float32, int8_inputs: bool = False,
            gated: float | None = None) -> torch.Tensor:
    """:func:`gemv` with row ``m``'s matrix found by address: ``addresses[m]`` (int64) is where its ``n``
    rows of ``x.shape[1]`` values in ``qtype`` blocks start, rows contiguous, wherever they sit (device
    memory, or host memory the device can read).  The by-expert kernels of :func:`gemv` over a bank of
    small "experts" at an anchor of ``x``'s device: each row's offset from the anchor picks its matrix.
    ``aligned`` (the caller's promise that every address is a multiple of 16): the experts are 16 bytes
    apart, so the compiler knows what it knows of a bank's aligned experts and builds the same kernel:
    the result is :func:`gemv`'s with ``experts`` bit for bit where the bank's matrices are a multiple of
    16 bytes.  Unaligned, the experts are one byte apart, and the sums may round differently (every
    address must still be a multiple of the type's :data:`WORD_BYTES`).  ``int8_inputs`` as in :func:`gemv`;
    ``gated`` (with ``int8_inputs``, a type of :data:`DOT`) as in :func:`dot_gemv`.  No host read: capturable in
    a CUDA graph."""
    row_bytes = row_bytes_of(qtype, x.shape[-1])
    if x.stride(-1) != 1:
        x = x.contiguous()
    if gated is not None and not gated_fits(qtype, int8_inputs):
        raise ValueError(f"gemv_at: a gated product takes int8 inputs and a type of {sorted(DOT)}, not {qtype}")
    if not x.shape[0]:
        return torch.empty(0, n if gated is None else n // 2, dtype=out_dtype, device=x.device)
    anchor = _anchor(x.device)
    unit = 16 if aligned else 1
    offsets = (addresses.to(device=x.device, dtype=torch.int64) - anchor.data_ptr()).contiguous()
    if aligned:
        offsets = offsets // unit
    if int8_inputs and qtype in DOT:
        return _launch_dot(x, anchor, qtype, n, row_bytes, unit, offsets, out_dtype, gated)
    return _launch_gemv(x, anchor, qtype, n, row_bytes, unit, offsets, out_dtype=out_dtype)


def gated_fits(qtype: str, int8_inputs: bool) -> bool:
    """Whether the GEMVs of a ``qtype`` weight (``int8_inputs`` as in :func:`gemv`) take ``gated``: the int8-input
    kernels (:func:`dot_gemv`) do, for one row or rows by expert."""
    return int8_inputs and qtype in DOT


def _anchor(device: torch.device) -> torch.Tensor:
    """16 bytes of ``device`` memory, kept (aligned, as every allocation): the base the addresses of
    :func:`gemv_at` are taken from."""
    key = f"anchor:{device}"
    if key not in _state:
        _state[key] = torch.zeros(16, dtype=torch.uint8, device=device)
    return _state[key]


DOT = {"Q8_0": {"block_n": 4, "groups": 32, "warps": 4, "wide_inputs": True},
       "Q2_K": {"block_n": 16, "groups": 8, "warps": 4, "wide_inputs": True},
       "IQ2_XXS": {"block_n": 4, "groups": 32, "warps": 4, "computed_signs": True, "selector_grid": True,
                   "wide_inputs": True}}
"""Types with a GEMV on int8-quantised inputs (``gguf_dot``) and its launch: weight rows a program, groups of each a
trip (Q8_0, IQ2_XXS: 32 values; Q2_K: 64), warps.  The best of three launches (8 x 16, 16 x 8, 4 x 32, 4 warps) in
``tests/gpu/gguf_dot_sweep.py --launches 3`` on an H100 (docs/BENCHMARKS.md): against 8 x 16, Q8_0's ``wkv``
[512, 4096] 5.2 us (8.7), ``wo_b`` 20.0 (20.8), ``wq_b`` 19.7 (18.1); IQ2_XXS gate/up 42.4 (44.0); Q2_K down 18.6
(24.6).  IQ2_XXS's ``computed_signs`` and ``selector_grid`` (``gguf_dot.iq2_xxs_kernel``: no table gathers for its
signs, half the grid's bytes) took its gate/up at 6 rows by expert from 42.7 to 30.6 us on an H100, the same sums.
``wide_inputs``: the quantised inputs read 16 bytes a load, not 8 (``gguf_dot.input_words``: half the loads, the same
cache lines each; compiled for sm_90 the same sums with 1-3% fewer instructions a value,
``tests/gpu/gguf_sass_count.py --dot``); ``gguf_dot_sweep.py --launches 3 --wide`` on an H100 picked it for every
type (IQ2_XXS gate/up 27.3 us, Q2_K down 18.6, Q8_0 ``wo_b`` 19.8)."""


DOT_ROWS = {"Q8_0": {"block_n": 4, "groups": 32, "warps": 4}}
"""Types whose int8-input GEMV also takes up to :data:`MULTI_ROWS` input rows of one matrix a program (each weight
word read once for all of them: ``gguf_dot.q8_0_rows_kernel``), and its launch as :data:`DOT`'s: the least time
per byte over ``tests/gpu/gguf_dot_sweep.py --rows`` on an H100 (wq_b and wo_b at 2, 4 and 8 rows: 1.19-1.97x
faster than the float GEMV, docs/BENCHMARKS.md).  Compiled for sm_90 eight rows take 6.9 instructions a weight
value against the float GEMV's 56.4."""


def _dot():
    if "dot" not in _state:
        from ds4d.cuda import gguf_dot

        _state["dot"] = gguf_dot
    return _state["dot"]


def _sign_words(device: torch.device) -> torch.Tensor:
    """IQ2_XXS's 128 sign patterns as ``gguf_dot`` applies them: int32 ``[128, 2]``, byte ``i % 4`` of word
    ``i // 4`` 1 where the pattern's value ``i`` is negative (its eight signs from the ``gguf`` package's
    ``ksigns``, the eighth set so that the count of minus signs is even)."""
    key = ("sign words", str(device))
    if key not in _state:
        from gguf import quants

        signs = torch.frombuffer(bytearray(quants.IQ2_XXS.ksigns), dtype=torch.uint8).to(torch.int32)
        bits = (signs[:, None] >> torch.arange(8, dtype=torch.int32)) & 1  # [128, 8]
        _state[key] = bits.to(torch.uint8).contiguous().view(torch.int32).to(device)
    return _state[key]


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [M, K]`` (``K`` a multiple of 32) rounded to int8 in runs of 32, as ``gguf_dot`` multiplies it:
    (int8 ``q [M, K]``, float32 scales ``d [M, K / 32]``, int32 sums of ``q`` over each 16 ``[M, K / 16]``);
    ``x`` is about ``q * d``, each value within half its run's scale."""
    m, k = x.shape
    if k % 32:
        raise ValueError(f"inputs are quantised in runs of 32, not {k} columns")
    if x.stride(-1) != 1:
        x = x.contiguous()
    q = torch.empty(m, k, dtype=torch.int8, device=x.device)
    d = torch.empty(m, k // 32, dtype=torch.float32, device=x.device)
    s = torch.empty(m, k // 16, dtype=torch.int32, device=x.device)
    if m:
        runs = 8
        _dot().quantize_kernel[(m, -(-(k // 32) // runs))](x, q, d, s, k, x.stride(0), runs=runs)
    return q, d, s


def dot_gemv(x: torch.Tensor, raw: torch.Tensor, qtype: str, experts: torch.Tensor | None = None, *,
             out_dtype: torch.dtype = torch.float32, gated: float | None = None) -> torch.Tensor:
    """:func:`gemv` with ``x`` first rounded to int8 (:func:`quantize_rows`) and the products summed four bytes
    at a time in int32 (``gguf_dot``), for the types of :data:`DOT`: ``[M, N]`` in ``out_dtype``, the exact product of
    the quantised inputs with the weight's values up to float32 rounding of the groups' scaled sums.  A program
    takes one input row, so rows of one matrix each read it (the float GEMV decodes it once for up to
    :data:`MULTI_ROWS`), except for the types of :data:`DOT_ROWS`, whose programs take up to that many rows.

    ``gated`` (a SwiGLU limit, 0 for no clamp; one row, or rows by expert): the weight's first half of rows are
    gates and the second their up rows, and the result is ``prefill_triton.swiglu`` of the two halves of the
    product, ``[M, N/2]``, in the GEMV's launch (bit for bit where the rows are summed alike: always in the
    interpreter; a launch of one row a program takes two)."""
    if qtype not in DOT:
        raise ValueError(f"no int8-input GEMV for {qtype}; these have one: {', '.join(DOT)}")
    flat, row_bytes, expert_bytes = _bank(raw, qtype, x.shape[-1])
    if (experts is None) != (raw.dim() == 2):
        raise ValueError("dot_gemv takes a matrix [N, row_bytes], or a bank [E, N, row_bytes] with experts")
    _check_word_aligned(flat, qtype)
    chosen = experts.to(device=raw.device, dtype=torch.int32) if experts is not None else None
    return _launch_dot(x, flat, qtype, raw.shape[-2], row_bytes, expert_bytes, chosen, out_dtype, gated)


def _launch_dot(x: torch.Tensor, flat: torch.Tensor, qtype: str, n: int, row_bytes: int, expert_bytes: int,
                chosen: torch.Tensor | None, out_dtype: torch.dtype = torch.float32,
                gated: float | None = None) -> torch.Tensor:
    """``gguf_dot``'s GEMV over weight rows at ``flat``; ``chosen`` (None: one matrix): per row of ``x``, the index
    of its matrix, ``expert_bytes`` apart from ``flat``; ``gated`` as in :func:`dot_gemv`."""
    cols, m = x.shape[-1], x.shape[0]
    by_expert = chosen is not None
    shared_rows = not by_expert and m > 1 and qtype in DOT_ROWS
    if gated is not None and (n % 2 or shared_rows):
        raise ValueError(f"dot_gemv: no gated product of {n} weight rows for {m} rows of one matrix")
    width = n if gated is None else n // 2
    out = torch.empty(m, width, dtype=out_dtype, device=flat.device)
    if not m:
        return out
    q, d, s = quantize_rows(x)
    launch = dict((DOT_ROWS if shared_rows else DOT)[qtype])
    per_group = 64 if qtype == "Q2_K" else 32
    groups = next(g for g in (launch["groups"], 8, 4, 2, 1) if (cols // per_group) % g == 0)
    if gated is not None:
        launch["block_n"] += launch["block_n"] % 2  # a gate row and its up row side by side
    if shared_rows:
        rows_per = min(MULTI_ROWS, 1 << (m - 1).bit_length())
        _dot().q8_0_rows_kernel[(-(-n // launch["block_n"]), -(-m // rows_per))](
            q, d, flat, out, n, m, cols, row_bytes, block_n=launch["block_n"], groups=groups, rows_per=rows_per,
            native=flat.device.type == "cuda", num_warps=launch["warps"])
        return out
    limit = 0.0 if gated is None else float(gated)
    common = {"by_expert": by_expert, "block_n": launch["block_n"], "groups": groups,
              "native": flat.device.type == "cuda", "num_warps": launch["warps"], "gated": gated is not None,
              "limit": limit, "clamp": limit > 0, "wide_inputs": launch.get("wide_inputs", False)}
    grid = (-(-n // launch["block_n"]), m)  # gated: block_n / 2 of the width outputs a program
    chosen = chosen if by_expert else d
    if qtype == "IQ2_XXS":
        selectors = launch.get("selector_grid", False)
        table = _grid_selectors(flat.device) if selectors else _grid_words(flat.device).view(torch.int64)
        signs = _sign_words(flat.device).view(torch.int64)
        _dot().iq2_xxs_kernel[grid](q, d, flat, out, table, signs, chosen, width, m, cols, row_bytes, expert_bytes,
                                    computed_signs=launch.get("computed_signs", False), selector_grid=selectors,
                                    **common)
    elif qtype == "Q2_K":
        _dot().q2_k_kernel[grid](q, d, s, flat, out, chosen, width, m, cols, row_bytes, expert_bytes, **common)
    else:
        _dot().q8_0_kernel[grid](q, d, flat, out, chosen, width, m, cols, row_bytes, expert_bytes, **common)
    return out


BLOCKWISE_TILES = {
    "Q8_0": {"block_m": 128, "block_n": 64, "supers": 1, "warps": 8, "stages": 1},
    "Q2_K": {"block_m": 64, "block_n": 64, "supers": 1, "warps": 8, "stages": 2},
    "IQ2_XXS": {"block_m": 128, "block_n": 64, "supers": 1, "warps": 8, "stages": 1},
}
"""The block-wise tiles' launch per type of :data:`BLOCKWISE`: input rows and weight rows a program, blocks
of 256 values a trip, warps, pipeline stages of the loop.  Timed on an H200 (``tests/gpu/gguf_tiles_sweep.py``:
a prefill's routed experts at V4-Flash shapes, steps of 2,048 and 4,096 tokens, the least time per FLOP summed
over both): against 64 x 64 in one stage, 4,096-token steps take 0.64x the time for IQ2_XXS gate/up, 0.69x
for Q2_K down and 0.57x for Q8_0 gate/up; 2,048-token steps 1.06x, 0.70x and 1.04x."""


def tiles(x: torch.Tensor, raw: torch.Tensor, qtype: str, offsets: torch.Tensor | None = None, *,
          blockwise: bool = True, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[M, N]`` in ``out_dtype`` (float32 sums rounded once as they are stored): ``x [M, K]`` (float32,
    bfloat16 or float16) times the weight rows of ``raw`` on tensor cores, each weight tile decoded into ``x``'s
    dtype; with ``offsets [E]`` (group ends),
    ``x``'s rows are sorted by expert and ``raw`` is a bank ``[E, N, row_bytes]``.  The types of
    :data:`BLOCKWISE` take ``gguf_blockwise``'s tiles (a trip's values decoded once for a tile of rows)
    unless ``blockwise`` is False."""
    from ds4d.cuda.quant_matmul import _precision, expert_tiles

    cols = x.shape[-1]
    flat, row_bytes, expert_bytes = _bank(raw, qtype, cols)
    if (offsets is None) != (raw.dim() == 2):
        raise ValueError("tiles takes a matrix [N, row_bytes], or a bank [E, N, row_bytes] with offsets")
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, n = x.shape[0], raw.shape[-2]
    out = torch.empty(m, n, dtype=out_dtype, device=raw.device)
    if not m:
        return out
    if offsets is None:
        offsets = torch.tensor([m], dtype=torch.int32, device=raw.device)
    grid_table, signs = _tables(raw.device, qtype)
    if blockwise and qtype in BLOCKWISE:
        _check_word_aligned(flat, qtype)
        launch = BLOCKWISE_TILES[qtype]
        expert, first, end = expert_tiles(offsets.to(raw.device), m, launch["block_m"])
        table = _grid_words(raw.device) if qtype == "IQ2_XXS" else grid_table
        _blockwise().tiles_kernel[(expert.shape[0], -(-n // launch["block_n"]))](
            x, flat, out, table, expert, first, end, n, cols, row_bytes, expert_bytes, x.stride(0), out.stride(0),
            qtype=TYPES[qtype], block_m=launch["block_m"], block_n=launch["block_n"], supers=launch["supers"],
            precision=_precision(x), stages=launch["stages"], num_warps=launch["warps"], enable_fp_fusion=False)
        return out
    block_m, block_n, block_k = 32, 32, 32
    expert, first, end = expert_tiles(offsets.to(raw.device), m, block_m)
    _kernels().tiles_kernel[(expert.shape[0], -(-n // block_n))](
        x, flat, out, grid_table, signs, expert, first, end, n, cols, row_bytes, expert_bytes, x.stride(0),
        out.stride(0), qtype=TYPES[qtype], block_m=block_m, block_n=block_n, block_k=block_k,
        precision=_precision(x), enable_fp_fusion=False)
    return out


GEMV_ROWS = 8
""":func:`linear` takes the GEMV up to this many rows (decode), and the decoded weight past it."""


def linear(x: torch.Tensor, raw: torch.Tensor, qtype: str, *, gemv_rows: int = GEMV_ROWS,
           decoded_rows: int | None = None, int8_inputs: bool = False) -> torch.Tensor:
    """``x [M, K] @ W^T`` in ``x``'s dtype for a weight ``raw`` of ``qtype`` blocks: a GEMV per row up to
    ``gemv_rows`` rows (float32 sums), else the weight decoded into ``x``'s dtype and one dense
    product (prefill: bound by compute, the decoding a small share of it); ``decoded_rows``: decode at
    most this many weight rows at a time (a large matrix, such as an output head, is never whole in
    ``x``'s dtype); ``int8_inputs`` as in :func:`gemv`."""
    if x.shape[0] <= gemv_rows:
        return gemv(x, raw, qtype, out_dtype=x.dtype, int8_inputs=int8_inputs)
    cols, n = x.shape[-1], raw.shape[0]
    step = n if decoded_rows is None else max(1, decoded_rows)
    if step >= n:
        return torch.nn.functional.linear(x, dequantize(raw, qtype, cols).to(x.dtype))
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    for at in range(0, n, step):
        out[:, at:at + step] = torch.nn.functional.linear(x, dequantize(raw[at:at + step], qtype, cols).to(x.dtype))
    return out


def expert_rows(x: torch.Tensor, raw: torch.Tensor, qtype: str, expert_of_row: torch.Tensor,
                offsets: torch.Tensor | None, *, int8_inputs: bool = False, gated: float | None = None) -> torch.Tensor:
    """Rows of ``x [M, K]`` times their expert's matrix of the bank ``raw [E, N, row_bytes]``, in ``x``'s
    dtype: a GEMV per row by ``expert_of_row`` when ``offsets`` is None, else tensor-core tiles over the
    rows sorted by expert (group ends ``offsets``); ``int8_inputs`` as in :func:`gemv`; ``gated`` (the GEMV per
    row, where :func:`gated_fits`) as in :func:`dot_gemv`."""
    if gated is not None:
        if offsets is not None or not gated_fits(qtype, int8_inputs):
            raise ValueError(f"expert_rows: a gated product takes the int8 GEMV per row, not {qtype} here")
        return dot_gemv(x, raw, qtype, expert_of_row, out_dtype=x.dtype, gated=gated)
    if offsets is None:
        return gemv(x, raw, qtype, expert_of_row, out_dtype=x.dtype, int8_inputs=int8_inputs)
    return tiles(x, raw, qtype, offsets, out_dtype=x.dtype)
