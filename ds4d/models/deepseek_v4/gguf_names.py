"""What llama.cpp's converter writes for DeepSeek-V4, read back into ds4d's terms.

``convert_hf_to_gguf.py`` (``conversion/deepseek.py``, class ``DeepseekV4Model``) writes
architecture ``deepseek4``: hyper-parameters under ``deepseek4.*`` keys, tensors under
llama.cpp names (``blk.3.attn_q_b.weight``), routed experts stacked per layer
(``blk.3.ffn_gate_exps.weight``: ``[E, inter, hidden]``), the token -> expert tables of
the hash-routed layers as I32 ``blk.N.ffn_gate_tid2eid.weight``.  It drops the hash
layers' unused ``gate.bias`` and the multi-token-prediction block (unless asked for an
MTP-only export, which ds4d does not serve).

``deepseek4.nextn_predict_layers`` alone does not say what a file holds: ds4's files set it to
1 with no MTP tensor at all (its quantiser copies the metadata of a converter that counted the
MTP block and dropped it), and an export with the MTP block numbers it after the main blocks
(``blk.43.*`` with its ``blk.43.nextn.*``).  So the main model is whatever leading blocks are
not MTP blocks: served when there is one, MTP blocks left unused; a file without a main block is
an MTP-only export and refused.

This module maps reference names (``layers.3.attn.wq_b.weight``, the names the forward
pass reads, see ``loader.expected_tensors``) to those GGUF names, and rebuilds the
``config.json`` the checkpoint had from the metadata, refusing what the forward pass
cannot run with a message that names the key and the value.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

ARCHITECTURE = "deepseek4"
"""``general.architecture`` of DeepSeek-V4 files (``gguf.MODEL_ARCH.DEEPSEEK4``)."""

EXPERT_TENSORS = {"w1": "ffn_gate_exps.weight", "w2": "ffn_down_exps.weight", "w3": "ffn_up_exps.weight"}
"""Routed expert matrix -> the per-layer stacked GGUF tensor holding it (``[E, out, in]``)."""

_ROOT_NAMES = {
    "embed.weight": "token_embd.weight",
    "norm.weight": "output_norm.weight",
    "head.weight": "output.weight",
    "hc_head_fn": "output_hc_fn.weight",
    "hc_head_base": "output_hc_base.weight",
    "hc_head_scale": "output_hc_scale.weight",
}

_LAYER_NAMES = {
    "attn_norm.weight": "attn_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "hc_attn_fn": "hc_attn_fn.weight",
    "hc_attn_base": "hc_attn_base.weight",
    "hc_attn_scale": "hc_attn_scale.weight",
    "hc_ffn_fn": "hc_ffn_fn.weight",
    "hc_ffn_base": "hc_ffn_base.weight",
    "hc_ffn_scale": "hc_ffn_scale.weight",
    "attn.attn_sink": "attn_sinks.weight",
    "attn.wq_a.weight": "attn_q_a.weight",
    "attn.q_norm.weight": "attn_q_a_norm.weight",
    "attn.wq_b.weight": "attn_q_b.weight",
    "attn.wkv.weight": "attn_kv.weight",
    "attn.kv_norm.weight": "attn_kv_a_norm.weight",
    "attn.wo_a.weight": "attn_output_a.weight",
    "attn.wo_b.weight": "attn_output_b.weight",
    "attn.compressor.wkv.weight": "attn_compressor_kv.weight",
    "attn.compressor.wgate.weight": "attn_compressor_gate.weight",
    "attn.compressor.ape": "attn_compressor_ape.weight",
    "attn.compressor.norm.weight": "attn_compressor_norm.weight",
    "attn.indexer.wq_b.weight": "indexer.attn_q_b.weight",
    "attn.indexer.weights_proj.weight": "indexer.proj.weight",
    "attn.indexer.compressor.wkv.weight": "indexer_compressor_kv.weight",
    "attn.indexer.compressor.wgate.weight": "indexer_compressor_gate.weight",
    "attn.indexer.compressor.ape": "indexer_compressor_ape.weight",
    "attn.indexer.compressor.norm.weight": "indexer_compressor_norm.weight",
    "ffn.gate.weight": "ffn_gate_inp.weight",
    "ffn.gate.bias": "exp_probs_b.bias",
    "ffn.gate.tid2eid": "ffn_gate_tid2eid.weight",
    "ffn.shared_experts.w1.weight": "ffn_gate_shexp.weight",
    "ffn.shared_experts.w2.weight": "ffn_down_shexp.weight",
    "ffn.shared_experts.w3.weight": "ffn_up_shexp.weight",
}

IGNORED_TENSORS = re.compile(r"^blk\.\d+\.exp_probs_b_vl\.bias$")
"""Tensors the converter may write that text-only serving has no use for (the router bias of
image tokens of the vision export)."""

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_NEXTN = re.compile(r"^blk\.(\d+)\.nextn\.")
_BLOCK = re.compile(r"^blk\.(\d+)\.")


def mtp_blocks(tensor_names: Any) -> set[int]:
    """The blocks of a file that hold next-token-prediction tensors (``blk.N.nextn.*``)."""
    return {int(m.group(1)) for name in tensor_names if (m := _NEXTN.match(name))}


def is_mtp_tensor(name: str, layers: int) -> bool:
    """A tensor of a next-token-prediction block: ``mtp.*`` (ds4's separate MTP file's names), ``blk.N.nextn.*``,
    or anything of a block past the main model's ``layers``."""
    block = _BLOCK.match(name)
    return name.startswith("mtp.") or bool(_NEXTN.match(name)) or (block is not None and int(block.group(1)) >= layers)


