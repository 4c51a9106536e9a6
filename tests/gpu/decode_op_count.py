"""Count what a DeepSeek-V4 decode step's attention layer dispatches, on the CPU: torch operators that produce
data (views and metadata excluded; in eager CUDA each is about one kernel launch; inside CUDA graphs each is
one node) and Triton launches, for each layer kind, on the torch decode path and with
``ForwardPaths.decode_kernel``.  The attention layer is ``decode.decode_attention``: projections, compressors,
indexer, attention, output projection.  The counts do not depend on the widths (tiny models here).

    TRITON_INTERPRET=1 PYTHONPATH=. python3 tests/gpu/decode_op_count.py
"""

from __future__ import annotations

import collections
import functools
import os
import tempfile

from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from ds4d.contracts import ForwardBatch, SeqChunk
from ds4d.cuda import decode_kernels, decode_triton, prefill_triton
from ds4d.models.deepseek_v4 import load_model, write_tiny_checkpoint
from ds4d.models.deepseek_v4 import model as v4_model
from ds4d.models.deepseek_v4.paths import ForwardPaths

METADATA = {"view", "_unsafe_view", "expand", "unsqueeze", "squeeze", "t", "transpose", "permute", "select", "slice",
            "as_strided", "alias", "detach", "lift_fresh", "split", "split_with_sizes", "unbind", "chunk",
            "_reshape_alias", "reshape", "flatten", "unflatten", "diagonal", "narrow", "empty", "empty_like",
            "empty_strided", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "dim", "size", "stride"}


class Count(TorchDispatchMode):
    """Counts the data-producing operators dispatched while it is on."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in METADATA:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def counted(kernel, name: str, launches: collections.Counter):
    """``kernel`` (``kernel[grid](...)``) whose launches are counted and run with the counting mode off
    (Triton's interpreter runs torch operators of its own)."""

    class Launcher:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches[name] += 1
                with _disable_current_modes():
                    return kernel[grid](*args, **kwargs)
            return launch

    return Launcher()


class CountedKernels:
    """``decode_kernels``, each kernel :func:`counted`."""

    def __init__(self, launches: collections.Counter) -> None:
        self.launches = launches

    def __getattr__(self, name: str):
        return counted(getattr(decode_kernels, name), name, self.launches)


def main() -> int:
    launches: collections.Counter = collections.Counter()
    decode_triton._state["kernels"] = CountedKernels(launches)
    norm_rope = prefill_triton._kernels()  # the projections' norms and RoPE take these kernels on that path
    prefill_triton._state["kernels"] = {name: counted(kernel, name, launches) for name, kernel in norm_rope.items()}
    counts: list[tuple[int, int]] = []
    attend = v4_model.decode_attention

    @functools.wraps(attend)
    def counted_attention(*args, **kwargs):
        before = sum(launches.values())
        with Count() as count:
            out = attend(*args, **kwargs)
        counts.append((sum(count.ops.values()), sum(launches.values()) - before))
        return out

    v4_model.decode_attention = counted_attention
    kinds = {"sliding window only": 0, "CSA (ratio 4, with its indexer)": 4, "HCA (ratio 128)": 128}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = load_model(write_tiny_checkpoint(os.path.join(tmp, "ckpt"), layers=list(kinds.values()), seed=1))
        ids = list(range(1000, 1301))
        for kernel in (False, True):
            run = model.with_paths(ForwardPaths(fast_path=True, decode_kernel=kernel))
            run.allocate_cache(8, 2)
            run.forward(ForwardBatch((SeqChunk(0, tuple(ids[:300]), 0, (1, 2, 3), 1),)))
            counts.clear()
            run.forward(ForwardBatch((SeqChunk(0, (ids[300],), 300, (1, 2, 3), 1),)))
            rows.append(list(counts))
    print("| layer kind | torch decode path: operators | decode kernels: operators + Triton launches |")
    print("|---|---|---|")
    for name, (plain, _), (ops, triton) in zip(kinds, *rows, strict=True):
        print(f"| {name} | {plain} | {ops} + {triton} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
