"""Weights kept as the checkpoint stores them, read directly by the kernels of ``ds4d.cuda.quant_matmul``
and ``ds4d.cuda.gguf_matmul``.

FP8 linears (:class:`Fp8Weight`: e4m3 values with float32 scales per 128 x 128
block), MXFP4 expert matrices (:class:`Mxfp4Matrices`, and
:class:`Mxfp4Addresses` when found by address), and a GGUF file's quantised blocks
(:class:`GgufWeight` for a linear, :class:`GgufMatrices` for an expert bank, :class:`GgufAddresses` when found
by address).  Below both the checkpoint
reader (``loader.py``), which makes them, and the weight records (``weights.py``),
which hold them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ds4d.cuda import gguf_matmul, quant_matmul
from ds4d.models.deepseek_v4.quant import decode_e8m0, dequant_fp8_block


@dataclass
class Fp8Weight:
    """A linear's ``[out, in]`` FP8 e4m3 values with float32 scales per ``block`` x ``block`` (128 in
    V4, 32 in V4.1), kept as stored."""

    data: torch.Tensor  # float8_e4m3fn [out, in]
    scale: torch.Tensor  # float32 [ceil(out/block), ceil(in/block)]
    dtype: torch.dtype  # the activations' dtype (and the result's)
    block: int = 128
    setting_rows: int | None = None  # its rows are part of a fused weight of this many (``fuse_rows``)

    @classmethod
    def from_stored(cls, weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, block: int = 128) -> Fp8Weight:
        factors = decode_e8m0(scale) if scale.element_size() == 1 else scale.to(torch.float32)
        return cls(weight.view(torch.float8_e4m3fn), factors.contiguous(), dtype, block)

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dense(self) -> torch.Tensor:
        """The decoded ``[out, in]`` values in the activations' dtype (exact: every e4m3 value times a
        power of two is a bf16 value)."""
        return dequant_fp8_block(self.data, self.scale, (self.block, self.block)).to(self.dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in] @ W^T``."""
        if quant_matmul.available() and x.dtype == self.dtype:
            flat = x.reshape(-1, x.shape[-1])
            return quant_matmul.fp8_linear(flat, self.data, self.scale, self.block,
                                           setting_rows=self.setting_rows).view(*x.shape[:-1], -1)
        return torch.nn.functional.linear(x, self.dense())  # no kernel here: decode, then the plain product

    def takes_gemv(self, x: torch.Tensor) -> bool:
        """Whether :meth:`matmul` multiplies ``x`` by the per-row GEMV, whose sums for a weight row do not
        depend on the weight rows beside it (``quant_matmul.fp8_linear``'s decode rows)."""
        rows = x.reshape(-1, x.shape[-1]).shape[0]
        return (quant_matmul.available() and x.dtype == self.dtype and x.device == self.data.device
                and 0 < rows <= quant_matmul.TUNING["fp8_rows"]["most_rows"])

    def gated(self, x: torch.Tensor, limit: float) -> torch.Tensor | None:
        """For a weight of gate rows over as many up rows (``fuse_rows`` of ``w1`` and ``w3``): the SwiGLU of
        the two halves of ``x``'s product in the GEMV's own launch (``quant_matmul.fp8_linear``, ``gated``), where
        ``x`` takes the GEMV; else None."""
        flat = x.reshape(-1, x.shape[-1])
        if not (self.takes_gemv(x) and quant_matmul.fp8_gated_fits(flat.shape[0], self.data.shape[0])):
            return None
        return quant_matmul.fp8_linear(flat, self.data, self.scale, self.block, gated=limit).view(*x.shape[:-1], -1)


@dataclass
class GgufWeight:
    """A linear's ``[out, in]`` weight in GGUF blocks of ``qtype`` as the file stores them: ``raw`` uint8
    ``[out, in / block_values * block_bytes]`` (``ds4d.cuda.gguf_matmul``); ``int8_inputs``: its one-row GEMV
    rounds the inputs to int8 (``gguf_matmul.gemv``; a type without such a kernel ignores it)."""

    raw: torch.Tensor
    qtype: str
    cols: int
    dtype: torch.dtype  # the activations' dtype (and the result's)
    int8_inputs: bool = False

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.raw.shape[0], self.cols))

    def dense(self) -> torch.Tensor:
        """The decoded ``[out, in]`` values in the activations' dtype."""
        return gguf_values(self.raw, self.qtype, self.cols).to(self.dtype)

    def matmul(self, x: torch.Tensor, **launch) -> torch.Tensor:
        """``x [..., in] @ W^T`` (``launch``: ``gguf_matmul.linear``'s ``gemv_rows`` and ``decoded_rows``)."""
        if gguf_matmul.available() and x.device == self.raw.device:
            flat = x.reshape(-1, x.shape[-1])
            return gguf_matmul.linear(flat, self.raw, self.qtype, int8_inputs=self.int8_inputs,
                                      **launch).view(*x.shape[:-1], -1)
        return torch.nn.functional.linear(x, self.dense())

    def takes_gemv(self, x: torch.Tensor) -> bool:
        """Whether :meth:`matmul` multiplies ``x`` by the GEMV, whose sums for a weight row do not depend on
        the weight rows beside it."""
        rows = x.reshape(-1, x.shape[-1]).shape[0]
        return gguf_matmul.available() and x.device == self.raw.device and rows <= gguf_matmul.GEMV_ROWS

    def gated(self, x: torch.Tensor, limit: float) -> torch.Tensor | None:
        """As :meth:`Fp8Weight.gated`: for one row on the int8-input GEMV (``gguf_matmul.dot_gemv``, ``gated``), the
        SwiGLU of the two halves of its product in the GEMV's launch; else None."""
        flat = x.reshape(-1, x.shape[-1])
        if not (flat.shape[0] == 1 and self.takes_gemv(x) and gguf_matmul.gated_fits(self.qtype, self.int8_inputs)
                and self.raw.shape[0] % 2 == 0):
            return None
        return gguf_matmul.dot_gemv(flat, self.raw, self.qtype, out_dtype=x.dtype, gated=limit).view(
            *x.shape[:-1], -1)


