"""The model's parameters as plain tensors, grouped the way the forward pass uses them.

The forward pass is written as functions over these records rather than as
``nn.Module`` trees: the serving path owns its caches explicitly, and a flat
record per sub-layer keeps the weight layout (and its memory) obvious.  Routed
experts are stacked per layer (``w1``/``w3``: ``[E, I, D]``, ``w2``: ``[E, D, I]``);
each expert is decoded straight into its slot, so a layer never exists twice.

With ``native`` weights (a CUDA device, bf16) the dense FP8 linears stay FP8
(:class:`Fp8Weight`) and MXFP4 expert banks stay packed (:class:`Mxfp4Matrices`);
the kernels of ``ds4d.cuda.quant_matmul`` read those bytes as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ds4d.models.deepseek_v4.config import CSA_RATIO, DeepseekV4Config
from ds4d.models.deepseek_v4.loader import CheckpointError, WeightReader
from ds4d.models.deepseek_v4.quant import dequant_fp8_block, dequant_mxfp4
from ds4d.models.deepseek_v4.stored import (
    Fp8Weight,
    GgufMatrices,
    GgufWeight,
    Linear,
    Mxfp4Matrices,
    fuse_rows,
    gguf_values,
)


@dataclass
class HyperWeights:
    fn: torch.Tensor  # [(2 + m) * m, m * D]
    base: torch.Tensor  # [(2 + m) * m]
    scale: torch.Tensor  # [3]
    fn_split: torch.Tensor | None = None  # ops.split_bf16(fn), where set (add_split_weights)


@dataclass
class CompressorWeights:
    wkv: torch.Tensor  # [c * d, D] float32, c = 2 when windows overlap
    wgate: torch.Tensor  # [c * d, D] float32
    ape: torch.Tensor  # [ratio, c * d]
    norm: torch.Tensor  # [d]
    ratio: int
    head_dim: int
    split: torch.Tensor | None = None  # ops.split_bf16 of wkv and wgate stacked, where set (add_split_weights)

    @property
    def overlap(self) -> bool:
        return self.ratio == CSA_RATIO


@dataclass
class IndexerWeights:
    wq_b: Linear  # [IH * ID, q_lora_rank]
    weights_proj: torch.Tensor  # [IH, D]
    compressor: CompressorWeights


@dataclass
class AttentionWeights:
    wq_a: Linear
    q_norm: torch.Tensor
    wq_b: Linear
    wkv: Linear
    kv_norm: torch.Tensor
    wo_a: torch.Tensor  # [G * o_lora_rank, H * hd / G] (bf16 in the release)
    wo_b: Linear
    sink: torch.Tensor  # [H], float32
    ratio: int
    compressor: CompressorWeights | None = None
    indexer: IndexerWeights | None = None
    wq_a_wkv: GgufWeight | Fp8Weight | None = None  # stored.fuse_rows(wq_a, wkv): both GGUF blocks of one form, or FP8


@dataclass
class ExpertBank:
    """One layer's routed experts as stored: ``kind`` is ``mxfp4``, ``fp8``, ``float`` or ``gguf``.

    ``weights[w]`` stacks expert matrices ``w`` in (w1, w2, w3) over experts
    (packed bytes for mxfp4 / fp8, model-dtype values for float) and
    ``scales[w]`` their ue8m0 scale bytes."""

    kind: str
    weights: dict[str, torch.Tensor]
    scales: dict[str, torch.Tensor]
    dtype: torch.dtype
    block: tuple[int, int]
    gate_up: torch.Tensor | None = None
    """Float banks: ``[E, 2I, D]`` holding w1 over w3 (``weights["w1"]`` and ``["w3"]`` are views of it)."""
    native: tuple | None = None
    """Banks multiplied as stored: (w1 over w3, w2), MXFP4 (:class:`Mxfp4Matrices`) or, for ``gguf``, each
    :class:`GgufMatrices` or decoded ``[E, out, in]``; ``weights``/``scales`` are views of them."""
    gguf: dict[str, GgufMatrices] | None = None
    """``gguf`` banks: the matrices (w1, w2, w3) kept in their GGUF blocks (``weights`` holds their bytes);
    the others are decoded in ``weights``."""
    _dense_cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def weight(self, which: str, expert: int) -> torch.Tensor:
        """Expert ``expert``'s matrix ``which`` as ``[out, in]`` in the model dtype."""
        stored = self.weights[which][expert]
        if self.gguf and which in self.gguf:
            return gguf_values(stored, self.gguf[which].qtype, self.gguf[which].cols).to(self.dtype)
        if self.kind == "mxfp4":
            return dequant_mxfp4(stored, self.scales[which][expert]).to(self.dtype)
        if self.kind == "fp8":
            return dequant_fp8_block(stored, self.scales[which][expert], self.block).to(self.dtype)
        return stored

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up ``[E, 2I, D]``, down ``[E, D, I]``) in the model dtype, for grouped matmuls.

        Float banks answer with their own storage.  Quantised banks are decoded
        whole; banks under ``DENSE_CACHE_BYTES`` keep the decoded copy."""
        if self.gate_up is not None:
            return self.gate_up, self.weights["w2"]
        if self._dense_cache is not None:
            return self._dense_cache
        experts = range(self.weights["w1"].shape[0])
        gate_up = torch.stack([torch.cat([self.weight("w1", e), self.weight("w3", e)]) for e in experts])
        down = torch.stack([self.weight("w2", e) for e in experts])
        if (gate_up.numel() + down.numel()) * gate_up.element_size() <= DENSE_CACHE_BYTES:
            self._dense_cache = (gate_up, down)
        return gate_up, down


DENSE_CACHE_BYTES = 256 << 20


@dataclass
class MoEWeights:
    gate: torch.Tensor  # [E, D]
    bias: torch.Tensor | None  # [E] on score-routed layers
    tid2eid: torch.Tensor | None  # [V, k] on hash-routed layers
    experts: ExpertBank
    shared_w1: Linear
    shared_w2: Linear
    shared_w3: Linear
    gate_split: torch.Tensor | None = None  # ops.split_bf16(gate), where set (add_split_weights)
    shared_w13: GgufWeight | Fp8Weight | None = None  # stored.fuse_rows(shared_w1, shared_w3): GGUF blocks or FP8


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    attn_hc: HyperWeights
    ffn_hc: HyperWeights
    attn: AttentionWeights
    ffn: MoEWeights


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [V, D]
    norm: torch.Tensor
    head: torch.Tensor | GgufWeight  # [V, D], float32 (or a GGUF file's blocks: :func:`_head`)
    head_hc: HyperWeights  # fn [m, m * D], base [m], scale [1]
    layers: list[LayerWeights]

    def parameter_bytes(self) -> int:
        seen: set[int] = set()
        total = 0
        for tensor in _walk(self):
            if id(tensor) not in seen:
                seen.add(id(tensor))
                total += tensor.numel() * tensor.element_size()
        return total


def _walk(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _walk(item)
    elif isinstance(obj, dict):  # an expert bank's matrices
        for item in obj.values():
            yield from _walk(item)
    elif hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            if name not in _NOT_PARAMETERS:
                yield from _walk(getattr(obj, name))


_NOT_PARAMETERS = {"gate_up", "native", "gguf", "_dense_cache", "fn_split", "split", "gate_split", "wq_a_wkv",
                   "shared_w13"}
"""Views over, or copies of, tensors counted elsewhere."""


def add_split_weights(weights: ModelWeights) -> None:
    """Give the float32 weights that a prefill step multiplies by bf16 activations their
    ``ops.split_bf16`` form: the hyper-connections' ``fn``, the compressors' ``wkv`` and ``wgate``
    (stacked), the routers' ``gate``.  One bf16 matmul with float32 results then does what a
    float32 matmul of the widened activations did (16 of the weights' 24 mantissa bits kept),
    at as much device memory again as those weights take.  Weights already split are left as they are."""
    from ds4d.models.deepseek_v4.ops import split_bf16

    if weights.layers and weights.layers[0].ffn.gate_split is not None:
        return

    for layer in weights.layers:
        for hyper in (layer.attn_hc, layer.ffn_hc):
            hyper.fn_split = split_bf16(hyper.fn)
        attn = layer.attn
        for comp in (attn.compressor, attn.indexer.compressor if attn.indexer is not None else None):
            if comp is not None:
                comp.split = split_bf16(torch.cat([comp.wkv, comp.wgate]))
        layer.ffn.gate_split = split_bf16(layer.ffn.gate)


F32 = torch.float32


def _linear(reader: WeightReader, name: str) -> Linear:
    """A linear's weight: as stored (:class:`Fp8Weight`, :class:`GgufWeight`) when the reader keeps
    native weights and the weight is stored in a form a kernel reads, else decoded to the model dtype."""
    stored = reader.stored_linear(name) if getattr(reader, "native", False) else None
    return stored if stored is not None else reader.tensor(name)


def _head(reader: WeightReader) -> torch.Tensor | GgufWeight:
    """The output head: float32 values, or, from a reader keeping a GGUF file's blocks, its blocks
    multiplied in float32 (a q2 file's Q8_0 head: a quarter of the float32 bytes)."""
    stored = reader.stored_linear("head.weight") if getattr(reader, "native", False) else None
    if isinstance(stored, GgufWeight):
        return GgufWeight(stored.raw, stored.qtype, stored.cols, F32)
    return reader.tensor("head.weight", F32)


def _hyper(reader: WeightReader, prefix: str) -> HyperWeights:
    return HyperWeights(
        fn=reader.tensor(prefix + "fn", F32),
        base=reader.tensor(prefix + "base", F32),
        scale=reader.tensor(prefix + "scale", F32),
    )


def _compressor(reader: WeightReader, prefix: str, ratio: int, head_dim: int) -> CompressorWeights:
    return CompressorWeights(
        wkv=reader.tensor(prefix + "wkv.weight", F32),
        wgate=reader.tensor(prefix + "wgate.weight", F32),
        ape=reader.tensor(prefix + "ape", F32),
        norm=reader.tensor(prefix + "norm.weight", F32),
        ratio=ratio,
        head_dim=head_dim,
    )


def _attention(reader: WeightReader, cfg: DeepseekV4Config, layer: int) -> AttentionWeights:
    p = f"layers.{layer}.attn."
    ratio = cfg.compress_ratios[layer]
    weights = AttentionWeights(
        wq_a=_linear(reader, p + "wq_a.weight"),
        q_norm=reader.tensor(p + "q_norm.weight", F32),
        wq_b=_linear(reader, p + "wq_b.weight"),
        wkv=_linear(reader, p + "wkv.weight"),
        kv_norm=reader.tensor(p + "kv_norm.weight", F32),
        wo_a=reader.tensor(p + "wo_a.weight"),
        wo_b=_linear(reader, p + "wo_b.weight"),
        sink=reader.tensor(p + "attn_sink", F32),
        ratio=ratio,
    )
    weights.wq_a_wkv = fuse_rows(weights.wq_a, weights.wkv)
    if ratio:
        weights.compressor = _compressor(reader, p + "compressor.", ratio, cfg.head_dim)
    if ratio == CSA_RATIO:
        weights.indexer = IndexerWeights(
            wq_b=_linear(reader, p + "indexer.wq_b.weight"),
            weights_proj=reader.tensor(p + "indexer.weights_proj.weight"),
            compressor=_compressor(reader, p + "indexer.compressor.", ratio, cfg.index_head_dim),
        )
    return weights


def _experts(
    reader: WeightReader, cfg: DeepseekV4Config, layer: int, device: torch.device | None, experts: range | None = None
) -> ExpertBank:
    """Routed experts ``experts`` of ``layer`` (default all; local index 0 = ``experts[0]``) stacked as
    an :class:`ExpertBank`, on ``device`` when given (the host, for expert offload); a reader keeping
    native weights may answer with a whole bank of its own (``stored_bank``: GGUF blocks)."""
    if experts is None and getattr(reader, "native", False):
        stored = reader.stored_bank(layer, device)
        if stored is not None:
            return stored
    experts = range(cfg.n_routed_experts) if experts is None else experts
    count = len(experts)
    kind = None
    gate_up = None
    weights: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for which in ("w1", "w2", "w3"):
        for local, expert in enumerate(experts):
            this_kind, weight, scale = reader.expert_stored(layer, expert, which)
            if device is not None:
                weight, scale = weight.to(device), scale.to(device) if scale is not None else None
            if kind is None:
                kind = this_kind
            if this_kind != kind:
                raise CheckpointError(f"layer {layer}: routed experts mix {kind} and {this_kind} storage")
            if which not in weights:  # stacked storage, filled one expert at a time
                if this_kind == "float" and which == "w3":  # w1 over w3 in one tensor, as grouped matmuls want
                    gate_up = weight.new_empty((count, 2 * weight.shape[0], weight.shape[1]))
                    gate_up[:, : weight.shape[0]] = weights["w1"]
                    weights["w1"], weights["w3"] = gate_up[:, : weight.shape[0]], gate_up[:, weight.shape[0] :]
                else:
                    weights[which] = weight.new_empty((count, *weight.shape))
                if scale is not None:
                    scales[which] = scale.new_empty((count, *scale.shape))
            weights[which][local] = weight
            if scale is not None:
                scales[which][local] = scale
    bank = ExpertBank(
        kind=kind or "float", weights=weights, scales=scales, dtype=reader.dtype, block=reader.block, gate_up=gate_up
    )
    if kind == "mxfp4" and getattr(reader, "native", False) and (device is None or device == reader.device):
        _keep_packed(bank)
    return bank


def gguf_bank(matrices: dict[str, torch.Tensor], types: dict[str, str | None], dtype: torch.dtype,
              block: tuple[int, int], *, int8_inputs: bool = False) -> ExpertBank:
    """A ``gguf`` bank from each routed matrix stacked over experts (w1, w2, w3: ``[E, out, ...]``): its GGUF
    blocks where ``types`` names a type, else its decoded values; gate and up (one type, or both None) are
    stacked as one matrix, w1 over w3, and the per-matrix tensors become views of it.  ``int8_inputs``: the
    blocks' decode GEMVs round their inputs to int8 (``stored.GgufMatrices``)."""
    inter, hidden = matrices["w1"].shape[1], matrices["w2"].shape[1]
    gate_up = torch.cat([matrices["w1"], matrices["w3"]], 1)
    weights = {"w1": gate_up[:, :inter], "w2": matrices["w2"], "w3": gate_up[:, inter:]}
    cols = {"w1": hidden, "w2": inter, "w3": hidden}
    blocks = {which: GgufMatrices(weights[which], qtype, cols[which], int8_inputs)
              for which, qtype in types.items() if qtype}
    native = (GgufMatrices(gate_up, types["w1"], hidden, int8_inputs) if types["w1"] else gate_up,
              blocks.get("w2", weights["w2"]))
    return ExpertBank(kind="gguf", weights=weights, scales={}, dtype=dtype, block=block,
                      gate_up=None if types["w1"] else gate_up, native=native, gguf=blocks)


def _keep_packed(bank: ExpertBank) -> None:
    """Restack an MXFP4 bank as (w1 over w3, w2) for the native kernels; the per-matrix dicts become views."""
    inter = bank.weights["w1"].shape[1]
    gate_up = Mxfp4Matrices(torch.cat([bank.weights["w1"], bank.weights["w3"]], 1),
                            torch.cat([bank.scales["w1"], bank.scales["w3"]], 1))
    bank.weights.update(w1=gate_up.packed[:, :inter], w3=gate_up.packed[:, inter:])
    bank.scales.update(w1=gate_up.scales[:, :inter], w3=gate_up.scales[:, inter:])
    bank.native = (gate_up, Mxfp4Matrices(bank.weights["w2"], bank.scales["w2"]))


def _moe(reader: WeightReader, cfg: DeepseekV4Config, layer: int, expert_device: torch.device | None,
         expert_sink=None) -> MoEWeights:
    p = f"layers.{layer}.ffn."
    hashed = cfg.is_hash_layer(layer)
    experts = _experts(reader, cfg, layer, expert_device)
    weights = MoEWeights(
        gate=reader.tensor(p + "gate.weight", F32),
        bias=None if hashed else reader.tensor(p + "gate.bias", F32),
        tid2eid=reader.index(p + "gate.tid2eid") if hashed else None,
        experts=expert_sink(layer, experts) if expert_sink is not None else experts,
        shared_w1=_linear(reader, p + "shared_experts.w1.weight"),
        shared_w2=_linear(reader, p + "shared_experts.w2.weight"),
        shared_w3=_linear(reader, p + "shared_experts.w3.weight"),
    )
    weights.shared_w13 = fuse_rows(weights.shared_w1, weights.shared_w3)
    return weights


def read_weights(
    reader: WeightReader, expert_device: str | torch.device | None = None, expert_sink=None
) -> ModelWeights:
    """Every parameter on the reader's device; routed experts on ``expert_device`` when given
    (the host, when they are to be split over device and host RAM: ``offload.py``).

    ``expert_sink(layer, bank) -> bank``: each layer's routed experts go there as
    soon as they are read (``ExpertOffload.adopt``), before the next layer's."""
    cfg = reader.cfg
    expert_device = torch.device(expert_device) if expert_device is not None else None
    layers = []
    for layer in range(cfg.num_hidden_layers):
        p = f"layers.{layer}."
        layers.append(
            LayerWeights(
                attn_norm=reader.tensor(p + "attn_norm.weight", F32),
                ffn_norm=reader.tensor(p + "ffn_norm.weight", F32),
                attn_hc=_hyper(reader, p + "hc_attn_"),
                ffn_hc=_hyper(reader, p + "hc_ffn_"),
                attn=_attention(reader, cfg, layer),
                ffn=_moe(reader, cfg, layer, expert_device, expert_sink),
            )
        )
    return ModelWeights(
        embed=reader.tensor("embed.weight"),
        norm=reader.tensor("norm.weight", F32),
        head=_head(reader),
        head_hc=_hyper(reader, "hc_head_"),
        layers=layers,
    )
