"""Count the instructions a GGUF block-wise GEMV spends on a weight value, without a GPU.

Triton compiles for a target it is told (``GPUTarget("cuda", 90, 32)``: an H200) with the ``ptxas`` and
``nvdisasm`` its wheel carries, so the SASS of ``gguf_blockwise.gemv_kernel`` can be read on any machine.
A decode GEMV of these types is bound by the instructions it issues, not by memory, at the tile sizes
that keep enough programs in flight, so the loop's instructions per weight value (and its 4-cycle loads,
its 8-cycle int-to-float conversions, its registers, which bound how many programs an SM holds) are
what to look at before spending device time; the sweep (``gguf_gemv_sweep.py``) then times them.

    python3 tests/gpu/gguf_sass_count.py [--x bf16|fp32] [--stages N] [--json]   # --json: one line a case
                                                                               # --stages 0: trips written out
    python3 tests/gpu/gguf_sass_count.py --tiles [--json]   # the prefill's expert tiles, old and block-wise
    python3 tests/gpu/gguf_sass_count.py --dot [--json]      # the GEMVs on int8 inputs (gguf_dot), by launch
                                                            # (--json: the default launches, the float GEMV's too)

Triton's interpreter (``TRITON_INTERPRET=1``) must be off: it compiles nothing.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ds4d.cuda import gguf_blockwise, gguf_dot, gguf_kernels, gguf_matmul
from ds4d.cuda.gguf_matmul import TYPES

SIGNATURE = {"x_ptr": "*bf16", "raw_ptr": "*u8", "out_ptr": "*fp32", "table_ptr": "*i32", "expert_ptr": "*i32",
             "n": "i32", "m": "i32", "k": "constexpr", "row_bytes": "i32", "expert_bytes": "i64", "sxm": "i32",
             "som": "i32", "qtype": "constexpr", "by_expert": "constexpr", "block_n": "constexpr",
             "supers": "constexpr", "rows_per": "constexpr", "stages": "constexpr"}
ALIGNED = (0, 1, 2, 3, 4, 8, 9, 10, 11)
"""The arguments a launch at these shapes has divisible by 16 (Triton specialises on that): the pointers,
the row and expert bytes and the strides."""
CASES = [  # (type, input width, by expert: the cases of gguf_gemv_sweep.py; wo_b's width, so the loop stays a loop)
    ("Q8_0", 8192, False), ("IQ2_XXS", 4096, True), ("Q2_K", 2048, True)]
LAUNCHES = [(8, 1), (8, 2), (16, 1), (16, 2)]  # (weight rows a program, blocks of 256 a trip)


def tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


TILES_SIGNATURE = {"x_ptr": "*bf16", "raw_ptr": "*u8", "out_ptr": "*fp32", "table_ptr": "*i32",
                   "tile_expert_ptr": "*i32", "tile_start_ptr": "*i32", "tile_end_ptr": "*i32", "n": "i32",
                   "k": "constexpr", "row_bytes": "i32", "expert_bytes": "i64", "sxm": "i32", "som": "i32",
                   "qtype": "constexpr", "block_m": "constexpr", "block_n": "constexpr", "supers": "constexpr",
                   "precision": "constexpr", "stages": "constexpr"}
"""``gguf_blockwise.tiles_kernel``'s arguments; ``gguf_kernels.tiles_kernel`` (element by element) calls the table
``grid_ptr`` and has a second one (``signs_ptr``) after it, ``block_k`` for ``supers`` and no ``stages``."""
TILES_ALIGNED = (0, 1, 2, 3, 4, 5, 6, 9, 10, 11, 12)
TILES_CASES = [("Q8_0", 4096), ("IQ2_XXS", 4096), ("Q2_K", 2048)]  # the experts' gate/up and down widths
TILES_LAUNCHES = [(True, 64, 64, 8), (True, 64, 32, 4), (True, 64, 32, 8), (True, 128, 64, 8)]
"""(block-wise, rows, weight rows, warps)"""


def _compile(fn, signature: dict, constants: dict, aligned, warps: int = 4, fp_fusion: bool = False):
    """``fp_fusion``: as the kernel is launched (the GGUF kernels run without contraction)."""
    source = ASTSource(fn=fn, signature=signature, constexprs=constants,
                       attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "enable_fp_fusion": fp_fusion})


def compiled(qtype: str, k: int, by_expert: bool, block_n: int, supers: int, rows_per: int, stages: int, x: str):
    constants = {"k": k, "qtype": TYPES[qtype], "by_expert": by_expert, "block_n": block_n, "supers": supers,
                 "rows_per": rows_per, "stages": stages}
    return _compile(gguf_blockwise.gemv_kernel, dict(SIGNATURE, x_ptr=f"*{x}"), constants, ALIGNED)


def tiles_counts(qtype: str, k: int, blockwise: bool, block_m: int, block_n: int, warps: int = 4) -> dict[str, float]:
    """The expert tiles' loop (bfloat16 rows): instructions and loads per weight value a thread decodes, the
    same per weight value and input row of the tile (the decode shared by ``block_m`` rows), tensor-core
    instructions a trip, registers a thread.  ``blockwise``: ``gguf_blockwise.tiles_kernel`` with a trip of
    256 values, else ``gguf_kernels.tiles_kernel`` with 32."""
    common = {"k": k, "qtype": TYPES[qtype], "block_m": block_m, "block_n": block_n, "precision": "tf32"}
    if blockwise:
        kernel = _compile(gguf_blockwise.tiles_kernel, TILES_SIGNATURE, dict(common, supers=1, stages=1),
                          TILES_ALIGNED, warps)
        span = 256
    else:
        renamed = {"table_ptr": "grid_ptr", "supers": "block_k"}
        pairs = [(renamed.get(name, name), kind) for name, kind in TILES_SIGNATURE.items() if name != "stages"]
        signature = dict(pairs[:4] + [("signs_ptr", "*u8")] + pairs[4:])
        aligned = tuple(i + (i >= 4) for i in TILES_ALIGNED) + (4,)
        kernel = _compile(gguf_kernels.tiles_kernel, signature, dict(common, block_k=32), aligned, warps)
        span = 32
    ops, registers, _ = loop_and_registers(kernel)
    values = block_n * span / (32 * warps)
    return {"instructions": sum(ops.values()) / values, "loads": (ops["LDG"] + ops["LDGSTS"]) / values,
            "per_row": sum(ops.values()) / values / block_m, "mma": ops["HMMA"] + ops["HGMMA"],
            "spills": ops["LDL"] + ops["STL"], "registers": registers}


def _sass(kernel) -> tuple[list[str], str]:
    """(the kernel's SASS lines, ``cuobjdump``'s resource usage)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        text = subprocess.run([tool("nvdisasm"), "-c", cubin.name], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([tool("cuobjdump"), "--dump-resource-usage", cubin.name], capture_output=True,
                               text=True, check=True).stdout
    return text.splitlines(), usage


INSTRUCTION = re.compile(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?P\d+\s+)?([A-Z0-9_]+)((?:\.[A-Z0-9_]+)*)\s*([^;]*);")
LOAD_BYTES = {"U8": 1, "S8": 1, "U16": 2, "S16": 2, "64": 8, "128": 16}  # LDG's width suffix (none: 4 bytes)


def loop_and_registers(kernel) -> tuple[collections.Counter, int, bool]:
    """(opcode counts of the longest backward branch's body, or of the whole kernel where no loop is left (every
    trip written out), registers a thread, whether a loop was found)."""
    lines, usage = _sass(kernel)
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"\.(L_x_\d+):", line.strip()))}
    body = (0, 0)
    for i, line in enumerate(lines):
        jump = re.search(r"BRA\s+`?\(\.(L_x_\d+)\)", line)
        if jump and labels.get(jump.group(1), i) < i - 1 and i - labels[jump.group(1)] > body[1] - body[0]:
            body = (labels[jump.group(1)], i)
    looped = body != (0, 0)
    ops = collections.Counter()
    for line in lines[body[0]:body[1] + 1] if looped else lines:
        if m := INSTRUCTION.match(line):
            ops[m.group(1)] += 1
    registers = re.search(r"REG:(\d+)", usage)
    return ops, int(registers.group(1)) if registers else 0, looped


