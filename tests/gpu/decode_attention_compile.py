"""Compile the decode attention kernel (``ds4d.cuda.decode_attention_kernel``) for an H200 (sm_90) on any
machine, with the ptxas Triton's wheel carries: each kind of entries (none, every visible one, the indexer's
picks) at V4-Flash's head width, in bfloat16 and float32, at the launch ``attention_triton.DECODE_TUNING`` sets.
One JSON line a case: its registers a thread, local-memory loads and stores, and shared memory.

    PYTHONPATH=. python3 tests/gpu/decode_attention_compile.py
"""

from __future__ import annotations

import collections
import json
import re

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ds4d.cuda.attention_triton import DECODE_TUNING
from ds4d.cuda.decode_attention_kernel import decode_attention_kernel
from tests.gpu.gguf_sass_count import INSTRUCTION, _sass

INTS = ("heads", "window", "ratio", "per_block", "n_slots", "n_picks")
STRIDES = ("sqb", "sqh", "sps", "sss", "srs", "srw", "spb", "spp", "stb", "spk", "sob", "soh")


def compiled(entries: int, dtype: str, d: int = 512, window: int = 128):
    values = f"*{dtype}"
    signature = {"q_ptr": values, "ring_ptr": values, "slots_ptr": "*i64", "pos_ptr": "*i64", "pool_ptr": values,
                 "table_ptr": "*i64", "picks_ptr": "*i64", "sink_ptr": "*fp32", "out_ptr": values,
                 **dict.fromkeys(INTS, "i32"), "scale": "fp32", **dict.fromkeys(STRIDES, "i32")}
    t = DECODE_TUNING
    constants = {"d": d, "block_h": t["block_heads"], "block_k": t["block_keys"], "block_d": t["block_d"],
                 "d_out": t["d_out"],
                 "window_tiles": -(-window // t["block_keys"]), "entries": entries,
                 "precision": "ieee" if dtype == "fp32" else "tf32"}
    signature.update(dict.fromkeys(constants, "constexpr"))
    source = ASTSource(fn=decode_attention_kernel, signature=signature, constexprs=constants)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": t["warps"], "num_stages": t["stages"]})


def facts(kernel) -> dict:
    """Registers a thread, local-memory loads and stores (spills) in its SASS, shared memory."""
    lines, usage = _sass(kernel)
    ops = collections.Counter(m.group(1) for line in lines if (m := INSTRUCTION.match(line)))
    registers = re.search(r"REG:(\d+)", usage)
    return {"registers": int(registers.group(1)) if registers else 0, "spills": ops["LDL"] + ops["STL"],
            "shared_bytes": kernel.metadata.shared}


def main() -> int:
    for entries in (0, 1, 2):
        for dtype in ("bf16", "fp32"):
            print(json.dumps({"entries": entries, "dtype": dtype, **facts(compiled(entries, dtype))}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
