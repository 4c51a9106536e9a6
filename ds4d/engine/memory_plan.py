"""The GPU memory plan printed at start, and the KV/state pool sized to fit it.

What a GPU holds while ds4d serves: the weights (measured: bytes allocated on
the device once the model has loaded, including hot expert banks and staging),
activations (measured: the peak of one profiling step as large as the scheduler
can form, ``step_tokens`` of prompt in chunks of ``prefill_chunk``, one sequence
each, every chunk at the end of a ``max_context``-token prompt, and of any shorter context the model
names where its attention is heavier), CUDA graphs (a fixed reserve: decode buckets
are captured lazily, after start), and the KV/state pool.  The pool takes what
``gpu_memory_utilization`` of the device leaves after the other three (and at
most ``kv_cache_gib``); an explicit ``kv_cache_tokens`` that does not fit is
refused at start rather than failing on the first long prompt.  The rest of the
device is headroom (the CUDA context, allocator slack, other processes).

Only the arithmetic and the profiling step live here; ``ds4d.kernel`` asks a
:class:`DeviceMemory` (``torch.cuda`` on a GPU) for the numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ds4d.config import GIB
from ds4d.contracts import ForwardBatch, Model, ModelInfo, SeqChunk

GRAPH_RESERVE_BYTES = 1 << 30
"""Kept for the decode CUDA graphs' memory pools (captured per batch bucket after start)."""


class DeviceMemory(Protocol):
    def total(self) -> int: ...
    def allocated(self) -> int: ...
    def reset_peak(self) -> None: ...
    def peak(self) -> int: ...


class CudaMemory:
    """:class:`DeviceMemory` of one CUDA device (each read after a synchronize)."""

    def __init__(self, device) -> None:
        import torch

        self.torch, self.device = torch, torch.device(device)

    def total(self) -> int:
        return int(self.torch.cuda.mem_get_info(self.device)[1])

    def allocated(self) -> int:
        self.torch.cuda.synchronize(self.device)
        return int(self.torch.cuda.memory_allocated(self.device))

    def reset_peak(self) -> None:
        self.torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        self.torch.cuda.synchronize(self.device)
        return int(self.torch.cuda.max_memory_allocated(self.device))


class MemoryPlanError(ValueError):
    """The configured KV pool does not fit the GPU next to the weights, activations and graphs."""


