"""Writes a small random DeepSeek-V4.1 checkpoint in the official release format.

The default config covers every layer mode of the release at tiny widths:

* layers 0, 1: ratio 0 (sliding window only); Engram on layer 1;
* layers 2-4: ratio 2; layer 2 is a KV source (compressor, index keys) and an index
  source, layer 3 reuses its top-k and its Engram table is the second one, layer 4
  reindexes (its own indexer against layer 2's keys);
* layers 5-7: ratio 1; layer 5 is a KV source, an index source and the candidate
  source of the two-level top-k, layer 6 reuses, layer 7 reindexes inside layer 5's
  candidate blocks;
* one DSpark draft stage (``mtp.0.*``) and a one-block vision tower, written so that a
  loader has them to skip.

Tensors are drawn in layout order from one seeded generator and stored as the
release stores them (FP8 e4m3 with e8m0 32 x 32 block scales, FP4 experts with e8m0
scales per 32 inputs, FP8 Engram tables with e8m0 scales per row and 32 channels,
bf16 and f32 elsewhere), in two shards with ``model.safetensors.index.json``, next
to a composite config.json and a small byte-level BPE tokenizer.json whose
compressed Engram vocabulary size is in the config.

``tokenizer="v4"`` instead sizes the vocabulary (embedding, head, Engram compressed
vocabulary: 129,280 and 99,092 ids) for the real V4.1 tokenizer as
``ds4d.models.deepseek_v41.tokenizer`` derives it from V4's, and writes no
tokenizer.json, like the release: the family then loads the derived one.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from ds4d.models.deepseek_v4.quant import quantize_fp8_block, quantize_mxfp4
from ds4d.models.deepseek_v41.layout import (
    FP4,
    FP8,
    SCALE,
    CheckpointLayout,
    TensorSpec,
    hf_name,
)

DEFAULT_LAYERS = (0, 0, 2, 2, 2, 1, 1, 1)
INDEX_FILE = "model.safetensors.index.json"

SPECIAL_TOKENS = (
    "<｜begin▁of▁sentence｜>",  # id 0: bos
    "<｜end▁of▁sentence｜>",  # id 1: eos
    "<｜▁pad▁｜>",  # id 2: pad, also the Engram pad
    "<｜System｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<｜latest_reminder｜>",
    "<think>",
    "</think>",
    "<｜DSML｜",
    "<｜deepseek_image｜>",
)
WORDS = (
    "the", "The", " the", " The", " THE", "and", " and", " is", " of", " to", " in", " a", " A", " it",
    "hello", " hello", " Hello", " world", " World", " cat", " Cat", " dog", " sat", " on", " mat",
    "def", " return", "()", " {", " }", "\n", "\n\n", "  ", "    ", ".", ",", "!", "?",
)


# ---------------------------------------------------------------------- tokenizer


def tiny_tokenizer():
    """A byte-level BPE tokenizer: the specials, the 256 byte symbols, and merges for WORDS
    (case and leading-space variants, so the Engram compressed vocabulary is smaller)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    split = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    vocab: dict[str, int] = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    merges: list[tuple[str, str]] = []
    for word in WORDS:
        (symbols, _), = split.pre_tokenize_str(word)
        merged = symbols[0]
        for symbol in symbols[1:]:
            if merged + symbol not in vocab:
                merges.append((merged, symbol))
                vocab[merged + symbol] = len(vocab)
            merged += symbol
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = split
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS])
    return tokenizer


def compressed_vocab_size(tokenizer) -> int:
    """Size of the Engram compressed vocabulary of ``tokenizer`` (the model's own mapping:
    :func:`ds4d.models.deepseek_v41.engram.compressed_vocabulary`)."""
    from ds4d.models.deepseek_v41.engram import compressed_vocabulary

    return compressed_vocabulary(tokenizer)[1]


# ---------------------------------------------------------------------- config


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    return all(n % k for k in range(2, int(n**0.5) + 1))


def engram_table_rows(n_layers: int, max_ngram_size: int, n_heads: int, vocab_size: int) -> list[int]:
    """Rows of each Engram table: one prime-sized bucket range per (n-gram size, head), each
    prime the smallest above ``vocab_size - 1`` not handed out before (over all layers)."""
    used: set[int] = set()
    rows = []
    for _ in range(n_layers):
        total = 0
        for _ in range(max_ngram_size - 1):
            candidate = vocab_size - 1
            for _ in range(n_heads):
                candidate += 1
                while not _is_prime(candidate) or candidate in used:
                    candidate += 1
                used.add(candidate)
                total += candidate
        rows.append(total)
    return rows


def _runs(ratios: Sequence[int]) -> list[list[int]]:
    """Maximal runs of equal nonzero compress ratios, as lists of layer ids."""
    runs: list[list[int]] = []
    for layer, ratio in enumerate(ratios):
        if ratio and runs and ratios[runs[-1][-1]] == ratio and runs[-1][-1] == layer - 1:
            runs[-1].append(layer)
        elif ratio:
            runs.append([layer])
    return runs


