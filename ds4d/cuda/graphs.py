"""CUDA graphs of a step function, captured once per shape bucket and replayed.

A decode step is a few hundred small kernels whose launch cost exceeds their
run time at small batch sizes.  :class:`GraphCache` captures the step for
each bucket key the first time it is seen (after a warm-up run on a side
stream, as capture requires) and afterwards only copies the new inputs into
the captured input buffers and replays.  All graphs share one memory pool.

The step function must be capturable: no host synchronisation, no shapes that
depend on data, and every input that changes between steps passed in the input
tensors (anything else it reads, such as weights and cache tensors, must keep
its address for as long as the graphs live: call :meth:`clear` when those are
reallocated).  The warm-up run executes the step for real, so running the same
step twice must leave the same state, which holds for a decode step that
writes each new token's state at an index derived from its position.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch


def bucket(n: int) -> int:
    """The next power of two (decode batches and block tables are padded to these sizes)."""
    return 1 << max(0, n - 1).bit_length()


def decode_buckets(max_rows: int, max_blocks: int, min_width: int = 8) -> list[tuple[int, int]]:
    """Every (batch, block-table width) bucket a decode step of at most ``max_rows`` sequences of at most
    ``max_blocks`` blocks each can land in, smallest first (widths start at ``min_width``)."""
    widths = []
    width = min_width
    while True:
        widths.append(width)
        if width >= max_blocks:
            break
        width *= 2
    rows = [1 << n for n in range(bucket(max(max_rows, 1)).bit_length())]
    return [(r, w) for w in widths for r in rows]


def compiled(step: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``step`` through ``torch.compile`` for capture in graphs: inductor fuses the many small
    elementwise kernels of a step (Triton kernels the step calls stay calls of their own); each new
    bucket compiles once, tens of seconds, on first use."""
    import torch._dynamo

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    return torch.compile(step, dynamic=False)


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, ...]
    output: torch.Tensor


class GraphCache:
    def __init__(self, step: Callable[..., torch.Tensor], *, warmup_runs: int = 1) -> None:
        self.step = step
        self.warmup_runs = warmup_runs
        self._graphs: dict[Hashable, _Captured] = {}
        self._pool = None

    def __len__(self) -> int:
        return len(self._graphs)

    def run(self, key: Hashable, *inputs: torch.Tensor) -> torch.Tensor:
        """``step(*inputs)`` through the graph captured for ``key`` (captured now if new).

        The result is the graph's output buffer: the next replay overwrites it."""
        captured = self._graphs.get(key)
        if captured is None:
            captured = self._graphs[key] = self._capture(inputs)
        else:
            for buffer, value in zip(captured.inputs, inputs):
                buffer.copy_(value, non_blocking=True)
        captured.graph.replay()
        return captured.output

    def clear(self) -> None:
        """Destroy the graphs now (a graph holding NCCL work keeps its communicator busy until then)."""
        for captured in self._graphs.values():
            captured.graph.reset()
        self._graphs.clear()
        self._pool = None

    def _capture(self, inputs: tuple[torch.Tensor, ...]) -> _Captured:
        buffers = tuple(t.clone() for t in inputs)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup_runs):
                self.step(*buffers)
        torch.cuda.current_stream().wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            output = self.step(*buffers)
        return _Captured(graph, buffers, output)


class EagerBuckets:
    """:class:`GraphCache`'s interface without capture: each step runs eagerly at its bucket's padded
    shapes.  Lets a CPU run the exact padded decode path the graphs replay (tests)."""

    def __init__(self, step: Callable[..., torch.Tensor]) -> None:
        self.step = step
        self.keys: set[Hashable] = set()

    def __len__(self) -> int:
        return len(self.keys)

    def run(self, key: Hashable, *inputs: torch.Tensor) -> torch.Tensor:
        self.keys.add(key)
        return self.step(*inputs)

    def clear(self) -> None:
        self.keys.clear()