def gguf_name(reference: str) -> str:
    """The GGUF tensor name the converter gives reference name ``reference`` (experts: see
    :data:`EXPERT_TENSORS`)."""
    if reference in _ROOT_NAMES:
        return _ROOT_NAMES[reference]
    match = _LAYER.match(reference)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise KeyError(f"no GGUF name for DeepSeek-V4 tensor {reference!r}")
    return f"blk.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"


def expert_gguf_name(layer: int, which: str) -> str:
    return f"blk.{layer}.{EXPERT_TENSORS[which]}"


class MetadataError(ValueError):
    """A DeepSeek-V4 GGUF file whose metadata ds4d cannot serve; the message names the key."""


_GATING_FUNCS = {1: "softmax", 2: "sigmoid", 4: "sqrtsoftplus"}  # gguf.ExpertGatingFuncType
GATING_FUNC_IDS = {name: number for number, name in _GATING_FUNCS.items()}
"""``scoring_func`` -> the ``expert_gating_func`` number the converter writes."""


def _short(value: Any) -> Any:
    """A float32 metadata value as the short decimal it was written from (``1e-06``, not
    ``9.999999974752427e-07``): GGUF keeps float32, config.json the decimal."""
    if isinstance(value, float):
        return float(str(np.float32(value)))
    if isinstance(value, list):
        return [_short(v) for v in value]
    return value


