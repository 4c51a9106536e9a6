"""A profiled decode step's kernels, layer by layer and by kind, from the trace that
``ds4d bench model --profile --profile-trace FILE`` writes (``FILE``'s stem + the path + ``.tsv``: one line a
kernel in the order they ran, with its start, time and the gap before it, in microseconds).

A layer starts at its first hyper-connection boundary (``boundary_mixes_kernel``; each layer has two, before
its attention and before its feed-forward), so the trace of a path without the two-launch boundary is one
segment.  The kernels before the first layer (the embedding, the step's inputs) are left out; the last
segment holds the last layer with the head and the token's choice after it.  ``bench model --profile
--profile-trace`` prints this table after each trace it writes; it reads no GPU, so it also runs where a trace was
copied to:

    python3 -m ds4d.bench.trace_layers out/trace.graphs.tsv [--small 2.2]
"""

from __future__ import annotations

import argparse
import csv
from dataclasses import dataclass, field

KINDS = (  # (kind, kernel name prefixes), the first that matches names the kind
    ("FP8 GEMV", ("fp8_rows_kernel",)),
    ("MXFP4 GEMV", ("mxfp4_rows_kernel",)),
    ("float32 rows GEMV", ("rows_kernel",)),
    ("GGUF GEMV", ("gemv_kernel", "iq2_xxs_kernel", "q2_k_kernel", "q8_0_kernel", "quantize_kernel")),
    ("cuBLAS", ("nvjet", "void cutlass", "void cublas", "sm90_", "ampere_")),
    ("hyper-connection boundary", ("boundary_mixes_kernel", "boundary_collapse_kernel")),
    ("decode kernels", ("decode_attention_kernel", "combine_kernel", "compress_kernel", "norm_rope_kernel",
                        "qkv_norms_kernel")),
    ("routing kernel", ("route_kernel",)),
)
LAYER_START = "boundary_mixes_kernel"


@dataclass
class Segment:
    kernels: int = 0
    time_us: float = 0.0
    gaps_us: float = 0.0
    kinds: dict[str, float] = field(default_factory=dict)


def kind_of(name: str, time_us: float, small_us: float) -> str:
    for kind, prefixes in KINDS:
        if name.startswith(prefixes):
            return kind
    return f"other, each under {small_us:g} us" if time_us < small_us else "other: " + name[:60]


def read(path: str) -> list[tuple[float, float, str]]:
    """(time, gap before, name) of each line of the trace."""
    with open(path, newline="") as f:
        return [(float(row["time_us"]), float(row["gap_us"]), row["name"]) for row in csv.DictReader(f, delimiter="\t")]


def layers(rows: list[tuple[float, float, str]], small_us: float = 2.2) -> list[Segment]:
    """The trace's kernels (memory copies left out) split into layers (every second boundary starts one; the whole
    step where there is none), each with its kernels' count, time, the gaps before them and the time of each kind."""
    rows = [row for row in rows if not row[2].startswith("Memcpy")]
    starts = [i for i, (_, _, name) in enumerate(rows) if name.startswith(LAYER_START)][::2] or [0]
    segments = []
    for begin, end in zip(starts, starts[1:] + [len(rows)]):
        seg = Segment()
        for time_us, gap_us, name in rows[begin:end]:
            seg.kernels += 1
            seg.time_us += time_us
            seg.gaps_us += gap_us
            kind = kind_of(name, time_us, small_us)
            seg.kinds[kind] = seg.kinds.get(kind, 0.0) + time_us
        segments.append(seg)
    return segments


def table(segments: list[Segment]) -> str:
    kinds = sorted({k for s in segments for k in s.kinds}, key=lambda k: -sum(s.kinds.get(k, 0.0) for s in segments))
    head = ["kind"] + [f"layer {i}" + (" (+ head)" if i == len(segments) - 1 and len(segments) > 1 else "")
                       for i in range(len(segments))]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for k in kinds:
        lines.append("| " + " | ".join([k] + [f"{s.kinds.get(k, 0.0):.1f}" for s in segments]) + " |")
    lines.append("| " + " | ".join(["gaps"] + [f"{s.gaps_us:.1f}" for s in segments]) + " |")
    lines.append("| " + " | ".join(["kernels: count, us"] + [f"{s.kernels}, {s.time_us:.1f}" for s in segments]) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace")
    p.add_argument("--small", type=float, default=2.2, help="kernels of no named kind under this many us are lumped")
    args = p.parse_args()
    print(table(layers(read(args.trace), args.small)))


if __name__ == "__main__":
    main()