def bytes_in_flight(kernel) -> int:
    """The most bytes a thread has requested by global loads into registers and not yet used, at any point of the
    kernel read in order: a load counts from its issue to the first later instruction that names its destination
    register.  An estimate (a use earlier in a loop's text, or a load into shared memory, is not seen), for how
    far the loads run ahead of the arithmetic: a GEMV that waits on memory is bound by the bytes in flight."""
    found = [m for line in _sass(kernel)[0] if (m := INSTRUCTION.match(line))]
    spans = []
    for i, m in enumerate(found):
        dest = re.match(r"R(\d+)", m.group(3))
        if m.group(1) != "LDG" or not dest:
            continue
        width = next((b for suffix, b in LOAD_BYTES.items() if m.group(2).endswith("." + suffix)), 4)
        registers = {f"R{int(dest.group(1)) + j}" for j in range(max(1, width // 4))}
        end = next((j for j in range(i + 1, len(found)) if registers & set(re.findall(r"\bR\d+\b", found[j].group(3)))),
                   len(found))
        spans.append((i, end, width))
    return max((sum(w for start, end, w in spans if start <= i < end) for i, _, _ in spans), default=0)


def loop_counts(qtype: str, k: int, by_expert: bool, block_n: int, supers: int, rows_per: int = 1, stages: int = 1,
                x: str = "bf16") -> dict[str, float]:
    """The GEMV's loop for one launch (``stages`` 0: its trips written out, counted over the whole kernel):
    instructions, global loads and int-to-float conversions per weight value a thread decodes (4 warps),
    registers a thread, and :func:`bytes_in_flight`."""
    kernel = compiled(qtype, k, by_expert, block_n, supers, rows_per, stages, x)
    ops, registers, looped = loop_and_registers(kernel)
    values = block_n * (supers * 256 if looped else k) / 128
    return {"instructions": sum(ops.values()) / values, "loads": (ops["LDG"] + ops["LDGSTS"]) / values,
            "conversions": (ops["I2F"] + ops["F2I"]) / values, "registers": registers,
            "in_flight": bytes_in_flight(kernel)}


DOT_COMMON = {"n": "i32", "m": "i32", "k": "constexpr", "row_bytes": "i32", "expert_bytes": "i64",
              "by_expert": "constexpr", "block_n": "constexpr", "groups": "constexpr", "native": "constexpr",
              "gated": "constexpr", "limit": "fp32", "clamp": "constexpr"}
DOT_KERNELS = {  # type: (kernel, its pointers, input width, by expert, values a group)
    "Q8_0": ("q8_0_kernel", ("q_ptr:*i8", "d_ptr:*fp32", "raw_ptr:*u8", "out_ptr:*fp32", "expert_ptr:*i32"), 8192,
             False, 32),
    "IQ2_XXS": ("iq2_xxs_kernel", ("q_ptr:*i8", "d_ptr:*fp32", "raw_ptr:*u8", "out_ptr:*fp32", "grid_ptr:*i64",
                                   "signs_ptr:*i64", "expert_ptr:*i32"), 4096, True, 32),
    "Q2_K": ("q2_k_kernel", ("q_ptr:*i8", "d_ptr:*fp32", "s_ptr:*i32", "raw_ptr:*u8", "out_ptr:*fp32",
                             "expert_ptr:*i32"), 2048, True, 64)}
DOT_LAUNCHES = [(8, 16, 4), (16, 8, 4), (32, 8, 8)]  # (weight rows a program, groups of each a trip, warps)


def dot_counts(qtype: str, block_n: int, groups: int, warps: int, computed_signs: bool = False,
               selector_grid: bool = False, wide_inputs: bool = False) -> dict[str, float]:
    """``gguf_dot``'s GEMV of ``qtype`` at the q2 recipe's width (its loop): instructions, global loads and
    ``dp4a`` per weight value a thread takes, registers a thread, spilled loads and stores.  ``computed_signs``,
    ``selector_grid`` (IQ2_XXS): its sign bytes made from the pattern's bits, its grid read as selectors;
    ``wide_inputs``: its inputs read 16 bytes a load."""
    name, pointers, k, by_expert, per_group = DOT_KERNELS[qtype]
    signature = dict(pointer.split(":") for pointer in pointers) | DOT_COMMON
    aligned = tuple(i for i, arg in enumerate(signature) if arg.endswith(("_ptr", "_bytes")))
    constants = {"k": k, "by_expert": by_expert, "block_n": block_n, "groups": groups, "native": True,
                 "gated": False, "clamp": False, "wide_inputs": wide_inputs}
    signature["wide_inputs"] = "constexpr"
    if qtype == "IQ2_XXS":
        signature.update(computed_signs="constexpr", selector_grid="constexpr")
        constants.update(computed_signs=computed_signs, selector_grid=selector_grid)
        if selector_grid:
            signature["grid_ptr"] = "*i32"
    ops, registers, _ = loop_and_registers(_compile(getattr(gguf_dot, name), signature, constants, aligned, warps))
    values = block_n * groups * per_group / (32 * warps)
    return {"instructions": sum(ops.values()) / values, "loads": ops["LDG"] / values, "dp4a": ops["IDP"] / values,
            "registers": registers, "spills": ops["LDL"] + ops["STL"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--x", default="bf16", choices=["bf16", "fp32"], help="the input rows' dtype")
    parser.add_argument("--stages", type=int, default=1,
                        help="the loop's pipeline stages (0: every trip written out, no loop)")
    parser.add_argument("--json", action="store_true", help="a JSON line a case, not a table")
    parser.add_argument("--tiles", action="store_true",
                        help="the prefill's expert tiles (block-wise against element-wise), not the GEMV")
    parser.add_argument("--dot", action="store_true", help="the GEMVs on int8 inputs (gguf_dot), not the float one")
    args = parser.parse_args()
    if args.dot and args.json:  # each type at its default launch, and the float GEMV at its default launch
        for qtype, (_, _, k, by_expert, _) in DOT_KERNELS.items():
            launch = gguf_matmul.DOT[qtype]
            floats = gguf_matmul.BLOCKWISE[qtype]
            float_counts = loop_counts(qtype, k, by_expert, floats["block_n"], floats["supers"], 1, floats["stages"])
            counts = dot_counts(qtype, launch["block_n"], launch["groups"], launch["warps"],
                                launch.get("computed_signs", False), launch.get("selector_grid", False),
                                launch.get("wide_inputs", False))
            print(json.dumps(dict(counts, qtype=qtype, float_instructions=float_counts["instructions"])))
        return
    if args.dot:
        print("| type | weight rows x groups, warps | instructions a value | loads a value | dp4a a value | registers "
              "| spills |")
        print("|---|---|---|---|---|---|---|")
        for qtype in DOT_KERNELS:
            variants = [(False, False), (True, False), (True, True)] if qtype == "IQ2_XXS" else [(False, False)]
            for computed, selectors, wide in [(*v, False) for v in variants] + [(*variants[-1], True)]:
                for block_n, groups, warps in DOT_LAUNCHES:
                    c = dot_counts(qtype, block_n, groups, warps, computed, selectors, wide)
                    name = qtype + (", signs computed" if computed else "") + (", grid selectors" if selectors else "")
                    name += ", 16-byte input loads" if wide else ""
                    print(f"| {name} | {block_n} x {groups}, {warps} | {c['instructions']:.2f} | {c['loads']:.2f} | "
                          f"{c['dp4a']:.3f} | {c['registers']} | {c['spills']} |")
        return
    if args.tiles:
        if not args.json:
            print("| type | kernel | rows x weight rows, warps | instructions a value | loads a value | instructions a "
                  "value and row | mma a trip | spills | registers |")
            print("|---|---|---|---|---|---|---|---|---|")
        for qtype, k in TILES_CASES:
            default = gguf_matmul.BLOCKWISE_TILES[qtype]
            launches = [(False, 32, 32, 4), (True, default["block_m"], default["block_n"], default["warps"])]
            launches += [launch for launch in TILES_LAUNCHES if launch not in launches]
            for blockwise, block_m, block_n, warps in launches:
                c = tiles_counts(qtype, k, blockwise, block_m, block_n, warps)
                kind = "block-wise" if blockwise else "element-wise"
                if blockwise and (block_m, block_n, warps) == launches[1][1:]:
                    kind += " (default)"
                if args.json:
                    print(json.dumps(dict(c, qtype=qtype, kernel=kind, block_m=block_m, block_n=block_n, warps=warps)))
                    continue
                print(f"| {qtype} | {kind} | {block_m} x {block_n}, {warps} | {c['instructions']:.2f} | "
                      f"{c['loads']:.2f} | {c['per_row']:.3f} | {c['mma']} | {c['spills']} | {c['registers']} |")
        return
    if args.json:
        for qtype, k, by_expert in CASES:
            for block_n, supers in LAUNCHES:
                counts = loop_counts(qtype, k, by_expert, block_n, supers, 1, args.stages, args.x)
                print(json.dumps(dict(counts, qtype=qtype, block_n=block_n, supers=supers)))
        return
    print("| type | launch | rows | instructions a value | loads a value | conversions a value | registers | "
          "bytes in flight a thread |")
    print("|---|---|---|---|---|---|---|---|")
    for qtype, k, by_expert in CASES:
        for block_n, supers in LAUNCHES:
            for rows_per in (1,) if by_expert else (1, 8):
                c = loop_counts(qtype, k, by_expert, block_n, supers, rows_per, args.stages, args.x)
                print(f"| {qtype} | {block_n} x {supers} | {rows_per} | {c['instructions']:.2f} | {c['loads']:.2f} | "
                      f"{c['conversions']:.2f} | {c['registers']} | {c['in_flight']} |")


if __name__ == "__main__":
    main()
