"""The DeepSeek-V4.1 ``config.json``, parsed into one frozen object.

Two files describe the same text model: the release's composite config
(``model_type: deepseek_v41`` with ``text_config``, ``vision_config`` and a
top-level ``quantization_config``) and the bare text config HF transformers
writes from ``save_pretrained`` (``model_type: deepseek_v41_text``, rope as
``rope_parameters.{main,compress}``).  Both parse to :class:`DeepseekV41Config`.

V4.1 gives every layer a *mode* rather than "owns a compressor or not":

* ``compress_ratios[i]`` 0 is sliding-window attention only; 1 or 2 adds the
  shared compressed KV of the layer's group (ratio 2 pools two tokens into one
  entry, ratio 1 keeps one latent per token);
* the group of a compressed layer is the nearest KV source at or before it
  (``kv_source_layer_ids``); only the source owns a compressor and the index
  keys, every layer of the group attends to its entries ("reuse");
* index sources (``index_source_layer_ids``) score the group's index keys with
  their own indexer weights ("reindex"); the layers after one reuse its top-k;
* the candidate source (``candidate_source_layer_id``, negative: none) keeps
  the best ``candidate_topk_blocks`` blocks of ``candidate_block_size``
  entries; index sources after it pick their top-k inside those blocks;
* Engram layers (``engram_layer_ids``) add an n-gram table lookup to the
  residual streams before the layer.

:meth:`DeepseekV41Config.plan` turns these lists into one :class:`LayerPlan`
per layer.  DSpark draft layers (``num_nextn_predict_layers``) and the vision
tower are parsed but not part of the forward implemented here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ds4d.models.deepseek_v4.config import QuantizationConfig, YarnScaling

MODEL_TYPES = ("deepseek_v41", "deepseek_v41_text")
RELEASE_RATIOS = (0, 0) + (2,) * 18 + (1,) * 20
RELEASE_KV_SOURCES = (2, 8, 14, 20)
RELEASE_INDEX_SOURCES = (2, 8, 14, 20, 24, 28, 32, 36)
FLASH_WIDTHS = {
    "hidden_size": 5120, "moe_intermediate_size": 2304, "num_attention_heads": 64, "num_key_value_heads": 1,
    "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1280, "o_lora_rank": 1024, "o_groups": 8,
    "sliding_window": 128, "num_experts_per_tok": 6, "index_n_heads": 32, "index_head_dim": 128,
    "index_topk": 512, "candidate_topk_blocks": 2048, "candidate_block_size": 8, "engram_max_ngram_size": 4,
    "engram_n_heads": 8, "engram_head_dim": 256,
}
"""The release V4.1-Flash text config's widths (its config.json), for benchmarks of random models."""


@dataclass(frozen=True)
class LayerPlan:
    """What one backbone layer does, derived once from the config lists."""

    layer: int
    ratio: int
    """0: sliding window only; 1 or 2: also the group's compressed KV."""
    kv_source: int | None
    """The layer whose compressor produces this layer's compressed KV (None at ratio 0)."""
    is_index_source: bool
    """Scores the group's index keys with its own indexer (else reuses the last top-k)."""
    is_candidate_source: bool
    uses_candidates: bool
    """An index source after the candidate source: its top-k is restricted to the candidate blocks."""
    engram_slot: int | None
    """Position of this layer in ``engram_layer_ids`` (None: no Engram here)."""

    @property
    def is_kv_source(self) -> bool:
        return self.kv_source == self.layer


