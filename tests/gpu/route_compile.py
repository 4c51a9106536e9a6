"""Compile the routing kernel (``ds4d.cuda.route_triton``) for an H200 (sm_90) on any machine, with the ptxas
Triton's wheel carries, at the launches ``route_triton.route`` sets: V4-Flash's 256 experts (score-routed, and
hash-routed from the token's table row) and V4.1-Flash's 384, six picked, ``sqrt(softplus)`` scores.  One JSON
line a case: instructions, barriers and shuffles in the kernel's SASS, registers a thread, spilled registers.

    PYTHONPATH=. python3 tests/gpu/route_compile.py
"""

from __future__ import annotations

import collections
import json
import re

import triton

from ds4d.cuda import route_triton
from tests.gpu.gguf_sass_count import INSTRUCTION, _compile, _sass

SIGNATURE = {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "table_ptr": "*i64", "ids_ptr": "*i64",
             "weights_ptr": "*fp32", "indices_ptr": "*i64", "experts": "i32", "scale": "fp32", "temperature": "fp32",
             "slogits": "i32", "k": "constexpr", "block_e": "constexpr", "block_k": "constexpr",
             "scoring": "constexpr", "has_bias": "constexpr", "hashed": "constexpr", "norm": "constexpr"}
ALIGNED = (0, 1, 2, 3, 4, 5)


def case(experts: int, hashed: bool, k: int = 6) -> dict:
    warps = route_triton.TUNING["warps_wide" if experts > 256 else "warps"]
    constants = {"k": k, "block_e": triton.next_power_of_2(experts), "block_k": triton.next_power_of_2(k),
                 "scoring": route_triton.SCORING["sqrtsoftplus"], "has_bias": not hashed, "hashed": hashed,
                 "norm": True}
    kernel = _compile(route_triton._kernel(), SIGNATURE, constants, ALIGNED, warps, fp_fusion=True)
    lines, usage = _sass(kernel)
    ops = collections.Counter(m.group(1) for line in lines if (m := INSTRUCTION.match(line)))
    registers = re.search(r"REG:(\d+)", usage)
    return {"experts": experts, "hashed": hashed, "warps": warps, "instructions": sum(ops.values()),
            "barriers": ops["BAR"], "shuffles": ops["SHFL"], "registers": int(registers.group(1)) if registers else 0,
            "spills": ops["LDL"] + ops["STL"]}


def main() -> None:
    for experts, hashed in ((256, False), (256, True), (384, False)):
        print(json.dumps(case(experts, hashed)))


if __name__ == "__main__":
    main()
