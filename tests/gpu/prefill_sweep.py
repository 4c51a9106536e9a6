"""Time the prefill step's token-wise Triton kernels against torch on a V4-Flash 2K-token chunk.

    PYTHONPATH=. python3 tests/gpu/prefill_sweep.py

The hyper-connection boundary between two sub-layers (streams of 2048 tokens, 4 x 4096 bf16:
``hyper.hc_boundary`` with and without ``kernels``) for a few settings of
``prefill_triton.TUNING``, and the queries' norm and RoPE (64 heads of 512).  A tool for
reading, not a test.
"""

from __future__ import annotations

import sys

import torch

from ds4d.bench.kernels import _timed
from ds4d.cuda import prefill_triton as pt
from ds4d.models.deepseek_v4.hyper import hc_boundary
from ds4d.models.deepseek_v4.ops import apply_rope, unweighted_rms_norm
from ds4d.models.deepseek_v4.weights import HyperWeights


def main() -> int:
    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens, m, d = 2048, 4, 4096
    streams = torch.randn(tokens, m, d, device="cuda", generator=gen).bfloat16()
    output = torch.randn(tokens, d, device="cuda", generator=gen).bfloat16()
    post = 2 * torch.rand(tokens, m, device="cuda", generator=gen)
    comb = torch.rand(tokens, m, m, device="cuda", generator=gen).softmax(-1)
    weights = HyperWeights(torch.randn((2 + m) * m, m * d, device="cuda", generator=gen) * (m * d) ** -0.5,
                           torch.randn((2 + m) * m, device="cuda", generator=gen) * 0.5,
                           torch.ones(3, device="cuda"))
    norm = torch.ones(d, device="cuda", dtype=torch.bfloat16)

    def boundary(kernels: bool):
        return hc_boundary(output, streams, post, comb, weights, norm, 20, 1e-6, 1e-6, fused="numba", kernels=kernels)

    plain = _timed(torch, boundary, False, reps=5, calls=4)
    want = boundary(False)[0].float()
    defaults = dict(pt.TUNING)
    print("| case | setting | us | torch us | torch / kernels |")
    print("|---|---|---|---|---|")
    for bt, bd, splits, warps in ((8, 128, 8, 4), (4, 256, 8, 4), (16, 64, 8, 4), (8, 128, 4, 4), (4, 128, 16, 2),
                                  (2, 512, 4, 4), (1, 1024, 4, 4), (4, 512, 2, 8)):
        setting = f"{bt}, {bd}, {splits}, {warps}"
        pt.TUNING.update(hc_block_t=bt, hc_block_d=bd, hc_splits=splits, hc_warps=warps)
        try:
            err = ((boundary(True)[0].float() - want).abs().max() / want.abs().max()).item()
            us = _timed(torch, boundary, True, reps=5, calls=4)
            alone = _timed(torch, pt.hc_update_mixes, streams, weights.fn, 1e-6, output, post, comb, reps=5, calls=4)
        except Exception as exc:  # noqa: BLE001 - a setting the compiler refuses: say so
            print(f"| hc boundary | {setting} | {type(exc).__name__} | | |")
            continue
        print(f"| hc boundary (update and mixes alone) | {setting} | {us * 1e6:.0f} ({alone * 1e6:.0f}; err {err:.1e}) "
              f"| {plain * 1e6:.0f} | {plain / us:.2f}x |", flush=True)
    q = torch.randn(tokens, 64, 512, device="cuda", generator=gen).bfloat16()
    angles = torch.rand(tokens, 32, device="cuda", generator=gen) * 6
    cos, sin = angles.cos(), angles.sin()
    pt.TUNING.update(defaults)
    first = _timed(torch, pt.hc_update_mixes, streams, weights.fn, 1e-6, reps=5, calls=4)
    print(f"| mixes of the first layer's streams (no update) | default | {first * 1e6:.0f} | | |")
    plain = _timed(torch, lambda: apply_rope(unweighted_rms_norm(q, 1e-6), cos, sin), reps=5, calls=4)
    for block_h in (2, 4, 8):
        pt.TUNING.update(rope_block_h=block_h)
        us = _timed(torch, lambda: pt.head_norm_rope(q, cos, sin, 1e-6), reps=5, calls=4)
        back = _timed(torch, lambda: pt.head_norm_rope(q, cos, sin, norm=False, inverse=True), reps=5, calls=4)
        print(f"| query norm + RoPE (inverse RoPE only) | {block_h} heads | {us * 1e6:.0f} ({back * 1e6:.0f}) "
              f"| {plain * 1e6:.0f} | {plain / us:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
