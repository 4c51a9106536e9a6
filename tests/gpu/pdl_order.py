"""Where the kernels launched as programmatic dependent launches (``ds4d.cuda.devices.LAUNCH["pdl"]``) wait,
read from their Triton IR compiled for sm_90 on a machine without a GPU.

A kernel launched that way may run while the kernel before it is still running, up to its
``griddepcontrol.wait``.  Before that wait it may read only memory no kernel writes (the weights), and it
must write nothing (a buffer the kernel before still reads could be reused for its output).  For each kernel
compiled with ``pdl`` on and off this prints, as JSON lines: how many waits and launch-dependents it has,
whether the launch comes after the wait, how many stores come before the wait, and for each load before the
wait the pointer arguments its address is made from (traced through the IR's definitions).

    PYTHONPATH=. python3 tests/gpu/pdl_order.py        # TRITON_INTERPRET must be off
"""

from __future__ import annotations

import json
import re

from ds4d.cuda import f32_gemv, hc_triton_kernels, quant_kernels
from tests.gpu.gguf_sass_count import _compile
from tests.gpu.native_sass_count import FP8_SIGNATURE, MXFP4_SIGNATURE

F32_SIGNATURE = {"x_ptr": "*bf16", "a_ptr": "*fp32", "b_ptr": "*fp32", "out_a": "*fp32", "out_b": "*fp32",
                 "n_a": "i32", "n_b": "i32", "k": "constexpr", "sx": "i32", "sa": "i32", "sb": "i32", "soa": "i32",
                 "sob": "i32", "blocks_a": "i32", "block_n": "constexpr", "block_k": "constexpr", "pdl": "constexpr"}
MIXES_SIGNATURE = {"s_ptr": "*bf16", "o_ptr": "*bf16", "post_ptr": "*fp32", "comb_ptr": "*fp32", "new_ptr": "*bf16",
                   "fn_ptr": "*fp32", "dot_ptr": "*fp32", "sq_ptr": "*fp32", "tokens": "i32", "d": "constexpr",
                   "m": "constexpr", "update": "constexpr", "span": "constexpr", "block_d": "constexpr",
                   "block_mix": "constexpr", "pdl": "constexpr"}
COLLAPSE_SIGNATURE = {"s_ptr": "*bf16", "dot_ptr": "*fp32", "sq_ptr": "*fp32", "base_ptr": "*fp32",
                      "scale_ptr": "*fp32", "w_ptr": "*bf16", "out_ptr": "*bf16", "post_ptr": "*fp32",
                      "comb_ptr": "*fp32", "tokens": "i32", "hc_eps": "fp32", "norm_eps": "fp32",
                      "iters": "constexpr", "d": "constexpr", "m": "constexpr", "splits": "constexpr",
                      "block_s": "constexpr", "block_d": "constexpr", "pdl": "constexpr"}


def kernels() -> dict[str, tuple]:
    """name -> (kernel, signature, constants without ``pdl``, warps): V4-Flash shapes, the launches' settings."""
    return {
        "fp8_rows": (quant_kernels.fp8_rows_kernel, FP8_SIGNATURE,
                     {"k": 8192, "block_n": 2, "block_k": 4096, "block": 128}, 1),
        "mxfp4_rows": (quant_kernels.mxfp4_rows_kernel, MXFP4_SIGNATURE,
                       {"k": 4096, "block_n": 32, "block_b": 256, "ptx_decode": True, "aligned": True}, 4),
        "f32_rows": (f32_gemv._kernel(), F32_SIGNATURE, {"k": 4096, "block_n": 2, "block_k": 4096}, 4),
        "boundary_mixes": (hc_triton_kernels.boundary_mixes_kernel, MIXES_SIGNATURE,
                           {"d": 4096, "m": 4, "update": True, "span": 512, "block_d": 256, "block_mix": 32}, 4),
        "boundary_collapse": (hc_triton_kernels.boundary_collapse_kernel, COLLAPSE_SIGNATURE,
                              {"iters": 20, "d": 4096, "m": 4, "splits": 8, "block_s": 8, "block_d": 4096}, 4),
    }


DEFINITION = re.compile(r"^\s*(%[\w.]+)(?::\d+)?\s*=\s*(.*)$")
VALUE = re.compile(r"%[\w.]+")


def _operands(text: str) -> list[str]:
    """The SSA values an op reads: the ``%`` names before its type annotation and location."""
    body = text.split(" loc(")[0]
    if " : " in body:
        body = body.split(" : ")[0]
    return VALUE.findall(body)


def order(ttir: str, pointer_args: list[str]) -> dict:
    """The wait and launch-dependents of one kernel's Triton IR, the stores before the wait, and the pointer
    arguments behind each load before it."""
    lines = [line.strip() for line in ttir.splitlines()]
    definitions = {}
    for line in lines:
        if m := DEFINITION.match(line):
            definitions[m.group(1)] = m.group(2)

    def roots(value: str, seen: set[str]) -> set[str]:
        if value in seen:
            return set()
        seen.add(value)
        if value not in definitions:
            return {value.lstrip("%")} & set(pointer_args)
        return set().union(*(roots(v, seen) for v in _operands(definitions[value])))

    waits = [i for i, line in enumerate(lines) if "tt.grid_dependency_wait" in line]
    launches = [i for i, line in enumerate(lines) if "tt.grid_dependency_launch_dependents" in line]
    first_wait = waits[0] if waits else len(lines)
    loads = []
    for line in lines[:first_wait]:
        m = DEFINITION.match(line)
        if m and m.group(2).startswith("tt.load "):
            loads.append(sorted(roots(_operands(m.group(2))[0], set())))
    return {"waits": len(waits), "launches": len(launches),
            "launch_after_wait": bool(waits and launches and launches[0] > waits[0]),
            "stores_before_wait": sum(("tt.store" in line or "tt.atomic" in line) for line in lines[:first_wait]),
            "loads_before_wait": loads}


def main() -> None:
    for name, (fn, signature, constants, warps) in kernels().items():
        pointer_args = [arg for arg, kind in signature.items() if kind.startswith("*")]
        for pdl in (False, True):
            compiled = _compile(fn, signature, {**constants, "pdl": pdl}, (), warps, fp_fusion=True)
            print(json.dumps({"kernel": name, "pdl": pdl, **order(compiled.asm["ttir"], pointer_args)}), flush=True)


if __name__ == "__main__":
    main()
