"""Numba CUDA kernel for the hyper-connection mixing weights (pre, post, Sinkhorn comb).

Turning a token's ``(2 + m) * m`` mixing logits into ``pre``, ``post`` and the
doubly-stochastic ``comb`` takes about 130 tiny tensor ops in torch (20
Sinkhorn iterations of row and column normalisation), run twice per layer;
at decode batch sizes their launch cost dominates the whole step.  Here one
kernel does it all: ``m * m`` threads per token, one per matrix cell, the
matrix in shared memory, same formulas (``ds4d.models.deepseek_v4.hyper`` is
the reference), in float32.

Numba is imported on first use only; :func:`available` says whether it can be.
The kernel runs on torch's current stream and reads torch tensors in place, so
it can be captured in a CUDA graph.  Under ``NUMBA_ENABLE_CUDASIM=1`` the
kernel runs on numpy arrays on the CPU (that is how the tests check it).
"""

from __future__ import annotations

import math

import torch

MAX_STREAMS = 8  # m * m cells must fit in one block
_THREADS = 128
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


def _hc_mix(mixes, base, scale, hc_eps, iters, m, pre, post, comb):
    # one thread per comb cell, m * m threads per token, the matrix in shared memory
    cells = m * m
    shared = cuda.shared.array(_THREADS, float32)
    tid = cuda.threadIdx.x
    local = tid // cells
    cell = tid - local * cells
    i = cell // m
    j = cell - i * m
    t = cuda.blockIdx.x * (_THREADS // cells) + local
    live = t < mixes.shape[0] and local < _THREADS // cells
    src = t if live else 0
    eps = float32(hc_eps)
    first = local * cells if local < _THREADS // cells else 0  # threads past the last whole token read token 0
    row, col = first + i * m, first + j
    v = mixes[src, 2 * m + cell] * scale[2] + base[2 * m + cell]
    shared[tid] = v
    cuda.syncthreads()
    top = shared[row]
    for k in range(1, m):
        top = max(top, shared[row + k])
    v = math.exp(v - top)
    cuda.syncthreads()
    shared[tid] = v
    cuda.syncthreads()
    total = float32(0.0)
    for k in range(m):
        total += shared[row + k]
    v = v / total + eps
    for step in range(2 * iters - 1):  # column, then (row, column) iters - 1 times
        cuda.syncthreads()
        shared[tid] = v
        cuda.syncthreads()
        total = float32(0.0)
        if step % 2 == 0:
            for k in range(m):
                total += shared[col + k * m]
        else:
            for k in range(m):
                total += shared[row + k]
        v = v / (total + eps)
    if live:
        comb[t, i, j] = v
        if j == 0:
            one = float32(1.0)
            pre[t, i] = one / (one + math.exp(-(mixes[t, i] * scale[0] + base[i]))) + eps
            post[t, i] = float32(2.0) / (one + math.exp(-(mixes[t, m + i] * scale[1] + base[m + i])))


def kernel():
    """The jitted kernel ``(mixes, base, scale, hc_eps, iters, m, pre, post, comb)``."""
    global cuda, float32
    if "kernel" not in _state:
        cuda = _cuda()
        from numba import float32 as f32

        float32 = f32
        _state["kernel"] = cuda.jit(_hc_mix)
    return _state["kernel"]


def launch(mixes, base, scale, hc_eps: float, iters: int, m: int, pre, post, comb, stream=0) -> None:
    """Run the kernel on arrays numba accepts (device arrays, or numpy under the simulator)."""
    if m > MAX_STREAMS:
        raise ValueError(f"hc_mult {m} exceeds the kernel's {MAX_STREAMS}")
    tokens = mixes.shape[0]
    blocks = max(1, -(-tokens // (_THREADS // (m * m))))
    kernel()[blocks, _THREADS, stream](mixes, base, scale, hc_eps, iters, m, pre, post, comb)


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
