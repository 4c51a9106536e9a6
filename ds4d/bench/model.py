"""`ds4d bench model`: DeepSeek-V4 on a GPU, ds4d vs HF transformers (see the module that replaces this)."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser("model", help="random DeepSeek-V4 model on a GPU vs HF transformers")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    print("ds4d bench model: not built yet")
    return 1
