"""The published DeepSeek-V4 ``config.json``, parsed into one frozen object.

Flash and Pro share an architecture and differ only in widths, depth and the
per-layer ``compress_ratios`` list, so everything the forward pass needs is
read from the file; nothing here assumes Flash.  Two spellings exist in the
wild: the official release (``compress_ratios``, ``num_hash_layers``,
``qk_rope_head_dim``, ``rope_scaling``) and the one HF transformers writes from
``save_pretrained`` (``layer_types``, ``mlp_layer_types``,
``partial_rotary_factor``, ``rope_parameters``).  Both map to the same fields.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_LAYER_TYPE_TO_RATIO = {
    "sliding_attention": 0,
    "compressed_sparse_attention": 4,
    "heavily_compressed_attention": 128,
}
RATIO_TO_LAYER_TYPE = {ratio: name for name, ratio in _LAYER_TYPE_TO_RATIO.items()}
CSA_RATIO = 4
"""The one compress ratio that uses overlapped windows and the lightning indexer."""
FLASH_WIDTHS = {  # every width of V4-Flash, none of its depth
    "hidden_size": 4096, "num_attention_heads": 64, "head_dim": 512, "qk_rope_head_dim": 64,
    "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024, "n_routed_experts": 256,
    "num_experts_per_tok": 6, "moe_intermediate_size": 2048, "index_n_heads": 64,
    "index_head_dim": 128, "index_topk": 512,
}
"""V4-Flash's widths (reference config.flash.json), for random models of any depth."""


@dataclass(frozen=True)
class QuantizationConfig:
    """``quantization_config`` of the official release (absent for a float checkpoint)."""

    method: str = "fp8"
    fmt: str = "e4m3"
    scale_fmt: str = "ue8m0"
    weight_block_size: tuple[int, int] = (128, 128)
    expert_dtype: str | None = "fp4"
    """``fp4``: routed experts are MXFP4; None: experts use the FP8 layout."""


