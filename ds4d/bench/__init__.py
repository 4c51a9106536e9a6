"""`ds4d bench`: benchmarks whose results go into docs/BENCHMARKS.md.

    ds4d bench embedded   CPU: the embedded GGUF model through the engine vs llama.cpp on the same file
    ds4d bench model      GPU: a random DeepSeek-V4 model of real widths, ds4d vs HF transformers
    ds4d bench parallel   GPUs: that model split over several GPUs (NCCL) vs the same model on one
    ds4d bench serve      HTTP: concurrent streaming chat load with cancellations against a running server
    ds4d bench agent      HTTP: time to first token of an agent's next step, prefix reused vs cold
"""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> int:
    from ds4d.bench import agent, embedded, model, parallel, serve

    parser = argparse.ArgumentParser(prog="ds4d bench")
    sub = parser.add_subparsers(dest="which", required=True)
    embedded.add_parser(sub)
    model.add_parser(sub)
    parallel.add_parser(sub)
    serve.add_parser(sub)
    agent.add_parser(sub)
    args = parser.parse_args(argv)
    return args.run(args)
