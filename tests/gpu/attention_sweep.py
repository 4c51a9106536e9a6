"""Time the Triton prefill attention kernel against torch's score blocks on a V4-Flash prefill chunk.

    PYTHONPATH=. python3 tests/gpu/attention_sweep.py

2048 queries of 64 heads of 512 over a 128-key window: without entries (sliding-window layers),
with 16 shared entries (HCA, ratio 128) and with 512 (CSA at 2K, ratio 4, all kept), for a few
kernel settings (``attention_triton.TUNING``) and for ``attention._attend_local``.  A tool for
reading, not a test.
"""

from __future__ import annotations

import sys

import torch

from ds4d.bench.kernels import _timed
from ds4d.cuda import attention_triton as at
from ds4d.models.deepseek_v4.attention import _attend_local


def main() -> int:
    gen = torch.Generator(device="cuda").manual_seed(0)
    n, heads, d, window = 2048, 64, 512, 128
    q = torch.randn(n, heads, d, device="cuda", generator=gen).bfloat16()
    keys = torch.randn(n, d, device="cuda", generator=gen).bfloat16()
    sink = torch.randn(heads, device="cuda", generator=gen)
    positions = torch.arange(n, device="cuda")
    cases = {"window only": None}
    for name, ratio in (("16 entries (HCA)", 128), ("512 entries (CSA)", 4)):
        count = n // ratio
        closed = torch.arange(count, device="cuda")[None, :] < ((positions + 1) // ratio)[:, None]
        cases[name] = (torch.randn(count, d, device="cuda", generator=gen).bfloat16(),
                       torch.zeros(closed.shape, device="cuda").masked_fill_(~closed, float("-inf")))
    settings = [{"block_heads": bh, "block_keys": bk, "warps": w, "stages": st}
                for bh, bk, w, st in ((32, 32, 8, 2), (16, 32, 4, 2), (64, 32, 8, 2), (32, 64, 8, 2), (32, 32, 4, 2),
                                      (16, 64, 4, 2), (64, 16, 8, 2), (32, 32, 8, 1))]
    print("| case | setting | us | torch us | torch / kernel |")
    print("|---|---|---|---|---|")
    for name, extra in cases.items():
        plain = _timed(torch, _attend_local, q, keys, 0, 0, extra, sink, d**-0.5, window, reps=5, calls=2)
        want = _attend_local(q, keys, 0, 0, extra, sink, d**-0.5, window).float()
        for setting in settings:
            at.TUNING.update(setting)
            try:
                got = at.window_attention(q, keys, 0, 0, window, sink, d**-0.5, extra)
                err = ((got.float() - want).abs().max() / want.abs().max()).item()
                us = _timed(torch, at.window_attention, q, keys, 0, 0, window, sink, d**-0.5, extra, reps=5, calls=2)
            except Exception as exc:  # noqa: BLE001 - a setting the compiler refuses: say so
                print(f"| {name} | {setting} | {type(exc).__name__} | | |")
                continue
            print(f"| {name} | {setting} | {us * 1e6:.0f} (err {err:.1e}) | {plain * 1e6:.0f} | {plain / us:.2f}x |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
