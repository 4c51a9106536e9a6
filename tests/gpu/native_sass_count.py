"""Count the instructions the batch-1 FP8 and MXFP4 GEMVs (``quant_kernels.fp8_rows_kernel``,
``mxfp4_rows_kernel``) spend on a weight value, without a GPU, as ``gguf_sass_count.py`` does for the GGUF
blocks: compiled for an H200/H100 (``GPUTarget("cuda", 90, 32)``) with the launch options they run with
(floating-point contraction on), the SASS read with the ``nvdisasm`` Triton's wheel carries.

A GEMV's loop that issues more instructions a value than the SMs retire in the time its bytes take to
arrive is bound by its instructions, not by memory.  An H100's 132 SMs retire 30-33 T thread-instructions
a second against about 3.0 TB/s of copy bandwidth: 10-11 instructions a byte, so 10-11 a value for FP8 and
5.3-5.9 for MXFP4 (0.53 bytes a value with its scales).  The rows: the kernel's own launch and the
per-shape ones (``quant_matmul.TUNING``), by kind of instruction per value a thread takes:

* decode: integer and permute work turning the stored codes into numbers (LOP3, SHF, PRMT, IMAD, IADD3, SEL);
* widen: half to float conversions (HADD2 with a float32 result, F2FP);
* math: FFMA, FMUL, FADD (and HMUL2, a scale applied to half pairs); shuffles: SHFL (sums across a warp);
  loads: LDG, LDS.

``--dot-scaled`` adds a GEMV written with ``tl.dot_scaled`` (the MXFP4 tile widened to bfloat16 by Triton,
the product on tensor cores, the input row padded to 16 columns): a measured alternative, not a kernel of
the project.  A tool for reading, not a test; ``TRITON_INTERPRET`` must be off.

    PYTHONPATH=. python3 tests/gpu/native_sass_count.py [--dot-scaled] [--pdl] [--gated]
"""

from __future__ import annotations

import argparse
import collections

import triton
import triton.language as tl

from ds4d.cuda import quant_kernels, quant_matmul
from tests.gpu import gguf_sass_count
from tests.gpu.gguf_sass_count import loop_and_registers

KINDS = {"decode": ("LOP3", "SHF", "PRMT", "IMAD", "IADD3", "SEL", "LEA"), "widen": ("HADD2", "F2FP"),
         "math": ("FFMA", "FMUL", "FADD", "HMUL2"), "shuffles": ("SHFL",), "loads": ("LDG", "LDS")}

FP8_SIGNATURE = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "out_ptr": "*bf16", "n": "i32",
                 "k": "constexpr", "sxm": "i32", "swn": "i32", "ssn": "i32", "som": "i32", "block_n": "constexpr",
                 "block_k": "constexpr", "block": "constexpr", "pdl": "constexpr", "gated": "constexpr",
                 "limit": "fp32", "clamp": "constexpr"}
MXFP4_SIGNATURE = {"x_ptr": "*bf16", "w_table": "*i64", "s_table": "*i64", "out_ptr": "*bf16", "anchor_ptr": "*u8",
                   "anchor": "i64", "expert_ptr": "*i64", "n": "i32", "k": "constexpr", "sxr": "i32", "swn": "i32",
                   "ssn": "i32", "sor": "i32", "block_n": "constexpr", "block_b": "constexpr",
                   "ptx_decode": "constexpr", "aligned": "constexpr", "pdl": "constexpr", "gated": "constexpr",
                   "limit": "fp32", "clamp": "constexpr"}
FP8_SHAPES = {"wq_b": (32768, 1024), "wo_b": (4096, 8192), "shared w1 + w3": (4096, 4096), "shared w2": (4096, 2048),
              "wq_a + wkv": (1536, 4096)}
MXFP4_SHAPES = {"experts gate/up": (4096, 4096), "experts down": (4096, 2048)}


