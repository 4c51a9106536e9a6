"""Time ``decode_triton.decode_attention`` on one GPU at DeepSeek-V4-Flash's shapes (64 heads of 512, a window
of 128, 128-token blocks) over candidate launches (``DECODE_TUNING``), against the torch decode path's attention
on the same rows (``decode._gather`` of the entry blocks, the window ring's keys and ``decode._attend``).

Cases: batch 1 and 8 at 1K and 32K positions, for each kind of layer: the window alone, HCA (every visible entry,
ratio 128) and CSA (ratio 4: at 1K the indexer keeps every entry, at 32K its 512 picks).  Each call is timed in a
CUDA graph of 16 calls over distinct rings and pools (``do_bench`` median).  Prints each candidate, then a table of
the best launch per case against torch, and the launch with the least time summed over the cases.

    PYTHONPATH=. python3 tests/gpu/decode_kernel_sweep.py
    TRITON_INTERPRET=1 PYTHONPATH=. python3 tests/gpu/decode_kernel_sweep.py --check   # errors only, any device
"""

from __future__ import annotations

import itertools
import json
import os
import sys

import torch

from ds4d.cuda import decode_triton
from ds4d.models.deepseek_v4.decode import _attend, _gather
from tests.gpu.gguf_gemv_sweep import graph_time

HEADS, D, WINDOW, BLOCK = 64, 512, 128, 128
CASES = [(batch, position, ratio) for batch in (1, 8) for position in (1023, 32767) for ratio in (0, 128, 4)]
LAUNCHES = [{"block_heads": 16, "block_keys": k, "block_d": 64, "d_out": 64, "chunk": c, "warps": w, "stages": 1}
            for k, c, w in itertools.product((16, 32), (32, 64, 128), (4, 8)) if c >= k]
COPIES = int(os.environ.get("COPIES", "16"))
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32  # the interpreter: float32


def case_tensors(batch: int, position: int, ratio: int):
    """Distinct inputs for COPIES calls: (q, ring, slots, positions, sink, pool, table, picks) each."""
    gen = torch.Generator(device=DEVICE).manual_seed(batch * 7 + ratio)
    made = []
    visible = (position + 1) // ratio if ratio else 0
    per_block = BLOCK // ratio if ratio else 0
    width = -(-visible // per_block) if ratio else 0
    for _ in range(COPIES):
        q = torch.randn(batch, HEADS, D, device=DEVICE, dtype=DTYPE, generator=gen)
        ring = torch.randn(batch, WINDOW, D, device=DEVICE, dtype=DTYPE, generator=gen)
        slots = torch.arange(batch, device=DEVICE)
        positions = torch.full((batch,), position, device=DEVICE)
        sink = torch.randn(HEADS, device=DEVICE, generator=gen)
        pool = table = picks = None
        if ratio:
            pool = torch.randn(batch * width, per_block, D, device=DEVICE, dtype=DTYPE, generator=gen)
            table = torch.arange(batch * width, device=DEVICE).view(batch, width)
            if ratio == 4 and visible > 512:  # the indexer's picks
                picks = torch.stack([torch.randperm(visible, device=DEVICE, generator=gen)[:512]
                                     for _ in range(batch)])
        made.append((q, ring, slots, positions, sink, pool, table, picks))
    return made


def torch_attention(q, ring, slots, positions, sink, pool, table, picks, ratio):
    """The torch decode path's keys, mask and attention for these rows."""
    keys = ring[slots]
    slot_index = torch.arange(WINDOW, device=q.device)
    held = positions[:, None] - (positions[:, None] - slot_index) % WINDOW
    mask = torch.zeros(held.shape, dtype=torch.float32, device=q.device).masked_fill_(held < 0, float("-inf"))
    if pool is not None:
        entries = _gather(pool, table)
        if picks is not None:
            entries = entries.gather(1, picks[..., None].expand(-1, -1, D))
            valid = torch.ones(picks.shape, dtype=torch.bool, device=q.device)
        else:
            visible = (positions + 1) // ratio
            valid = torch.arange(entries.shape[1], device=q.device)[None, :] < visible[:, None]
        extra = torch.zeros(valid.shape, dtype=torch.float32, device=q.device).masked_fill_(~valid, float("-inf"))
        keys = torch.cat([keys, entries], dim=1)
        mask = torch.cat([mask, extra], dim=1)
    return _attend(q, keys, mask, sink, D**-0.5)


def check() -> None:
    """The kernel at its default launch against the torch path on every case, batch 1: no timing."""
    for _, position, ratio in CASES[: len(CASES) // 2]:
        a = case_tensors(1, position, ratio)[0]
        got = decode_triton.decode_attention(*a[:4], a[4], D**-0.5, pool=a[5], table=a[6], ratio=ratio, picks=a[7])
        want = torch_attention(*a, ratio).float()
        error = (got.float() - want).abs().max().item() / want.abs().max().item()
        print(f"@{position + 1} ratio {ratio}: largest difference {error:.1e} of the largest output")
        assert error < (2e-2 if DTYPE == torch.bfloat16 else 1e-4), error


def main() -> None:
    if "--check" in sys.argv:
        return check()
    print(f"{torch.cuda.get_device_name()}: decode_attention, CUDA graphs of {COPIES} calls, do_bench median")
    default = dict(decode_triton.DECODE_TUNING)
    timed: dict[str, dict[str, float]] = {}
    rows = []
    for batch, position, ratio in CASES:
        label = f"b{batch} @{(position + 1) // 1024}K " + {0: "window", 128: "HCA", 4: "CSA"}[ratio]
        made = case_tensors(batch, position, ratio)
        t_torch = graph_time([lambda a=a, r=ratio: torch_attention(*a, r) for a in made])
        times = timed[label] = {}
        for launch in LAUNCHES:
            decode_triton.DECODE_TUNING.update(launch)
            kernel = [lambda a=a, r=ratio: decode_triton.decode_attention(*a[:4], a[4], D**-0.5, pool=a[5], table=a[6],
                                                                      ratio=r, picks=a[7]) for a in made]
            try:
                got = kernel[0]().float()
                want = torch_attention(*made[0], ratio).float()
                error = (got - want).abs().max().item() / want.abs().max().item()
                seconds = graph_time(kernel)
            except Exception as exc:  # noqa: BLE001 - a launch that does not compile is reported and skipped
                print(f"  {label} {launch}: failed: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            times[json.dumps(launch)] = seconds
            print(f"  {label} {launch}: {seconds * 1e6:.1f} us (torch {t_torch * 1e6:.1f}), error {error:.1e}")
        decode_triton.DECODE_TUNING.update(default)
        if times:
            best = min(times, key=times.get)
            rows.append((label, times.get(json.dumps(default)), times[best], best, t_torch))
    print("\n| case | default launch us | best us | best launch | torch us | torch / default |")
    print("|---|---|---|---|---|---|")
    for label, at_default, best_s, best, t_torch in rows:
        shown = f"{at_default * 1e6:.1f}" if at_default else "n/a"
        ratio = f"{t_torch / at_default:.2f}x" if at_default else "n/a"
        print(f"| {label} | {shown} | {best_s * 1e6:.1f} | {best} | {t_torch * 1e6:.1f} | {ratio} |")
    keys = set.intersection(*(set(t) for t in timed.values() if t)) if timed else set()
    if keys:
        overall = min(keys, key=lambda key: sum(t[key] for t in timed.values() if t))
        print(f"\nleast time summed over the cases: {overall}")


if __name__ == "__main__":
    main()
