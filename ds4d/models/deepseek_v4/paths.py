"""Which implementation of each piece of the forward pass a DeepSeek-V4 model runs.

Every path computes the same arithmetic per token; they differ in how the work
is laid out on the device.  A model is given its :class:`ForwardPaths` when it
is built and keeps them for its life: the family picks the fastest the device
can run (:meth:`ForwardPaths.for_device`), the CPU keeps the exact reference
path, and a benchmark or test that wants another mix builds a model with it
(``DeepseekV4Model.with_paths``: same weights, its own cache and graphs).

The kernel paths (``hc_kernels``, ``fused_attention``, ``decode_kernel``, ``route_kernel``, ``fused_prefill``)
and the decode graphs apply only with ``fast_path``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

HC_KERNELS = ("torch", "numba", "triton", "boundary")
DECODE_GRAPHS = ("off", "cuda", "padded")


@dataclass(frozen=True)
class ForwardPaths:
    fast_path: bool = False
    """Routed experts as grouped matmuls (``moe.py``); steps in which every chunk is one token needing
    its logits run the batched decode attention of ``decode.py`` (no per-sequence loop, no host
    round trip); prefill windows attend block by block."""
    hc_kernels: str = "torch"
    """Where the hyper-connection mixing weights (Sinkhorn included) come from: ``torch``; ``numba``
    (the Numba CUDA kernel, always); ``triton`` (decode batches: two Triton kernels, prefill: the Numba one);
    ``boundary`` (as ``triton``, and a decode batch's whole boundary between two sub-layers -- the streams'
    update, the weights, the collapse and the norm -- in two Triton launches: ``hc_triton.hc_boundary_step``)."""
    fused_attention: bool = False
    """Prefill chunks longer than the sliding window attend in one Triton kernel (window keys,
    compressed entries and the sink in one online softmax) instead of torch's score blocks."""
    decode_kernel: bool = False
    """Decode steps run each compressor's step and their attention in Triton kernels (``decode_triton``: one
    launch a compressor, two for the attention over the window ring and entry blocks read in place) instead of
    torch's indexing, gathers and batched matmuls (the queries' norm and RoPE as the attention reads them), the
    KV's norm, RoPE and ring write with the query's low-rank norm in one more (``decode_triton.decode_qkv_norms``),
    and the feed-forward's SwiGLUs and its routed experts' weighted sum with the shared expert's output in
    ``prefill_triton``'s kernels (with the experts on the device).  On by default where the kernels can launch on
    CUDA (:meth:`for_device`): on an H100, 16 layers of V4-Flash widths decoded 1.04-1.06x faster at batch 1 with
    the attention's kernels and even at batch 8 (``ds4d bench model --decode-kernel`` adds the rows of the other
    path)."""
    shared_beside: bool = False
    """Decode steps run the shared expert on a second CUDA stream (``ds4d.cuda.streams``), beside the routing and
    the routed experts (in a CUDA graph, two branches the GPU runs at once).  Off by default until measured
    (``ds4d bench model --shared-beside`` compares the two)."""
    route_kernel: bool = False
    """Decode steps route each token in one Triton launch after the router's logits (``route_triton``: scores,
    the pick of ``k`` experts or a hash layer's table row, their weights) instead of torch's four or five (the
    top-k's the longest).  On by default where the kernel can launch on CUDA (:meth:`for_device`): on an H200, 16
    layers of V4-Flash widths decoded 1.02-1.03x faster at batch 1 with it, and its GPU test
    (``tests/gpu/test_dsv4_fast_path.py -k routing``: float32 and bfloat16, eager, padded and compiled) passes on
    an H100 (``ds4d bench model --route-kernel`` adds the rows of the other path)."""
    fused_prefill: bool = False
    """The token-wise work of steps that are not pure decode (hyper-connections, norms, RoPE, SwiGLU,
    the experts' weighted sum) goes through ``ds4d.cuda.prefill_triton``, and (bf16 models) the float32
    projections of bf16 activations through split weights (``weights.add_split_weights``)."""
    decode_graphs: str = "off"
    """Decode steps padded to a batch bucket and a block-table bucket: ``cuda`` captures and replays
    them as CUDA graphs (``ds4d.cuda.graphs``); ``padded`` runs the same padded steps eagerly (the
    path the graphs replay, on the CPU); ``off`` runs each decode step at its own shapes."""
    graph_fallback: bool = True
    """A decode step whose graph capture fails: True runs it and every later decode step eagerly
    (logged once; the model's ``graph_failure`` and ``/v1/ds4d/stats``' ``model.decode_graph_fallback``
    give the first failure); False raises."""
    compile_decode: bool = False
    """Decode steps go through ``torch.compile`` inside their CUDA graphs (each new bucket compiles once)."""
    last_layer_rows_only: bool = True
    """The last layer's feed-forward runs on the rows whose logits are asked for only."""
    prefill_block: int = 0
    """A step of more rows than this (not a pure decode step) runs layer by layer, each layer over
    its rows this many at a time (``DeepseekV4Model._blocks``): activations of one block, and with
    routed experts offloaded each cold expert copied once per layer per step; 0: every layer takes
    the whole step at once."""

    def __post_init__(self) -> None:
        if self.hc_kernels not in HC_KERNELS:
            raise ValueError(f"hc_kernels {self.hc_kernels!r}: use one of {', '.join(HC_KERNELS)}")
        if self.prefill_block < 0:
            raise ValueError(f"prefill_block {self.prefill_block}: 0 (off) or a positive row count")
        if self.decode_graphs not in DECODE_GRAPHS:
            raise ValueError(f"decode_graphs {self.decode_graphs!r}: use one of {', '.join(DECODE_GRAPHS)}")

    @classmethod
    def for_device(cls, device: str | torch.device, *, compile_decode: bool = False) -> ForwardPaths:
        """Every path the device can run: on CUDA the grouped experts, the kernels whose compilers are
        installed and CUDA graphs; elsewhere the reference path (kept exact on the CPU)."""
        if torch.device(device).type != "cuda":
            return cls()
        from ds4d.cuda import attention_triton, decode_triton, hc_kernels, hc_triton, prefill_triton, route_triton

        hc = ("boundary" if hc_triton.available() else "numba") if hc_kernels.available() else "torch"
        return cls(fast_path=True, hc_kernels=hc, fused_attention=attention_triton.available(),
                   fused_prefill=hc_triton.available() and prefill_triton.available(), decode_graphs="cuda",
                   decode_kernel=decode_triton.available() and prefill_triton.available(),
                   route_kernel=route_triton.available(), compile_decode=compile_decode)

    def replace(self, **changes) -> ForwardPaths:
        return dataclasses.replace(self, **changes)

    @property
    def fused_hc(self) -> bool | str:
        """What the hyper-connection functions take as ``fused`` (False: torch) on this path."""
        return self.hc_kernels if self.fast_path and self.hc_kernels != "torch" else False

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)
