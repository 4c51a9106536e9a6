"""Time two of a decode step's launches against what they replace, at V4-Flash widths, with a small sweep of
their launch settings; weights cycled through copies so reads come from memory, not L2 (``bench.kernels``).
A tool for reading, not a test.

* the hyper-connection boundary (``hc_triton.hc_boundary_step``: update, weights, collapse, norm in two
  launches) against the update, collapse and norm in torch around the two Triton weight kernels;
* the float32 products of a few rows (``f32_gemv.rows_f32``: the router, a compressor's kv and gate pair)
  against torch's ``x.float() @ w.t()``.

    PYTHONPATH=. python3 tests/gpu/decode_fusions_time.py
"""

from __future__ import annotations

import sys

import torch

from ds4d.bench.kernels import _timed_over, cold_copies
from ds4d.cuda import f32_gemv, hc_triton
from ds4d.models.deepseek_v4.hyper import hc_boundary
from ds4d.models.deepseek_v4.weights import HyperWeights

D, M = 4096, 4


def boundary(tokens: int) -> list[str]:
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    width = (2 + M) * M
    streams = (torch.randn(tokens, M, D, device="cuda", generator=gen) * 2).to(torch.bfloat16)
    output = torch.randn(tokens, D, device="cuda", generator=gen).to(torch.bfloat16)
    post = 2 * torch.rand(tokens, M, device="cuda", generator=gen)
    comb = torch.rand(tokens, M, M, device="cuda", generator=gen).softmax(dim=-1)
    norm = 1 + 0.3 * torch.randn(D, device="cuda", generator=gen)
    sets = [(HyperWeights(torch.randn(width, M * D, device="cuda", generator=gen) * (M * D) ** -0.5,
                          torch.randn(width, device="cuda", generator=gen) * 0.5,
                          1 + 0.2 * torch.randn(3, device="cuda", generator=gen)),)
            for _ in range(cold_copies(width * M * D * 4))]

    def run(fused, iters=20):
        return lambda w: hc_boundary(output, streams, post, comb, w, norm, iters, 1e-6, 1e-6, fused=fused)

    plain = _timed_over(torch, run("triton"), sets)
    lines = [f"| boundary, {tokens} token(s) | torch update + Triton weights | {plain * 1e6:.1f} |"]
    want = run("triton")(sets[0][0])
    original = dict(hc_triton.TUNING)
    settings = [(p, b, w, 8) for p in (32, 64, 128) for b in (32, 64, 128) for w in (2, 4)]
    settings += [(64, 128, 2, c) for c in (1, 2, 4)]  # the second kernel's warps
    for programs, block_d, warps, collapse in settings:
        if QUICK and collapse == 8 and (programs, block_d, warps) != (64, 128, 2):
            continue
        hc_triton.TUNING.update(boundary_programs=programs, boundary_block_d=block_d, boundary_warps=warps,
                                collapse_warps=collapse)
        got = run("boundary")(sets[0][0])
        err = max((g.float() - w.float()).abs().max().item() / max(w.float().abs().max().item(), 1e-30)
                  for g, w in zip(got, want))
        us = _timed_over(torch, run("boundary"), sets) * 1e6
        lines.append(f"| boundary, {tokens} token(s) | two launches, {programs} programs, block_d {block_d}, "
                     f"{warps} warps, collapse {collapse} | {us:.1f} | rel. diff {err:.1e} |")
    hc_triton.TUNING.update(original)
    us = _timed_over(torch, run("boundary", iters=1), sets) * 1e6
    lines.append(f"| boundary, {tokens} token(s) | two launches, one Sinkhorn iteration (not 20) | {us:.1f} | |")
    return lines


def products(rows: int) -> list[str]:
    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, D, device="cuda", generator=gen).to(torch.bfloat16)
    lines = []
    for name, shapes in (("router", (256,)), ("compressor kv+gate, ratio 4", (1024, 1024)),
                         ("compressor kv+gate, ratio 128", (512, 512)), ("indexer compressor", (256, 256))):
        sets = [tuple(torch.randn(n, D, device="cuda", generator=gen) for n in shapes)
                for _ in range(cold_copies(sum(shapes) * D * 4))]
        nbytes = sum(shapes) * D * 4

        def torch_way(*ws):
            xf = x.float()
            return [xf @ w.t() for w in ws]

        base = _timed_over(torch, torch_way, sets)
        lines.append(f"| {name}, {rows} row(s) | torch (widen + cuBLAS) | {base * 1e6:.1f} | "
                     f"{nbytes / base / 1e12:.2f} TB/s |")
        original = dict(f32_gemv.TUNING)
        for block_n in (1, 2, 4):
            for warps in (2, 4, 8):
                f32_gemv.TUNING.update(block_n=block_n, warps=warps, warps_one_row=warps)
                us = _timed_over(torch, lambda *ws: f32_gemv.rows_f32(x, *ws), sets)
                lines.append(f"| {name}, {rows} row(s) | rows_f32 block_n {block_n}, {warps} warps | {us * 1e6:.1f} | "
                             f"{nbytes / us / 1e12:.2f} TB/s |")
        f32_gemv.TUNING.update(original)
    return lines


QUICK = "--quick" in sys.argv
"""``--quick``: the boundary's warps of its second kernel only."""


def main() -> None:
    print(f"{torch.cuda.get_device_name()}")
    print("| case | how | us | |\n|---|---|---|---|")
    for line in [*boundary(1), *boundary(8)] if QUICK else [*boundary(1), *boundary(8), *products(1), *products(8)]:
        print(line, flush=True)


if __name__ == "__main__":
    main()
