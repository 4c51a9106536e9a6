"""V4.1 weights from a ``{official tensor name: tensor}`` dict, grouped per layer.

The names are the official checkpoint's (``layers.N.attn.wq_a.weight``,
``layers.N.ffn.experts.E.w1.weight``, ``layers.N.engram.embed.weight``,
``embed.weight``, ``head.weight``); a Hugging Face ``save_pretrained`` file
uses the same names behind ``model.``, with ``lm_head`` for ``head``
(:func:`official_names` maps them back).  Every tensor arrives decoded to
float (the official FP8/FP4 reader decodes), with two exceptions: an Engram
table may stay FP8 with its per-row scales, since the release tables are far
too large to widen (they stay in host memory, where they are, whatever the
device of the rest), and with ``stored_weights`` the FP8 linears (e4m3 values with
e8m0 scales per 32 x 32) and the routed experts' FP4 codes and e8m0 scales that
arrive as stored stay so (:class:`Fp8Weight`, :class:`Mxfp4Matrices` banks, read by
V4's kernels in ``ds4d.cuda.quant_matmul``).  The tensors are read one at a time, by name, so a
mapping that decodes on access keeps one decoded tensor in host memory at once.
Names this forward does not use (DSpark ``mtp.*``, the vision tower, the image
delimiters, ``bias_vl``) are ignored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from ds4d.models.deepseek_v4.quant import as_bytes, dequant_mxfp4
from ds4d.models.deepseek_v4.stored import Fp8Weight, Linear, Mxfp4Matrices
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
    wq_b: Linear
    weights_proj: torch.Tensor
    wk: torch.Tensor | None
    """Only at a KV source, which derives its group's index keys from the compressor latents."""
    k_norm: torch.Tensor | None


@dataclass(frozen=True)
class AttentionWeights:
    wq_a: Linear
    """FP8 in the release, like ``wq_b``, ``wkv`` and ``wo_b``: decoded, or as stored (``Fp8Weight``)."""
    q_norm: torch.Tensor
    wq_b: Linear
    wkv: Linear
    kv_norm: torch.Tensor
    wo_a: torch.Tensor
    """``[o_groups * o_lora_rank, heads * head_dim / o_groups]``: one block per group."""
    wo_b: Linear
    sink: torch.Tensor
    compressor: CompressorWeights | None
    indexer: IndexerWeights | None


@dataclass(frozen=True)
class ExpertWeights:
    w1: Linear
    """The shared expert's are FP8 in the release (decoded, or as stored); a routed expert's decoded."""
    w2: Linear
    w3: Linear


Bank = torch.Tensor | Mxfp4Matrices
"""One projection of every routed expert: decoded ``[experts, out, in]``, or FP4 as stored (codes
``[experts, out, in/2]`` and e8m0 scales ``[experts, out, in/32]``, both uint8)."""


@dataclass(frozen=True)
class ExpertBanks:
    """Every routed expert's projections, one bank per projection; expert ``e`` is row ``e``."""

    w1: Bank
    """``[experts, intermediate, hidden]`` (the gate branch)."""
    w2: Bank
    """``[experts, hidden, intermediate]``."""
    w3: Bank
    """``[experts, intermediate, hidden]`` (the up branch)."""
    dtype: torch.dtype = torch.float32
    """The activations' dtype (what a stored bank decodes to)."""

    @property
    def stored(self) -> bool:
        """Whether the banks hold FP4 as stored."""
        return isinstance(self.w1, Mxfp4Matrices)

    @property
    def experts(self) -> int:
        return (self.w1.packed if self.stored else self.w1).shape[0]

    def expert(self, e: int) -> ExpertWeights:
        """Expert ``e``'s three matrices, decoded when the banks hold FP4 (exact: every e2m1 value
        times a power of two is a bf16 value)."""
        def one(bank: Bank) -> torch.Tensor:
            if isinstance(bank, Mxfp4Matrices):
                return dequant_mxfp4(bank.packed[e], bank.scales[e]).to(self.dtype)
            return bank[e]
        return ExpertWeights(one(self.w1), one(self.w2), one(self.w3))

    def stored_bytes(self) -> int:
        """Bytes the three banks take (codes and scales, or decoded values)."""
        total = 0
        for bank in (self.w1, self.w2, self.w3):
            parts = (bank.packed, bank.scales) if isinstance(bank, Mxfp4Matrices) else (bank,)
            total += sum(part.nbytes for part in parts)
        return total


