"""Linear layers of the llama family on the CPU, in the weight format the config picks.

``DenseLinear`` multiplies float weights (MKL for float32, oneDNN for bfloat16);
``Int4Linear`` multiplies a GGUF file's own quantised blocks with torch's CPU int4
kernel (``weight_format = "int4"``).  Both compute ``residual + x @ W.T`` for one
weight or several fused along the output dimension.  The row-invariance each one
relies on is described in ds4d/models/llama.py (dense) and below (int4).

int4
----
torch's CPU int4 kernel (``_weight_int4pack_mm_for_cpu``) multiplies activations by
a weight of 4-bit values stored in groups of 32 along the reduction, each group of
each output row with its own scale and zero:

    w = (nibble - 8) * scale + zero        (scale, zero as bfloat16; float32 FMAs)

GGUF's legacy block formats (32 weights per block) map onto that with the file's own
4-bit values; nothing is re-quantised:

* ``Q4_0``  w = d (q - 8):   nibble q, scale d, zero 0.
* ``Q4_1``  w = d q + m:     nibble q, scale d, zero m + 8 d.
* ``Q8_0``  w = d q, q int8: u = q + 128 = 16 hi + lo splits into two 4-bit planes,
  w = 16 d (hi - 8) + [d (lo - 8) + 8 d].  The planes lie side by side along the
  reduction and the activation is repeated once per plane, so one kernel call (one
  float32 accumulation, one output rounding) computes the Q8_0 product.

The conversions are the kernel's own: its scales and zeros are bfloat16, so ``d`` (a
float16) and ``m + 8 d`` are rounded to 8 significant bits (relative error <= 2^-8
per group; for Q4_0 and Q8_0 that is exactly "the file's scale rounded to bfloat16"),
and its inputs and outputs are bfloat16.  tests/unit/test_llama_int4.py bounds the
product against a float64 matmul of the file's dequantised weights and checks that
the weights come back bit for bit when the file's scales are bfloat16 numbers.

Invariance: the kernel computes every output as one float32 FMA chain over the
reduction in order, in tiles of 4 rows x 64 columns, and splits work over tiles
only, so a row's result depends neither on the number of rows, nor on its
neighbours, nor on the thread count (measured: torch 2.13, AVX-512; tested).  Its
vectorised path exists for bfloat16 inputs only: inputs of any other dtype are
rounded to bfloat16 first and outputs are returned in the input's dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ds4d.models.gguf_file import GGUFFile

MAX_REDUCTION = 768
"""Longest float32 GEMM reduction run as one MKL call (see ds4d/models/llama.py)."""
GROUP_SIZE = 32
"""Weights per scale/zero group: GGUF's legacy block size and the kernel's qGroupSize."""
ROW_MULTIPLE = 16
"""The kernel's column tiles are 16, 32, 48 or 64 wide: output rows are padded to this."""
PACK_CHUNK_ROWS = 4096
"""Rows converted to the kernel's layout at a time (a multiple of its 64-row tile, so the
packed chunks concatenate to the packing of the whole matrix) to bound load-time memory."""
INT4_TYPES = ("Q4_0", "Q4_1", "Q8_0")
"""GGUF block types whose values map onto 4-bit planes without re-quantisation."""
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


@dataclass(frozen=True)
class BlockPlanes:
    """A matrix ``[rows, cols]`` as 4-bit planes: ``w = sum_p (nibble_p - 8) * scale_p + zero_p``.

    Planes are laid side by side along the reduction: column ``p * cols + k`` of
    ``nibbles`` is plane ``p`` of input column ``k``; scale/zero group ``g`` covers
    columns ``32 g .. 32 g + 31`` of that layout.
    """

    nibbles: torch.Tensor
    """uint8 ``[rows, planes * cols]``, values 0..15."""
    scales: torch.Tensor
    """float32 ``[rows, planes * cols / 32]``."""
    zeros: torch.Tensor
    """float32 ``[rows, planes * cols / 32]``."""
    planes: int

    @property
    def rows(self) -> int:
        return self.nibbles.shape[0]

    @property
    def cols(self) -> int:
        return self.nibbles.shape[1] // self.planes

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> BlockPlanes:
        """Apply a row reordering (any ``[rows, x] -> [rows, x]`` row permutation) to every part."""
        return BlockPlanes(fn(self.nibbles), fn(self.scales), fn(self.zeros), self.planes)

    def scaled(self, factor: float) -> BlockPlanes:
        """``factor * w`` (exact for powers of two)."""
        return BlockPlanes(self.nibbles, self.scales * factor, self.zeros * factor, self.planes)

    def with_planes(self, planes: int) -> BlockPlanes:
        """The same matrix over more planes; added planes have scale and zero 0 (they add exact zeros)."""
        extra = planes - self.planes
        if extra == 0:
            return self
        groups = self.scales.shape[1] // self.planes
        return BlockPlanes(
            torch.cat([self.nibbles, self.nibbles.new_full((self.rows, extra * self.cols), 8)], dim=1),
            torch.cat([self.scales, self.scales.new_zeros(self.rows, extra * groups)], dim=1),
            torch.cat([self.zeros, self.zeros.new_zeros(self.rows, extra * groups)], dim=1),
            planes,
        )

    def dequantize(self) -> torch.Tensor:
        """float64 ``[rows, cols]``: the exact values these planes stand for (before any bfloat16 rounding)."""
        per_col = self.nibbles.double() - 8
        scales = self.scales.double().repeat_interleave(GROUP_SIZE, dim=1)
        zeros = self.zeros.double().repeat_interleave(GROUP_SIZE, dim=1)
        return (per_col * scales + zeros).view(self.rows, self.planes, self.cols).sum(dim=1)


