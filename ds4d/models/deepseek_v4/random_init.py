"""Random V4 weights of any config, built straight on the target device.

Benchmarks need a model of real widths without a 150 GB download.  A
:class:`RandomReader` answers the same questions as the checkpoint
:class:`~ds4d.models.deepseek_v4.loader.WeightReader` (one parameter at a time,
by reference name), so :func:`~ds4d.models.deepseek_v4.weights.read_weights`
builds the model from it exactly as it does from a file.  Every tensor it hands
out is kept under its reference name (:attr:`RandomReader.issued`), so another
implementation can be given the very same tensors.

Every tensor is drawn from its own generator, seeded from the reader's seed and
the tensor's name, so the values do not depend on the order of the questions:
the ranks of a model split over several devices each ask only for their own
layers and experts and together hold the same model as one process.

Scales follow the tiny checkpoints: linear weights with std ``in ** -0.5``,
norm weights near 1, small routing biases, a random token -> experts table.
Routed experts come out as float (``float`` bank kind); with ``native=True``
the linears the release stores in FP8 come out as FP8 (128 x 128 block scales)
and the routed experts as MXFP4, quantised from the same random draws, and
:attr:`RandomReader.issued` keeps the values they decode to.
"""

from __future__ import annotations

import re
import zlib

import torch

from ds4d.models.deepseek_v4.config import CSA_RATIO, DeepseekV4Config
from ds4d.models.deepseek_v4.quant import dequant_fp8_block, quantize_fp8_block, quantize_mxfp4
from ds4d.models.deepseek_v4.stored import Fp8Weight, GgufWeight
from ds4d.models.deepseek_v4.weights import ExpertBank, gguf_bank

FP8_IN_RELEASE = re.compile(r"\.(wq_a|wq_b|wkv|wo_b|shared_experts\.w[123])\.weight$")
"""The linears the release stores as FP8 (CHECKPOINT.md); wo_a and weights_proj are bf16 there."""


