"""Small numeric building blocks: RMS norms and V4's partial interleaved RoPE.

RoPE touches only the trailing ``qk_rope_head_dim`` channels of a head (the
"nope" channels stay position-free) and rotates consecutive channel pairs.
Two frequency tables exist: plain RoPE with ``rope_theta`` for sliding-window
layers, and YaRN-scaled RoPE with ``compress_rope_theta`` for compressed
layers (their queries, keys, compressed entries and indexer all share it).
YaRN here changes the frequencies only; cos/sin are not rescaled.
"""

from __future__ import annotations

import math

import torch

from ds4d.cuda import f32_gemv
from ds4d.cuda.rows import padded_product
from ds4d.models.deepseek_v4.config import DeepseekV4Config, YarnScaling


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * x).to(dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def plain_inv_freq(rope_dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.float) / rope_dim))


def yarn_inv_freq(rope_dim: int, base: float, yarn: YarnScaling) -> torch.Tensor:
    """Frequencies interpolated by ``factor`` below the ``beta_slow`` rotation count,
    kept above ``beta_fast``, with a linear ramp between (correction range rounded out)."""

    def correction_dim(rotations: float) -> float:
        original = yarn.original_max_position_embeddings
        return rope_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    pos_freqs = base ** (torch.arange(0, rope_dim, 2, dtype=torch.float) / rope_dim)
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (yarn.factor * pos_freqs)
    return interpolated * (1 - keep) + extrapolated * keep


class Rope:
    """cos/sin tables for one frequency set, computed per call from positions."""

    def __init__(self, inv_freq: torch.Tensor, device: torch.device) -> None:
        self.inv_freq = inv_freq.to(device)

    @classmethod
    def for_layers(cls, cfg: DeepseekV4Config, device: torch.device) -> tuple[Rope, Rope]:
        """(sliding-window rope, compressed-layer rope)."""
        main = plain_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta)
        if cfg.yarn is not None:
            compress = yarn_inv_freq(cfg.qk_rope_head_dim, cfg.compress_rope_theta, cfg.yarn)
        else:
            compress = plain_inv_freq(cfg.qk_rope_head_dim, cfg.compress_rope_theta)
        return cls(main, device), cls(compress, device)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[n]`` positions -> cos, sin of shape ``[n, rope_dim / 2]`` (float32)."""
        freqs = positions[:, None].float() * self.inv_freq
        return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing ``2 * cos.shape[-1]`` channels of ``x`` pairwise.

    ``x``: ``[n, ..., d]``; ``cos``/``sin``: ``[n, r/2]`` (broadcast over middle dims).
    Pass ``-sin`` for the inverse rotation.
    """
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    rope_dim = 2 * cos.shape[-1]
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat([nope, rotated.to(x.dtype)], dim=-1)


_MM_OUT_DTYPE = {"ok": True}


def linear_bf16_weight_f32_out(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [n, D]`` float32 times a bfloat16 ``weight [V, D]``, float32 result, reading the weight once.

    ``x`` is split into a bfloat16 high part and a bfloat16 remainder (16 mantissa
    bits together); both go through one bf16 x bf16 -> fp32 matmul, then add.
    Where that matmul is unavailable the weight is widened instead."""
    if _MM_OUT_DTYPE["ok"] and x.is_cuda:
        high = x.to(torch.bfloat16)
        low = (x - high.float()).to(torch.bfloat16)
        try:
            both = padded_product(torch.cat([high, low]),
                                  lambda rows: torch.mm(rows, weight.t(), out_dtype=torch.float32))
            return both[: x.shape[0]] + both[x.shape[0] :]
        except (RuntimeError, TypeError):
            _MM_OUT_DTYPE["ok"] = False
    return torch.nn.functional.linear(x, weight.float())


def split_bf16(weight: torch.Tensor) -> torch.Tensor:
    """A float32 ``weight [N, K]`` as ``[2N, K]`` bf16: its bf16 rounding, then the remainder's
    (16 mantissa bits together, against float32's 24)."""
    weight = weight.float()
    high = weight.to(torch.bfloat16)
    return torch.cat([high, (weight - high.float()).to(torch.bfloat16)])


def linear_split(x: torch.Tensor, split: torch.Tensor) -> torch.Tensor:
    """``x [n, K]`` (bf16) times a float32 weight given as :func:`split_bf16`, float32 ``[n, N]``: one
    bf16 matmul with float32 results (each product exact in float32), whose two halves then add.
    On the CPU, where that matmul is missing, the same products in a float32 matmul."""
    if x.is_cuda:
        both = padded_product(x, lambda rows: torch.mm(rows, split.t(), out_dtype=torch.float32))
    else:
        both = x.float() @ split.float().t()
    half = split.shape[0] // 2
    return both[:, :half] + both[:, half:]


def linear_f32(x: torch.Tensor, weight: torch.Tensor, split: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight^T`` in float32 for a float32 ``weight``: through ``split`` (:func:`split_bf16` of
    ``weight``) for a bf16 ``x`` where given, else a few CUDA rows through ``f32_gemv.rows_f32``,
    else with ``x`` widened."""
    if split is not None and x.dtype == torch.bfloat16:
        return linear_split(x, split)
    if f32_gemv.usable(x, weight):
        return f32_gemv.rows_f32(x, weight)
    return padded_product(x.float(), lambda rows: torch.nn.functional.linear(rows, weight.float()))


def linear(x: torch.Tensor, weight) -> torch.Tensor:
    """``x @ weight^T`` for a decoded weight, or for an FP8 one kept as stored (``stored.Fp8Weight``)."""
    if isinstance(weight, torch.Tensor):
        return padded_product(x, lambda rows: torch.nn.functional.linear(rows, weight))
    return padded_product(x, weight.matmul)


def linear_pair(x: torch.Tensor, first, second, both=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(``x @ first^T``, ``x @ second^T``).  ``both`` (``stored.fuse_rows`` of the two): where the rows take
    the GEMV (``both.takes_gemv``), one launch over both weights, each half bit for bit its own product;
    otherwise each weight alone, as :func:`linear` multiplies it."""
    if both is None:
        return linear(x, first), linear(x, second)

    def product(rows: torch.Tensor) -> torch.Tensor:
        if both.takes_gemv(rows):
            return both.matmul(rows)
        return torch.cat([first.matmul(rows), second.matmul(rows)], dim=-1)

    out = padded_product(x, product)
    split = first.shape[0]
    return out[..., :split], out[..., split:]
