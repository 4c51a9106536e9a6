"""What bounds the MXFP4 rows kernel (about 1 TB/s of stored bytes at batch 1): variants with one part removed.

    PYTHONPATH=. python3 tests/gpu/mxfp4_ablation.py            # on a GPU: a table of device times
    TRITON_INTERPRET=1 PYTHONPATH=. python3 tests/gpu/mxfp4_ablation.py --tiny   # the script's own check, CPU

The production kernel (``ds4d.cuda.quant_kernels.mxfp4_rows_kernel``) per step loads a tile of packed
bytes, the even and odd activations (two strided loads), decodes both nibbles, multiplies, and sums
each 16-byte group before scaling it.  Each variant here changes one of those parts, at the tile
settings of ``quant_matmul.TUNING``, on V4-Flash gate/up shapes (6 and 48 rows of 4096 x 4096):

* ``decode``: ptx (as in production), int (the integer decode), none (bytes used as numbers: wrong
  values, the cost of a decode-free loop);
* ``x``: strided (production), pairs (one contiguous load of ``[bytes, 2]`` split into even and
  odd), none (constant activations: the cost of a loop without activation loads);
* ``sum``: group (production), flat (each step's products added into a ``[rows, bytes]`` tile,
  reduced once at the end, no scales: the cost of the per-step reductions).

Variants that keep the arithmetic (decode ptx/int, x strided/pairs, sum group) are checked against
a float32 product of the decoded weights.  Each timed call picks other experts (weights cold, as in
a decode step).  A tool for reading, not a test.
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl

from ds4d.bench.kernels import _timed_over, cold_copies, global_loads
from ds4d.cuda import quant_matmul as qm
from ds4d.cuda.quant_kernels import e2m1_pairs_scaled, e2m1_scaled, e8m0_scaled
from ds4d.models.deepseek_v4.quant import dequant_mxfp4

DECODES = {"ptx": 0, "int": 1, "none": 2}
XS = {"strided": 0, "pairs": 1, "none": 2}
SUMS = {"group": 0, "flat": 1}
ADDRS = {"strided": 0, "table": 1, "table16": 2, "offsets": 3}


@triton.jit
def variant_kernel(x_ptr, w_ptr, s_ptr, w_table, s_table, out_ptr, expert_ptr, n, k: tl.constexpr, sxr, swe, swn,
                   sse, ssn, sor, block_n: tl.constexpr, block_b: tl.constexpr, decode: tl.constexpr,
                   x_mode: tl.constexpr, sum_mode: tl.constexpr, addr_mode: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * block_n + tl.arange(0, block_n)
    live_cols = cols < n
    expert = tl.load(expert_ptr + row).to(tl.int64)
    if addr_mode == 0:  # base + expert * stride
        w_base = w_ptr + expert * swe + cols[:, None] * swn
        s_base = s_ptr + expert * sse + cols[:, None] * ssn
    elif addr_mode == 1:  # address table, int -> pointer
        w_base = tl.load(w_table + expert).to(tl.pointer_type(tl.uint8)) + cols[:, None] * swn
        s_base = tl.load(s_table + expert).to(tl.pointer_type(tl.uint8)) + cols[:, None] * ssn
    elif addr_mode == 2:  # address table, int -> pointer, the address declared a multiple of 16
        w_base = tl.multiple_of(tl.load(w_table + expert), 16).to(tl.pointer_type(tl.uint8)) + cols[:, None] * swn
        s_base = tl.multiple_of(tl.load(s_table + expert), 16).to(tl.pointer_type(tl.uint8)) + cols[:, None] * ssn
    else:  # table of offsets from the base pointer, declared multiples of 16
        w_base = w_ptr + tl.multiple_of(tl.load(w_table + expert), 16) + cols[:, None] * swn
        s_base = s_ptr + tl.multiple_of(tl.load(s_table + expert), 16) + cols[:, None] * ssn
    acc = tl.zeros([block_n], dtype=tl.float32)
    flat = tl.zeros([block_n, block_b], dtype=tl.float32)
    for k0 in range(0, k // 2, block_b):
        byte = k0 + tl.arange(0, block_b)
        live = byte < k // 2
        if x_mode == 0:
            even = tl.load(x_ptr + row * sxr + 2 * byte, mask=live, other=0.0).to(tl.float32)
            odd = tl.load(x_ptr + row * sxr + 2 * byte + 1, mask=live, other=0.0).to(tl.float32)
        elif x_mode == 1:
            pairs = tl.load(x_ptr + row * sxr + 2 * byte[:, None] + tl.arange(0, 2)[None, :], mask=live[:, None],
                            other=0.0).to(tl.float32)
            even, odd = tl.split(pairs)
        else:
            even = tl.full([block_b], 1.0, tl.float32)
            odd = tl.full([block_b], 1.0, tl.float32)
        packed = tl.load(w_base + byte[None, :], mask=live_cols[:, None] & live[None, :], other=0)
        if decode == 0:
            low, high = e2m1_pairs_scaled(packed)
            part = low.to(tl.float32) * even[None, :] + high.to(tl.float32) * odd[None, :]
        elif decode == 1:
            codes = packed.to(tl.int32)
            part = e2m1_scaled(codes & 15) * even[None, :] + e2m1_scaled(codes >> 4) * odd[None, :]
        else:
            part = packed.to(tl.float32) * even[None, :] + packed.to(tl.float32) * odd[None, :]
        if sum_mode == 0:
            groups = k0 // 16 + tl.arange(0, block_b // 16)
            scale = e8m0_scaled(tl.load(s_base + groups[None, :],
                                        mask=live_cols[:, None] & (groups[None, :] < k // 32), other=0))
            acc += tl.sum(tl.sum(tl.reshape(part, [block_n, block_b // 16, 16]), axis=2) * scale, axis=1)
        else:
            flat += part
    if sum_mode == 1:
        acc = tl.sum(flat, axis=1)
    tl.store(out_ptr + row * sor + cols, acc.to(out_ptr.dtype.element_ty), mask=live_cols)


def run_variant(x, packed, scales, experts, decode: str, x_mode: str, sum_mode: str, addr: str = "strided"):
    rows, k = x.shape
    n = packed.shape[1]
    t = qm.TUNING["mxfp4_rows"]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    grid = (rows, triton.cdiv(n, t["block_n"]))
    w_table, s_table = qm.expert_table(packed), qm.expert_table(scales)
    if addr == "offsets":
        w_table, s_table = w_table - packed.data_ptr(), s_table - scales.data_ptr()
    compiled = variant_kernel[grid](x, packed, scales, w_table, s_table, out, experts, n, k, x.stride(0),
                                    packed.stride(0), packed.stride(1), scales.stride(0), scales.stride(1),
                                    out.stride(0), block_n=t["block_n"], block_b=t["block_b"], decode=DECODES[decode],
                                    x_mode=XS[x_mode], sum_mode=SUMS[sum_mode], addr_mode=ADDRS[addr],
                                    num_warps=t["warps"])
    LOADS[(decode, x_mode, sum_mode, addr)] = _vector_loads(compiled)
    return out


LOADS: dict = {}


def _vector_loads(compiled) -> str:
    ptx = getattr(compiled, "asm", {}).get("ptx", "") if compiled is not None else ""
    return ", ".join(f"{w}: {c}" for w, c in sorted(global_loads(ptx).items())) or "n/a"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true", help="small shapes, correctness only (runs in the interpreter)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(0)
    experts, n, k = (8, 48, 256) if args.tiny else (64, 4096, 4096)
    packed = torch.randint(0, 256, (experts, n, k // 2), device=device, dtype=torch.uint8, generator=gen)
    scales = torch.randint(118, 124, (experts, n, k // 32), device=device, dtype=torch.uint8, generator=gen)
    variants = [(d, x, s, a) for d, x, s, a in (("ptx", "strided", "group", "strided"),
                                                ("ptx", "pairs", "group", "strided"),
                                                ("ptx", "pairs", "group", "table"),
                                                ("ptx", "pairs", "group", "table16"),
                                                ("ptx", "pairs", "group", "offsets"),
                                                ("int", "pairs", "group", "strided"),
                                                ("none", "pairs", "group", "strided"),
                                                ("ptx", "none", "group", "strided"),
                                                ("none", "none", "flat", "strided"))
                if device == "cuda" or d != "ptx"] if device == "cuda" else [
        ("int", "pairs", "group", a) for a in ADDRS]
    print("| variant (decode, x, sum, addresses) | rows | us | TB/s of stored bytes | global loads in the PTX |")
    print("|---|---|---|---|---|")
    for rows in (6, 48) if not args.tiny else (3,):
        stored = rows * n * (k // 2 + k // 32)
        # Distinct expert picks per timed call: the weights come from HBM, not from the L2 cache.
        picks = [torch.randperm(experts, device=device, generator=gen)[:rows].sort().values
                 for _ in range(cold_copies(stored))]
        x = torch.randn(rows, k, device=device, generator=gen).to(torch.bfloat16 if device == "cuda" else torch.float32)
        values = torch.stack([dequant_mxfp4(packed[e], scales[e]) for e in picks[0].tolist()])
        want = torch.einsum("rnk,rk->rn", values, x.float())
        for variant in variants:
            got = run_variant(x, packed, scales, picks[0], *variant)
            if variant[0] != "none" and variant[1] != "none" and variant[2] == "group":
                err = ((got.float() - want).abs().max() / want.abs().max()).item()
                assert err < 2e-2, (variant, err)
            if args.tiny:
                print(f"| {', '.join(variant)} | {rows} | checked | | |")
                continue
            seconds = _timed_over(torch, run_variant, [(x, packed, scales, e, *variant) for e in picks])
            print(f"| {', '.join(variant)} | {rows} | {seconds * 1e6:.1f} | {stored / seconds / 1e12:.2f} | "
                  f"{LOADS.get(variant, 'n/a')} |")
        if not args.tiny:
            seconds = _timed_over(torch, qm.mxfp4_rows, [(x, packed, scales, e) for e in picks])
            print(f"| production (quant_matmul.mxfp4_rows) | {rows} | {seconds * 1e6:.1f} | "
                  f"{stored / seconds / 1e12:.2f} | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
