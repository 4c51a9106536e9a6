"""Triton kernels for a decode step's hyper-connection weights: two launches instead of five.

Before each sub-layer, every token's ``m`` streams (``m * D`` values) are
RMS-normalised and projected to ``(2 + m) * m`` mixing logits, which become
``pre``, ``post`` and the Sinkhorn-normalised ``comb`` (``ds4d.models.deepseek_v4.hyper``
is the reference).  In torch that is a norm, cuBLAS's three-kernel GEMV for an
output of 24 values over 16K inputs (about 11 us on an H200 for one token),
and the mixing kernel.  Here:

* :func:`hc_mixes` -- one program per (token, output): the dot product of the
  flattened streams with one row of ``fn``, with the sum of squares taken in
  the same pass and the norm applied to the dot product (the same value as
  normalising first, up to float32 rounding).  Meant for a few tokens
  (``MAX_TOKENS``); a prefill's many tokens are a matmul.
* :func:`hc_weights` -- ``pre``, ``post`` and ``comb`` of a block of tokens,
  the ``m x m`` matrices held as one ``[tokens, m, m]`` tile whose row and
  column sums are reductions inside a warp (no shared-memory barriers); a
  prefill step's many tokens use it too (``hyper.hc_boundary``).

Both run in float32.  Triton is imported on first use; with ``TRITON_INTERPRET=1``
the kernels run on CPU tensors (that is how the tests compare them with the
torch reference).
"""

from __future__ import annotations

import torch

from ds4d.cuda.devices import triton_can_launch

MAX_TOKENS = 64
""":func:`hc_mixes` is used up to this many tokens (decode batches)."""
_BLOCK_K = 2048
_BLOCK_T = 16
_state: dict[str, object] = {}


def _kernels():
    if "kernels" not in _state:
        import triton
        import triton.language as tl

        @triton.jit
        def mixes_kernel(x_ptr, w_ptr, out_ptr, k: tl.constexpr, eps, sx, sw, so, block_k: tl.constexpr):
            token = tl.program_id(0)
            col = tl.program_id(1)
            dot = tl.zeros([block_k], dtype=tl.float32)
            squares = tl.zeros([block_k], dtype=tl.float32)
            for k0 in range(0, k, block_k):
                ks = k0 + tl.arange(0, block_k)
                x = tl.load(x_ptr + token * sx + ks, mask=ks < k, other=0.0).to(tl.float32)
                w = tl.load(w_ptr + col * sw + ks, mask=ks < k, other=0.0).to(tl.float32)
                dot += x * w
                squares += x * x
            norm = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / k + eps)
            tl.store(out_ptr + token * so + col, tl.sum(dot, axis=0) * norm)

        @triton.jit(do_not_specialize=["tokens"])
        def weights_kernel(mix_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, tokens, hc_eps,
                           iters: tl.constexpr, m: tl.constexpr, block_t: tl.constexpr):
            t = tl.program_id(0) * block_t + tl.arange(0, block_t)
            live = t < tokens
            i = tl.arange(0, m)
            width = (2 + m) * m
            row = mix_ptr + t[:, None] * width + i[None, :]
            pre = tl.sigmoid(tl.load(row, mask=live[:, None], other=0.0) * tl.load(scale_ptr)
                             + tl.load(base_ptr + i)[None, :]) + hc_eps
            post = 2.0 * tl.sigmoid(tl.load(row + m, mask=live[:, None], other=0.0) * tl.load(scale_ptr + 1)
                                    + tl.load(base_ptr + m + i)[None, :])
            cell = i[:, None] * m + i[None, :]
            c = tl.load(mix_ptr + t[:, None, None] * width + 2 * m + cell[None, :, :], mask=live[:, None, None],
                        other=0.0) * tl.load(scale_ptr + 2) + tl.load(base_ptr + 2 * m + cell)[None, :, :]
            c = tl.exp(c - tl.max(c, axis=2)[:, :, None])
            c = c / tl.sum(c, axis=2)[:, :, None] + hc_eps  # softmax over each row
            c = c / (tl.sum(c, axis=1)[:, None, :] + hc_eps)  # then columns
            for _ in range(iters - 1):
                c = c / (tl.sum(c, axis=2)[:, :, None] + hc_eps)
                c = c / (tl.sum(c, axis=1)[:, None, :] + hc_eps)
            out = t[:, None] * m + i[None, :]
            tl.store(pre_ptr + out, pre, mask=live[:, None])
            tl.store(post_ptr + out, post, mask=live[:, None])
            tl.store(comb_ptr + t[:, None, None] * (m * m) + cell[None, :, :], c, mask=live[:, None, None])

        _state["kernels"] = (mixes_kernel, weights_kernel)
    return _state["kernels"]


def available() -> bool:
    """Triton is importable and can launch here (a CUDA device, or the interpreter)."""
    if "available" not in _state:
        _state["available"] = triton_can_launch(_kernels)
    return bool(_state["available"])


def usable(tokens: int, m: int) -> bool:
    """Whether :func:`hc_mix` takes ``tokens`` tokens of ``m`` streams (a power of two)."""
    return 0 < tokens <= MAX_TOKENS and m & (m - 1) == 0 and available()


@torch.compiler.disable  # launched as is; torch.compile and CUDA graph capture see the kernels
def hc_mixes(streams: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """``[T, N]`` float32: the RMS-normalised flattened ``streams [T, m, D]`` times ``fn [N, m * D]``."""
    flat = streams.reshape(streams.shape[0], -1)
    if flat.stride(-1) != 1 or fn.stride(-1) != 1:
        raise ValueError("hc_mixes needs the streams and fn contiguous in their last dimension")
    tokens, k = flat.shape
    out = torch.empty(tokens, fn.shape[0], dtype=torch.float32, device=streams.device)
    if tokens:
        _kernels()[0][(tokens, fn.shape[0])](flat, fn, out, k, norm_eps, flat.stride(0), fn.stride(0), out.stride(0),
                                              block_k=_BLOCK_K, num_warps=4)
    return out


@torch.compiler.disable
def hc_weights(mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float, iters: int, m: int):
    """(pre ``[T, m]``, post ``[T, m]``, comb ``[T, m, m]``) from float32 ``mixes [T, (2 + m) * m]``."""
    import triton

    mixes = mixes.contiguous()
    tokens = mixes.shape[0]
    pre = torch.empty(tokens, m, dtype=torch.float32, device=mixes.device)
    post = torch.empty_like(pre)
    comb = torch.empty(tokens, m, m, dtype=torch.float32, device=mixes.device)
    if tokens:
        grid = (triton.cdiv(tokens, _BLOCK_T),)
        _kernels()[1][grid](mixes, base.float().contiguous(), scale.float().contiguous(), pre, post, comb, tokens,
                            hc_eps, iters, m=m, block_t=_BLOCK_T, num_warps=1)
    return pre, post, comb


@torch.compiler.disable
def hc_mix(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float,
           iters: int, norm_eps: float):
    """(pre, post, comb) of a few tokens' ``streams [T, m, D]``: :func:`hc_mixes`, then :func:`hc_weights`."""
    m = streams.shape[-2]
    return hc_weights(hc_mixes(streams, fn, norm_eps), base, scale, hc_eps, iters, m)
