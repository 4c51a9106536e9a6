"""``ds4d bench model --kernels``: the FP8 / MXFP4 weight kernels against their bf16 counterparts.

At V4-Flash shapes, each stored-format product (``ds4d.cuda.quant_matmul``) is
timed next to the bf16 product the decoded weights would take (cuBLAS for the
dense linears; the Triton expert GEMV or the grouped matmul for the experts),
with CUDA events around CUDA-graph replays (device time, as decode steps see it:
no host launch cost), median of 30 replays.  Bandwidth is the weight
bytes the product must read (the selected experts only) over its time.

Weights are timed cold, as a decode step meets them: the calls of one replay
cycle through distinct weights (copies of a dense matrix, other expert picks)
that together hold :data:`COLD_BYTES`, far more than the 50 MB L2 cache, so
each call reads its weights from HBM.  Timing one matrix over and over would
serve a 4 MB matrix, or six experts' 50 MB, largely from L2.
"""

from __future__ import annotations

COLD_BYTES = 256 << 20
"""Distinct weight bytes one timed replay cycles through (several times the L2 cache)."""


def _timed_over(torch, fn, arg_sets: list, reps: int = 30) -> float:
    """Device seconds of one ``fn`` call, averaged over one call per argument tuple of ``arg_sets``
    captured in a CUDA graph; median of ``reps`` replays after warm-up."""
    for args in arg_sets[:3]:
        fn(*args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for args in arg_sets:
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
        times.append(start.elapsed_time(end) / 1e3 / len(arg_sets))
    del graph
    return sorted(times)[len(times) // 2]


def _timed(torch, fn, *args, reps: int = 30, calls: int = 10) -> float:
    """Device seconds of one ``fn(*args)``, the same arguments ``calls`` times (warm caches)."""
    return _timed_over(torch, fn, [args] * calls, reps)


def global_loads(ptx: str) -> dict[str, int]:
    """How many global-memory loads of each width a kernel's PTX holds, e.g. ``{"v4.b32": 2, "b8": 34}``
    (cache hints left out): 16-byte vector loads against byte loads tell how a kernel reads its weights."""
    counts: dict[str, int] = {}
    for line in ptx.splitlines():
        parts = line.split()
        if parts and parts[0].startswith("@"):  # a predicated instruction
            parts = parts[1:]
        op = parts[0] if parts and parts[0].startswith("ld.global") else None
        if op is not None:
            width = ".".join(p for p in op.split(".")[2:] if p != "nc" and "::" not in p)
            counts[width] = counts.get(width, 0) + 1
    return counts


def cold_copies(weight_bytes: int) -> int:
    """How many distinct copies of a weight of ``weight_bytes`` make up :data:`COLD_BYTES` (at least 2)."""
    return max(2, -(-COLD_BYTES // max(1, weight_bytes)))


def routed_rows(torch, gen, experts: int, k_sel: int, tokens: int, device):
    """One random routing of ``tokens`` tokens to ``k_sel`` distinct experts each: (the rows' experts
    sorted, as int64; the end offset of each expert's rows, as int32)."""
    ids = torch.stack([torch.randperm(experts, device=device, generator=gen)[:k_sel] for _ in range(tokens)])
    of_row = torch.sort(ids.reshape(-1)).values
    return of_row, torch.cumsum(torch.bincount(of_row, minlength=experts), 0).to(torch.int32)


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
        weights = [(weight.clone(), factors.clone()) for _ in range(cold_copies(n * k))]
        denses = [dense.clone() for _ in range(cold_copies(2 * n * k))]
        for m in (1, 8, 64, 2048):
            x = torch.randn(m, k, device=device, generator=gen).to(torch.bfloat16)
            stored = _timed_over(torch, quant_matmul.fp8_linear, [(x, w, f) for w, f in weights])
            plain = _timed_over(torch, F.linear, [(x, d) for d in denses])
            report(name, m, "fp8", stored, n * k + factors.numel() * 4, plain, 2 * n * k)
        del weights, denses

    experts, inter, hidden, k_sel = 256, 2048, 4096, 6
    for name, n, k in (("experts gate/up", 2 * inter, hidden), ("experts down", hidden, inter)):
        packed = torch.randint(0, 256, (experts, n, k // 2), device=device, dtype=torch.uint8, generator=gen)
        scales = torch.randint(118, 124, (experts, n, k // 32), device=device, dtype=torch.uint8, generator=gen)
        dense = (torch.randn(experts, n, k, device=device, generator=gen) * 0.02).to(torch.bfloat16)
        for tokens in (1, 8, 64, 2048):
            picks = [routed_rows(torch, gen, experts, k_sel, tokens, device)
                     for _ in range(cold_copies(min(tokens * k_sel, experts) * n * k // 2))]
            used = sum(int(torch.unique(of_row).numel()) for of_row, _ in picks) / len(picks)
            m = picks[0][0].shape[0]
            x = torch.randn(m, k, device=device, generator=gen).to(torch.bfloat16)
            if m <= moe_gemv.MAX_ROWS:
                stored = _timed_over(torch, quant_matmul.mxfp4_rows, [(x, packed, scales, r) for r, _ in picks])
                plain = _timed_over(torch, moe_gemv.expert_rows, [(x, dense, r) for r, _ in picks])
            else:
                stored = _timed_over(torch, quant_matmul.mxfp4_grouped, [(x, packed, scales, o) for _, o in picks])
                plain = _timed_over(torch, lambda a, b, o: moe._GROUPED_MM(a, b, offs=o),
                                    [(x, dense.transpose(-2, -1), o) for _, o in picks])
            report(name, m, "mxfp4", stored, used * n * (k // 2 + k // 32), plain, used * n * k * 2)
    return rows


SWEEP = {
    "fp8_rows": [{"most_rows": 1, "block_n": bn, "block_k": bk, "warps": w}
                 for bn in (4, 8, 16) for bk in (512, 1024, 2048) for w in (2, 4)],
    "fp8_tiles": [{"block_n": bn, "warps": 4, "stages": st, "programs": p}
                  for bn in (32, 64, 128) for st in (3, 4) for p in (256, 512, 1024)],
    "mxfp4_rows": [{"block_n": bn, "block_b": bb, "warps": w, "ptx_decode": True}
                   for bn in (4, 8, 16, 32) for bb in (128, 256, 512) for w in (2, 4, 8)],
    "mxfp4_grouped": [{"block_m": bm, "block_n": bn, "block_b": bb, "warps": w, "stages": st}
                      for bm, bn, bb, w, st in ((64, 128, 64, 4, 3), (64, 128, 64, 4, 4), (64, 128, 128, 8, 3),
                                                (128, 128, 64, 8, 3), (64, 256, 64, 8, 3))],
}
"""Candidate settings per kernel for ``--sweep``."""


def sweep(torch, device, say) -> dict:
    """Time every candidate of :data:`SWEEP` on Flash shapes, weights cold; the best (least total time)
    per kernel."""
    from ds4d.cuda import quant_matmul as qm
    from ds4d.models.deepseek_v4.quant import quantize_fp8_block

    gen = torch.Generator(device=device).manual_seed(0)
    fp8 = {}
    for name, n, k in (("wq_b", 32768, 1024), ("wo_b", 4096, 8192), ("wq_a", 1024, 4096), ("w1", 2048, 4096)):
        weight, scale = quantize_fp8_block(torch.randn(n, k, device=device, generator=gen) * k**-0.5)
        factors = scale.view(torch.uint8).int().sub(127).float().exp2()
        fp8[name] = [(weight.clone(), factors.clone()) for _ in range(cold_copies(n * k))]
    experts = 256
    banks = [(torch.randint(0, 256, (experts, n, k // 2), device=device, dtype=torch.uint8, generator=gen),
              torch.randint(118, 124, (experts, n, k // 32), device=device, dtype=torch.uint8, generator=gen))
             for n, k in ((4096, 4096), (4096, 2048))]  # gate/up, down

    def act(m, k):
        return torch.randn(m, k, device=device, generator=gen).to(torch.bfloat16)

    def routed(tokens, packed, scales):
        picks = [routed_rows(torch, gen, experts, 6, tokens, device)
                 for _ in range(cold_copies(min(6 * tokens, experts) * packed[0].numel()))]
        x = act(6 * tokens, 2 * packed.shape[2])
        return [(x, packed, scales, of_row, offsets) for of_row, offsets in picks]

    def rows_args(sets):
        return [(x, packed, scales, of_row) for x, packed, scales, of_row, _ in sets]

    def grouped_args(sets):
        return [(x, packed, scales, offsets) for x, packed, scales, _, offsets in sets]

    cases = {  # (function, the argument tuples one replay cycles through) per timed shape
        "fp8_rows": [(qm.fp8_linear, [(x, w, s) for w, s in copies])
                     for copies in fp8.values() for x in [act(1, copies[0][0].shape[1])]],
        "fp8_tiles": [(qm.fp8_linear, [(x, w, s) for w, s in copies])
                      for copies in fp8.values() for m in (8, 64) for x in [act(m, copies[0][0].shape[1])]],
        "mxfp4_rows": [(qm.mxfp4_rows, rows_args(routed(t, *bank))) for bank in banks for t in (1, 8)],
        "mxfp4_grouped": [(qm.mxfp4_grouped, grouped_args(routed(t, *banks[0]))) for t in (64, 2048)],
    }
    best = {}
    for kernel, candidates in SWEEP.items():
        original, shapes = qm.TUNING[kernel], qm.TUNING.get(f"{kernel}_shapes")
        if shapes is not None:
            qm.TUNING[f"{kernel}_shapes"] = {}
        results = []
        for candidate in candidates:
            qm.TUNING[kernel] = candidate
            try:
                total = sum(_timed_over(torch, fn, arg_sets, reps=10) for fn, arg_sets in cases[kernel])
            except Exception as exc:  # noqa: BLE001 - a setting the compiler refuses (resources): skip it
                say(f"  {kernel} {candidate}: {type(exc).__name__}")
                continue
            results.append((total, candidate))
        qm.TUNING[kernel] = original
        if shapes is not None:
            qm.TUNING[f"{kernel}_shapes"] = shapes
        results.sort(key=lambda r: r[0])
        for total, candidate in results[:3]:
            say(f"{kernel}: {total * 1e6:.1f} us over {len(cases[kernel])} shapes: {candidate}")
        best[kernel] = results[0][1] if results else original
    return best