def config_dict(meta: Any, vocab_size: int, source: str, tensor_names: Any = ()) -> dict[str, Any]:
    """The ``config.json`` (official spelling) that ``meta`` describes.

    ``meta.get(key, default)`` reads one metadata value; ``vocab_size`` is the embedding's rows;
    ``source`` names the file in errors; ``tensor_names``: the file's tensors, which say, when
    ``nextn_predict_layers`` is set, which blocks are the main model's (the module's docstring)."""
    arch = ARCHITECTURE

    def get(suffix: str, default: Any = None) -> Any:
        return _short(meta.get(f"{arch}.{suffix}", default))

    def need(suffix: str) -> Any:
        value = get(suffix)
        if value is None:
            raise MetadataError(f"{source}: metadata key {arch}.{suffix!s} is missing")
        return value

    def refuse(key: str, value: Any, why: str) -> MetadataError:
        return MetadataError(f"{source}: {arch}.{key} = {value!r}: {why}")

    layers = int(need("block_count"))
    if get("nextn_predict_layers"):
        names = set(tensor_names)
        mtp = mtp_blocks(names)
        main = 0
        while main < layers and main not in mtp and f"blk.{main}.attn_q_a.weight" in names:
            main += 1
        if not main:
            raise refuse("nextn_predict_layers", get("nextn_predict_layers"),
                         "an MTP-only export (the next-token-prediction block alone); serve the main model's file")
        stray = sorted(set(range(main, layers)) - mtp)
        if stray:  # a main block short of a tensor is not taken for the end of the model
            raise refuse("block_count", layers, f"block {stray[0]} has no attn_q_a tensor and no next-token-prediction "
                         "tensor (blk.N.nextn.*)")
        layers = main
    hidden = int(need("embedding_length"))
    if int(get("attention.head_count_kv", 1)) != 1:
        raise refuse("attention.head_count_kv", get("attention.head_count_kv"), "DeepSeek-V4 has one KV head")
    hc_mult = int(need("hyper_connection.count"))
    if get("embedding_length_out") is not None and int(get("embedding_length_out")) != hidden * hc_mult:
        raise refuse("embedding_length_out", get("embedding_length_out"),
                     f"expected embedding_length x hyper_connection.count = {hidden * hc_mult}")
    if int(get("attention.key_length", 0)) != int(get("attention.value_length", get("attention.key_length", 0))):
        raise refuse("attention.value_length", get("attention.value_length"), "differs from attention.key_length")
    clamps = [float(v) for v in (get("swiglu_clamp_exp") or [0.0]) + (get("swiglu_clamp_shexp") or [])]
    if len(set(clamps)) != 1:
        raise refuse("swiglu_clamp_exp", get("swiglu_clamp_exp"),
                     "ds4d clamps every layer's routed and shared SwiGLU at one limit")
    gating = int(get("expert_gating_func", 4))
    if gating not in _GATING_FUNCS:
        raise refuse("expert_gating_func", gating, f"ds4d scores experts by {sorted(_GATING_FUNCS.values())}")
    if int(get("expert_shared_count", 1)) != 1:
        raise refuse("expert_shared_count", get("expert_shared_count"), "ds4d runs exactly one shared expert")
    if get("expert_group_count") not in (None, 1) or get("expert_group_used_count") not in (None, 1):
        raise refuse("expert_group_count", get("expert_group_count"), "DeepSeek-V4 routes without expert groups")
    ratios = [int(r) for r in need("attention.compress_ratios")]
    if len(ratios) < layers:
        raise refuse("attention.compress_ratios", ratios, f"fewer entries than block_count {layers}")
    config: dict[str, Any] = {
        "model_type": "deepseek_v4",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": int(need("attention.head_count")),
        "head_dim": int(need("attention.key_length")),
        "qk_rope_head_dim": int(need("rope.dimension_count")),
        "q_lora_rank": int(need("attention.q_lora_rank")),
        "o_groups": int(need("attention.output_group_count")),
        "o_lora_rank": int(need("attention.output_lora_rank")),
        "sliding_window": int(need("attention.sliding_window")),
        "compress_ratios": ratios[:layers],
        "n_routed_experts": int(need("expert_count")),
        "n_shared_experts": 1,
        "num_experts_per_tok": int(need("expert_used_count")),
        "moe_intermediate_size": int(need("expert_feed_forward_length")),
        "num_hash_layers": int(get("hash_layer_count", 0)),
        "routed_scaling_factor": float(get("expert_weights_scale", 1.0)),
        "scoring_func": _GATING_FUNCS[gating],
        "norm_topk_prob": bool(get("expert_weights_norm", True)),
        "swiglu_limit": clamps[0],
        "index_n_heads": int(need("attention.indexer.head_count")),
        "index_head_dim": int(need("attention.indexer.key_length")),
        "index_topk": int(need("attention.indexer.top_k")),
        "hc_mult": hc_mult,
        "hc_sinkhorn_iters": int(need("hyper_connection.sinkhorn_iterations")),
        "hc_eps": float(need("hyper_connection.epsilon")),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(need("rope.freq_base")),
        "compress_rope_theta": float(need("attention.compress_rope_freq_base")),
        "max_position_embeddings": int(need("context_length")),
        "num_nextn_predict_layers": 0,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    scaling = get("rope.scaling.type", "none")
    if scaling == "yarn":
        config["rope_scaling"] = {
            "type": "yarn",
            "factor": float(need("rope.scaling.factor")),
            "original_max_position_embeddings": int(need("rope.scaling.original_context_length")),
            "beta_fast": float(get("rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(get("rope.scaling.yarn_beta_slow", 1.0)),
        }
        for key in ("rope.scaling.yarn_ext_factor", "rope.scaling.yarn_attn_factor"):
            if get(key) is not None:
                raise refuse(key, get(key), "ds4d's YaRN takes factor, original context and beta_fast/slow only")
    elif scaling != "none":
        raise refuse("rope.scaling.type", scaling, "DeepSeek-V4 uses YaRN or no RoPE scaling")
    return config