class RandomReader:
    def __init__(
        self, cfg: DeepseekV4Config, *, dtype: torch.dtype, device: str | torch.device, seed: int = 0,
        native: bool = False, keep_values: bool = True,
    ) -> None:
        self.cfg = cfg
        self.native = native
        self.keep_values = keep_values
        """False: :attr:`issued` keeps shapes only (meta tensors), not a second copy of decoded FP8 values."""
        self.dtype = dtype
        self.device = torch.device(device)
        self.block = (128, 128)
        self.seed = seed
        self.issued: dict[str, torch.Tensor] = {}

    # the WeightReader questions read_weights asks ---------------------------------

    def tensor(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        shape, kind = _shape(self.cfg, name)
        dtype = dtype or self.dtype
        draw = self._randn(shape, name)
        if kind == "norm":
            t = 1.0 + 0.1 * draw
        elif kind == "linear":
            t = draw * shape[-1] ** -0.5
        elif kind == "hc_scale":
            t = 1.0 + 0.2 * draw
        else:  # biases, sinks, ape, hc base
            t = draw * {"bias": 0.1, "sink": 1.0, "ape": 0.5, "hc_base": 0.5}[kind]
        t = t.to(torch.bfloat16).to(dtype)  # values a bf16 checkpoint could hold, whatever the dtype asked
        self._issue(name, t)
        return t

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """The shape :meth:`tensor` draws ``name`` in."""
        return tuple(_shape(self.cfg, name)[0])

    def index_shape(self, name: str) -> tuple[int, ...]:
        """The shape of :meth:`index`'s table."""
        return self.cfg.vocab_size, self.cfg.num_experts_per_tok

    def index(self, name: str) -> torch.Tensor:
        cfg = self.cfg
        draws = torch.rand(cfg.vocab_size, cfg.n_routed_experts, generator=self._generator(name), device=self.device)
        table = draws.argsort(dim=-1)[:, : cfg.num_experts_per_tok].contiguous()
        self._issue(name, table)
        return table

    def stored_linear(self, name: str):
        """With ``native``: the random linear ``name`` quantised to FP8 as the release stores it."""
        if not self.native or not FP8_IN_RELEASE.search(name):
            return None
        weight, scale = quantize_fp8_block(self.tensor(name, torch.float32))
        self._issue(name, dequant_fp8_block(weight, scale, self.block).to(self.dtype))
        return Fp8Weight.from_stored(weight, scale, self.dtype)

    def stored_bank(self, layer: int, device: torch.device | None) -> None:
        """None: this reader's experts are read one matrix at a time (``expert_stored``)."""

    def expert_stored(self, layer: int, expert: int, which: str) -> tuple[str, torch.Tensor, torch.Tensor | None]:
        name = f"layers.{layer}.ffn.experts.{expert}.{which}.weight"
        shape, _ = _shape(self.cfg, name)
        values = self._randn(shape, name) * shape[-1] ** -0.5
        if self.native:
            packed, scale = quantize_mxfp4(values)
            return "mxfp4", packed.view(torch.uint8), scale.view(torch.uint8)
        return "float", values.to(torch.bfloat16).to(self.dtype), None

    def _issue(self, name: str, tensor: torch.Tensor) -> None:
        self.issued[name] = tensor if self.keep_values else torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")

    def _generator(self, name: str) -> torch.Generator:
        seed = zlib.crc32(f"{self.seed}/{name}".encode())  # the low 32 bits are all a CPU generator keeps
        return torch.Generator(device=self.device).manual_seed(seed)

    def _randn(self, shape: tuple[int, ...], name: str) -> torch.Tensor:
        return torch.randn(shape, generator=self._generator(name), device=self.device, dtype=torch.float32)


def _shape(cfg: DeepseekV4Config, name: str) -> tuple[tuple[int, ...], str]:
    """(shape, initialiser kind) of a reference-named parameter."""
    d, m, v = cfg.hidden_size, cfg.hc_mult, cfg.vocab_size
    heads, hd, qr = cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank
    inter, experts = cfg.moe_intermediate_size, cfg.n_routed_experts
    if name in ("embed.weight", "head.weight"):
        return (v, d), "linear" if name == "head.weight" else "sink"
    if name == "norm.weight":
        return (d,), "norm"
    hc = re.match(r"(?:layers\.\d+\.)?hc_(head|attn|ffn)_(fn|base|scale)$", name)
    if hc:
        mix = m if hc.group(1) == "head" else (2 + m) * m
        scales = 1 if hc.group(1) == "head" else 3
        return {"fn": ((mix, m * d), "linear"), "base": ((mix,), "hc_base"), "scale": ((scales,), "hc_scale")}[
            hc.group(2)
        ]
    layer = int(name.split(".")[1])
    ratio = cfg.compress_ratios[layer]
    rest = name.split(".", 2)[2]
    if rest in ("attn_norm.weight", "ffn_norm.weight"):
        return (d,), "norm"
    comp = re.match(r"attn\.(indexer\.)?compressor\.(wkv\.weight|wgate\.weight|ape|norm\.weight)$", rest)
    if comp:
        dim = cfg.index_head_dim if comp.group(1) else hd
        coff = 2 if ratio == CSA_RATIO else 1
        part = comp.group(2)
        if part == "ape":
            return (ratio, coff * dim), "ape"
        if part == "norm.weight":
            return (dim,), "norm"
        return (coff * dim, d), "linear"
    e = re.match(r"ffn\.experts\.\d+\.(w[123])\.weight$", rest) or re.match(r"ffn\.shared_experts\.(w[123])\.weight$", rest)
    if e:
        return ((d, inter) if e.group(1) == "w2" else (inter, d)), "linear"
    table = {
        "attn.wq_a.weight": ((qr, d), "linear"),
        "attn.q_norm.weight": ((qr,), "norm"),
        "attn.wq_b.weight": ((heads * hd, qr), "linear"),
        "attn.wkv.weight": ((hd, d), "linear"),
        "attn.kv_norm.weight": ((hd,), "norm"),
        "attn.wo_a.weight": ((cfg.o_groups * cfg.o_lora_rank, heads * hd // cfg.o_groups), "linear"),
        "attn.wo_b.weight": ((d, cfg.o_groups * cfg.o_lora_rank), "linear"),
        "attn.attn_sink": ((heads,), "sink"),
        "attn.indexer.wq_b.weight": ((cfg.index_n_heads * cfg.index_head_dim, qr), "linear"),
        "attn.indexer.weights_proj.weight": ((cfg.index_n_heads, d), "linear"),
        "ffn.gate.weight": ((experts, d), "linear"),
        "ffn.gate.bias": ((experts,), "bias"),
    }
    if rest not in table:
        raise KeyError(f"no random initialiser for {name!r}")
    return table[rest]


GGUF_RECIPES = {"q2": {"linear": "Q8_0", "w1": "IQ2_XXS", "w3": "IQ2_XXS", "w2": "Q2_K"}}
"""Quant types by role: ``q2`` is the ds4 q2 files' recipe (routed gate/up IQ2_XXS, down Q2_K, the linears
the release stores in FP8 as Q8_0)."""

_HALVES = {"Q8_0": (0,), "Q2_K": (80, 82), "IQ2_XXS": (0,)}
"""Byte offsets of each block's float16 fields (``d``; Q2_K's ``d`` and ``dmin``)."""
_SPREAD = {"Q8_0": 1 / 74, "Q2_K": 1 / 8, "IQ2_XXS": 1 / 50}
"""``d`` times ``in ** 0.5`` that gives random blocks values of std about ``in ** -0.5``."""


def random_gguf_blocks(rows: int, cols: int, qtype: str, generator: torch.Generator,
                       device: torch.device) -> torch.Tensor:
    """uint8 ``[rows, row_bytes]``: random codes, scales and signs in ``qtype`` blocks, their float16
    fields set so the values have std about ``cols ** -0.5`` (Q2_K's ``dmin`` 1.5 ``d``: about zero mean)."""
    from ds4d.cuda import gguf_matmul

    values, nbytes = gguf_matmul.block_shape(qtype)
    raw = torch.randint(0, 256, (rows, cols // values, nbytes), generator=generator, device=device,
                        dtype=torch.uint8)
    d = _SPREAD[qtype] * cols ** -0.5
    for at, field in zip(_HALVES[qtype], (d, 1.5 * d)):
        raw[:, :, at:at + 2] = torch.tensor([field], dtype=torch.float16).view(torch.uint8).to(device)
    return raw.reshape(rows, -1)


def _meta_blocks(rows: int, cols: int, qtype: str) -> torch.Tensor:
    """A meta tensor of the shape :func:`random_gguf_blocks` returns."""
    from ds4d.cuda import gguf_matmul

    return torch.empty(rows, gguf_matmul.row_bytes_of(qtype, cols), dtype=torch.uint8, device="meta")


def _fitting(qtype: str, cols: int) -> str | None:
    """``qtype``, or Q8_0 for rows that are not a whole number of its blocks (as llama-quantize falls back
    for such tensors), or None where Q8_0's blocks of 32 do not fit either."""
    from ds4d.cuda import gguf_matmul

    for kind in (qtype, "Q8_0"):
        if cols % gguf_matmul.block_shape(kind)[0] == 0:
            return kind
    return None


def gguf_expert_bytes(cfg: DeepseekV4Config, recipe: str) -> int:
    """One routed expert's bytes as :class:`RandomGgufReader` draws it: in ``recipe``'s blocks, or MXFP4 (17
    bytes per 32 values) where a matrix is narrower than every block that could hold it."""
    from ds4d.cuda import gguf_matmul

    inter, hidden = cfg.moe_intermediate_size, cfg.hidden_size
    shapes = {"w1": (inter, hidden), "w3": (inter, hidden), "w2": (hidden, inter)}
    types = {which: _fitting(GGUF_RECIPES[recipe][which], cols) for which, (_, cols) in shapes.items()}
    if None in types.values():
        return 3 * inter * hidden * 17 // 32
    return sum(rows * gguf_matmul.row_bytes_of(types[which], cols) for which, (rows, cols) in shapes.items())


class RandomGgufReader(RandomReader):
    """Random V4 weights with the linears and routed experts in GGUF blocks by a recipe
    (:data:`GGUF_RECIPES`), on the device, as a GGUF file's native model holds them: a benchmark of
    low-bit weights at real widths and depth without a file (a matrix narrower than its type's blocks takes
    Q8_0, or where that does not fit either, :class:`RandomReader`'s FP8 or MXFP4).  Every other tensor is :class:`RandomReader`'s;
    :attr:`issued` keeps the quantised ones' shapes only."""

    def __init__(self, cfg: DeepseekV4Config, *, dtype: torch.dtype, device: str | torch.device, recipe: str,
                 seed: int = 0, int8_inputs: bool = False) -> None:
        super().__init__(cfg, dtype=dtype, device=device, seed=seed, native=True, keep_values=False)
        self.recipe = GGUF_RECIPES[recipe]
        self.int8_inputs = int8_inputs
        """The blocks' decode GEMVs round their inputs to int8 (``stored.GgufWeight.int8_inputs``)."""

    def stored_linear(self, name: str, *, describe: bool = False) -> GgufWeight | None:
        """The linear ``name`` in random blocks of the recipe, or None (not stored in FP8 by the release, or
        no type fits); with ``describe``, its blocks as a meta tensor (nothing drawn, nothing issued)."""
        if not FP8_IN_RELEASE.search(name):
            return None
        shape, _ = _shape(self.cfg, name)
        qtype = _fitting(self.recipe["linear"], shape[1])
        if qtype is None:
            return None
        if describe:
            return GgufWeight(_meta_blocks(shape[0], shape[1], qtype), qtype, shape[1], self.dtype, self.int8_inputs)
        self._issue(name, torch.empty(shape, device="meta"))
        raw = random_gguf_blocks(shape[0], shape[1], qtype, self._generator(name), self.device)
        return GgufWeight(raw, qtype, shape[1], self.dtype, self.int8_inputs)

    def expert_blocks(self, layer: int, device: torch.device, *, describe: bool = False,
                      ) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
        """(uint8 ``[E, rows, row_bytes]`` per routed matrix w1, w2, w3, their types), or None where a type
        does not fit; with ``describe``, meta tensors (nothing drawn, nothing issued)."""
        cfg = self.cfg
        experts, inter, hidden = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
        shapes = {"w1": (inter, hidden), "w3": (inter, hidden), "w2": (hidden, inter)}
        types = {which: _fitting(self.recipe[which], cols) for which, (_, cols) in shapes.items()}
        if None in types.values():
            return None
        matrices = {}
        for which, (rows, cols) in shapes.items():
            if describe:
                matrices[which] = _meta_blocks(rows, cols, types[which]).expand(experts, -1, -1)
                continue
            for expert in range(experts):  # the shapes a checkpoint's experts would be issued as
                self._issue(f"layers.{layer}.ffn.experts.{expert}.{which}.weight", torch.empty(rows, cols, device="meta"))
            gen = self._generator(f"layers.{layer}.ffn.experts.{which}")
            matrices[which] = torch.stack([random_gguf_blocks(rows, cols, types[which], gen, self.device)
                                           for _ in range(experts)]).to(device)  # drawn where the generator is
        return {which: matrices[which] for which in ("w1", "w2", "w3")}, types

    def stored_bank(self, layer: int, device: torch.device | None) -> ExpertBank | None:
        blocks = self.expert_blocks(layer, device or self.device)
        if blocks is None:
            return None  # RandomReader's experts, MXFP4
        return gguf_bank(*blocks, self.dtype, self.block, int8_inputs=self.int8_inputs)
