"""A DeepSeek-V4 GGUF file of random weights in a GGUF recipe, laid out as llama.cpp's converter lays out V4.

``ds4d make-tiny --family deepseek_v4 --gguf q2 --out FILE.gguf`` writes the weights that
``load_format = random-q2`` draws in process (``random_init.RandomGgufReader``, same seed: the same bytes)
into one file, so the GGUF loader, its memory map and a daemon serving a file can be measured at real
widths and depth without downloading one.  What the converter writes and ds4d reads back
(``gguf_names``): ``deepseek4.*`` hyper-parameters, tensors under llama.cpp names in torch order, routed
experts stacked per layer, the hash layers' tables as I32, the vocabulary's tokens (V4's, so the loader
takes the V4 tokenizer).  The tensors are written one at a time, as they are drawn: the file may be
larger than the memory.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from ds4d.models.deepseek_v4.config import DeepseekV4Config
from ds4d.models.deepseek_v4.gguf_names import (
    ARCHITECTURE,
    EXPERT_TENSORS,
    GATING_FUNC_IDS,
    expert_gguf_name,
    gguf_name,
)
from ds4d.models.deepseek_v4.loader import expected_tensors
from ds4d.models.deepseek_v4.random_init import RandomGgufReader

STORED_LINEARS = re.compile(r"^layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123])\.weight$")
"""The linears ``weights.read_weights`` asks a reader for as stored (``_linear``): these are written in the
recipe's blocks; every other matrix (the compressors' too) as the values ``RandomReader.tensor`` draws."""


def write_random_gguf(path: str | Path, cfg: DeepseekV4Config, *, recipe: str = "q2", seed: int = 0,
                      device: str | torch.device = "cpu") -> Path:
    """Write ``cfg``'s random weights in ``recipe`` (``random_init.GGUF_RECIPES``) to the GGUF file ``path``."""
    import gguf

    from ds4d.models.hf_tokenizer import deepseek_v4_tokenizer

    path = Path(path)
    reader = RandomGgufReader(cfg, dtype=torch.float32, device=device, recipe=recipe, seed=seed)
    tokenizer = deepseek_v4_tokenizer()
    if tokenizer.vocab_size != cfg.vocab_size:
        raise ValueError(f"the V4 vocabulary has {tokenizer.vocab_size} ids, the config {cfg.vocab_size}")
    writer = gguf.GGUFWriter(path, arch=ARCHITECTURE)
    writer.add_string("general.name", cfg.name or "random-v4")
    for key, value in _metadata(cfg).items():
        _add(writer, f"{ARCHITECTURE}.{key}", value)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_array("tokenizer.ggml.tokens", [tokenizer.id_to_token(i) for i in range(cfg.vocab_size)])
    writer.add_uint32("tokenizer.ggml.bos_token_id", cfg.bos_token_id)
    writer.add_uint32("tokenizer.ggml.eos_token_id", cfg.eos_token_id)
    order = list(_tensors(reader, cfg, describe=True))
    for name, shape, array, qtype in order:
        writer.add_tensor_info(name, shape, array.dtype, array.nbytes, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for (name, shape, _, _), (drawn, drawn_shape, array, _) in zip(order, _tensors(reader, cfg), strict=True):
        if (name, shape) != (drawn, drawn_shape):  # the header promised this tensor here
            raise RuntimeError(f"drew {drawn} {drawn_shape} where the header says {name} {shape}")
        writer.write_tensor_data(array)
    writer.close()
    return path


def _tensors(reader: RandomGgufReader, cfg: DeepseekV4Config, describe: bool = False,
             ) -> Iterator[tuple[str, tuple[int, ...], np.ndarray, object]]:
    """(GGUF name, shape as stored, data, quant type or None) per tensor, in file order; with ``describe``
    the data is an empty array of the right dtype and byte count (nothing drawn)."""
    import gguf

    done: set[int] = set()
    for reference in expected_tensors(cfg):
        if ".ffn.experts." in reference:
            layer = int(reference.split(".")[1])
            if layer in done:
                continue
            done.add(layer)
            drawn = reader.expert_blocks(layer, reader.device, describe=describe)
            if drawn is None:
                raise ValueError(f"layer {layer}: no GGUF type of the recipe fits the routed experts' widths")
            blocks, types = drawn
            for which in EXPERT_TENSORS:
                yield expert_gguf_name(layer, which), *_stored(blocks[which], types[which], gguf)
            continue
        name = gguf_name(reference)
        if reference.endswith(".tid2eid"):
            table = _meta(reader.index_shape(reference), np.int32) if describe else \
                reader.index(reference).cpu().numpy().astype(np.int32)
            yield name, table.shape, table, None
            continue
        linear = reader.stored_linear(reference, describe=describe) if STORED_LINEARS.match(reference) else None
        if linear is not None:
            yield name, *_stored(linear.raw, linear.qtype, gguf)
            continue
        shape = reader.tensor_shape(reference)
        if len(shape) == 1:  # norms, sinks and the like: F32, as the converter writes them
            values = _meta(shape, np.float32) if describe else reader.tensor(reference).cpu().numpy()
            yield name, values.shape, values, None
            continue
        # matrices: BF16, which holds the drawn values exactly (``RandomReader.tensor`` rounds them to bf16)
        if describe:
            data = torch.empty((*shape[:-1], 2 * shape[-1]), dtype=torch.uint8, device="meta")
        else:
            data = reader.tensor(reference, torch.bfloat16).view(torch.uint8)
        yield name, *_stored(data, "BF16", gguf)


def _stored(raw: torch.Tensor, qtype: str, gguf) -> tuple[tuple[int, ...], np.ndarray, object]:
    """A quantised (or BF16) tensor: its byte shape (the writer derives the values'), its bytes, its type."""
    array = raw.cpu().numpy() if raw.device.type != "meta" else _meta(tuple(raw.shape), np.uint8)
    return tuple(raw.shape), array, gguf.GGMLQuantizationType[qtype]


def _meta(shape: tuple[int, ...], dtype) -> np.ndarray:
    """A zero-stride array of ``shape``: its dtype and byte count without its memory."""
    return np.lib.stride_tricks.as_strided(np.zeros(1, dtype=dtype), shape=shape, strides=(0,) * len(shape))


def _add(writer, key: str, value) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    else:
        writer.add_array(key, list(value))


def _metadata(cfg: DeepseekV4Config) -> dict[str, object]:
    """The ``deepseek4.*`` keys (without the prefix) that ``gguf_names.config_dict`` reads back as ``cfg``."""
    keys: dict[str, object] = {
        "block_count": cfg.num_hidden_layers,
        "embedding_length": cfg.hidden_size,
        "context_length": cfg.max_position_embeddings,
        "attention.head_count": cfg.num_attention_heads,
        "attention.head_count_kv": 1,
        "attention.key_length": cfg.head_dim,
        "attention.value_length": cfg.head_dim,
        "rope.dimension_count": cfg.qk_rope_head_dim,
        "attention.q_lora_rank": cfg.q_lora_rank,
        "attention.output_group_count": cfg.o_groups,
        "attention.output_lora_rank": cfg.o_lora_rank,
        "attention.sliding_window": cfg.sliding_window,
        "attention.compress_ratios": [int(r) for r in cfg.compress_ratios],
        "attention.indexer.head_count": cfg.index_n_heads,
        "attention.indexer.key_length": cfg.index_head_dim,
        "attention.indexer.top_k": cfg.index_topk,
        "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        "attention.compress_rope_freq_base": float(cfg.compress_rope_theta),
        "rope.freq_base": float(cfg.rope_theta),
        "expert_count": cfg.n_routed_experts,
        "expert_used_count": cfg.num_experts_per_tok,
        "expert_feed_forward_length": cfg.moe_intermediate_size,
        "expert_shared_count": 1,
        "hash_layer_count": cfg.num_hash_layers,
        "expert_weights_scale": float(cfg.routed_scaling_factor),
        "expert_weights_norm": bool(cfg.norm_topk_prob),
        "expert_gating_func": GATING_FUNC_IDS[cfg.scoring_func],
        "swiglu_clamp_exp": [float(cfg.swiglu_limit)] * cfg.num_hidden_layers,
        "hyper_connection.count": cfg.hc_mult,
        "hyper_connection.sinkhorn_iterations": cfg.hc_sinkhorn_iters,
        "hyper_connection.epsilon": float(cfg.hc_eps),
    }
    if cfg.yarn is not None:
        keys.update({"rope.scaling.type": "yarn", "rope.scaling.factor": float(cfg.yarn.factor),
                     "rope.scaling.original_context_length": int(cfg.yarn.original_max_position_embeddings),
                     "rope.scaling.yarn_beta_fast": float(cfg.yarn.beta_fast),
                     "rope.scaling.yarn_beta_slow": float(cfg.yarn.beta_slow)})
    return keys


def main_random_gguf(out: Path, cfg: DeepseekV4Config, recipe: str, seed: int, *, widths: str,
                     device: str = "cpu") -> None:
    """``ds4d make-tiny --gguf RECIPE``: write ``cfg``'s random weights to ``out`` and say what it holds."""
    path = write_random_gguf(out, cfg, recipe=recipe, seed=seed, device=device)
    print(f"wrote random DeepSeek-V4 GGUF file ({widths} widths, recipe {recipe}, seed {seed}, drawn on {device}) to "
          f"{path}: {cfg.num_hidden_layers} layers, compress ratios {list(cfg.compress_ratios)}, "
          f"{path.stat().st_size / 2**20:.1f} MiB")
