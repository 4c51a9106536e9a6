"""Routed experts of a V4.1 model split between device memory (hot) and page-locked host RAM (cold).

V4.1's routed experts have V4's shapes and storage (``w1`` / ``w3`` ``[I, D]``, ``w2``
``[D, I]``, FP4 codes with e8m0 scales per 32), so V4's ``ExpertOffload``
(``deepseek_v4/offload.py``) holds and runs them: the placement policy and its knobs
(``expert_vram_gib``, ``expert_placement``, ``expert_calibration``, ``expert_decode_cold``,
``expert_cpu_threads``), host slots, the two staging banks on a copy stream, the
zero-token skip (a cold expert no token chose is never copied), host threads for a
decode step's few-row cold experts, and, with FP4 kept as stored, the zero-copy decode
that CUDA graphs capture.  What is V4.1's is the arithmetic: each (token, expert)
pair's routing weight multiplies its float32 SwiGLU before ``w2``, as
:func:`~ds4d.models.deepseek_v41.moe.moe_forward` computes it
(``OffloadOptions.pair_weighted``), so a model with offload gives the model without
it, wherever each expert sits, up to the rounding of a matmul laid out otherwise.

The checkpoint is read layer by layer: a layer's banks are built in host memory,
handed over (:meth:`ExpertSink.__call__`) and emptied, so neither the device nor the
host holds every expert twice.
"""

from __future__ import annotations

import dataclasses

import torch

from ds4d.models.deepseek_v4.offload import ExpertOffload, OffloadOptions
from ds4d.models.deepseek_v4.weights import ExpertBank
from ds4d.models.deepseek_v41.config import DeepseekV41Config
from ds4d.models.deepseek_v41.weights import ExpertBanks

FP4_BLOCK = (1, 32)
"""The e8m0 scale block of V4.1's FP4 experts (one scale per 32 inputs of a row)."""


def as_expert_bank(banks: ExpertBanks) -> ExpertBank:
    """One layer's banks in V4's stacked layout (views where it can: FP4 codes and scales stay as they
    are; decoded ``w1`` and ``w3`` are stacked into one ``gate_up`` tensor, as the grouped matmuls read it)."""
    if banks.stored:
        parts = {"w1": banks.w1, "w2": banks.w2, "w3": banks.w3}
        return ExpertBank(kind="mxfp4", weights={w: m.packed for w, m in parts.items()},
                          scales={w: m.scales for w, m in parts.items()}, dtype=banks.dtype, block=FP4_BLOCK)
    inter = banks.w1.shape[1]
    gate_up = torch.cat([banks.w1, banks.w3], dim=1)
    return ExpertBank(kind="float", weights={"w1": gate_up[:, :inter], "w2": banks.w2, "w3": gate_up[:, inter:]},
                      scales={}, dtype=banks.dtype, block=FP4_BLOCK, gate_up=gate_up)


def expert_offload(cfg: DeepseekV41Config, options: OffloadOptions, *, device: str | torch.device,
                   dtype: torch.dtype, stored: bool) -> ExpertOffload:
    """An empty offload for ``cfg``'s routed experts, to be filled by an :class:`ExpertSink`; ``stored``:
    the experts arrive as FP4 codes and stay so on the device (hot banks, staging, zero-copy decode)."""
    options = dataclasses.replace(options, pair_weighted=True, native=stored)
    return ExpertOffload(None, cfg, device=device, dtype=dtype, options=options)


class ExpertSink:
    """``build_weights``' ``expert_sink``: each layer's banks (built in host memory) into the offload;
    :meth:`finish` after the last layer."""

    def __init__(self, offload: ExpertOffload) -> None:
        self.offload = offload

    def __call__(self, layer: int, banks: ExpertBanks) -> None:
        self.offload.adopt(layer, as_expert_bank(banks))

    def finish(self) -> None:
        self.offload.finish()