@dataclass(frozen=True)
class MoEWeights:
    gate: torch.Tensor
    bias: torch.Tensor
    """Added to the scores for choosing experts only."""
    banks: ExpertBanks | None
    """The routed experts (``banks.expert(e)``: expert ``e``'s three matrices); None when an expert
    offload holds them (``offload.py``)."""
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

    def parameter_bytes(self) -> int:
        """Bytes of every weight as held, the Engram tables (in host memory) left out."""
        tables = {id(part) for layer in self.layers if layer.engram is not None
                  for part in (layer.engram.table, layer.engram.table_scale) if part is not None}
        return sum(t.nbytes for t in tensors_of(self) if id(t) not in tables)


def tensors_of(obj):
    """Every tensor reachable through a weights dataclass (or tuple of them)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif dataclasses.is_dataclass(obj):
        for field in dataclasses.fields(obj):
            yield from tensors_of(getattr(obj, field.name))
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from tensors_of(item)


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
    def __init__(self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype, device, stored: bool = False) -> None:
        self.tensors, self.dtype, self.device, self.stored = tensors, dtype, device, stored
        self.names = {official: name for official, name in zip(official_names(dict.fromkeys(tensors)), tensors)}
        """Official name -> the mapping's key (no tensor is read to build it)."""
        self.used: set[str] = set()

    def __call__(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.host(name).to(device=self.device, dtype=dtype or self.dtype)

    def host(self, name: str) -> torch.Tensor:
        """As stored and where it is (Engram tables stay in host memory, whatever the device)."""
        if name not in self.names:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        self.used.add(name)
        return self.tensors[self.names[name]]

    def has(self, name: str) -> bool:
        return name in self.names

    def linear(self, name: str) -> Linear:
        """A linear's weight: FP8 as stored (with its scales) when reading stored weights and the
        checkpoint holds it so, else decoded to the model's dtype."""
        weight = self.host(name)
        if not (self.stored and weight.dtype == torch.float8_e4m3fn):
            return weight.to(device=self.device, dtype=self.dtype)  # read once: a lookup may decode
        scale = self.host(name.removesuffix("weight") + "scale")
        data = weight.to(self.device)
        return Fp8Weight.from_stored(data, scale.to(self.device), self.dtype, block=square_block(weight, scale))


def square_block(weight: torch.Tensor, scale: torch.Tensor) -> int:
    """The edge of the square blocks a ``scale`` grid covers ``weight`` with (V4: 128, V4.1: 32)."""
    out_f, in_f = weight.shape
    for block in (16, 32, 64, 128):
        if tuple(scale.shape) == (-(-out_f // block), -(-in_f // block)):
            return block
    raise ValueError(f"scales {list(scale.shape)} fit no square block of a {list(weight.shape)} weight")


def _expert(read: _Reader, prefix: str) -> ExpertWeights:
    return ExpertWeights(*(read.linear(f"{prefix}.{part}.weight") for part in ("w1", "w2", "w3")))


def is_packed_fp4(tensor: torch.Tensor) -> bool:
    """Whether a routed expert's ``.weight`` is FP4 as the official checkpoint stores it (int8 pairs)."""
    return tensor.dtype in (torch.int8, torch.uint8)


def _banks(read: _Reader, prefix: str, experts: int, stored: bool, device=None) -> ExpertBanks:
    """Each projection of the ``experts`` routed experts copied into one bank on ``device`` (default the
    model's): FP4 codes and scales as stored when ``stored`` and the checkpoint holds them so, else
    decoded values (a packed expert handed over without ``stored`` is decoded here)."""
    device = read.device if device is None else device
    banks = {}
    for part in ("w1", "w2", "w3"):
        name = f"{prefix}.{{}}.{part}.{{}}"
        first = read.host(name.format(0, "weight"))
        if is_packed_fp4(first) and stored:
            scale = read.host(name.format(0, "scale"))
            codes = torch.empty(experts, *first.shape, dtype=torch.uint8, device=device)
            scales = torch.empty(experts, *scale.shape, dtype=torch.uint8, device=device)
            for e in range(experts):
                codes[e].copy_(as_bytes(first if e == 0 else read.host(name.format(e, "weight"))))
                scales[e].copy_(as_bytes(scale if e == 0 else read.host(name.format(e, "scale"))))
            banks[part] = Mxfp4Matrices(codes, scales)
            continue
        shape = (first.shape[0], 2 * first.shape[1]) if is_packed_fp4(first) else first.shape
        bank = torch.empty(experts, *shape, dtype=read.dtype, device=device)
        for e in range(experts):
            weight = first if e == 0 else read.host(name.format(e, "weight"))  # each read once
            if is_packed_fp4(weight):
                weight = dequant_mxfp4(weight, read.host(name.format(e, "scale")))
            bank[e].copy_(weight)
        banks[part] = bank
    return ExpertBanks(**banks, dtype=read.dtype)


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
            wq_b=read.linear(f"{p}.indexer.wq_b.weight"),
            weights_proj=read(f"{p}.indexer.weights_proj.weight"),
            wk=read(f"{p}.indexer.wk.weight") if plan.is_kv_source else None,
            k_norm=read(f"{p}.indexer.k_norm.weight") if plan.is_kv_source else None,
        )
    return AttentionWeights(
        wq_a=read.linear(f"{p}.wq_a.weight"), q_norm=read(f"{p}.q_norm.weight"),
        wq_b=read.linear(f"{p}.wq_b.weight"), wkv=read.linear(f"{p}.wkv.weight"),
        kv_norm=read(f"{p}.kv_norm.weight"), wo_a=read(f"{p}.wo_a.weight"),
        wo_b=read.linear(f"{p}.wo_b.weight"), sink=read(f"{p}.attn_sink", torch.float32),
        compressor=compressor, indexer=indexer,
    )


def _engram(read: _Reader, layer: int) -> EngramWeights:
    p = f"layers.{layer}.engram"
    table = read.host(f"{p}.embed.weight")
    scale = read.host(f"{p}.embed.scale") if read.has(f"{p}.embed.scale") else None
    if table.dtype != torch.float8_e4m3fn:
        table, scale = table.to(dtype=read.dtype), None  # a float table holds the decoded values already
    return EngramWeights(
        table=table, table_scale=scale, wkv=read.linear(f"{p}.wkv.weight"),
        gate_weight=read(f"{p}.q_weight", torch.float32) * read(f"{p}.k_weight", torch.float32),
    )


def build_weights(cfg: DeepseekV41Config, tensors: Mapping[str, torch.Tensor], *,
                  dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                  stored_weights: bool = False,
                  expert_sink: Callable[[int, ExpertBanks], None] | None = None) -> ModelWeights:
    """Group the mapping's tensors by layer, reading each once; a missing tensor raises ``KeyError``
    naming it.  ``stored_weights``: FP8 linears and routed experts handed over as stored (e4m3 values
    or FP4 codes under ``.weight``, e8m0 scales under ``.scale``) stay so; otherwise they are decoded.
    ``expert_sink``: each layer's routed experts are built in host memory and handed to it, layer by
    layer (``offload.ExpertSink``), and the layer keeps none (``MoEWeights.banks`` None)."""
    read = _Reader(tensors, dtype, device, stored_weights)
    layers = []
    for i, plan in enumerate(cfg.plan()):
        p = f"layers.{i}"
        banks = _banks(read, f"{p}.ffn.experts", cfg.n_routed_experts, stored_weights,
                       device="cpu" if expert_sink is not None else None)
        if expert_sink is not None:
            expert_sink(i, banks)
            banks = None
        ffn = MoEWeights(
            gate=read(f"{p}.ffn.gate.weight", torch.float32),
            bias=read(f"{p}.ffn.gate.bias", torch.float32),
            banks=banks,
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