def _half(raw: np.ndarray, offset: int) -> torch.Tensor:
    """The float16 at byte ``offset`` of every block, as float32 ``[rows, blocks]``."""
    return torch.from_numpy(np.ascontiguousarray(raw[:, :, offset : offset + 2]).view(np.float16)[..., 0]).float()


def _nibbles(qs: np.ndarray) -> torch.Tensor:
    """GGUF's 16 bytes per block: element j in the low nibble of byte j, element j + 16 in the high one."""
    q = torch.from_numpy(np.ascontiguousarray(qs))
    return torch.cat([q & 15, q >> 4], dim=-1)


def decode_blocks(quant_type: str, raw: np.ndarray, rows: int, cols: int) -> BlockPlanes:
    """One tensor's raw blocks (``uint8 [rows, cols / 32 * block bytes]``) as :class:`BlockPlanes`."""
    if quant_type not in _BLOCK_BYTES or cols % GROUP_SIZE:
        raise ValueError(f"{quant_type} tensor of {cols} columns has no 4-bit plane form")
    blocks = cols // GROUP_SIZE
    raw = np.asarray(raw, dtype=np.uint8).reshape(rows, blocks, _BLOCK_BYTES[quant_type])
    d = _half(raw, 0)
    if quant_type == "Q4_0":
        return BlockPlanes(_nibbles(raw[:, :, 2:]).reshape(rows, cols), d, torch.zeros_like(d), 1)
    if quant_type == "Q4_1":
        m = _half(raw, 2)
        return BlockPlanes(_nibbles(raw[:, :, 4:]).reshape(rows, cols), d, m + 8 * d, 1)
    unsigned = torch.from_numpy(np.ascontiguousarray(raw[:, :, 2:])).reshape(rows, cols) ^ 0x80  # q + 128
    return BlockPlanes(
        torch.cat([unsigned >> 4, unsigned & 15], dim=1),
        torch.cat([16 * d, d], dim=1),
        torch.cat([torch.zeros_like(d), 8 * d], dim=1),
        2,
    )


def tensor_planes(gguf_file: GGUFFile, name: str) -> BlockPlanes | None:
    """A 2-D tensor of the file as :class:`BlockPlanes`, or None if its type has no 4-bit form."""
    info = gguf_file.tensor_info(name)
    if info.quant_type not in INT4_TYPES or len(info.shape) != 2 or info.shape[1] % GROUP_SIZE:
        return None
    rows, cols = info.shape
    return decode_blocks(info.quant_type, _raw_bytes(gguf_file, name), rows, cols)


def _raw_bytes(gguf_file: GGUFFile, name: str) -> np.ndarray:
    """The tensor's bytes as stored (a view of the memory map).

    GGUFFile's public API only dequantises; this reads its reader's tensor record.
    """
    return np.asarray(gguf_file._get_tensor(name).data, dtype=np.uint8)


def int4_kernel_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(
        torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"
    )


