"""Which prompt steps pay a first-use cost after the warm-up: fresh prompts of lengths the warm-up did not
meet, each timed three times (first, then twice with other tokens of the same length), in one process, on an
engine over a warmed-up model; then the profiler's op table for a new length's first and second run.

Usage: python tests/gpu/first_use_shapes.py CONFIG_DIR   (random weights for CONFIG_DIR/config.json, CUDA)
       LENGTHS=5000,2600 the prompt lengths; PROFILED=5555 the profiled one; DEVICE=cpu a smoke run on a tiny config
"""

from __future__ import annotations

import os
import random
import sys
import time

import torch

from ds4d.cache.blocks import BlockPool
from ds4d.cache.manager import PrefixCache
from ds4d.engine.offline import OfflineEngine, default_policy
from ds4d.engine.request import EngineRequest, SamplingParams
from ds4d.engine.warmup import warm_up
from ds4d.models.deepseek_v4 import load_model

CONTEXT, CHUNK, STEP = 32768, 4096, 8192
DEVICE = os.environ.get("DEVICE", "cuda")  # cpu: a smoke run of this script on a tiny config
model = load_model(sys.argv[1], dtype=torch.bfloat16 if DEVICE == "cuda" else torch.float32, device=DEVICE,
                   weight_format="native" if DEVICE == "cuda" else "dense", load_format="random")
sync = torch.cuda.synchronize if DEVICE == "cuda" else (lambda: None)
LENGTHS = [int(n) for n in os.environ.get("LENGTHS", "5000,3300,4500,6100,2600,1249,904,3616,7000,12345").split(",")]
blocks = 4 * CONTEXT // model.info.block_size_tokens
model.allocate_cache(blocks, 4)
report = warm_up(model, default_policy(), num_blocks=blocks, max_num_seqs=4, step_tokens=STEP, prefill_chunk=CHUNK,
                 max_context=CONTEXT, lookahead=True, checkpoints=64, checkpoint_every_tokens=8192)
print(report.line(), flush=True)
cache = PrefixCache(BlockPool(blocks, model.info.block_size_tokens), model=model,
                    block_bytes=model.info.cache_bytes_per_block, checkpoints=64, checkpoint_every_tokens=8192)
engine = OfflineEngine(model, max_num_seqs=4, prefill_chunk=CHUNK, step_tokens=STEP, cache=cache, lookahead=True,
                       publish=lambda outputs: None)
rng = random.Random(0)
names = iter(range(1_000_000))


def prompt_seconds(length: int, prefix: list[int] | None = None) -> float:
    tokens = (prefix or []) + [rng.randrange(1000, 120000) for _ in range(length)]
    sync()
    began = time.perf_counter()
    engine.submit(EngineRequest(f"p{next(names)}", tuple(tokens), SamplingParams(temperature=0.0, max_tokens=1,
                                                                                 ignore_eos=True)))
    while engine.has_work:
        engine.step()
    sync()
    return time.perf_counter() - began


print("| prompt tokens | first ms | second ms | third ms |\n|---|---|---|---|")
for length in LENGTHS:
    times = [prompt_seconds(length) * 1e3 for _ in range(3)]
    print(f"| {length} | {times[0]:.1f} | {times[1]:.1f} | {times[2]:.1f} |", flush=True)

from torch.profiler import ProfilerActivity, profile  # noqa: E402

for label in ("first", "second"):
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        seconds = prompt_seconds(int(os.environ.get("PROFILED", "5555")))
    print(f"\n## {os.environ.get('PROFILED', '5555')} tokens, {label}: {seconds * 1e3:.1f} ms; top ops by CPU time (self)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60))