def _token_id(tokenizer, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise ValueError(f"the tokenizer has no {token}")
    return token_id


def tiny_config(layers: Sequence[int] = DEFAULT_LAYERS, tokenizer=None, **text_overrides: object) -> dict:
    """A composite release-style config.json.  Each run of equal nonzero ratios gets its
    first layer as KV and index source and, when 3 layers or longer, its last layer as a
    reindex source; the last KV source is the candidate source; Engram sits on layer 1
    and on the layer after the first KV source."""
    tokenizer = tokenizer or tiny_tokenizer()
    ratios = [int(r) for r in layers]
    bad = [r for r in ratios if r not in (0, 1, 2)]
    if bad or not ratios:
        raise ValueError(f"V4.1 layers have compress ratio 0, 1 or 2; got {list(layers)}")
    runs = _runs(ratios)
    kv_sources = [run[0] for run in runs]
    index_sources = sorted(kv_sources + [run[-1] for run in runs if len(run) >= 3])
    engram_layers = {min(1, len(ratios) - 1), *([kv_sources[0] + 1] if kv_sources else [])}
    engram_layers = sorted(layer for layer in engram_layers if layer < len(ratios))
    engram = {"engram_max_ngram_size": 3, "engram_n_heads": 2, "engram_head_dim": 64, "engram_vocab_size": 50}
    text = {
        "model_type": "deepseek_v41_text",
        "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True),
        "hidden_size": 64,
        "moe_intermediate_size": 64,
        "num_hidden_layers": len(ratios),
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "qk_rope_head_dim": 16,
        "q_lora_rank": 32,
        "o_lora_rank": 32,
        "o_groups": 2,
        "hidden_act": "silu",
        "swiglu_limit": 10.0,
        "rms_norm_eps": 1e-20,
        "tie_word_embeddings": False,
        "max_position_embeddings": 4096,
        "rope_theta": 10000,
        "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                         "original_max_position_embeddings": 64},
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "sliding_window": 8,
        "compress_ratios": [*ratios, 0],  # the last entry belongs to the DSpark stage
        "compress_rope_theta": 160000,
        "kv_source_layer_ids": kv_sources,
        "index_source_layer_ids": index_sources,
        "index_n_heads": 4,
        "index_head_dim": 32,
        "index_topk": 4,
        "candidate_source_layer_id": kv_sources[-1] if kv_sources else -1,
        "candidate_topk_blocks": 3,
        "candidate_block_size": 2,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "engram_layer_ids": engram_layers,
        "engram_num_embeddings": engram_table_rows(len(engram_layers), engram["engram_max_ngram_size"],
                                                   engram["engram_n_heads"], engram["engram_vocab_size"]),
        **engram,
        "engram_pad_token_id": 2,
        "engram_compressed_vocab_size": compressed_vocab_size(tokenizer),
        "num_nextn_predict_layers": 1,
        "dspark_block_size": 3,
        "dspark_noise_token_id": _token_id(tokenizer, "<｜System｜>"),
        "dspark_target_layer_ids": [i for i in range(len(ratios)) if i not in kv_sources][-3:] or [len(ratios) - 1],
        "dspark_markov_rank": 32,
        "dspark_n_routed_experts": 2,
        "dspark_num_experts_per_tok": 1,
    }
    text.update(text_overrides)
    return {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "image_token_id": _token_id(tokenizer, "<｜deepseek_image｜>"),
        "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                "weight_block_size": [32, 32], "scale_fmt": "ue8m0", "expert_dtype": "fp4"},
        "text_config": text,
        "vision_config": {"model_type": "deepseek_v41_vision", "num_hidden_layers": 1, "hidden_size": 32,
                          "num_attention_heads": 2, "intermediate_size": 64, "patch_size": 2,
                          "rope_theta": 10000, "downsample_ratio": 2, "max_image_tokens": 16},
    }


# ---------------------------------------------------------------------- tensors


def _draw(spec: TensorSpec, gen: torch.Generator) -> torch.Tensor:
    """Random float values of ``spec``'s decoded shape, at a scale fit for its role."""
    shape = spec.dense_shape or spec.shape
    values = torch.randn(*shape, generator=gen)
    name = spec.name
    if name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "q_weight", "k_weight")):
        return 1.0 + 0.1 * values
    if name.endswith(("_scale",)):
        return 1.0 + 0.2 * values
    if name.endswith("_base"):
        return 0.5 * values
    if name.endswith(("gate.bias", "gate.bias_vl")) or name.endswith(".bias"):
        return 0.1 * values
    if name.endswith(("attn_sink", "embed.weight")) or name.startswith("image_") or ".engram.embed." in name:
        return values
    return values * shape[-1] ** -0.5  # a linear: unit-variance outputs


