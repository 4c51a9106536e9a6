"""Where the wall time of a batch-1 decode step goes: the graph on the GPU against the host around it.

    PYTHONPATH=. python3 tests/gpu/decode_anatomy.py [--native] [--compile] [--lookahead] [--steps 48]

Builds the random model of ``ds4d bench model`` (V4-Flash widths, 4 layers), prefills a 1K prompt
through the engine, then times each decode step: its wall time (``EngineCore.step`` to the
synchronize after it), the GPU time of the graph replay (CUDA events around it, so the gaps
between the graph's kernels count), and the host time before the replay is launched and after the
tokens are back.  With ``--lookahead`` (the engine queueing each step behind the one before) nothing
is synchronised between steps and the wall time is from one ``step()`` return to the next.  A tool
for reading, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from ds4d.bench import random_v4
from ds4d.bench.harness import make_engine
from ds4d.engine.request import EngineRequest, SamplingParams


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--native", action="store_true")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--lookahead", action="store_true")
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--layers", default="0,0,4,128")
    args = parser.parse_args()
    build_args = argparse.Namespace(config="", tiny=False, layers=args.layers, dtype="bfloat16", seed=0, no_hf=True,
                                    native=args.native, device="cuda")
    cfg, _, built, _, _ = random_v4.build(torch, build_args, torch.device("cuda"))
    model = random_v4.on_path(built, "graphs", built.paths.replace(compile_decode=args.compile))
    engine = make_engine(model, max_num_seqs=1, context_tokens=1024 + 2 * args.steps + 64, prefill_chunk=2048,
                         lookahead=args.lookahead)
    prompt = torch.randint(100, cfg.vocab_size, (1024,), generator=torch.Generator().manual_seed(0)).tolist()

    marks: dict[str, list[float]] = {k: [] for k in ("launch", "graph_gpu", "sample", "wall")}
    graphs = model._graphs
    run_graph, collect = graphs.run, engine.runner.sampler.collect
    step_began = [0.0]

    def timed_run(key, *inputs):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        marks["launch"].append(time.perf_counter() - step_began[0])
        begin.record()
        out = run_graph(key, *inputs)
        end.record()
        timed_run.events = (begin, end)
        return out

    def timed_collect(*a, **k):
        t0 = time.perf_counter()
        out = collect(*a, **k)
        marks["sample"].append(time.perf_counter() - t0)
        return out

    graphs.run, engine.runner.sampler.collect = timed_run, timed_collect
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 8, ignore_eos=True)
    engine.submit(EngineRequest("anatomy", tuple(prompt), params))
    for values in marks.values():
        values.clear()
    events = []
    step_began[0] = time.perf_counter()
    while engine.has_work:
        if not args.lookahead:
            torch.cuda.synchronize()
            step_began[0] = time.perf_counter()
        engine.step()
        if not args.lookahead:
            torch.cuda.synchronize()
        now = time.perf_counter()
        marks["wall"].append(now - step_began[0])
        step_began[0] = now
        if hasattr(timed_run, "events"):
            events.append(timed_run.events)
            del timed_run.events
    torch.cuda.synchronize()
    marks["graph_gpu"] = [begin.elapsed_time(end) / 1e3 for begin, end in events]
    skip = 4  # the prefill step and the steps that capture or compile
    rows = {k: statistics.median(v[skip:]) * 1e3 for k, v in marks.items() if len(v) > skip}
    print(f"decode b1 @1K, {'native' if args.native else 'bf16'}{', compiled' if args.compile else ''}"
          f"{', steps queued ahead' if args.lookahead else ''}: "
          f"{len(marks['wall']) - skip} steps, medians in ms")
    print("| wall | launched after | graph on GPU | token read-back (waits for the GPU) | wall - graph |")
    print("|---|---|---|---|---|")
    print(f"| {rows['wall']:.3f} | {rows['launch']:.3f} | {rows['graph_gpu']:.3f} | {rows['sample']:.3f} | "
          f"{rows['wall'] - rows['graph_gpu']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