class Int4Linear:
    """``residual + x @ W.T`` with ``W`` held as packed 4-bit planes (see module docstring).

    Several weights may be fused along the output dimension (Q/K/V, gate/up); parts
    with fewer planes are padded with zero planes.  Each output row is computed on its
    own, so callers need not pad the rows (``row_multiple`` is 1).
    """

    row_multiple = 1

    def __init__(self, parts: list[BlockPlanes]) -> None:
        planes = max(p.planes for p in parts)
        parts = [p.with_planes(planes) for p in parts]
        self.in_features = parts[0].cols
        self.out_features = sum(p.rows for p in parts)
        padded_rows = -(-self.out_features // ROW_MULTIPLE) * ROW_MULTIPLE
        if padded_rows != self.out_features:
            filler = BlockPlanes(
                torch.full((padded_rows - self.out_features, planes * self.in_features), 8, dtype=torch.uint8),
                torch.zeros(padded_rows - self.out_features, parts[0].scales.shape[1]),
                torch.zeros(padded_rows - self.out_features, parts[0].scales.shape[1]),
                planes,
            )
            parts = [*parts, filler]
        nibbles = torch.cat([p.nibbles for p in parts], dim=0)
        scales = torch.cat([p.scales for p in parts], dim=0)
        zeros = torch.cat([p.zeros for p in parts], dim=0)
        self._planes = planes
        self._packed = torch.cat([
            torch.ops.aten._convert_weight_to_int4pack_for_cpu(chunk.to(torch.int32).contiguous(), 2)
            for chunk in torch.split(nibbles, PACK_CHUNK_ROWS, dim=0)
        ])
        # [groups, rows, (scale, zero)] as the kernel reads it
        self._scales_zeros = torch.stack([scales.t(), zeros.t()], dim=-1).to(torch.bfloat16).contiguous()
        self.n_bytes = self._packed.numel() * self._packed.element_size() + self._scales_zeros.numel() * 2

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        inputs = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)
        if self._planes > 1:
            inputs = inputs.repeat(1, self._planes)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            inputs.contiguous(), self._packed, GROUP_SIZE, self._scales_zeros
        )
        if y.shape[1] != self.out_features:
            y = y[:, : self.out_features]
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        return y if residual is None else y.add_(residual)


def _split_rows(weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A row-major ``[in, out]`` matrix as near-equal pieces of at most MAX_REDUCTION rows.

    Equal pieces (rather than 768 + remainder) keep every piece a real GEMM; a
    sliver of a few rows would fall to a different small-matrix kernel.  Row slices
    of a row-major matrix are contiguous views, so this copies nothing.
    """
    n_pieces = -(-weight.shape[0] // MAX_REDUCTION)
    piece_rows = -(-weight.shape[0] // n_pieces)
    return tuple(torch.split(weight, piece_rows, dim=0))


class DenseLinear:
    """``residual + x @ W.T`` for one (possibly fused) weight, in the layout its GEMM wants.

    float32 (and any dtype off the CPU fast path): MKL on row-major ``[in, out]``
    pieces, accumulated in a fixed order.  bfloat16 on the CPU: one oneDNN matmul on
    a weight pre-packed at load (packing once saves re-laying the weight every call);
    oneDNN picks its bf16 kernel per CPU and shape, so bf16 rows agree across row
    counts only to within bf16 rounding.
    Every GEMM is handed a multiple of ``row_multiple`` rows: the input (and residual) is padded
    with copies of its last row and the extra rows are dropped, since MKL's small-M kernels sum
    in other orders than its blocked one (see ds4d/models/llama.py).
    """

    row_multiple = 8

    def __init__(self, parts_out_in: list[torch.Tensor], dtype: torch.dtype, device: torch.device) -> None:
        self.in_features = parts_out_in[0].shape[1]
        self.out_features = sum(w.shape[0] for w in parts_out_in)
        self.n_bytes = self.in_features * self.out_features * torch.empty((), dtype=dtype).element_size()
        self._packed: torch.Tensor | None = None
        self._pieces: tuple[torch.Tensor, ...] = ()
        if dtype == torch.bfloat16 and device.type == "cpu" and torch.backends.mkldnn.is_available():
            weight = torch.cat(parts_out_in, dim=0).to(dtype).contiguous()
            try:
                self._packed = torch.ops.mkldnn._reorder_linear_weight(weight, 2)
                return
            except (AttributeError, RuntimeError):  # a torch build without oneDNN packing
                self._packed = None
        fused = torch.empty(self.in_features, self.out_features, dtype=dtype)
        col = 0
        for w in parts_out_in:
            fused[:, col : col + w.shape[0]].copy_(w.t())
            col += w.shape[0]
        self._pieces = tuple(p.to(device) for p in _split_rows(fused))

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.shape[0]
        pad = -rows % self.row_multiple
        if pad:
            x = torch.cat([x, x[-1:].expand(pad, -1)])
            residual = None if residual is None else torch.cat([residual, residual[-1:].expand(pad, -1)])
        y = self._matmul(x, residual)
        return y[:rows] if pad else y

    def _matmul(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        if self._packed is not None:
            y = torch.ops.mkldnn._linear_pointwise(x, self._packed, None, "none", [], "")
            return y if residual is None else y.add_(residual)
        pieces = self._pieces
        if len(pieces) == 1:
            return x @ pieces[0] if residual is None else torch.addmm(residual, x, pieces[0])
        acc, row0 = residual, 0
        for piece in pieces:
            part = x[:, row0 : row0 + piece.shape[0]]
            acc = part @ piece if acc is None else torch.addmm(acc, part, piece)
            row0 += piece.shape[0]
        return acc