def tensors_for(spec: TensorSpec, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """``spec`` (a plain tensor or a quantised weight) and, for the latter, its scale."""
    values = _draw(spec, gen)
    if spec.quant == FP4:
        weight, scale = quantize_mxfp4(values)
    elif spec.quant == FP8:
        weight, scale = quantize_fp8_block(values, spec.block)
    else:
        dtype = {"BF16": torch.bfloat16, "F32": torch.float32}[spec.dtype]
        return {spec.name: values.to(dtype).contiguous()}
    return {spec.name: weight.contiguous(), spec.scale_name: scale.contiguous()}


def _shard_of(name: str, n_layers: int) -> int:
    """0 for the embedding and the first half of the layers, 1 for the rest."""
    if name == "embed.weight":
        return 0
    if name.startswith("layers."):
        return int(name.split(".")[1]) >= (n_layers + 1) // 2
    return 1


TOKENIZERS = ("tiny", "v4")


def _tokenizer(kind: str):
    """The ``tokenizers.Tokenizer`` a tiny checkpoint is sized for."""
    if kind == "tiny":
        return tiny_tokenizer()
    from tokenizers import Tokenizer

    from ds4d.models.deepseek_v41.tokenizer import v41_tokenizer_json

    return Tokenizer.from_str(json.dumps(v41_tokenizer_json(), ensure_ascii=False))


def write_tiny(
    out_dir: str | Path,
    layers: Sequence[int] | None = None,
    seed: int = 0,
    *,
    hf_names: bool = False,
    tokenizer: str = "tiny",
    **text_overrides: object,
) -> Path:
    """Write config.json, tokenizer.json and two safetensors shards + index into ``out_dir``.

    ``layers``: compress ratio per layer (default :data:`DEFAULT_LAYERS`); ``hf_names``:
    store tensors under HF transformers' names (``model.`` + official, ``lm_head``);
    ``tokenizer``: ``tiny`` (a small byte-level one, written) or ``v4`` (V4's with V4.1's
    added tokens, 129,280 ids, not written); ``text_overrides``: text_config values to change."""
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"tokenizer {tokenizer!r}: use one of {', '.join(TOKENIZERS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_kind, tokenizer = tokenizer, _tokenizer(tokenizer)
    config = tiny_config(DEFAULT_LAYERS if layers is None else layers, tokenizer, **text_overrides)
    layout = CheckpointLayout(config)
    n_layers = layout.config.num_hidden_layers
    gen = torch.Generator().manual_seed(seed)
    shards: list[dict[str, torch.Tensor]] = [{}, {}]
    for spec in layout:
        if spec.quant == SCALE:
            continue  # written with its weight
        for name, tensor in tensors_for(spec, gen).items():
            shards[_shard_of(name, n_layers)][hf_name(name) if hf_names else name] = tensor
    weight_map, total = {}, 0
    for index, tensors in enumerate(shards):
        file = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    index_data = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index_data, indent=2))
    (out / "config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    if tokenizer_kind == "v4":
        return out
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[1],
        "pad_token": SPECIAL_TOKENS[2],
    }, indent=2, ensure_ascii=False))
    return out


# ---------------------------------------------------------------------- command line


def add_tiny_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``ds4d make-tiny --family deepseek_v41``."""
    parser.add_argument("--out", required=True, help="directory to write the checkpoint into")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", default="", help="comma-separated compress ratios (0, 1 or 2), "
                                                     "default " + ",".join(map(str, DEFAULT_LAYERS)))
    parser.add_argument("--tokenizer", default="tiny", choices=TOKENIZERS,
                        help="tiny: a small byte-level tokenizer.json; v4: the real 129,280-id vocabulary "
                             "(V4's tokenizer with V4.1's added tokens, derived at load, not written)")


def main(args: argparse.Namespace) -> int:
    layers = [int(x) for x in args.layers.split(",")] if args.layers else None
    path = write_tiny(args.out, layers=layers, seed=args.seed, tokenizer=getattr(args, "tokenizer", "tiny"))
    text = json.loads((path / "config.json").read_text(encoding="utf-8"))["text_config"]
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    print(
        f"wrote random DeepSeek-V4.1 checkpoint to {path}: {text['num_hidden_layers']} layers, compress ratios "
        f"{text['compress_ratios'][: text['num_hidden_layers']]}, KV sources {text['kv_source_layer_ids']}, "
        f"index sources {text['index_source_layer_ids']}, Engram on {text['engram_layer_ids']}, "
        f"{size / 2**20:.1f} MiB"
    )
    return 0


if __name__ == "__main__":
    cli = argparse.ArgumentParser(description="write a random tiny DeepSeek-V4.1 checkpoint")
    add_tiny_arguments(cli)
    raise SystemExit(main(cli.parse_args()))
