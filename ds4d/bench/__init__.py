"""`ds4d bench`: benchmarks whose results go into docs/BENCHMARKS.md.

    ds4d bench embedded   CPU: the embedded GGUF model through the engine vs llama.cpp on the same file
    ds4d bench model      GPU: a random DeepSeek-V4 model of real widths, ds4d vs HF transformers
    ds4d bench parallel   GPUs: that model split over several GPUs (NCCL) vs the same model on one
    ds4d bench serve      HTTP: concurrent streaming chat load with cancellations against a running server
    ds4d bench agent      HTTP: time to first token of an agent's next step, prefix reused vs cold
"""

from __future__ import annotations

import argparse


def add_parsers(parser: argparse.ArgumentParser) -> None:
    """One subcommand per kind under `parser` (ds4d bench's), each declaring its own options and
    setting ``run``, the function that runs it.  The kinds' modules import no torch at the top, so
    building ds4d's parser stays cheap."""
    from ds4d.bench import agent, embedded, model, parallel, serve

    kinds = parser.add_subparsers(dest="kind", metavar="KIND", required=True)
    for kind in (embedded, model, parallel, serve, agent):
        kind.add_parser(kinds)
