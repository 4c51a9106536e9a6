"""Where a V4.1 decode step spends its time: wall time, GPU busy time and the top ops.

    PYTHONPATH=. python3 tests/gpu/profile_dsv41.py [--layers 0,0,2,2,1,1] [--batch 1] [--context 1024]

Builds the same random V4.1-Flash-width model as ``ds4d bench model --family
deepseek_v41``, prefills ``--batch`` sequences of ``--context`` tokens, then
profiles a few decode steps through ``DeepseekV41Serving.forward`` and prints
each step's wall time, the summed CUDA kernel time, the kernel count, and the
top ops by self CPU time and by CUDA time.  A tool for reading, not a test.
"""

from __future__ import annotations

import argparse
import time

import torch

from ds4d.bench.dsv41 import DEFAULT_LAYERS, bench_config, random_tensors
from ds4d.contracts import ForwardBatch, SeqChunk
from ds4d.models.deepseek_v41.config import DeepseekV41Config
from ds4d.models.deepseek_v41.model import DeepseekV41Model
from ds4d.models.deepseek_v41.serving import DeepseekV41Serving


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", default=DEFAULT_LAYERS)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    from torch.profiler import ProfilerActivity, profile

    device = torch.device("cuda")
    layers = [int(x) for x in args.layers.split(",")]
    config, tokenizer = bench_config(layers, False, args.experts, 262_144)
    cfg = DeepseekV41Config.from_dict(config, name="random-v41")
    model = DeepseekV41Model.from_tensors(cfg, random_tensors(torch, config, device, 0), tokenizer,
                                          dtype=torch.bfloat16, device=device)
    serving = DeepseekV41Serving(model, tokenizer)
    block = serving.info.block_size_tokens
    per_seq = -(-(args.context + 64) // block)
    serving.allocate_cache(per_seq * args.batch, args.batch)
    tables = [tuple(range(s * per_seq, (s + 1) * per_seq)) for s in range(args.batch)]
    gen = torch.Generator().manual_seed(0)
    nxt = []
    for s in range(args.batch):
        prompt = torch.randint(100, cfg.vocab_size, (args.context,), generator=gen).tolist()
        logits = serving.forward(ForwardBatch((SeqChunk(s, tuple(prompt), 0, tables[s], 1),)))
        nxt.append(int(logits[-1].argmax()))
    position = args.context

    def step() -> None:
        nonlocal nxt, position
        out = serving.forward(ForwardBatch(tuple(SeqChunk(s, (nxt[s],), position, tables[s], 1)
                                                 for s in range(args.batch))))
        nxt = out.argmax(-1).tolist()
        position += 1

    for _ in range(2):
        step()
    walls = []
    for _ in range(args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_us = sum(e.device_time for e in kernels) / args.steps
    print(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=50))
    print(events.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=50))
    print(f"| layers {args.layers} | batch {args.batch} | wall ms/step {min(walls) * 1e3:.2f} | "
          f"GPU kernel ms/step {gpu_us / 1e3:.2f} | kernels/step {len(kernels) / args.steps:.0f} |")


if __name__ == "__main__":
    main()
