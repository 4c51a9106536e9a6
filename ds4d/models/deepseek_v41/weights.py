"""V4.1 weights from a ``{official tensor name: tensor}`` dict, grouped per layer.

The names are the official checkpoint's (``layers.N.attn.wq_a.weight``,
``layers.N.ffn.experts.E.w1.weight``, ``layers.N.engram.embed.weight``,
``embed.weight``, ``head.weight``); a Hugging Face ``save_pretrained`` file
uses the same names behind ``model.``, with ``lm_head`` for ``head``
(:func:`official_names` maps them back).  Every tensor arrives decoded to
float (the official FP8/FP4 reader decodes); only an Engram table may stay FP8
with its per-row scales, since the release tables are far too large to widen;
the tables stay in host memory, where they are, whatever the device of the rest.
Names this forward does not use (DSpark ``mtp.*``, the vision tower, the image
delimiters, ``bias_vl``) are ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from ds4d.models.deepseek_v41.config import DeepseekV41Config
from ds4d.models.deepseek_v41.engram import EngramWeights


@dataclass(frozen=True)
class HyperWeights:
    fn: torch.Tensor
    """``[(2 + m) * m, m * hidden]`` float32."""
    base: torch.Tensor
    scale: torch.Tensor
    """``[3]``: pre, post and comb scales."""


@dataclass(frozen=True)
class CompressorWeights:
    wkv: torch.Tensor
    wgate: torch.Tensor | None
    """None at ratio 1 (one latent per token, nothing to pool)."""
    norm: torch.Tensor


@dataclass(frozen=True)
class IndexerWeights:
    wq_b: torch.Tensor
    weights_proj: torch.Tensor
    wk: torch.Tensor | None
    """Only at a KV source, which derives its group's index keys from the compressor latents."""
    k_norm: torch.Tensor | None


@dataclass(frozen=True)
class AttentionWeights:
    wq_a: torch.Tensor
    q_norm: torch.Tensor
    wq_b: torch.Tensor
    wkv: torch.Tensor
    kv_norm: torch.Tensor
    wo_a: torch.Tensor
    """``[o_groups * o_lora_rank, heads * head_dim / o_groups]``: one block per group."""
    wo_b: torch.Tensor
    sink: torch.Tensor
    compressor: CompressorWeights | None
    indexer: IndexerWeights | None


@dataclass(frozen=True)
class ExpertWeights:
    w1: torch.Tensor
    w2: torch.Tensor
    w3: torch.Tensor


@dataclass(frozen=True)
class ExpertBanks:
    """Every routed expert's projections, one tensor per projection; expert ``e`` is row ``e``."""

    w1: torch.Tensor
    """``[experts, intermediate, hidden]`` (the gate branch)."""
    w2: torch.Tensor
    """``[experts, hidden, intermediate]``."""
    w3: torch.Tensor
    """``[experts, intermediate, hidden]`` (the up branch)."""

    def expert(self, e: int) -> ExpertWeights:
        return ExpertWeights(self.w1[e], self.w2[e], self.w3[e])


@dataclass(frozen=True)
class MoEWeights:
    gate: torch.Tensor
    bias: torch.Tensor
    """Added to the scores for choosing experts only."""
    banks: ExpertBanks
    """The routed experts (``banks.expert(e)``: expert ``e``'s three matrices)."""
    shared: ExpertWeights


@dataclass(frozen=True)
class LayerWeights:
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    hc_attn: HyperWeights
    hc_ffn: HyperWeights
    attn: AttentionWeights
    ffn: MoEWeights
    engram: EngramWeights | None


@dataclass(frozen=True)
class ModelWeights:
    embed: torch.Tensor
    norm: torch.Tensor
    head: torch.Tensor
    layers: tuple[LayerWeights, ...]


