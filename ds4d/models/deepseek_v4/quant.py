"""Decoding (and, for tiny test checkpoints, encoding) of the V4 weight formats.

The official release stores most linears as FP8 e4m3 with one power-of-two
(ue8m0) scale per 128x128 block, and the routed experts as MXFP4: two e2m1
values per byte (low nibble first) with one ue8m0 scale per 32 inputs.  The
float path decodes every quantised tensor once at load time, one tensor at a
time (``weight_format = dense``, and always on the CPU); with ``native``
weights on CUDA these bytes stay as stored and ``ds4d.cuda.quant_matmul``
reads them, and this module decodes only where a float copy is needed
(reference paths, host-computed experts, tests).

Scale bytes are decoded through a 256-entry table built from exact powers of
two, and e2m1 nibbles through a 16-entry table, so decoding is exact and does
not depend on whether the safetensors reader knows the F8_E8M0 dtype (raw
``uint8`` bytes work the same).
"""

from __future__ import annotations

import torch

FP8_E4M3_MAX = 448.0
E2M1_MAX = 6.0
MXFP4_BLOCK = 32

_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_TABLE = torch.tensor(list(_E2M1_MAGNITUDES) + [-m for m in _E2M1_MAGNITUDES], dtype=torch.float32)
"""Value of each 4-bit code: bit 3 sign, bits 2..1 exponent, bit 0 mantissa."""

E8M0_TABLE = torch.tensor([2.0 ** (b - 127) for b in range(255)] + [float("nan")], dtype=torch.float32)
"""Value of each ue8m0 scale byte: 2^(b - 127); 0xFF is NaN."""


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a one-byte tensor as uint8 (any of fp8, e8m0, int8, uint8)."""
    if tensor.element_size() != 1:
        raise TypeError(f"expected a one-byte dtype, got {tensor.dtype}")
    return tensor.view(torch.uint8)


def decode_e8m0(scale: torch.Tensor) -> torch.Tensor:
    return E8M0_TABLE.to(scale.device)[as_bytes(scale).long()]


def decode_fp8_e4m3(weight: torch.Tensor) -> torch.Tensor:
    return as_bytes(weight).view(torch.float8_e4m3fn).to(torch.float32)


def dequant_fp8_block(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """FP8 ``[out, in]`` with ``[ceil(out/b0), ceil(in/b1)]`` ue8m0 scales -> float32."""
    out_features, in_features = weight.shape
    rows, cols = -(-out_features // block[0]), -(-in_features // block[1])
    if tuple(scale.shape) != (rows, cols):
        raise ValueError(f"scale shape {tuple(scale.shape)} does not match weight {tuple(weight.shape)}")
    values = decode_fp8_e4m3(weight)
    factors = decode_e8m0(scale) if scale.element_size() == 1 else scale.to(torch.float32)
    factors = factors.repeat_interleave(block[0], 0)[:out_features]
    factors = factors.repeat_interleave(block[1], 1)[:, :in_features]
    return values.mul_(factors)


def dequant_mxfp4(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Packed e2m1 ``[out, in/2]`` with ``[out, in/32]`` ue8m0 scales -> float32 ``[out, in]``."""
    out_features, half = weight.shape
    in_features = 2 * half
    if tuple(scale.shape) != (out_features, in_features // MXFP4_BLOCK):
        raise ValueError(f"scale shape {tuple(scale.shape)} does not match packed weight {tuple(weight.shape)}")
    packed = as_bytes(weight)
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(out_features, in_features)
    values = E2M1_TABLE.to(codes.device)[codes.long()]
    factors = decode_e8m0(scale) if scale.element_size() == 1 else scale.to(torch.float32)
    return values.mul_(factors.repeat_interleave(MXFP4_BLOCK, 1))


# ---------------------------------------------------------------------- encoding


def _pow2_scale(amax: torch.Tensor, top: float) -> torch.Tensor:
    """Smallest power of two ``s`` with ``amax / s <= top`` (as float32)."""
    return torch.exp2(torch.ceil(torch.log2(amax.clamp(min=1e-10) / top)))


def _encode_e8m0(scale: torch.Tensor) -> torch.Tensor:
    exponent = torch.log2(scale).round().to(torch.int32) + 127
    return exponent.clamp(0, 254).to(torch.uint8).view(torch.float8_e8m0fnu)


def quantize_fp8_block(weight: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """float ``[out, in]`` -> (FP8 e4m3 weight, ue8m0 block scales)."""
    weight = weight.to(torch.float32)
    out_features, in_features = weight.shape
    rows, cols = -(-out_features // block[0]), -(-in_features // block[1])
    padded = weight.new_zeros(rows * block[0], cols * block[1])
    padded[:out_features, :in_features] = weight
    tiles = padded.view(rows, block[0], cols, block[1]).abs().amax(dim=(1, 3))
    scale = _pow2_scale(tiles, FP8_E4M3_MAX)
    factors = scale.repeat_interleave(block[0], 0)[:out_features].repeat_interleave(block[1], 1)[:, :in_features]
    quantized = (weight / factors).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return quantized, _encode_e8m0(scale)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float ``[out, in]`` -> (int8 packed e2m1 ``[out, in/2]``, ue8m0 scales ``[out, in/32]``)."""
    weight = weight.to(torch.float32)
    out_features, in_features = weight.shape
    if in_features % MXFP4_BLOCK:
        raise ValueError(f"MXFP4 needs in_features divisible by {MXFP4_BLOCK}, got {in_features}")
    groups = weight.view(out_features, in_features // MXFP4_BLOCK, MXFP4_BLOCK)
    scale = _pow2_scale(groups.abs().amax(dim=-1), E2M1_MAX)
    scaled = (groups / scale.unsqueeze(-1)).reshape(out_features, in_features)
    magnitudes = E2M1_TABLE[:8].to(weight.device)
    nearest = (scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(dim=-1)
    codes = nearest | ((scaled < 0) & (nearest > 0)).to(torch.long) << 3
    codes = codes.view(out_features, in_features // 2, 2).to(torch.uint8)
    packed = codes[..., 0] | (codes[..., 1] << 4)
    return packed.view(torch.int8), _encode_e8m0(scale)
