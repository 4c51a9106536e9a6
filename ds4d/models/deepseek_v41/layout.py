"""Every tensor of an official DeepSeek-V4.1 checkpoint: name, stored shape, stored dtype.

Names are those of the official ``inference/model.py`` state dict (``embed.weight``,
``layers.N.attn.wq_a.weight`` + ``.scale``, ``layers.N.ffn.experts.E.w1.weight``,
``layers.N.engram.embed.weight``, ``head.weight``, ...), at one rank (no tensor
parallel split).  Shapes and dtypes follow the official parameter definitions and
the release's ``quantization_config``:

* FP8 linear: ``X.weight`` F8_E4M3 ``[out, in]`` + ``X.scale`` F8_E8M0
  ``[ceil(out/32), ceil(in/32)]`` (``weight_block_size``, 32 x 32 in the release).
  The linears built with the model's default dtype are FP8: attention ``wq_a``,
  ``wq_b``, ``wkv``, ``wo_b``, the indexer's ``wq_b``, the shared expert, Engram's
  ``wkv`` and DSpark's ``main_proj``.
* FP4 routed experts (``expert_dtype: fp4``): ``X.weight`` I8 ``[out, in/2]`` (two
  e2m1 codes per byte, low nibble first) + ``X.scale`` F8_E8M0 ``[out, in/32]``.
* Engram tables: F8_E4M3 ``[rows, head_dim]`` + F8_E8M0 ``[rows, head_dim/32]``
  (one scale per row and 32 channels), whatever the linears' dtype.
* F32: the hyper-connection parameters, the attention sinks and the gate biases.
* BF16: everything else (embeddings, head, norms, ``wo_a``, the compressor, the
  indexer's ``weights_proj`` / ``wk``, the gate weight, Engram's ``q_weight`` /
  ``k_weight``).  The reference promotes some of these to f32 at load (head, the
  ratio-2 compressor); the file holds bf16.

Without a ``quantization_config`` the linears are BF16 ``[out, in]`` with no scale
(the reference's ``dtype: bf16``), and the experts too unless ``expert_dtype`` is
``fp4``.

Tensors fall in three groups: ``text`` (what a text-only forward reads), ``vision``
(the ViT, the aligner, the image delimiters, and the gates' ``bias_vl`` used on
image tokens only) and ``dspark`` (the ``mtp.*`` draft stages).  A loader reads
``text`` and skips the other two with a note; :func:`skippable_group` also
recognises such tensors in a checkpoint whose config does not describe them.  The
reference's ``mtp.K.embed`` / ``mtp.K.head`` are the shared top-level ``embed`` and
``head`` modules, not tensors of their own, and are not listed.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

TEXT = "text"
VISION = "vision"
DSPARK = "dspark"
GROUPS = (TEXT, VISION, DSPARK)

PLAIN = "plain"
FP8 = "fp8"
FP4 = "fp4"
SCALE = "scale"

FP4_BLOCK = 32
"""Inputs per e8m0 scale of an FP4 expert matrix."""

ELEMENT_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "I64": 8}


@dataclass(frozen=True)
class TensorSpec:
    """One stored tensor.  A quantised weight (``quant`` fp8 or fp4) has a companion
    ``SCALE`` entry named :attr:`scale_name`; ``dense_shape`` is what it decodes to."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype string: BF16, F32, F8_E4M3, F8_E8M0, I8
    group: str
    quant: str = PLAIN  # PLAIN, FP8, FP4, or SCALE (the scale of a quantised weight)
    block: tuple[int, int] | None = None  # weight elements per scale: (rows, columns)
    dense_shape: tuple[int, ...] | None = None  # decoded shape of a quantised weight

    @property
    def is_quantized(self) -> bool:
        return self.quant in (FP8, FP4)

    @property
    def scale_name(self) -> str:
        return scale_name_of(self.name)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ELEMENT_BYTES[self.dtype]


def scale_name_of(weight_name: str) -> str:
    return weight_name.removesuffix("weight") + "scale"


def is_engram_table(name: str) -> bool:
    """An Engram layer's table (or its scales): kept as stored, in host memory."""
    return ".engram.embed." in name


# ---------------------------------------------------------------------- config


@dataclass(frozen=True)
class VisionShape:
    n_layers: int
    dim: int
    n_heads: int
    inter_dim: int
    patch_size: int
    downsample_ratio: int