@dataclass(frozen=True)
class GpuMemoryPlan:
    device: str
    total: int
    utilization: float
    weights: int
    activations: int
    profiled: tuple[int, ...]
    """The chunk lengths of the profiling step."""
    graphs: int = GRAPH_RESERVE_BYTES
    kv_bytes: int = 0

    @property
    def kv_budget(self) -> int:
        """What the KV/state pool may take."""
        return max(0, int(self.total * self.utilization) - self.weights - self.activations - self.graphs)

    @property
    def headroom(self) -> int:
        return self.total - self.weights - self.activations - self.graphs - self.kv_bytes

    def pool_tokens(self, wanted: int, *, block_bytes: int, block_tokens: int, state_bytes: int,
                    explicit: bool) -> int:
        """``wanted`` pool tokens, or fewer (whole blocks) when the budget holds fewer; ``explicit``
        (``kv_cache_tokens`` given): refuse instead of shrinking."""
        fits = max(0, self.kv_budget - state_bytes) // max(block_bytes, 1) * block_tokens
        if wanted <= fits:
            return wanted
        if explicit or fits < block_tokens:
            need = -(-wanted // block_tokens) * block_bytes + state_bytes
            raise MemoryPlanError(
                f"a KV pool of {wanted} tokens needs {need / GIB:.2f} GiB on {self.device}; the memory plan "
                f"leaves {self.kv_budget / GIB:.2f} GiB ({self.utilization:.0%} of {self.total / GIB:.1f} GiB, less "
                f"weights {self.weights / GIB:.2f}, activations {self.activations / GIB:.2f}, graphs "
                f"{self.graphs / GIB:.2f}): lower kv_cache_tokens, max_num_seqs or step_tokens, "
                "or raise gpu_memory_utilization")
        return fits

    def lines(self) -> list[str]:
        step = f"{len(self.profiled)} x {self.profiled[0]}" if len(set(self.profiled)) == 1 else \
            " + ".join(map(str, self.profiled))
        rows = [("weights (measured after load)", self.weights),
                (f"activations (peak of a step of {step} tokens)", self.activations),
                ("CUDA graphs (reserve)", self.graphs), ("KV/state pool", self.kv_bytes),
                ("headroom", self.headroom)]
        head = f"GPU memory plan on {self.device}: {self.total / GIB:.1f} GiB, {self.utilization:.0%} planned"
        return [head] + [f"  {name:<44} {size / GIB:8.2f} GiB" for name, size in rows]

    def as_dict(self) -> dict:
        return {"device": self.device, "total_bytes": self.total, "utilization": self.utilization,
                "weights_bytes": self.weights, "activations_bytes": self.activations,
                "profiled_chunks": list(self.profiled), "graphs_bytes": self.graphs, "kv_bytes": self.kv_bytes,
                "headroom_bytes": self.headroom}


def step_chunks(step_tokens: int, prefill_chunk: int, max_num_seqs: int, max_context: int) -> list[int]:
    """The largest prefill step the scheduler can form: chunks of ``prefill_chunk`` tokens (at most
    ``max_context``), one per sequence, up to ``step_tokens`` in all and ``max_num_seqs`` sequences."""
    chunk, left, sizes = max(1, min(prefill_chunk, max_context)), step_tokens, []
    while left > 0 and len(sizes) < max_num_seqs:
        sizes.append(min(chunk, left))
        left -= sizes[-1]
    return sizes


def profile_activations(model: Model, info: ModelInfo, chunks: list[int], memory: DeviceMemory,
                        contexts: Sequence[int]) -> int:
    """Peak bytes one forward of prompt chunks (one sequence each, ``chunks`` tokens long) adds on the
    device, each chunk the last piece of a ``context``-token prompt: attention over the compressed
    entries, the indexer's scores and the window all grow with the context, so the end of the longest
    prompt the daemon accepts is the largest step it can meet, unless the model switches to a leaner
    path past some length: every one of ``contexts`` (the model's ``activation_probe_contexts``) is
    probed and the largest peak counts."""
    return max(_profile_step(model, info, chunks, memory, context) for context in contexts)


def _profile_step(model: Model, info: ModelInfo, chunks: list[int], memory: DeviceMemory, context: int) -> int:
    """One profiling forward at the end of a ``context``-token prompt.  The blocks before a chunk's own
    are one shared block (the values do not matter, the shapes do), so the cache holds just the blocks
    the chunks write plus that one (the caller allocates the real cache afterwards).  A model whose
    sequences carry a state that a chunk must continue from exactly its start (DeepSeek-V4.1) is asked
    for one standing there (``place_probe_state(slot, position)``: shapes right, values anything)."""
    first = min(100, max(info.vocab_size - 1, 0))
    span = max(info.vocab_size - first, 1)
    block = info.block_size_tokens
    seqs, next_block = [], 1  # block 0: the shared prefix
    for slot, tokens in enumerate(chunks):
        start = max(0, context - tokens)
        own = (start + tokens - 1) // block - start // block + 1
        ids = tuple(first + (i * 7919 + slot) % span for i in range(tokens))
        table = (0,) * (start // block) + tuple(range(next_block, next_block + own))
        seqs.append(SeqChunk(slot, ids, start, table, 1))
        next_block += own
    model.allocate_cache(next_block, len(chunks))
    place = getattr(model, "place_probe_state", None)
    for chunk in seqs:
        if place is not None and chunk.start_pos:
            place(chunk.state_slot, chunk.start_pos)
    base = memory.allocated()
    memory.reset_peak()
    model.forward(ForwardBatch(tuple(seqs)))
    return max(0, memory.peak() - base)