@dataclass(frozen=True)
class DeepseekV41Config:
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
    """One entry per backbone layer (the DSpark entries of the published list are dropped)."""
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    candidate_source_layer_id: int
    candidate_topk_blocks: int
    candidate_block_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    routed_scaling_factor: float = 1.5
    scoring_func: str = "sqrtsoftplus"
    gate_temp: float = 1.0
    norm_topk_prob: bool = True
    swiglu_limit: float = 10.0
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-20
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    yarn: YarnScaling | None = None
    """YaRN applies to the compressed layers' rope only (and leaves cos/sin unscaled)."""
    max_position_embeddings: int = 1048576
    engram_layer_ids: tuple[int, ...] = ()
    engram_num_embeddings: tuple[int, ...] = ()
    engram_max_ngram_size: int = 4
    engram_vocab_size: int = 16000000
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 99092
    num_nextn_predict_layers: int = 0
    bos_token_id: int | None = 0
    eos_token_id: int | None = 1
    image_token_id: int | None = None
    quantization: QuantizationConfig | None = None
    name: str = "DeepSeek-V4.1"
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        ratios = self.compress_ratios
        if len(ratios) != n:
            raise ValueError(f"compress_ratios has {len(ratios)} entries for {n} layers")
        if any(r not in (0, 1, 2) for r in ratios):
            raise ValueError(f"V4.1 compress ratios are 0, 1 or 2, got {sorted(set(ratios))}")
        kv, index = self.kv_source_layer_ids, self.index_source_layer_ids
        for name, ids in (("kv_source_layer_ids", kv), ("index_source_layer_ids", index)):
            if list(ids) != sorted(set(ids)) or any(not 0 <= i < n or ratios[i] == 0 for i in ids):
                raise ValueError(f"{name} {list(ids)} must be increasing layers with a compress ratio")
        if not set(kv) <= set(index):
            # A source's group reuses the last top-k; without its own indexer that would be the
            # previous group's, over a different set of entries.
            raise ValueError(f"every KV source {list(kv)} must also be an index source {list(index)}")
        for layer, ratio in enumerate(ratios):
            source = self.kv_source_of(layer)
            if ratio and source is None:
                raise ValueError(f"layer {layer} has compress ratio {ratio} but no KV source at or before it")
            if ratio and ratios[source] != ratio:
                raise ValueError(f"layer {layer} (ratio {ratio}) reads KV source {source} (ratio {ratios[source]})")
        cand = self.candidate_source_layer_id
        if cand >= 0 and (cand not in index or self.candidate_block_size <= 0 or self.candidate_topk_blocks <= 0):
            raise ValueError(f"candidate source {cand} must be an index source with blocks to keep")
        if cand >= 0 and any(i > cand and self.kv_source_of(i) != self.kv_source_of(cand) for i in index):
            # the candidate blocks are blocks of the candidate source's group's entries
            raise ValueError(f"index sources after the candidate source {cand} must share its KV source")
        if len(self.engram_num_embeddings) != len(self.engram_layer_ids):
            raise ValueError("engram_num_embeddings needs one entry per engram layer")
        if any(not 0 <= i < n for i in self.engram_layer_ids):
            raise ValueError(f"engram_layer_ids {list(self.engram_layer_ids)} out of range")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > min(self.head_dim, self.index_head_dim):
            raise ValueError("qk_rope_head_dim must be even and fit in head_dim and index_head_dim")
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            raise ValueError("num_attention_heads * head_dim must split into o_groups")
        if self.scoring_func not in ("sqrtsoftplus", "sigmoid", "softmax"):
            raise ValueError(f"unknown scoring_func {self.scoring_func!r}")
        if self.n_shared_experts != 1:
            raise ValueError("V4.1 has exactly one shared expert")

    # ------------------------------------------------------------------ derived

    def kv_source_of(self, layer: int) -> int | None:
        """The nearest KV source at or before a compressed ``layer`` (None at ratio 0)."""
        if not self.compress_ratios[layer]:
            return None
        before = [s for s in self.kv_source_layer_ids if s <= layer]
        return before[-1] if before else None

    def plan(self) -> tuple[LayerPlan, ...]:
        cand = self.candidate_source_layer_id
        engram = {layer: slot for slot, layer in enumerate(self.engram_layer_ids)}
        return tuple(
            LayerPlan(
                layer=i,
                ratio=self.compress_ratios[i],
                kv_source=self.kv_source_of(i),
                is_index_source=i in self.index_source_layer_ids,
                is_candidate_source=i == cand,
                uses_candidates=i in self.index_source_layer_ids and 0 <= cand < i,
                engram_slot=engram.get(i),
            )
            for i in range(self.num_hidden_layers)
        )

    @property
    def hc_mix_size(self) -> int:
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def engram_hash_columns(self) -> int:
        """Rows gathered per position and Engram layer: one per (n-gram size 2..N, head)."""
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    # ------------------------------------------------------------------ parsing

    @classmethod
    def from_dict(cls, data: dict[str, Any], name: str = "DeepSeek-V4.1") -> DeepseekV41Config:
        """A composite release config or a bare text config."""
        if data.get("model_type") not in MODEL_TYPES:
            raise ValueError(f"model_type {data.get('model_type')!r} is not one of {MODEL_TYPES}")
        quantization = _quantization(data.get("quantization_config"))
        image_token_id = data.get("image_token_id")
        if data["model_type"] == "deepseek_v41":
            text = data.get("text_config")
            if not isinstance(text, dict):
                raise ValueError("a deepseek_v41 config needs a text_config")
            data = {**text, "model_type": "deepseek_v41_text"}
        return cls._from_text(data, name, quantization, image_token_id)

    @classmethod
    def _from_text(cls, data: dict[str, Any], name: str, quantization, image_token_id) -> DeepseekV41Config:
        n = int(data["num_hidden_layers"])
        head_dim = int(data.get("head_dim", 512))
        ratios = _ratios(data, n)
        kv = tuple(int(i) for i in data.get("kv_source_layer_ids") or _default_kv_sources(ratios))
        index = data.get("index_source_layer_ids")
        if index is None:
            index = RELEASE_INDEX_SOURCES if kv == RELEASE_KV_SOURCES else kv
        candidate = data.get("candidate_source_layer_id")
        main_rope, compress_rope = _rope_sections(data)
        engram_layers = tuple(int(i) for i in data.get("engram_layer_ids") or ())
        pad = data.get("engram_pad_id", data.get("engram_pad_token_id", 2))
        return cls(
            vocab_size=int(data["vocab_size"]),
            hidden_size=int(data["hidden_size"]),
            num_hidden_layers=n,
            num_attention_heads=int(data["num_attention_heads"]),
            head_dim=head_dim,
            qk_rope_head_dim=_rope_dim(data, head_dim, main_rope),
            q_lora_rank=int(data["q_lora_rank"]),
            o_groups=int(data["o_groups"]),
            o_lora_rank=int(data["o_lora_rank"]),
            sliding_window=int(data.get("sliding_window", 128)),
            compress_ratios=ratios,
            kv_source_layer_ids=kv,
            index_source_layer_ids=tuple(int(i) for i in index),
            candidate_source_layer_id=int(kv[-1] if candidate is None and kv else -1 if candidate is None
                                          else candidate),
            candidate_topk_blocks=int(data.get("candidate_topk_blocks", 2048)),
            candidate_block_size=int(data.get("candidate_block_size", 8)),
            n_routed_experts=int(data["n_routed_experts"]),
            n_shared_experts=int(data.get("n_shared_experts", 1)),
            num_experts_per_tok=int(data["num_experts_per_tok"]),
            moe_intermediate_size=int(data["moe_intermediate_size"]),
            routed_scaling_factor=float(data.get("routed_scaling_factor", 1.5)),
            scoring_func=str(data.get("scoring_func", "sqrtsoftplus")),
            gate_temp=float(data.get("gate_temp", 1.0)),
            norm_topk_prob=bool(data.get("norm_topk_prob", True)),
            swiglu_limit=float(data.get("swiglu_limit", 0.0) or 0.0),
            index_n_heads=int(data.get("index_n_heads", 32)),
            index_head_dim=int(data.get("index_head_dim", 128)),
            index_topk=int(data.get("index_topk", 512)),
            hc_mult=int(data.get("hc_mult", 4)),
            hc_sinkhorn_iters=int(data.get("hc_sinkhorn_iters", 20)),
            hc_eps=float(data.get("hc_eps", 1e-6)),
            rms_norm_eps=float(data.get("rms_norm_eps", 1e-20)),
            rope_theta=float(main_rope.get("rope_theta", data.get("rope_theta", 10000.0))),
            compress_rope_theta=float(compress_rope.get("rope_theta", data.get("compress_rope_theta", 160000.0))),
            yarn=_yarn(compress_rope),
            max_position_embeddings=int(data.get("max_position_embeddings", 1048576)),
            engram_layer_ids=engram_layers,
            engram_num_embeddings=tuple(int(r) for r in data.get("engram_num_embeddings") or (0,) * len(engram_layers)),
            engram_max_ngram_size=int(data.get("engram_max_ngram_size", 4)),
            engram_vocab_size=int(data.get("engram_vocab_size", 16000000)),
            engram_n_heads=int(data.get("engram_n_heads", 8)),
            engram_head_dim=int(data.get("engram_head_dim", 256)),
            engram_pad_id=int(pad),
            engram_compressed_vocab_size=int(data.get("engram_compressed_vocab_size", 99092)),
            num_nextn_predict_layers=int(data.get("num_nextn_predict_layers", 0)),
            bos_token_id=data.get("bos_token_id"),
            eos_token_id=_first_int(data.get("eos_token_id")),
            image_token_id=None if image_token_id is None else int(image_token_id),
            quantization=quantization,
            name=name,
            raw=dict(data),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> DeepseekV41Config:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        with path.open(encoding="utf-8") as handle:
            data = json.load(handle)
        return cls.from_dict(data, name=path.parent.name or "DeepSeek-V4.1")


# ---------------------------------------------------------------------- helpers


def _first_int(value: Any) -> int | None:
    if isinstance(value, list):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def _ratios(data: dict[str, Any], layers: int) -> tuple[int, ...]:
    ratios = data.get("compress_ratios")
    if ratios is None:
        if layers != len(RELEASE_RATIOS):
            raise ValueError("config.json has no compress_ratios")
        return RELEASE_RATIOS
    if len(ratios) < layers:
        raise ValueError(f"compress_ratios lists {len(ratios)} layers, config has {layers}")
    return tuple(int(r) for r in ratios[:layers])  # trailing entries: the DSpark draft layers


def _default_kv_sources(ratios: tuple[int, ...]) -> tuple[int, ...]:
    """Without an explicit list: the release's sources, else the first layer of each run of equal ratios."""
    if ratios == RELEASE_RATIOS:
        return RELEASE_KV_SOURCES
    return tuple(i for i, r in enumerate(ratios) if r and (i == 0 or ratios[i - 1] != r))


def _rope_sections(data: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(main rope, compress rope) parameters: ``rope_parameters`` when it has both, else ``rope_scaling``."""
    params = data.get("rope_parameters") or {}
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        return params["main"], params["compress"]
    return {}, dict(data.get("rope_scaling") or {})


def _rope_dim(data: dict[str, Any], head_dim: int, main_rope: dict[str, Any]) -> int:
    if "qk_rope_head_dim" in data:
        return int(data["qk_rope_head_dim"])
    return int(head_dim * float(main_rope.get("partial_rotary_factor", 64 / 512)))


def _yarn(params: dict[str, Any]) -> YarnScaling | None:
    if params.get("rope_type", params.get("type")) != "yarn":
        return None
    return YarnScaling(
        factor=float(params["factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
    )


def _quantization(quant: dict[str, Any] | None) -> QuantizationConfig | None:
    if not quant:
        return None
    if quant.get("quant_method", "fp8") != "fp8":
        raise ValueError(f"unsupported quant_method {quant.get('quant_method')!r}")
    block = tuple(int(b) for b in quant.get("weight_block_size", (32, 32)))
    if len(block) != 2:
        raise ValueError(f"weight_block_size {block} is not two numbers")
    return QuantizationConfig(
        method="fp8",
        fmt=str(quant.get("fmt", "e4m3")),
        scale_fmt=str(quant.get("scale_fmt", "ue8m0")),
        weight_block_size=(block[0], block[1]),
        expert_dtype=quant.get("expert_dtype"),
    )