@dataclass(frozen=True)
class LayoutConfig:
    """The config values that decide the checkpoint's tensors (the text config's names)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    compress_ratios: tuple[int, ...]
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    index_n_heads: int
    index_head_dim: int
    hc_mult: int
    engram_layer_ids: tuple[int, ...]
    engram_num_embeddings: tuple[int, ...]
    engram_max_ngram_size: int
    engram_n_heads: int
    engram_head_dim: int
    num_nextn_predict_layers: int
    dspark_block_size: int
    dspark_target_layer_ids: tuple[int, ...]
    dspark_markov_rank: int
    dspark_n_routed_experts: int
    vision: VisionShape | None
    linear_dtype: str  # FP8 or PLAIN (bf16)
    expert_dtype: str  # FP4, FP8 or PLAIN
    weight_block: tuple[int, int]

    @classmethod
    def from_config(cls, config: Mapping) -> LayoutConfig:
        """From a release config.json (composite ``deepseek_v41`` with ``text_config``) or a
        bare ``deepseek_v41_text`` config."""
        text = config.get("text_config", config)
        if not isinstance(text, Mapping):
            raise ValueError("text_config must be an object")
        quant = config.get("quantization_config") or text.get("quantization_config")
        vision_cfg = config.get("vision_config") if "text_config" in config else None

        def need(key: str):
            if key not in text:
                raise ValueError(f"config has no {key!r} (needed for the checkpoint layout)")
            return text[key]

        def ints(key: str, default: Sequence[int] = ()) -> tuple[int, ...]:
            value = text.get(key)
            return tuple(int(v) for v in (default if value is None else value))

        n_layers = int(need("num_hidden_layers"))
        n_mtp = int(text.get("num_nextn_predict_layers", 0))
        ratios = ints("compress_ratios")
        if len(ratios) < n_layers:
            raise ValueError(f"compress_ratios has {len(ratios)} entries for {n_layers} layers")
        ratios = ratios[:n_layers] + (ratios[n_layers:] + (0,) * n_mtp)[:n_mtp]
        vision = None
        if vision_cfg and int(vision_cfg.get("num_hidden_layers", 0)) > 0:
            vision = VisionShape(
                n_layers=int(vision_cfg["num_hidden_layers"]),
                dim=int(vision_cfg.get("hidden_size", 1024)),
                n_heads=int(vision_cfg.get("num_attention_heads", 16)),
                inter_dim=int(vision_cfg.get("intermediate_size", 2816)),
                patch_size=int(vision_cfg.get("patch_size", 14)),
                downsample_ratio=int(vision_cfg.get("downsample_ratio", 3)),
            )
        if quant:
            if quant.get("quant_method", "fp8") != "fp8":
                raise ValueError(f"quantization_config quant_method {quant.get('quant_method')!r} is not fp8")
            block = tuple(int(b) for b in quant.get("weight_block_size", (32, 32)))
            linear_dtype = FP8
            expert_dtype = FP4 if quant.get("expert_dtype", text.get("expert_dtype")) == "fp4" else FP8
        else:
            block = (32, 32)
            linear_dtype = PLAIN
            expert_dtype = FP4 if text.get("expert_dtype") == "fp4" else PLAIN
        if len(block) != 2:
            raise ValueError(f"weight_block_size must have two entries, got {list(block)}")
        engram_layers = ints("engram_layer_ids")
        return cls(
            vocab_size=int(need("vocab_size")),
            hidden_size=int(need("hidden_size")),
            num_hidden_layers=n_layers,
            num_attention_heads=int(need("num_attention_heads")),
            head_dim=int(need("head_dim")),
            q_lora_rank=int(need("q_lora_rank")),
            o_groups=int(need("o_groups")),
            o_lora_rank=int(need("o_lora_rank")),
            moe_intermediate_size=int(need("moe_intermediate_size")),
            n_routed_experts=int(need("n_routed_experts")),
            n_shared_experts=int(text.get("n_shared_experts", 1)),
            compress_ratios=ratios,
            kv_source_layer_ids=ints("kv_source_layer_ids"),
            index_source_layer_ids=ints("index_source_layer_ids"),
            index_n_heads=int(text.get("index_n_heads", 32)),
            index_head_dim=int(text.get("index_head_dim", 128)),
            hc_mult=int(text.get("hc_mult", 4)),
            engram_layer_ids=engram_layers,
            engram_num_embeddings=ints("engram_num_embeddings", (0,) * len(engram_layers)),
            engram_max_ngram_size=int(text.get("engram_max_ngram_size", 4)),
            engram_n_heads=int(text.get("engram_n_heads", 8)),
            engram_head_dim=int(text.get("engram_head_dim", 256)),
            num_nextn_predict_layers=n_mtp,
            dspark_block_size=int(text.get("dspark_block_size", 0)),
            dspark_target_layer_ids=ints("dspark_target_layer_ids"),
            dspark_markov_rank=int(text.get("dspark_markov_rank", 256)),
            dspark_n_routed_experts=int(text.get("dspark_n_routed_experts", 0)),
            vision=vision,
            linear_dtype=linear_dtype,
            expert_dtype=expert_dtype,
            weight_block=(block[0], block[1]),
        )

    def validate(self) -> None:
        n = self.num_hidden_layers
        for key in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids"):
            bad = [i for i in getattr(self, key) if not 0 <= i < n]
            if bad:
                raise ValueError(f"{key} {bad} out of range [0, {n})")
        if len(self.engram_num_embeddings) != len(self.engram_layer_ids):
            raise ValueError("engram_num_embeddings needs one entry per engram layer")
        no_ratio = [i for i in (*self.kv_source_layer_ids, *self.index_source_layer_ids) if not self.compress_ratios[i]]
        if no_ratio:
            raise ValueError(f"source layers {no_ratio} have compress ratio 0")
        if self.n_shared_experts != 1:
            raise ValueError(f"n_shared_experts must be 1 (the official model), got {self.n_shared_experts}")
        if self.engram_layer_ids and self.engram_head_dim % FP4_BLOCK:
            raise ValueError(f"engram_head_dim {self.engram_head_dim} is not a multiple of 32")


# ---------------------------------------------------------------------- layout


class _Builder:
    def __init__(self, cfg: LayoutConfig) -> None:
        self.cfg = cfg
        self.specs: list[TensorSpec] = []

    def plain(self, name: str, shape: Sequence[int], dtype: str = "BF16", group: str = TEXT) -> None:
        self.specs.append(TensorSpec(name, tuple(shape), dtype, group))

    def quantized(self, name: str, out_f: int, in_f: int, quant: str, group: str,
                  block: tuple[int, int] | None = None) -> None:
        """A ``[out_f, in_f]`` weight stored as ``quant`` (PLAIN: bf16, no scale)."""
        if quant == PLAIN:
            self.plain(name + ".weight", (out_f, in_f), "BF16", group)
            return
        if quant == FP4:
            if in_f % FP4_BLOCK:
                raise ValueError(f"{name}: FP4 needs in_features divisible by {FP4_BLOCK}, got {in_f}")
            block = (1, FP4_BLOCK)
            stored, dtype = (out_f, in_f // 2), "I8"
        else:
            block = block or self.cfg.weight_block
            stored, dtype = (out_f, in_f), "F8_E4M3"
        scale = (-(-out_f // block[0]), -(-in_f // block[1]))
        self.specs.append(TensorSpec(name + ".weight", stored, dtype, group, quant, block, (out_f, in_f)))
        self.specs.append(TensorSpec(name + ".scale", scale, "F8_E8M0", group, SCALE, block))

    def linear(self, name: str, out_f: int, in_f: int, group: str) -> None:
        self.quantized(name, out_f, in_f, self.cfg.linear_dtype, group)

    def block(self, prefix: str, layer_id: int, group: str) -> None:
        """One transformer block (``layers.N.`` or a DSpark stage ``mtp.K.``)."""
        cfg = self.cfg
        d, m = cfg.hidden_size, cfg.hc_mult
        backbone = layer_id < cfg.num_hidden_layers
        ratio = cfg.compress_ratios[layer_id]
        p = prefix
        self.plain(p + "attn_norm.weight", (d,), group=group)
        self.plain(p + "ffn_norm.weight", (d,), group=group)
        for site in ("attn", "ffn"):
            self.plain(f"{p}hc_{site}_fn", ((2 + m) * m, m * d), "F32", group)
            self.plain(f"{p}hc_{site}_base", ((2 + m) * m,), "F32", group)
            self.plain(f"{p}hc_{site}_scale", (3,), "F32", group)
        self._attention(p + "attn.", layer_id, ratio, backbone, group)
        self._moe(p + "ffn.", backbone, group)
        if backbone and layer_id in cfg.engram_layer_ids:
            self._engram(p + "engram.", layer_id, group)

    def _attention(self, a: str, layer_id: int, ratio: int, backbone: bool, group: str) -> None:
        cfg = self.cfg
        d, heads, hd, qr = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank
        self.plain(a + "attn_sink", (heads,), "F32", group)
        self.linear(a + "wq_a", qr, d, group)
        self.plain(a + "q_norm.weight", (qr,), group=group)
        self.linear(a + "wq_b", heads * hd, qr, group)
        self.linear(a + "wkv", hd, d, group)
        self.plain(a + "kv_norm.weight", (hd,), group=group)
        self.plain(a + "wo_a.weight", (cfg.o_groups * cfg.o_lora_rank, heads * hd // cfg.o_groups), group=group)
        self.linear(a + "wo_b", d, cfg.o_groups * cfg.o_lora_rank, group)
        if not backbone:
            return
        if layer_id in cfg.kv_source_layer_ids:
            c = a + "compressor."
            self.plain(c + "norm.weight", (hd,), group=group)
            self.plain(c + "wkv.weight", (hd, d), group=group)
            if ratio > 1:
                self.plain(c + "wgate.weight", (hd, d), group=group)
        if layer_id in cfg.index_source_layer_ids:
            i = a + "indexer."
            ih, idim = cfg.index_n_heads, cfg.index_head_dim
            self.linear(i + "wq_b", ih * idim, qr, group)
            self.plain(i + "weights_proj.weight", (ih, d), group=group)
            if layer_id in cfg.kv_source_layer_ids:  # only a KV source owns the index keys
                self.plain(i + "wk.weight", (idim, hd), group=group)
                self.plain(i + "k_norm.weight", (idim,), group=group)

    def _moe(self, f: str, backbone: bool, group: str) -> None:
        cfg = self.cfg
        d, inter = cfg.hidden_size, cfg.moe_intermediate_size
        experts = cfg.n_routed_experts if backbone else (cfg.dspark_n_routed_experts or cfg.n_routed_experts)
        self.plain(f + "gate.weight", (experts, d), group=group)
        self.plain(f + "gate.bias", (experts,), "F32", group)
        if cfg.vision is not None:
            self.plain(f + "gate.bias_vl", (experts,), "F32", VISION if group == TEXT else group)
        for e in range(experts):
            self.quantized(f"{f}experts.{e}.w1", inter, d, cfg.expert_dtype, group)
            self.quantized(f"{f}experts.{e}.w2", d, inter, cfg.expert_dtype, group)
            self.quantized(f"{f}experts.{e}.w3", inter, d, cfg.expert_dtype, group)
        self.linear(f + "shared_experts.w1", inter, d, group)
        self.linear(f + "shared_experts.w2", d, inter, group)
        self.linear(f + "shared_experts.w3", inter, d, group)

    def _engram(self, g: str, layer_id: int, group: str) -> None:
        cfg = self.cfg
        rows = cfg.engram_num_embeddings[cfg.engram_layer_ids.index(layer_id)]
        self.quantized(g + "embed", rows, cfg.engram_head_dim, FP8, group, block=(1, cfg.weight_block[1]))
        hash_cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        self.linear(g + "wkv", cfg.hidden_size * (cfg.hc_mult + 1), hash_cols * cfg.engram_head_dim, group)
        self.plain(g + "q_weight", (cfg.hc_mult, cfg.hidden_size), group=group)
        self.plain(g + "k_weight", (cfg.hc_mult, cfg.hidden_size), group=group)

    def dspark(self) -> None:
        cfg = self.cfg
        if not cfg.dspark_block_size:
            return  # the reference builds no draft stages
        d, n_mtp = cfg.hidden_size, cfg.num_nextn_predict_layers
        for stage in range(n_mtp):
            p = f"mtp.{stage}."
            self.block(p, cfg.num_hidden_layers + stage, DSPARK)
            if stage == 0:
                self.linear(p + "main_proj", d, d * len(cfg.dspark_target_layer_ids), DSPARK)
                self.plain(p + "main_norm.weight", (d,), group=DSPARK)
            if stage == n_mtp - 1:
                rank = cfg.dspark_markov_rank
                self.plain(p + "norm.weight", (d,), group=DSPARK)
                self.plain(p + "markov_head.embed.weight", (cfg.vocab_size, rank), group=DSPARK)
                self.plain(p + "markov_head.head.weight", (cfg.vocab_size, rank), group=DSPARK)
                self.plain(p + "confidence_head.proj.weight", (1, d + rank), group=DSPARK)

    def vision(self) -> None:
        v = self.cfg.vision
        if v is None:
            return
        patch_in = 3 * v.patch_size**2
        self.plain("vision.patch_embed.proj.weight", (v.dim, patch_in), group=VISION)
        self.plain("vision.patch_embed.proj.bias", (v.dim,), group=VISION)
        for n in range(v.n_layers):
            b = f"vision.blocks.{n}."
            self.plain(b + "norm1.weight", (v.dim,), "F32", VISION)
            self.plain(b + "attn.wqkv.weight", (3 * v.dim, v.dim), group=VISION)
            self.plain(b + "attn.wqkv.bias", (3 * v.dim,), group=VISION)
            self.plain(b + "attn.wo.weight", (v.dim, v.dim), group=VISION)
            self.plain(b + "attn.wo.bias", (v.dim,), group=VISION)
            self.plain(b + "norm2.weight", (v.dim,), "F32", VISION)
            self.plain(b + "mlp.w1.weight", (2 * v.inter_dim, v.dim), group=VISION)
            self.plain(b + "mlp.w2.weight", (v.dim, v.inter_dim), group=VISION)
        self.plain("vision.norm.weight", (v.dim,), "F32", VISION)
        d = self.cfg.hidden_size
        self.plain("aligner.w1.weight", (d, v.dim * v.downsample_ratio**2), group=VISION)
        self.plain("aligner.w1.bias", (d,), group=VISION)
        self.plain("aligner.w2.weight", (d, d), group=VISION)
        self.plain("aligner.w2.bias", (d,), group=VISION)
        for which in ("image_start", "image_end", "image_newline"):
            self.plain(which, (d,), group=VISION)


class CheckpointLayout:
    """The official checkpoint's tensors for one config, in a fixed order (top level, the
    layers in order, DSpark stages, vision)."""

    def __init__(self, config: Mapping | LayoutConfig) -> None:
        cfg = config if isinstance(config, LayoutConfig) else LayoutConfig.from_config(config)
        cfg.validate()
        self.config = cfg
        build = _Builder(cfg)
        d = cfg.hidden_size
        build.plain("embed.weight", (cfg.vocab_size, d))
        for layer in range(cfg.num_hidden_layers):
            build.block(f"layers.{layer}.", layer, TEXT)
        build.plain("norm.weight", (d,))
        build.plain("head.weight", (cfg.vocab_size, d))
        build.dspark()
        build.vision()
        self.specs: tuple[TensorSpec, ...] = tuple(build.specs)
        self._by_name = {spec.name: spec for spec in self.specs}
        if len(self._by_name) != len(self.specs):
            raise AssertionError("duplicate tensor names in the layout")

    def __iter__(self) -> Iterator[TensorSpec]:
        return iter(self.specs)

    def __len__(self) -> int:
        return len(self.specs)

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def __getitem__(self, name: str) -> TensorSpec:
        return self._by_name[name]

    def select(self, groups: Iterable[str] = (TEXT,)) -> list[TensorSpec]:
        wanted = set(groups)
        unknown = wanted - set(GROUPS)
        if unknown:
            raise ValueError(f"unknown tensor groups {sorted(unknown)}; known: {list(GROUPS)}")
        return [spec for spec in self.specs if spec.group in wanted]

    def nbytes(self, groups: Iterable[str] = GROUPS) -> int:
        return sum(spec.nbytes for spec in self.select(groups))


_VISION_NAME = re.compile(r"^(vision\.|aligner\.|image_(start|end|newline)$)|\.gate\.bias_vl$")


def skippable_group(name: str) -> str | None:
    """VISION or DSPARK for a tensor of those parts (listed in a layout or not), else None."""
    if name.startswith("mtp."):
        return DSPARK
    if _VISION_NAME.search(name):
        return VISION
    return None


# ---------------------------------------------------------------------- HF names


def hf_name(official: str) -> str:
    """The name HF transformers' ``save_pretrained`` gives an official tensor."""
    if official == "head.weight":
        return "lm_head.weight"
    return "model." + official


def official_name(stored: str) -> str:
    """Official name of a stored tensor in either spelling (identity on official names).
    ``weight_scale_inv`` (HF's FP8 scale name) is read as ``scale``."""
    if stored.startswith("lm_head."):
        stored = "head." + stored.removeprefix("lm_head.")
    stored = stored.removeprefix("model.")
    if stored.endswith(".weight_scale_inv"):
        stored = stored.removesuffix("weight_scale_inv") + "scale"
    return stored
