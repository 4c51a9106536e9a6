"""Which implementation of each piece of the forward pass a DeepSeek-V4.1 model runs.

Every path computes the same arithmetic per token; they differ in how the work
is laid out on the device.  A model is given its :class:`ForwardPaths` when it
is built and keeps them: :meth:`ForwardPaths.for_device` picks what the device
can run (on the CPU the reference path, which the float32 goldens pin), and a
test or benchmark that wants another mix passes its own.

The kernels are V4's (``ds4d.cuda.hc_triton``, ``ds4d.cuda.moe_gemv``,
``ds4d.cuda.attention_triton``, ``ds4d.cuda.route_triton``, torch's ``grouped_mm``): V4.1's hyper-connection
weights are V4's formulas, its routed experts are SwiGLUs over one bank per
projection as V4's are, and its window attention (sink, keys that are also the
values, compressed entries behind an additive mask) is V4's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ForwardPaths:
    fused_hyper: bool = False
    """Each site's ``pre``, ``post`` and Sinkhorn ``comb`` from two Triton kernels (``hc_triton``) instead
    of about 150 small torch operations; a step of more than ``hc_triton.MAX_TOKENS`` rows takes the
    mixing logits from one matmul and the rest from the same kernel."""
    expert_rows: bool = False
    """Steps of at most ``moe_gemv.MAX_ROWS`` (token, expert) pairs run the routed experts as three
    expert-indexed GEMVs over the layer's banks (no host round trip, no loop over experts)."""
    grouped_experts: bool = False
    """Steps with more pairs than that sort the pairs by expert and run each projection as one grouped
    matmul over the bank (torch's ``grouped_mm``; bf16 on CUDA) instead of one expert at a time."""
    window_kernel: bool = False
    """A chunk of several queries attends over its window and compressed entries in V4's Triton kernel
    (``attention_triton.window_attention``: no ``[queries, keys]`` scores or masks in memory) instead of
    through a dense mask; a one-token chunk keeps the dense path."""
    batched_decode: bool = False
    """With ``decode_graphs = off``: the one-token chunks of a step go through the layers together
    (``DeepseekV41Model.decode_many``): every projection, norm, hyper-connection and expert sees all
    their rows at once, only the attention core (each sequence's window and compressed entries) runs
    per sequence."""
    route_kernel: bool = False
    """Steps of one token a sequence route each row in one Triton launch after the router's product (V4's
    ``route_triton``: scores, the pick by score plus bias, the weights) instead of torch's few.  Off by default
    until measured (``ds4d bench model --family deepseek_v41 --route-kernel``)."""
    decode_graphs: str = "off"
    """How the engine's one-token chunks run: ``off``, as above; ``padded``, the fixed-shape step of
    ``decode.py`` (every row's attention batched, state in the slots' arrays and the block pool) at
    bucket-padded shapes, eagerly; ``cuda``, that step captured in a CUDA graph per bucket and replayed
    (eagerly where the routed experts of a bucket would leave the row kernel)."""

    compile_decode: bool = False
    """With ``decode_graphs = cuda``: the step goes through ``torch.compile`` before its capture
    (``ds4d.cuda.graphs.compiled``)."""

    def __post_init__(self) -> None:
        if self.decode_graphs not in ("off", "padded", "cuda"):
            raise ValueError(f"decode_graphs is off, padded or cuda, not {self.decode_graphs!r}")

    @classmethod
    def for_device(cls, device: str | torch.device) -> ForwardPaths:
        """On CUDA every path whose kernels can launch; elsewhere the reference path."""
        if torch.device(device).type != "cuda":
            return cls()
        from ds4d.cuda import attention_triton, hc_triton, moe_gemv

        from ds4d.models.deepseek_v41.moe import GROUPED_MM_AVAILABLE

        return cls(fused_hyper=hc_triton.available(), expert_rows=moe_gemv.available(),
                   grouped_experts=GROUPED_MM_AVAILABLE, window_kernel=attention_triton.available(),
                   batched_decode=True, decode_graphs="cuda")

    @classmethod
    def all_kernels(cls) -> ForwardPaths:
        """Every path on, wherever the kernels can run (the CPU through Triton's interpreter)."""
        return cls(fused_hyper=True, expert_rows=True, grouped_experts=True, window_kernel=True,
                   batched_decode=True, route_kernel=True)

    def replace(self, **changes) -> ForwardPaths:
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)
