"""Triton kernel: a decode step's routing after the router's logits, in one launch.

DeepSeek-V4 scores each routed expert from the router's float32 logits (``sqrt(softplus)`` in the published
configs), picks ``k`` by the scores plus a per-expert bias (or, on a hash-routed layer, reads them from the
token's row of a table), and weights the picked experts by their scores (unbiased), normalised to sum to one
and scaled (``ds4d.models.deepseek_v4.moe.route`` is the reference).  In torch, at batch 1, that is four to
five launches of a few microseconds each, ``torch.topk``'s the longest.  Here one program a token holds the
token's logits, picks the experts one at a time (the largest biased score not yet picked; the lowest id among
equal ones) and writes the weights and ids.

The picked experts come out in the order picked (largest biased score first), where ``torch.topk(...,
sorted=False)`` leaves its order to the implementation: a pair's weight is the same either way, up to the
order of the float32 sum of the picked scores.  Divisions and square roots round as torch's do (``div_rn``,
``sqrt_rn``); ``exp`` and ``log`` are Triton's (``log1p`` written as ``log(w) * u / (w - 1)``, exact to a few
float32 units), so the scores differ from torch's by float32 rounding.
Triton is imported on first use; with ``TRITON_INTERPRET=1`` it runs on CPU tensors (how the tests compare it
with the reference).
"""

from __future__ import annotations

import torch

from ds4d.cuda.devices import triton_can_launch

SCORING = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2}
"""The scoring functions of ``moe._scores`` and the kernel's code for each."""
MAX_EXPERTS = 1024
"""Routed experts a layer may have for the kernel (a program holds a token's logits)."""
TUNING = {"warps": 2, "warps_wide": 4}
"""Warps of a program up to 256 experts and past them.  Not yet timed on a GPU.  Compiled for sm_90 (Triton 3.9,
``tests/gpu/route_compile.py``), the score-routed kernel at 256 experts is 1,168 instructions with 23 barriers at
2 warps and 1,648 with one barrier at 1 warp; it spills nothing either way."""
_state: dict[str, object] = {}


def _kernel():
    if "kernel" not in _state:
        import triton
        import triton.language as tl

        @triton.jit
        def route_kernel(logits_ptr, bias_ptr, table_ptr, ids_ptr, weights_ptr, indices_ptr, experts, scale,
                         temperature, slogits, k: tl.constexpr, block_e: tl.constexpr, block_k: tl.constexpr,
                         scoring: tl.constexpr, has_bias: tl.constexpr, hashed: tl.constexpr, norm: tl.constexpr):
            t = tl.program_id(0).to(tl.int64)
            e = tl.arange(0, block_e)
            live = e < experts
            x = tl.div_rn(tl.load(logits_ptr + t * slogits + e, mask=live, other=0.0), temperature)
            if scoring == 2:  # sqrt(softplus(x)), softplus as torch's: x itself above 20
                u = tl.exp(tl.minimum(x, 20.0))
                w = 1.0 + u
                log1p = tl.where(w == 1.0, u, tl.log(w) * tl.div_rn(u, tl.where(w == 1.0, 1.0, w - 1.0)))
                scores = tl.sqrt_rn(tl.where(x > 20.0, x, log1p))
            elif scoring == 1:
                scores = tl.sigmoid(x)
            else:
                shifted = tl.exp(tl.where(live, x, -float("inf")) - tl.max(tl.where(live, x, -float("inf")), axis=0))
                scores = tl.div_rn(shifted, tl.sum(shifted, axis=0))
            slots = tl.arange(0, block_k)
            if hashed:
                token = tl.load(ids_ptr + t)
                picked = tl.load(table_ptr + token * k + slots, mask=slots < k, other=0).to(tl.int32)
            else:
                biased = scores
                if has_bias:
                    biased = biased + tl.load(bias_ptr + e, mask=live, other=0.0)
                biased = tl.where(live, biased, -float("inf"))
                picked = tl.zeros([block_k], dtype=tl.int32)
                for j in tl.static_range(k):
                    best = tl.argmax(biased, axis=0, tie_break_left=True).to(tl.int32)
                    picked = tl.where(slots == j, best, picked)
                    biased = tl.where(e == best, -float("inf"), biased)
            live_k = slots < k
            chosen = tl.sum(tl.where((e[None, :] == picked[:, None]) & live_k[:, None], scores[None, :], 0.0), axis=1)
            if norm:
                chosen = tl.div_rn(chosen, tl.sum(chosen, axis=0) + 1e-20)
            tl.store(weights_ptr + t * k + slots, chosen * scale, mask=live_k)
            tl.store(indices_ptr + t * k + slots, picked.to(tl.int64), mask=live_k)

        _state["kernel"] = route_kernel
    return _state["kernel"]


def available() -> bool:
    """Triton is importable and can launch here (a CUDA device, or the interpreter)."""
    if "available" not in _state:
        _state["available"] = triton_can_launch(_kernel)
    return bool(_state["available"])


def usable(logits: torch.Tensor, scoring_func: str) -> bool:
    """Whether :func:`route` takes these ``[T, E]`` logits: float32, rows of contiguous values, a known scoring
    function, at most ``MAX_EXPERTS`` experts, and the kernel can launch here."""
    return (logits.dim() == 2 and logits.dtype == torch.float32 and logits.stride(-1) == 1
            and scoring_func in SCORING and 0 < logits.shape[1] <= MAX_EXPERTS and available())


@torch.compiler.disable  # launched as is; torch.compile and CUDA graph capture see the kernel
def route(logits: torch.Tensor, k: int, scoring_func: str, scale: float, norm: bool, bias: torch.Tensor | None = None,
          table: torch.Tensor | None = None, token_ids: torch.Tensor | None = None,
          temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights ``[T, k]`` float32, expert ids ``[T, k]`` int64) from the router's ``logits [T, E]`` (divided by
    ``temperature`` first: V4.1's ``gate_temp``): the ``k`` experts of the largest scores plus ``bias [E]``, or
    with ``table [V, k]`` those of each token's row (``token_ids [T]``); each picked expert weighted by its
    score, divided by the picked scores' sum with ``norm``, times ``scale``."""
    import triton

    tokens, experts = logits.shape
    hashed, has_bias = table is not None, bias is not None
    if hashed and (token_ids is None or table.shape[1] != k):
        raise ValueError("a hash-routed layer needs the token ids and a table of k experts a token")
    weights = torch.empty(tokens, k, dtype=torch.float32, device=logits.device)
    indices = torch.empty(tokens, k, dtype=torch.int64, device=logits.device)
    if tokens:
        table = table.contiguous() if hashed else indices  # unread where the layer is not hashed
        ids = token_ids.contiguous() if hashed else indices
        bias = bias.float().contiguous() if has_bias else logits
        _kernel()[(tokens,)](logits, bias, table, ids, weights, indices, experts, float(scale), float(temperature),
                             logits.stride(0), k=k,
                             block_e=triton.next_power_of_2(experts), block_k=triton.next_power_of_2(k),
                             scoring=SCORING[scoring_func], has_bias=has_bias, hashed=hashed, norm=norm,
                             num_warps=TUNING["warps_wide" if experts > 256 else "warps"])
    return weights, indices
