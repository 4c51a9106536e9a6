"""Run ``ds4d`` with the GGUF block-wise launches of sweeps' JSON files in place of the defaults, in the same
process: ``python3 tests/gpu/with_launches.py LAUNCHES.json[,TILES.json]|- ARGS...`` (``-``: the defaults).  A
file's types take ``gguf_matmul.BLOCKWISE``'s GEMV launches (``gguf_gemv_sweep.py``), its ``"tiles"`` entry the
tiles' (``BLOCKWISE_TILES``, ``gguf_tiles_sweep.py``)."""

from __future__ import annotations

import json
import sys

from ds4d.cli import main
from ds4d.cuda import gguf_matmul

if __name__ == "__main__":
    if sys.argv[1] != "-":
        for path in sys.argv[1].split(","):
            with open(path) as f:
                launches = json.load(f)
            gguf_matmul.BLOCKWISE_TILES.update(launches.pop("tiles", {}))
            gguf_matmul.BLOCKWISE.update(launches)
        print(f"GGUF block-wise launches: {json.dumps(gguf_matmul.BLOCKWISE)}, tiles "
              f"{json.dumps(gguf_matmul.BLOCKWISE_TILES)}", flush=True)
    sys.exit(main(sys.argv[2:]))
