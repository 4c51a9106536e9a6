"""Compile the decode kernels (``ds4d.cuda.decode_kernels``) for an H200 (sm_90) on any machine, with the ptxas
Triton's wheel carries, at the launches ``ds4d.cuda.decode_triton`` sets: the attention for each kind of entries
(none, every visible one, the indexer's picks) at V4-Flash's head width (its queries normed and rotated as read;
and once as stored), and the compressor step for V4-Flash's
three compressors (CSA's 512-wide and its indexer's 128-wide with overlapping windows of 4, HCA's 512-wide
windows of 128), the merge of the attention's parts with and without its inverse RoPE, and the query's and
KV's norms, in bfloat16 and float32.  One JSON line a case: its registers a thread, its local memory (spilled
registers, call stack) and its shared memory.

    PYTHONPATH=. python3 tests/gpu/decode_kernels_compile.py
"""

from __future__ import annotations

import json
import re

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ds4d.cuda.decode_kernels import combine_kernel, compress_kernel, decode_attention_kernel, qkv_norms_kernel
from ds4d.cuda.decode_triton import COMBINE_TUNING, COMPRESS_TUNING, DECODE_TUNING, QKV_TUNING
from tests.gpu.gguf_sass_count import _sass

INTS = ("heads", "window", "ratio", "per_block", "n_slots", "n_picks", "window_parts")
STRIDES = ("sqb", "sqh", "sps", "sss", "srs", "srw", "spb", "spp", "stb", "spk", "sc")
COMPRESS_STRIDES = ("skb", "ssb", "sts", "str_", "sps", "sss", "stb", "spb", "spp")
QKV_STRIDES = ("sqb", "skb", "sc", "srb", "srs", "srw", "sps", "sss")


def compiled(entries: int, dtype: str, d: int = 512, window: int = 128, rope_pairs: int = 32):
    """The attention for ``entries``, queries of ``dtype`` (``rope_pairs``: normed and rotated as read)."""
    values = f"*{dtype}"
    signature = {"q_ptr": values, "ring_ptr": values, "slots_ptr": "*i64", "pos_ptr": "*i64", "pool_ptr": values,
                 "table_ptr": "*i64", "picks_ptr": "*i64", "o_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32",
                 "cos_ptr": "*fp32", "sin_ptr": "*fp32", **dict.fromkeys(INTS, "i32"), "scale": "fp32",
                 "q_eps": "fp32", **dict.fromkeys(STRIDES, "i32")}
    t = DECODE_TUNING
    constants = {"d": d, "block_h": t["block_heads"], "block_k": t["block_keys"], "block_d": t["block_d"],
                 "d_out": t["d_out"], "chunk": -(-t["chunk"] // t["block_keys"]) * t["block_keys"],
                 "entries": entries, "precision": "ieee" if dtype == "fp32" else "tf32", "rope_pairs": rope_pairs}
    signature.update(dict.fromkeys(constants, "constexpr"))
    return _compile(decode_attention_kernel, signature, constants, t["warps"], t["stages"])


def compiled_combine(dtype: str, d: int = 512, rope_pairs: int = 0):
    """The merge of the attention's parts, into an output of ``dtype`` (``rope_pairs``: its RoPE undone)."""
    signature = {"o_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32", "sink_ptr": "*fp32", "out_ptr": f"*{dtype}",
                 "cos_ptr": "*fp32", "sin_ptr": "*fp32", "heads": "i32", "parts": "i32", "sob": "i32", "soh": "i32",
                 "sc": "i32"}
    c = COMBINE_TUNING
    constants = {"d": d, "block_h": c["block_heads"], "d_out": c["d_out"], "block_p": c["block_parts"],
                 "rope_pairs": rope_pairs}
    signature.update(dict.fromkeys(constants, "constexpr"))
    return _compile(combine_kernel, signature, constants, c["warps"], 1)


def compiled_qkv(dtype: str, rank: int = 1024, d: int = 512, rope_pairs: int = 32):
    """The query's and KV's norms and the KV's RoPE and ring write, activations and ring of ``dtype``."""
    values = f"*{dtype}"
    signature = {"ql_ptr": values, "kvl_ptr": values, "qn_ptr": "*fp32", "kvn_ptr": "*fp32", "cos_ptr": "*fp32",
                 "sin_ptr": "*fp32", "ring_ptr": values, "slots_ptr": "*i64", "pos_ptr": "*i64", "qr_ptr": values,
                 "window": "i32", "eps": "fp32", **dict.fromkeys(QKV_STRIDES, "i32")}
    constants = {"rank": rank, "block_r": rank, "d": d, "rope_pairs": rope_pairs}
    signature.update(dict.fromkeys(constants, "constexpr"))
    return _compile(qkv_norms_kernel, signature, constants, QKV_TUNING["warps"], 1)


def compiled_compress(ratio: int, dim: int, overlap: bool, dtype: str):
    """The compressor step's kernel for windows of ``ratio``, entries of ``dim``, a pool of ``dtype``."""
    signature = {"kv_ptr": "*fp32", "score_ptr": "*fp32", "tail_kv_ptr": "*fp32", "tail_score_ptr": "*fp32",
                 "slots_ptr": "*i64", "pos_ptr": "*i64", "table_ptr": "*i64", "pool_ptr": f"*{dtype}",
                 "norm_ptr": "*fp32", "inv_freq_ptr": "*fp32", "ring": "i32", "per_block": "i32",
                 "table_width": "i32", "eps": "fp32", **dict.fromkeys(COMPRESS_STRIDES, "i32")}
    t = COMPRESS_TUNING
    constants = {"ratio": ratio, "dim": dim, "overlap": overlap, "rope_pairs": 32, "chunk": min(t["chunk"], ratio)}
    signature.update(dict.fromkeys(constants, "constexpr"))
    return _compile(compress_kernel, signature, constants, t["warps"], t["stages"])


def _compile(fn, signature: dict, constants: dict, warps: int, stages: int):
    source = ASTSource(fn=fn, signature=signature, constexprs=constants)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})


