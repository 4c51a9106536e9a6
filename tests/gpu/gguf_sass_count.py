"""Count the instructions a GGUF block-wise GEMV spends on a weight value, without a GPU.

Triton compiles for a target it is told (``GPUTarget("cuda", 90, 32)``: an H200) with the ``ptxas`` and
``nvdisasm`` its wheel carries, so the SASS of ``gguf_blockwise.gemv_kernel`` can be read on any machine.
A decode GEMV of these types is bound by the instructions it issues, not by memory, at the tile sizes
that keep enough programs in flight, so the loop's instructions per weight value (and its 4-cycle loads,
its 8-cycle int-to-float conversions, its registers, which bound how many programs an SM holds) are
what to look at before spending device time; the sweep (``gguf_gemv_sweep.py``) then times them.

    python3 tests/gpu/gguf_sass_count.py [--x bf16|fp32] [--stages N] [--json]   # --json: one line a case

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

from ds4d.cuda import gguf_blockwise
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


def compiled(qtype: str, k: int, by_expert: bool, block_n: int, supers: int, rows_per: int, stages: int, x: str):
    constants = {"k": k, "qtype": TYPES[qtype], "by_expert": by_expert, "block_n": block_n, "supers": supers,
                 "rows_per": rows_per, "stages": stages}
    source = ASTSource(fn=gguf_blockwise.gemv_kernel, signature=dict(SIGNATURE, x_ptr=f"*{x}"), constexprs=constants,
                       attrs={(i,): [["tt.divisibility", 16]] for i in ALIGNED})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4, "enable_fp_fusion": False})


def loop_and_registers(kernel) -> tuple[collections.Counter, int]:
    """(opcode counts of the longest backward branch's body, registers a thread)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        text = subprocess.run([tool("nvdisasm"), "-c", cubin.name], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([tool("cuobjdump"), "--dump-resource-usage", cubin.name], capture_output=True,
                               text=True, check=True).stdout
    lines = text.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"\.(L_x_\d+):", line.strip()))}
    body = (0, 0)
    for i, line in enumerate(lines):
        jump = re.search(r"BRA\s+`?\(\.(L_x_\d+)\)", line)
        if jump and labels.get(jump.group(1), i) < i - 1 and i - labels[jump.group(1)] > body[1] - body[0]:
            body = (labels[jump.group(1)], i)
    ops = collections.Counter()
    for line in lines[body[0]:body[1] + 1]:
        if m := re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?P\d+\s+)?([A-Z0-9_]+)", line):
            ops[m.group(1)] += 1
    registers = re.search(r"REG:(\d+)", usage)
    return ops, int(registers.group(1)) if registers else 0


def loop_counts(qtype: str, k: int, by_expert: bool, block_n: int, supers: int, rows_per: int = 1, stages: int = 1,
                x: str = "bf16") -> dict[str, float]:
    """The GEMV's loop for one launch: instructions, global loads and int-to-float conversions per weight
    value a thread decodes (4 warps), and registers a thread."""
    ops, registers = loop_and_registers(compiled(qtype, k, by_expert, block_n, supers, rows_per, stages, x))
    values = block_n * supers * 256 / 128
    return {"instructions": sum(ops.values()) / values, "loads": (ops["LDG"] + ops["LDGSTS"]) / values,
            "conversions": (ops["I2F"] + ops["F2I"]) / values, "registers": registers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--x", default="bf16", choices=["bf16", "fp32"], help="the input rows' dtype")
    parser.add_argument("--stages", type=int, default=1, help="the loop's pipeline stages")
    parser.add_argument("--json", action="store_true", help="a JSON line a case, not a table")
    args = parser.parse_args()
    if args.json:
        for qtype, k, by_expert in CASES:
            for block_n, supers in LAUNCHES:
                counts = loop_counts(qtype, k, by_expert, block_n, supers, 1, args.stages, args.x)
                print(json.dumps(dict(counts, qtype=qtype, block_n=block_n, supers=supers)))
        return
    print("| type | launch | rows | instructions a value | loads a value | conversions a value | registers |")
    print("|---|---|---|---|---|---|---|")
    for qtype, k, by_expert in CASES:
        for block_n, supers in LAUNCHES:
            for rows_per in (1,) if by_expert else (1, 8):
                c = loop_counts(qtype, k, by_expert, block_n, supers, rows_per, args.stages, args.x)
                print(f"| {qtype} | {block_n} x {supers} | {rows_per} | {c['instructions']:.2f} | {c['loads']:.2f} | "
                      f"{c['conversions']:.2f} | {c['registers']} |")


if __name__ == "__main__":
    main()