@dataclass(frozen=True)
class YarnScaling:
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class DeepseekV4Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    compress_ratios: tuple[int, ...]
    """One entry per main layer (the MTP entry of the published list is dropped)."""
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    num_hash_layers: int
    routed_scaling_factor: float
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    swiglu_limit: float = 10.0
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    yarn: YarnScaling | None = None
    max_position_embeddings: int = 1048576
    num_nextn_predict_layers: int = 1
    bos_token_id: int | None = 0
    eos_token_id: int | None = 1
    quantization: QuantizationConfig | None = None
    name: str = "DeepSeek-V4"
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.compress_ratios) != self.num_hidden_layers:
            raise ValueError(
                f"compress_ratios has {len(self.compress_ratios)} entries for {self.num_hidden_layers} layers"
            )
        for ratio in self.compress_ratios:
            if ratio < 0 or (ratio and self.block_size_tokens % ratio):
                raise ValueError(f"compress ratio {ratio} does not divide the block size")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > min(self.head_dim, self.index_head_dim):
            raise ValueError("qk_rope_head_dim must be even and fit in head_dim and index_head_dim")
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            raise ValueError("num_attention_heads * head_dim must split into o_groups")
        if self.scoring_func not in ("sqrtsoftplus", "sigmoid", "softmax"):
            raise ValueError(f"unknown scoring_func {self.scoring_func!r}")

    # ------------------------------------------------------------------ derived

    @property
    def block_size_tokens(self) -> int:
        """KV block size: a multiple of every compress ratio (lcm(4, 128) = 128)."""
        ratios = [r for r in self.compress_ratios if r] or [1]
        return max(128, math.lcm(*ratios))

    def is_hash_layer(self, layer: int) -> bool:
        return layer < self.num_hash_layers

    # ------------------------------------------------------------------ parsing

    @classmethod
    def from_dict(cls, data: dict[str, Any], name: str = "DeepSeek-V4") -> DeepseekV4Config:
        if data.get("model_type") not in (None, "deepseek_v4"):
            raise ValueError(f"model_type {data.get('model_type')!r} is not deepseek_v4")
        layers = int(data["num_hidden_layers"])
        head_dim = int(data.get("head_dim", 512))
        return cls(
            vocab_size=int(data["vocab_size"]),
            hidden_size=int(data["hidden_size"]),
            num_hidden_layers=layers,
            num_attention_heads=int(data["num_attention_heads"]),
            head_dim=head_dim,
            qk_rope_head_dim=_rope_dim(data, head_dim),
            q_lora_rank=int(data["q_lora_rank"]),
            o_groups=int(data["o_groups"]),
            o_lora_rank=int(data["o_lora_rank"]),
            sliding_window=int(data.get("sliding_window", 128)),
            compress_ratios=_compress_ratios(data, layers),
            n_routed_experts=int(data["n_routed_experts"]),
            n_shared_experts=int(data.get("n_shared_experts", 1)),
            num_experts_per_tok=int(data["num_experts_per_tok"]),
            moe_intermediate_size=int(data["moe_intermediate_size"]),
            num_hash_layers=_num_hash_layers(data),
            routed_scaling_factor=float(data.get("routed_scaling_factor", 1.0)),
            scoring_func=str(data.get("scoring_func", "sqrtsoftplus")),
            norm_topk_prob=bool(data.get("norm_topk_prob", True)),
            swiglu_limit=float(data.get("swiglu_limit", 0.0) or 0.0),
            index_n_heads=int(data.get("index_n_heads", 64)),
            index_head_dim=int(data.get("index_head_dim", 128)),
            index_topk=int(data.get("index_topk", 512)),
            hc_mult=int(data.get("hc_mult", 4)),
            hc_sinkhorn_iters=int(data.get("hc_sinkhorn_iters", 20)),
            hc_eps=float(data.get("hc_eps", 1e-6)),
            rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
            rope_theta=float(_main_rope(data).get("rope_theta", data.get("rope_theta", 10000.0))),
            compress_rope_theta=float(
                _compress_rope(data).get("rope_theta", data.get("compress_rope_theta", 160000.0))
            ),
            yarn=_yarn(data),
            max_position_embeddings=int(data.get("max_position_embeddings", 1048576)),
            num_nextn_predict_layers=int(data.get("num_nextn_predict_layers", 0)),
            bos_token_id=data.get("bos_token_id"),
            eos_token_id=_first_int(data.get("eos_token_id")),
            quantization=_quantization(data),
            name=name,
            raw=dict(data),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> DeepseekV4Config:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        with path.open(encoding="utf-8") as handle:
            data = json.load(handle)
        return cls.from_dict(data, name=path.parent.name or "DeepSeek-V4")

    def to_hf_dict(self) -> dict[str, Any]:
        """Keyword arguments for ``transformers.DeepseekV4Config`` (used by parity tests)."""
        rope_scaling: dict[str, Any] = {}
        if self.yarn is not None:
            rope_scaling = {
                "type": "yarn",
                "factor": self.yarn.factor,
                "original_max_position_embeddings": self.yarn.original_max_position_embeddings,
                "beta_fast": self.yarn.beta_fast,
                "beta_slow": self.yarn.beta_slow,
            }
        return {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": 1,
            "head_dim": self.head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "q_lora_rank": self.q_lora_rank,
            "o_groups": self.o_groups,
            "o_lora_rank": self.o_lora_rank,
            "sliding_window": self.sliding_window,
            "compress_ratios": list(self.compress_ratios),
            "n_routed_experts": self.n_routed_experts,
            "n_shared_experts": self.n_shared_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_hash_layers": self.num_hash_layers,
            "routed_scaling_factor": self.routed_scaling_factor,
            "scoring_func": self.scoring_func,
            "norm_topk_prob": self.norm_topk_prob,
            "swiglu_limit": self.swiglu_limit,
            "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk,
            "hc_mult": self.hc_mult,
            "hc_sinkhorn_iters": self.hc_sinkhorn_iters,
            "hc_eps": self.hc_eps,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "compress_rope_theta": self.compress_rope_theta,
            "rope_scaling": rope_scaling or None,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "tie_word_embeddings": False,
        }


# ---------------------------------------------------------------------- helpers


def _first_int(value: Any) -> int | None:
    if isinstance(value, list):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def _rope_dim(data: dict[str, Any], head_dim: int) -> int:
    if "qk_rope_head_dim" in data:
        return int(data["qk_rope_head_dim"])
    factor = data.get("partial_rotary_factor")
    if factor is None:
        factor = _main_rope(data).get("partial_rotary_factor", 64 / 512)
    return int(head_dim * float(factor))


def _compress_ratios(data: dict[str, Any], layers: int) -> tuple[int, ...]:
    if data.get("compress_ratios") is not None:
        ratios = [int(r) for r in data["compress_ratios"]]
        if len(ratios) < layers:
            raise ValueError(f"compress_ratios lists {len(ratios)} layers, config has {layers}")
        return tuple(ratios[:layers])  # trailing entries belong to the MTP block(s)
    if data.get("layer_types") is not None:
        rates = {**_LAYER_TYPE_TO_RATIO, **(data.get("compress_rates") or {})}
        rates["sliding_attention"] = 0
        return tuple(int(rates[t]) for t in data["layer_types"][:layers])
    raise ValueError("config.json names neither compress_ratios nor layer_types")


def _num_hash_layers(data: dict[str, Any]) -> int:
    if data.get("num_hash_layers") is not None:
        return int(data["num_hash_layers"])
    kinds = data.get("mlp_layer_types")
    if kinds is not None:
        count = 0
        for kind in kinds:
            if kind != "hash_moe":
                break
            count += 1
        if any(k == "hash_moe" for k in kinds[count:]):
            raise ValueError("hash-routed MoE layers must come first")
        return count
    return 0


def _main_rope(data: dict[str, Any]) -> dict[str, Any]:
    params = data.get("rope_parameters") or {}
    main = params.get("main")
    return main if isinstance(main, dict) else {}


def _compress_rope(data: dict[str, Any]) -> dict[str, Any]:
    params = data.get("rope_parameters") or {}
    compress = params.get("compress")
    if isinstance(compress, dict):
        return compress
    return data.get("rope_scaling") or {}


def _yarn(data: dict[str, Any]) -> YarnScaling | None:
    params = _compress_rope(data)
    kind = params.get("rope_type", params.get("type"))
    if kind != "yarn":
        return None
    return YarnScaling(
        factor=float(params["factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
    )


def _quantization(data: dict[str, Any]) -> QuantizationConfig | None:
    quant = data.get("quantization_config")
    if not quant:
        return None
    method = quant.get("quant_method", "fp8")
    if method != "fp8":
        raise ValueError(f"unsupported quant_method {method!r}")
    block = tuple(int(b) for b in quant.get("weight_block_size", (128, 128)))
    if len(block) != 2:
        raise ValueError(f"weight_block_size {block} is not two numbers")
    return QuantizationConfig(
        method=method,
        fmt=str(quant.get("fmt", "e4m3")),
        scale_fmt=str(quant.get("scale_fmt", "ue8m0")),
        weight_block_size=(block[0], block[1]),
        expert_dtype=quant.get("expert_dtype", data.get("expert_dtype")),
    )