def facts(kernel) -> dict:
    """Registers a thread, bytes of local memory a thread for spilled registers (``LOCAL``) and for its call
    stack (``STACK``: libdevice's sine and cosine keep their large-argument reduction there), shared memory."""
    _, usage = _sass(kernel)
    found = {key: int(value) for key, value in re.findall(r"(REG|STACK|LOCAL):(\d+)", usage)}
    return {"registers": found.get("REG", 0), "spilled_bytes": found.get("LOCAL", 0),
            "stack_bytes": found.get("STACK", 0), "shared_bytes": kernel.metadata.shared}


def main() -> int:
    for dtype in ("bf16", "fp32"):
        for entries in (0, 1, 2):
            print(json.dumps({"kernel": "attention", "entries": entries, "dtype": dtype,
                              **facts(compiled(entries, dtype))}), flush=True)
        print(json.dumps({"kernel": "attention", "entries": 0, "rope": 0, "dtype": dtype,
                          **facts(compiled(0, dtype, rope_pairs=0))}), flush=True)
        print(json.dumps({"kernel": "combine", "dtype": dtype, **facts(compiled_combine(dtype))}), flush=True)
        print(json.dumps({"kernel": "combine", "rope": 32, "dtype": dtype, **facts(compiled_combine(dtype, rope_pairs=32))}),
              flush=True)
        print(json.dumps({"kernel": "qkv", "dtype": dtype, **facts(compiled_qkv(dtype))}), flush=True)
        for ratio, dim, overlap in ((4, 512, True), (4, 128, True), (128, 512, False)):
            print(json.dumps({"kernel": "compress", "ratio": ratio, "dim": dim, "dtype": dtype,
                              **facts(compiled_compress(ratio, dim, overlap, dtype))}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