def official_names(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF ``save_pretrained`` names (``model.`` prefix, ``lm_head``) -> official names; others unchanged."""
    out = {}
    for name, tensor in tensors.items():
        if name.startswith("model."):
            name = name[len("model."):]
        elif name.startswith("lm_head."):
            name = "head." + name[len("lm_head."):]
        out[name] = tensor
    return out


class _Reader:
    def __init__(self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype, device) -> None:
        self.tensors, self.dtype, self.device = tensors, dtype, device
        self.used: set[str] = set()

    def __call__(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.host(name).to(device=self.device, dtype=dtype or self.dtype)

    def host(self, name: str) -> torch.Tensor:
        """As stored and where it is (Engram tables stay in host memory, whatever the device)."""
        if name not in self.tensors:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        self.used.add(name)
        return self.tensors[name]

    def has(self, name: str) -> bool:
        return name in self.tensors


def _expert(read: _Reader, prefix: str) -> ExpertWeights:
    return ExpertWeights(read(f"{prefix}.w1.weight"), read(f"{prefix}.w2.weight"), read(f"{prefix}.w3.weight"))


def _banks(read: _Reader, prefix: str, experts: int) -> ExpertBanks:
    """Each projection of the ``experts`` routed experts copied into one tensor on the model's device."""
    banks = {}
    for part in ("w1", "w2", "w3"):
        first = read.host(f"{prefix}.0.{part}.weight")
        bank = torch.empty(experts, *first.shape, dtype=read.dtype, device=read.device)
        for e in range(experts):
            bank[e].copy_(read.host(f"{prefix}.{e}.{part}.weight"))
        banks[part] = bank
    return ExpertBanks(**banks)


def _hyper(read: _Reader, prefix: str) -> HyperWeights:
    f32 = torch.float32
    return HyperWeights(read(f"{prefix}_fn", f32), read(f"{prefix}_base", f32), read(f"{prefix}_scale", f32))


def _attention(read: _Reader, cfg: DeepseekV41Config, layer: int) -> AttentionWeights:
    p = f"layers.{layer}.attn"
    plan = cfg.plan()[layer]
    compressor = indexer = None
    if plan.is_kv_source:
        compressor = CompressorWeights(
            wkv=read(f"{p}.compressor.wkv.weight", torch.float32 if plan.ratio > 1 else None),
            wgate=read(f"{p}.compressor.wgate.weight", torch.float32) if plan.ratio > 1 else None,
            norm=read(f"{p}.compressor.norm.weight"),
        )
    if plan.is_index_source:
        indexer = IndexerWeights(
            wq_b=read(f"{p}.indexer.wq_b.weight"),
            weights_proj=read(f"{p}.indexer.weights_proj.weight"),
            wk=read(f"{p}.indexer.wk.weight") if plan.is_kv_source else None,
            k_norm=read(f"{p}.indexer.k_norm.weight") if plan.is_kv_source else None,
        )
    return AttentionWeights(
        wq_a=read(f"{p}.wq_a.weight"), q_norm=read(f"{p}.q_norm.weight"), wq_b=read(f"{p}.wq_b.weight"),
        wkv=read(f"{p}.wkv.weight"), kv_norm=read(f"{p}.kv_norm.weight"), wo_a=read(f"{p}.wo_a.weight"),
        wo_b=read(f"{p}.wo_b.weight"), sink=read(f"{p}.attn_sink", torch.float32),
        compressor=compressor, indexer=indexer,
    )


def _engram(read: _Reader, layer: int) -> EngramWeights:
    p = f"layers.{layer}.engram"
    table = read.host(f"{p}.embed.weight")
    scale = read.host(f"{p}.embed.scale") if read.has(f"{p}.embed.scale") else None
    if table.dtype != torch.float8_e4m3fn:
        table, scale = table.to(dtype=read.dtype), None  # a float table holds the decoded values already
    return EngramWeights(
        table=table, table_scale=scale, wkv=read(f"{p}.wkv.weight"),
        gate_weight=read(f"{p}.q_weight", torch.float32) * read(f"{p}.k_weight", torch.float32),
    )


def build_weights(cfg: DeepseekV41Config, tensors: Mapping[str, torch.Tensor], *,
                  dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> ModelWeights:
    """Group the dict's tensors by layer; a missing tensor raises ``KeyError`` naming it."""
    read = _Reader(official_names(tensors), dtype, device)
    layers = []
    for i, plan in enumerate(cfg.plan()):
        p = f"layers.{i}"
        ffn = MoEWeights(
            gate=read(f"{p}.ffn.gate.weight", torch.float32),
            bias=read(f"{p}.ffn.gate.bias", torch.float32),
            banks=_banks(read, f"{p}.ffn.experts", cfg.n_routed_experts),
            shared=_expert(read, f"{p}.ffn.shared_experts"),
        )
        layers.append(LayerWeights(
            attn_norm=read(f"{p}.attn_norm.weight"), ffn_norm=read(f"{p}.ffn_norm.weight"),
            hc_attn=_hyper(read, f"{p}.hc_attn"), hc_ffn=_hyper(read, f"{p}.hc_ffn"),
            attn=_attention(read, cfg, i), ffn=ffn,
            engram=_engram(read, i) if plan.engram_slot is not None else None,
        ))
    return ModelWeights(embed=read("embed.weight"), norm=read("norm.weight"),
                        head=read("head.weight", torch.float32), layers=tuple(layers))


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, or of all ``*.safetensors`` files of a directory."""
    from safetensors.torch import load_file

    path = Path(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"no safetensors file in {path}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(str(file)))
    return tensors
