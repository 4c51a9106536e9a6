"""``ds4d bench model --kernels``: the FP8 / MXFP4 weight kernels against their bf16 counterparts.

At V4-Flash shapes, each stored-format product (``ds4d.cuda.quant_matmul``) is
timed next to the bf16 product the decoded weights would take (cuBLAS for the
dense linears; the Triton expert GEMV or the grouped matmul for the experts),
with CUDA events around CUDA-graph replays of 10 calls (device time, as decode steps see it:
no host launch cost), median of 30 replays.  Bandwidth is the weight
bytes the product must read (the selected experts only) over its time.
"""

from __future__ import annotations


def _timed(torch, fn, *args, reps: int = 30, calls: int = 10) -> float:
    """Device seconds of one ``fn(*args)``: ``calls`` calls captured in a CUDA graph (so host launch
    cost is not counted, as in decode steps), median of ``reps`` replays after warm-up."""
    for _ in range(3):
        fn(*args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn(*args)
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    del graph
    return sorted(times)[len(times) // 2]


def run_kernels(torch, device, say) -> list[dict]:
    import torch.nn.functional as F

    from ds4d.cuda import moe_gemv, quant_matmul
    from ds4d.models.deepseek_v4 import moe
    from ds4d.models.deepseek_v4.quant import dequant_fp8_block, quantize_fp8_block

    gen = torch.Generator(device=device).manual_seed(0)
    rows: list[dict] = []
    say("| product | rows | stored format | us | TB/s | bf16 us | TB/s | bf16 / stored time |")
    say("|---|---|---|---|---|---|---|---|")

    def report(name, m, fmt, stored_s, stored_bytes, dense_s, dense_bytes):
        row = {"product": name, "rows": m, "format": fmt, "us": stored_s * 1e6, "tb_s": stored_bytes / stored_s / 1e12,
               "bf16_us": dense_s * 1e6, "bf16_tb_s": dense_bytes / dense_s / 1e12}
        rows.append(row)
        say(f"| {name} | {m} | {fmt} | {row['us']:.1f} | {row['tb_s']:.2f} | {row['bf16_us']:.1f} | "
            f"{row['bf16_tb_s']:.2f} | {dense_s / stored_s:.2f}x |")

    for name, n, k in (("wq_b", 32768, 1024), ("wo_b", 4096, 8192), ("wq_a", 1024, 4096), ("shared w1", 2048, 4096)):
        values = torch.randn(n, k, device=device, generator=gen) * k**-0.5
        weight, scale = quantize_fp8_block(values)
        factors = scale.view(torch.uint8).int().sub(127).float().exp2()
        dense = dequant_fp8_block(weight, scale, (128, 128)).to(torch.bfloat16)
        for m in (1, 8, 64, 2048):
            x = torch.randn(m, k, device=device, generator=gen).to(torch.bfloat16)
            stored = _timed(torch, quant_matmul.fp8_linear, x, weight, factors)
            plain = _timed(torch, F.linear, x, dense)
            report(name, m, "fp8", stored, n * k + factors.numel() * 4, plain, 2 * n * k)

    experts, inter, hidden, k_sel = 256, 2048, 4096, 6
    for name, n, k in (("experts gate/up", 2 * inter, hidden), ("experts down", hidden, inter)):
        packed = torch.randint(0, 256, (experts, n, k // 2), device=device, dtype=torch.uint8, generator=gen)
        scales = torch.randint(118, 124, (experts, n, k // 32), device=device, dtype=torch.uint8, generator=gen)
        dense = (torch.randn(experts, n, k, device=device, generator=gen) * 0.02).to(torch.bfloat16)
        for tokens in (1, 8, 64, 2048):
            ids = torch.stack([torch.randperm(experts, device=device, generator=gen)[:k_sel] for _ in range(tokens)])
            of_row = torch.sort(ids.reshape(-1)).values
            used = int(torch.unique(of_row).numel())
            m = of_row.shape[0]
            x = torch.randn(m, k, device=device, generator=gen).to(torch.bfloat16)
            offsets = torch.cumsum(torch.bincount(of_row, minlength=experts), 0).to(torch.int32)
            if m <= moe_gemv.MAX_ROWS:
                stored = _timed(torch, quant_matmul.mxfp4_rows, x, packed, scales, of_row)
                plain = _timed(torch, moe_gemv.expert_rows, x, dense, of_row)
            else:
                stored = _timed(torch, quant_matmul.mxfp4_grouped, x, packed, scales, offsets)
                plain = _timed(torch, lambda a, b, o: moe._GROUPED_MM(a, b, offs=o), x, dense.transpose(-2, -1),
                               offsets)
            report(name, m, "mxfp4", stored, used * n * (k // 2 + k // 32), plain, used * n * k * 2)
    return rows


SWEEP = {
    "fp8_rows": [{"most_rows": 1, "block_n": bn, "block_k": bk, "warps": w}
                 for bn in (4, 8, 16) for bk in (512, 1024, 2048) for w in (2, 4)],
    "fp8_tiles": [{"block_n": bn, "warps": 4, "stages": st, "programs": p}
                  for bn in (32, 64, 128) for st in (3, 4) for p in (256, 512, 1024)],
    "mxfp4_rows": [{"block_n": bn, "block_b": bb, "warps": w, "ptx_decode": p}
                   for bn in (4, 8) for bb in (256, 512) for w in (2, 4) for p in (False, True)],
    "mxfp4_grouped": [{"block_m": bm, "block_n": bn, "block_b": bb, "warps": w, "stages": st}
                      for bm, bn, bb, w, st in ((64, 128, 64, 4, 3), (64, 128, 64, 4, 4), (64, 128, 128, 8, 3),
                                                (128, 128, 64, 8, 3), (64, 256, 64, 8, 3))],
}
"""Candidate settings per kernel for ``--sweep``."""


def sweep(torch, device, say) -> dict:
    """Time every candidate of :data:`SWEEP` on Flash shapes; the best (least total time) per kernel."""
    from ds4d.cuda import quant_matmul as qm
    from ds4d.models.deepseek_v4.quant import quantize_fp8_block

    gen = torch.Generator(device=device).manual_seed(0)
    fp8 = {}
    for name, n, k in (("wq_b", 32768, 1024), ("wo_b", 4096, 8192), ("wq_a", 1024, 4096), ("w1", 2048, 4096)):
        weight, scale = quantize_fp8_block(torch.randn(n, k, device=device, generator=gen) * k**-0.5)
        fp8[name] = (weight, scale.view(torch.uint8).int().sub(127).float().exp2())
    experts = 256
    packed = torch.randint(0, 256, (experts, 4096, 2048), device=device, dtype=torch.uint8, generator=gen)
    scales = torch.randint(118, 124, (experts, 4096, 128), device=device, dtype=torch.uint8, generator=gen)

    def routed(tokens):
        ids = torch.stack([torch.randperm(experts, device=device, generator=gen)[:6] for _ in range(tokens)])
        of_row = torch.sort(ids.reshape(-1)).values
        offsets = torch.cumsum(torch.bincount(of_row, minlength=experts), 0).to(torch.int32)
        x = torch.randn(of_row.shape[0], 4096, device=device, generator=gen).to(torch.bfloat16)
        return x, of_row, offsets

    def act(m, k):
        return torch.randn(m, k, device=device, generator=gen).to(torch.bfloat16)

    r1, r8, r64, r2k = routed(1), routed(8), routed(64), routed(2048)
    cases = {  # (function, its arguments) per timed shape
        "fp8_rows": [(qm.fp8_linear, act(1, w.shape[1]), w, s) for w, s in fp8.values()],
        "fp8_tiles": [(qm.fp8_linear, act(m, w.shape[1]), w, s) for w, s in fp8.values() for m in (8, 64)],
        "mxfp4_rows": [(qm.mxfp4_rows, r[0], packed, scales, r[1]) for r in (r1, r8)],
        "mxfp4_grouped": [(qm.mxfp4_grouped, r[0], packed, scales, r[2]) for r in (r64, r2k)],
    }
    best = {}
    for kernel, candidates in SWEEP.items():
        original = qm.TUNING[kernel]
        results = []
        for candidate in candidates:
            qm.TUNING[kernel] = candidate
            try:
                total = sum(_timed(torch, fn, *args, reps=10) for fn, *args in cases[kernel])
            except Exception as exc:  # noqa: BLE001 - a setting the compiler refuses (resources): skip it
                say(f"  {kernel} {candidate}: {type(exc).__name__}")
                continue
            results.append((total, candidate))
        qm.TUNING[kernel] = original
        results.sort(key=lambda r: r[0])
        for total, candidate in results[:3]:
            say(f"{kernel}: {total * 1e6:.1f} us over {len(cases[kernel])} shapes: {candidate}")
        best[kernel] = results[0][1] if results else original
    return best