@triton.jit
def dot_scaled_rows_kernel(x_ptr, w_table, s_table, out_ptr, anchor_ptr, anchor, expert_ptr, n, k: tl.constexpr,
                           sxr, swn, ssn, sor, block_n: tl.constexpr, block_b: tl.constexpr,
                           ptx_decode: tl.constexpr, aligned: tl.constexpr, pdl: tl.constexpr):
    """``mxfp4_rows_kernel``'s product through ``tl.dot_scaled``: ``block_n`` weight rows times the input row
    padded to 16 columns (column 0 the row, the rest zeros) on tensor cores; ``ptx_decode`` and ``pdl`` unused."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * block_n + tl.arange(0, block_n)
    live_cols = cols < n
    expert = tl.load(expert_ptr + row)
    w_offset = tl.multiple_of(tl.load(w_table + expert) - anchor, 16)
    s_offset = tl.multiple_of(tl.load(s_table + expert) - anchor, 16)
    w_base = anchor_ptr + w_offset + cols[:, None] * swn
    s_base = anchor_ptr + s_offset + cols[:, None] * ssn
    pad = tl.arange(0, 16)
    acc = tl.zeros([block_n, 16], dtype=tl.float32)
    for k0 in range(0, k // 2, block_b):
        byte = k0 + tl.arange(0, block_b)
        packed = tl.load(w_base + byte[None, :], mask=live_cols[:, None], other=0)
        groups = k0 // 16 + tl.arange(0, block_b // 16)
        scales = tl.load(s_base + groups[None, :], mask=live_cols[:, None], other=0)
        inputs = tl.load(x_ptr + row * sxr + 2 * k0 + tl.arange(0, 2 * block_b))
        padded = tl.where(pad[None, :] == 0, inputs[:, None], 0.0).to(tl.bfloat16)
        acc = tl.dot_scaled(packed, scales, "e2m1", padded, None, "bf16", acc)
    out = tl.sum(tl.where(pad[None, :] == 0, acc, 0.0), axis=1)
    tl.store(out_ptr + row * sor + cols, out.to(out_ptr.dtype.element_ty), mask=live_cols)


def _compile(fn, signature: dict, constants: dict, warps: int):
    aligned = [i for i, (name, kind) in enumerate(signature.items()) if kind != "constexpr" and name != "n"]
    return gguf_sass_count._compile(fn, signature, constants, aligned, warps, fp_fusion=True)


def counts(kernel, values_a_trip: float, trips: int) -> dict:
    """Per weight value a thread takes: instructions in all and by kind (:data:`KINDS`); registers a thread.
    ``values_a_trip``: values a thread takes in one trip of the loop; a kernel whose loop was written out
    (one trip, or trips unrolled) is counted whole over ``trips`` trips."""
    ops, registers, looped = loop_and_registers(kernel)
    values = values_a_trip * (1 if looped else trips)
    by_kind = {kind: sum(ops[op] for op in names) / values for kind, names in KINDS.items()}
    return {"instructions": sum(ops.values()) / values, **by_kind, "registers": registers,
            "mma": (ops["HMMA"] + ops["HGMMA"]) / values, "top": collections.Counter(ops).most_common(6)}


def fp8_rows(n: int, k: int, pdl: bool = False, gated: bool = False) -> tuple[dict, dict]:
    t = dict(quant_matmul.TUNING["fp8_rows_shapes"].get(f"{n}x{k}", quant_matmul.TUNING["fp8_rows"]))
    if gated:
        t["block_n"] = quant_matmul._paired(t["block_n"])
    kernel = _compile(quant_kernels.fp8_rows_kernel, FP8_SIGNATURE,
                      {"k": k, "block_n": t["block_n"], "block_k": t["block_k"], "block": 128, "pdl": pdl,
                       "gated": gated, "clamp": gated}, t["warps"])
    return t, counts(kernel, t["block_n"] * t["block_k"] / (32 * t["warps"]), k // t["block_k"])


def mxfp4_rows(n: int, k: int, fn=None, t: dict | None = None, pdl: bool = False,
               gated: bool = False) -> tuple[dict, dict]:
    t = dict(t or quant_matmul.TUNING["mxfp4_rows_shapes"].get(f"{n}x{k}", quant_matmul.TUNING["mxfp4_rows"]))
    if gated:
        t["block_n"] = quant_matmul._paired(t["block_n"])
    constants = {"k": k, "block_n": t["block_n"], "block_b": t["block_b"], "ptx_decode": t["ptx_decode"],
                 "aligned": True, "pdl": pdl}
    signature = MXFP4_SIGNATURE
    if fn is None:
        constants.update(gated=gated, clamp=gated)
    else:  # a kernel of this tool: no gated epilogue
        signature = {name: kind for name, kind in signature.items() if name not in ("gated", "limit", "clamp")}
    kernel = _compile(fn or quant_kernels.mxfp4_rows_kernel, signature, constants, t["warps"])
    return t, counts(kernel, t["block_n"] * 2 * t["block_b"] / (32 * t["warps"]), k // 2 // t["block_b"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dot-scaled", action="store_true", help="also the tl.dot_scaled GEMV (MXFP4 shapes)")
    parser.add_argument("--pdl", action="store_true", help="the GEMVs as launched with devices.LAUNCH['pdl']")
    parser.add_argument("--gated", action="store_true",
                        help="also the gate/up GEMVs with their SwiGLU in the epilogue (``gated``)")
    args = parser.parse_args()
    print(f"triton {triton.__version__}, sm_90")
    print("| weight | kernel, launch | instructions a value | decode | widen | math | shuffles | loads | registers "
          "| most frequent |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = [(name, "fp8_rows", *fp8_rows(n, k, pdl=args.pdl)) for name, (n, k) in FP8_SHAPES.items()]
    rows += [(name, "mxfp4_rows", *mxfp4_rows(n, k, pdl=args.pdl)) for name, (n, k) in MXFP4_SHAPES.items()]
    if args.gated:
        rows += [("shared w1 + w3", "fp8_rows, gated", *fp8_rows(*FP8_SHAPES["shared w1 + w3"], args.pdl, True)),
                 ("experts gate/up", "mxfp4_rows, gated",
                  *mxfp4_rows(*MXFP4_SHAPES["experts gate/up"], pdl=args.pdl, gated=True))]
    if args.dot_scaled:
        for block_n, block_b, warps in ((64, 128, 4), (128, 128, 4), (64, 256, 4)):
            t = {"block_n": block_n, "block_b": block_b, "warps": warps, "ptx_decode": False}
            rows += [(name, "tl.dot_scaled", *mxfp4_rows(n, k, dot_scaled_rows_kernel, t))
                     for name, (n, k) in MXFP4_SHAPES.items()]
    for name, kernel, t, c in rows:
        launch = ", ".join(f"{key} {value}" for key, value in t.items() if key not in ("most_rows", "ptx_decode"))
        top = ", ".join(f"{op} {count}" for op, count in c["top"])
        print(f"| {name} | {kernel}: {launch} | {c['instructions']:.2f} | {c['decode']:.2f} | {c['widen']:.2f} | "
              f"{c['math']:.2f} | {c['shuffles']:.2f} | {c['loads']:.2f} | {c['registers']} | {top} |", flush=True)


if __name__ == "__main__":
    main()
