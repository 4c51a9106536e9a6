"""Numba CUDA kernel for the hyper-connection mixing weights (pre, post, Sinkhorn comb).

Turning a token's ``(2 + m) * m`` mixing logits into ``pre``, ``post`` and the
doubly-stochastic ``comb`` takes about 130 tiny tensor ops in torch (20
Sinkhorn iterations of row and column normalisation), run twice per layer;
at decode batch sizes their launch cost dominates the whole step.  Here one
kernel does it all: one thread per token with its ``m x m`` matrix in
registers (the kernel is compiled per ``m``), so the 40 normalisations need no
barrier or shared memory; same formulas (``ds4d.models.deepseek_v4.hyper`` is
the reference), in float32.

Numba is imported on first use only; :func:`available` says whether it can be.
The kernel runs on torch's current stream and reads torch tensors in place, so
it can be captured in a CUDA graph.  Under ``NUMBA_ENABLE_CUDASIM=1`` the
kernel runs on numpy arrays on the CPU (that is how the tests check it).
"""

from __future__ import annotations

import math

import torch

MAX_STREAMS = 8  # m * m float32 registers a thread
_THREADS = 64
_state: dict[str, object] = {}


def _cuda():
    if "cuda" not in _state:
        import numpy as np

        if not hasattr(np, "row_stack"):  # numba 0.68 still imports it; numpy 2.5 dropped it
            np.row_stack = np.vstack
        from numba import config, cuda

        config.CUDA_LOW_OCCUPANCY_WARNINGS = False  # decode launches are small by nature
        _state["cuda"] = cuda
    return _state["cuda"]


def available() -> bool:
    """Numba CUDA is installed, sees the device, and the kernel compiles and runs (checked once)."""
    if "available" not in _state:
        try:
            ok = _cuda().is_available() and torch.cuda.is_available()
            if ok:
                m = 4
                mixes = torch.zeros(1, (2 + m) * m, device="cuda")
                hc_mix_torch(mixes, mixes[0], torch.ones(3, device="cuda"), 1e-6, 2, m)
                torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - no numba, no driver, no NVVM: the torch path runs instead
            import logging

            logging.getLogger("ds4d.cuda").warning("hyper-connection kernel unavailable: %s", exc)
            ok = False
        _state["available"] = ok
    return bool(_state["available"])


cuda = None  # numba.cuda, bound on first use (module globals are what the simulator patches)
float32 = None


def _specialised(m: int):
    """The kernel for ``m`` streams: ``m`` is a compile-time constant, so the ``m * m`` matrix is a
    fixed-size local array that the compiler keeps in registers (every index is known once the
    loops over ``m`` are unrolled)."""
    cells = m * m

    def _hc_mix(mixes, base, scale, hc_eps, iters, pre, post, comb):
        t = cuda.grid(1)
        if t >= mixes.shape[0]:
            return
        eps = float32(hc_eps)
        one = float32(1.0)
        c = cuda.local.array(cells, float32)
        for i in range(m):  # softmax of each row, plus eps
            top = float32(-math.inf)
            for j in range(m):
                v = mixes[t, 2 * m + i * m + j] * scale[2] + base[2 * m + i * m + j]
                c[i * m + j] = v
                top = max(top, v)
            total = float32(0.0)
            for j in range(m):
                c[i * m + j] = math.exp(c[i * m + j] - top)
                total += c[i * m + j]
            for j in range(m):
                c[i * m + j] = c[i * m + j] / total + eps
        for step in range(iters):  # columns; then (rows, columns) iters - 1 times
            if step > 0:
                for i in range(m):
                    total = float32(0.0)
                    for j in range(m):
                        total += c[i * m + j]
                    for j in range(m):
                        c[i * m + j] = c[i * m + j] / (total + eps)
            for j in range(m):
                total = float32(0.0)
                for i in range(m):
                    total += c[i * m + j]
                for i in range(m):
                    c[i * m + j] = c[i * m + j] / (total + eps)
        for i in range(m):
            for j in range(m):
                comb[t, i, j] = c[i * m + j]
            pre[t, i] = one / (one + math.exp(-(mixes[t, i] * scale[0] + base[i]))) + eps
            post[t, i] = float32(2.0) / (one + math.exp(-(mixes[t, m + i] * scale[1] + base[m + i])))

    return _hc_mix


def kernel(m: int):
    """The jitted kernel ``(mixes, base, scale, hc_eps, iters, pre, post, comb)`` for ``m`` streams."""
    global cuda, float32
    key = ("kernel", m)
    if key not in _state:
        cuda = _cuda()
        from numba import float32 as f32

        float32 = f32
        _state[key] = cuda.jit(_specialised(m))
    return _state[key]


def launch(mixes, base, scale, hc_eps: float, iters: int, m: int, pre, post, comb, stream=0) -> None:
    """Run the kernel on arrays numba accepts (device arrays, or numpy under the simulator)."""
    if m > MAX_STREAMS:
        raise ValueError(f"hc_mult {m} exceeds the kernel's {MAX_STREAMS}")
    blocks = max(1, -(-mixes.shape[0] // _THREADS))
    kernel(m)[blocks, _THREADS, stream](mixes, base, scale, hc_eps, iters, pre, post, comb)


@torch.compiler.disable  # a launch through the driver: torch.compile leaves it as a call of its own
def hc_mix_torch(mixes, base, scale, hc_eps: float, iters: int, m: int):
    """(pre ``[T, m]``, post ``[T, m]``, comb ``[T, m, m]``) from float32 CUDA ``mixes [T, (2 + m) * m]``."""
    numba_cuda = _cuda()
    tokens = mixes.shape[0]
    pre = torch.empty(tokens, m, dtype=torch.float32, device=mixes.device)
    post = torch.empty_like(pre)
    comb = torch.empty(tokens, m, m, dtype=torch.float32, device=mixes.device)
    stream = numba_cuda.external_stream(torch.cuda.current_stream(mixes.device).cuda_stream)
    views = [numba_cuda.as_cuda_array(x, sync=False) for x in (mixes.contiguous(), base, scale, pre, post, comb)]
    launch(views[0], views[1], views[2], hc_eps, iters, m, *views[3:], stream=stream)
    return pre, post, comb
