"""A second CUDA stream for the part of a step that does not depend on the work beside it.

``beside(fn, *args)`` queues ``fn(*args)`` on the device's side stream behind everything the current
stream has queued so far, and returns its result; ``rejoin(result)`` makes the current stream wait for
the side stream before anything reads that result.  Captured in a CUDA graph, the two streams' work
becomes two branches of the graph, which the GPU runs at the same time: the small kernels of one
branch (a decode step's routing, bound by latency) run while the other branch reads its weights.

For a device that is not a CUDA device both calls are plain: ``fn`` runs where it is called.

Both calls are hidden from ``torch.compile`` (its graphs do not carry the stream switch), so ``fn``
runs eagerly: it should be made of launches of its own (the weight kernels, a Triton SwiGLU), not of
small torch operators that inductor would otherwise have fused.

The caching allocator is told about each tensor argument and result used on the other stream
(``record_stream``), so no block is handed out again while the other stream may still read it; during a
graph capture it keeps such blocks until the capture ends.  Tensors inside other arguments (a layer's
weights) are not recorded: they must outlive the step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_SIDE: dict[int, torch.cuda.Stream] = {}


def _side(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE:
        _SIDE[index] = torch.cuda.Stream(device=index)
    return _SIDE[index]


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


@torch.compiler.disable
def beside(fn: Callable, device: torch.device, *args):
    """``fn(*args)`` on ``device``'s side stream, after what the current stream has queued (on a
    CUDA ``device``); its result is not to be read before :func:`rejoin`."""
    if device.type != "cuda":
        return fn(*args)
    main, side = torch.cuda.current_stream(device), _side(device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        result = fn(*args)
    for t in _tensors(args):
        if t.is_cuda:
            t.record_stream(side)
    return result


@torch.compiler.disable
def rejoin(result, device: torch.device):
    """``result`` of :func:`beside`, once the current stream has waited for the side stream."""
    if device.type != "cuda":
        return result
    main = torch.cuda.current_stream(device)
    main.wait_stream(_side(device))
    for t in _tensors(result):
        t.record_stream(main)
    return result
