"""The ``llama`` family's weights from a GGUF file: its hyper-parameters, the layers' linears in the
chosen format (dense float, or int4 blocks kept as stored), the model's ``ModelInfo``.

GGUF stores the Q and K rows of each head interleaved for its RoPE; they are put back in
rotate-half order here, and the attention scale is folded into Q.  Q, K and V are fused into
one linear, and so are the FFN's gate and up projections.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from ds4d.contracts import ModelInfo
from ds4d.models.cpu_linear import BlockPlanes, DenseLinear, Int4Linear, int4_kernel_available, tensor_planes
from ds4d.models.gguf_file import GGUFFile
from ds4d.models.gguf_tokenizer import GGUFTokenizer

BLOCK_SIZE_TOKENS = 16
WEIGHT_FORMATS = ("dense", "int4", "auto")
Linear = DenseLinear | Int4Linear


@dataclass(frozen=True)
class LlamaHParams:
    n_layers: int
    hidden: int
    ffn: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_base: float
    rope_scale: float
    norm_eps: float
    context_length: int

    @classmethod
    def from_gguf(cls, gguf_file: GGUFFile) -> LlamaHParams:
        hidden = int(gguf_file.arch_get("embedding_length"))
        n_heads = int(gguf_file.arch_get("attention.head_count"))
        head_dim = int(gguf_file.arch_get("attention.key_length", hidden // n_heads))
        rope_dims = int(gguf_file.arch_get("rope.dimension_count", head_dim))
        if rope_dims != head_dim:
            raise NotImplementedError(f"partial rotary embedding ({rope_dims} of {head_dim} dims)")
        scaling = gguf_file.arch_get("rope.scaling.type", "none")
        if scaling not in ("none", "linear"):
            raise NotImplementedError(f"rope scaling {scaling!r}")
        factor = float(gguf_file.arch_get("rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0
        return cls(
            n_layers=int(gguf_file.arch_get("block_count")),
            hidden=hidden,
            ffn=int(gguf_file.arch_get("feed_forward_length")),
            n_heads=n_heads,
            n_kv_heads=int(gguf_file.arch_get("attention.head_count_kv", n_heads)),
            head_dim=head_dim,
            rope_base=float(gguf_file.arch_get("rope.freq_base", 10000.0)),
            rope_scale=factor or 1.0,
            norm_eps=float(gguf_file.arch_get("attention.layer_norm_rms_epsilon", 1e-5)),
            context_length=int(gguf_file.arch_get("context_length", 2048)),
        )


@dataclass(frozen=True)
class LayerWeights:
    attn_norm: torch.Tensor
    qkv: Linear
    """hidden -> (n_heads + 2 n_kv_heads) head_dim: Q, K, V columns."""
    out: Linear
    ffn_norm: torch.Tensor
    gate_up: Linear
    """hidden -> 2 ffn: gate columns, then up columns."""
    down: Linear


def _rope_unpermute(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """GGUF's per-head interleaved Q/K rows -> rotate-half order."""
    rows, cols = weight.shape
    head_dim = rows // n_heads
    return weight.reshape(n_heads, head_dim // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def _fix_rows(weight: torch.Tensor, rotary_heads: int, factor: float) -> torch.Tensor:
    weight = _rope_unpermute(weight, rotary_heads) if rotary_heads else weight
    return weight * factor if factor != 1.0 else weight


def _fix_planes(planes: BlockPlanes, rotary_heads: int, factor: float) -> BlockPlanes:
    planes = planes.map_rows(lambda t: _rope_unpermute(t, rotary_heads)) if rotary_heads else planes
    return planes.scaled(factor) if factor != 1.0 else planes



def resolve_weight_format(requested: str, gguf_file: GGUFFile, device: torch.device) -> str:
    """``dense`` or ``int4``; ``auto`` is int4 for files whose layer matrices are mostly Q4_0/Q4_1, on the CPU."""
    if requested not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format {requested!r} is not one of {', '.join(WEIGHT_FORMATS)}")
    int4_usable = device.type == "cpu" and int4_kernel_available()
    if requested == "int4" and not int4_usable:
        raise ValueError(f"weight_format int4 needs torch's CPU int4 kernel; device is {device}")
    if requested != "auto":
        return requested
    types = [t.quant_type for t in gguf_file.tensor_infos() if t.name.startswith("blk.") and len(t.shape) == 2]
    mostly_q4 = 2 * sum(t in ("Q4_0", "Q4_1") for t in types) > len(types)
    return "int4" if int4_usable and mostly_q4 else "dense"


@dataclass(frozen=True)
class LlamaWeights:
    """What a ``LlamaModel`` is built from."""

    info: ModelInfo
    tokenizer: GGUFTokenizer
    hp: LlamaHParams
    embed: torch.Tensor
    layers: list[LayerWeights]
    output_norm: torch.Tensor
    head: Linear
    freq_factors: torch.Tensor | None


def read_weights(
    gguf_file: GGUFFile, dtype: torch.dtype, device: torch.device, weight_format: str, log: logging.Logger
) -> LlamaWeights:
    """The file's weights in ``weight_format`` (``dense`` or ``int4``) on ``device``, and the model's info."""
    hp = LlamaHParams.from_gguf(gguf_file)
    tokenizer = GGUFTokenizer.from_gguf(gguf_file, log)

    def dense(name: str) -> torch.Tensor:
        return gguf_file.tensor(name, torch.float32)

    def place(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype).contiguous().to(device)

    def linear(*parts: tuple[str, int, float], preloaded: torch.Tensor | None = None) -> Linear:
        """Fused ``(tensor name, rotary heads to un-permute or 0, factor)`` parts in the chosen format."""
        if weight_format == "int4":
            planes = [tensor_planes(gguf_file, name) for name, _, _ in parts]
            if all(p is not None for p in planes):
                return Int4Linear([_fix_planes(p, heads, k) for p, (_, heads, k) in zip(planes, parts)])
        weights = [preloaded if preloaded is not None else dense(name) for name, _, _ in parts]
        return DenseLinear([_fix_rows(w, heads, k) for w, (_, heads, k) in zip(weights, parts)], dtype, device)

    q_scale = 1.0 / math.sqrt(hp.head_dim)
    layers = []
    for i in range(hp.n_layers):
        prefix = f"blk.{i}."
        layers.append(
            LayerWeights(
                attn_norm=place(dense(prefix + "attn_norm.weight")),
                qkv=linear(
                    (prefix + "attn_q.weight", hp.n_heads, q_scale),
                    (prefix + "attn_k.weight", hp.n_kv_heads, 1.0),
                    (prefix + "attn_v.weight", 0, 1.0),
                ),
                out=linear((prefix + "attn_output.weight", 0, 1.0)),
                ffn_norm=place(dense(prefix + "ffn_norm.weight")),
                gate_up=linear((prefix + "ffn_gate.weight", 0, 1.0), (prefix + "ffn_up.weight", 0, 1.0)),
                down=linear((prefix + "ffn_down.weight", 0, 1.0)),
            )
        )
    embed_f32 = dense("token_embd.weight")
    if gguf_file.has_tensor("output.weight"):
        head = linear(("output.weight", 0, 1.0))
    else:  # tied embedding
        head = linear(("token_embd.weight", 0, 1.0), preloaded=embed_f32)
    vocab_rows = head.out_features
    embed = place(embed_f32)
    del embed_f32
    output_norm = place(dense("output_norm.weight"))

    itemsize = torch.tensor([], dtype=dtype).element_size()
    cache_bytes_per_block = 2 * hp.n_layers * BLOCK_SIZE_TOKENS * hp.n_kv_heads * hp.head_dim * itemsize
    tensors = [embed, output_norm]
    linears = [head]
    for layer in layers:
        tensors += [layer.attn_norm, layer.ffn_norm]
        linears += [layer.qkv, layer.out, layer.gate_up, layer.down]
    info = ModelInfo(
        family="llama",
        name=str(gguf_file.get("general.name") or gguf_file.path.stem),
        vocab_size=vocab_rows,
        max_context_tokens=hp.context_length,
        block_size_tokens=BLOCK_SIZE_TOKENS,
        cache_bytes_per_block=cache_bytes_per_block,
        default_chat_encoder="jinja",
        chat_template=gguf_file.get("tokenizer.chat_template"),
        dtype=str(dtype).removeprefix("torch."),
        device=str(device),
        parameter_bytes=sum(t.numel() * t.element_size() for t in tensors) + sum(lin.n_bytes for lin in linears),
        extra={
            "path": str(gguf_file.path),
            "n_layers": hp.n_layers,
            "n_heads": hp.n_heads,
            "n_kv_heads": hp.n_kv_heads,
            "head_dim": hp.head_dim,
            "file_type": gguf_file.get("general.file_type"),
            "weight_format": weight_format,
        },
    )
    log.info(
        "loaded %s: %d layers, hidden %d, vocab %d, %s weights, %s activations on %s (%.0f MiB)",
        info.name,
        hp.n_layers,
        hp.hidden,
        vocab_rows,
        weight_format,
        info.dtype,
        info.device,
        info.parameter_bytes / 2**20,
    )
    freq_factors = dense("rope_freqs.weight") if gguf_file.has_tensor("rope_freqs.weight") else None
    return LlamaWeights(info, tokenizer, hp, embed, layers, output_norm, head, freq_factors)
