"""Run ``ds4d`` with the GGUF block-wise GEMV launches of a sweep's JSON (``gguf_gemv_sweep.py LAUNCHES.json``)
in place of ``gguf_matmul.BLOCKWISE``'s, in the same process: ``python3 tests/gpu/with_launches.py
LAUNCHES.json|- ARGS...`` (``-``: the defaults)."""

from __future__ import annotations

import json
import sys

from ds4d.cli import main
from ds4d.cuda import gguf_matmul

if __name__ == "__main__":
    if sys.argv[1] != "-":
        with open(sys.argv[1]) as f:
            gguf_matmul.BLOCKWISE.update(json.load(f))
        print(f"GGUF block-wise launches: {json.dumps(gguf_matmul.BLOCKWISE)}", flush=True)
    sys.exit(main(sys.argv[2:]))