def fuse_rows(first: Linear, second: Linear) -> GgufWeight | Fp8Weight | None:
    """One weight of ``first``'s rows over ``second``'s (two linears of one input: its GEMV is one launch, with
    more programs) when both are GGUF blocks of one type and width on one device, or both FP8 of one width and
    scale block whose first weight ends on a scale block, at 16-byte offsets (so the fused GEMV's loads are
    those of the two alone); ``first`` and ``second`` then hold views of its rows, so no memory is added.
    None for any other pair."""
    if isinstance(first, Fp8Weight) and isinstance(second, Fp8Weight):
        return _fuse_fp8(first, second)
    if not (isinstance(first, GgufWeight) and isinstance(second, GgufWeight)):
        return None
    if (first.qtype, first.cols, first.dtype, first.raw.device, first.int8_inputs) != (
            second.qtype, second.cols, second.dtype, second.raw.device, second.int8_inputs):
        return None
    rows = first.raw.shape[0]
    both = torch.cat([first.raw, second.raw])
    first.raw, second.raw = both[:rows], both[rows:]
    return GgufWeight(both, first.qtype, first.cols, first.dtype, first.int8_inputs)


def _fuse_fp8(first: Fp8Weight, second: Fp8Weight) -> Fp8Weight | None:
    rows, cols = first.data.shape
    if (cols, first.block, first.dtype, first.data.device) != (second.data.shape[1], second.block, second.dtype,
                                                                 second.data.device) or rows % first.block:
        return None
    scale_rows = rows // first.block
    if (rows * cols) % 16 or (scale_rows * first.scale.shape[1] * first.scale.element_size()) % 16:
        return None
    data, scale = torch.cat([first.data, second.data]), torch.cat([first.scale, second.scale])
    first.data, second.data = data[:rows], data[rows:]
    first.scale, second.scale = scale[:scale_rows], scale[scale_rows:]
    first.setting_rows = second.setting_rows = data.shape[0]  # each alone sums its rows as the fused GEMV does
    return Fp8Weight(data, scale, first.dtype, first.block)


@dataclass
class GgufMatrices:
    """One matrix per expert in GGUF blocks of ``qtype``: uint8 ``[E, out, row_bytes]`` (``cols`` inputs);
    ``int8_inputs`` as :class:`GgufWeight`'s (a decode step's rows by expert)."""

    raw: torch.Tensor
    qtype: str
    cols: int
    int8_inputs: bool = False


@dataclass
class GgufAddresses:
    """Expert matrices in GGUF blocks of ``qtype`` found by address: int64 ``[E]`` of where each expert's
    ``rows`` rows of ``cols`` values start (rows contiguous), wherever they sit (``offload_zero_copy.py``);
    ``aligned``: every address is a multiple of 16 (``gguf_matmul.gemv_at``); ``int8_inputs`` as
    :class:`GgufWeight`'s."""

    table: torch.Tensor
    qtype: str
    rows: int
    cols: int
    aligned: bool = False
    int8_inputs: bool = False


def gguf_values(raw: torch.Tensor, qtype: str, cols: int, *, kernel: bool = True) -> torch.Tensor:
    """float32 ``[..., cols]``: the values of GGUF blocks ``raw [..., row_bytes]`` (the kernel where it
    runs, else, or with ``kernel`` False, the ``gguf`` package's numpy dequantiser: the same bits)."""
    flat = raw.reshape(-1, raw.shape[-1])
    if kernel and gguf_matmul.available() and (flat.is_cuda or not torch.cuda.is_available()):
        values = gguf_matmul.dequantize(flat.contiguous(), qtype, cols)
    else:
        import gguf

        decoded = gguf.quants.dequantize(flat.cpu().numpy(), gguf.GGMLQuantizationType[qtype])
        values = torch.from_numpy(decoded.reshape(flat.shape[0], cols).astype("float32")).to(raw.device)
    return values.reshape(*raw.shape[:-1], cols)


Linear = torch.Tensor | Fp8Weight | GgufWeight
"""A linear's weight ``[out, in]``: decoded values, FP8 as stored, or GGUF blocks as stored."""


@dataclass
class Mxfp4Matrices:
    """One matrix per expert in MXFP4 as stored: e2m1 pairs ``[E, out, in/2]``, ue8m0 bytes ``[E, out, in/32]``."""

    packed: torch.Tensor
    scales: torch.Tensor


@dataclass
class Mxfp4Addresses:
    """MXFP4 expert matrices found by address: int64 ``[E]`` of each expert's ``[rows, inputs/2]`` bytes
    and ``[rows, inputs/32]`` scales (rows contiguous), wherever they sit: device memory, or page-locked
    host memory the GPU reads in place (``offload_zero_copy.py``).  ``aligned``: every address is a multiple of
    16 bytes (the kernel then reads 16-byte vectors)."""

    packed: torch.Tensor
    scales: torch.Tensor
    rows: int
    inputs: int
    aligned: bool = False
