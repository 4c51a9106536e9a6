"""`ds4d bench parallel`: one random DeepSeek-V4 model split over several GPUs against the same model on one.

Every row runs the very same random weights: the random reader draws each
tensor from a generator seeded by its name, so each rank of a split model draws
only its own layers and experts.  Rows, for prefill of one 2K-token prompt and
for decode at 1K context per batch size:

* ``1 GPU``: the single-process model (CUDA graphs for decode), what a
  one-GPU deployment runs;
* ``1 GPU, sharded step``: the sharded step on a single rank (no graphs): the
  base of the scaling ratios, since the split layouts run that same step;
* each layout asked for (``ep``, ``pp``, ``2x2`` ...) on the GPUs given.

Floors (BENCH.md's formulas, with the copy bandwidth and matmul rate of one GPU
measured at the start): routed experts split over ``ep`` GPUs divide their
bytes and FLOPs by ``ep``; stages run one after another, so they divide
nothing.  A split row's links are timed on its ranks at the sizes its steps
send (``ParallelDeepseekV4Model.transfer_seconds``: an all-reduce of the routed
output a layer, the streams at each stage boundary, the logits back to rank 0),
and a second floor adds them to the first, less the shared expert each
all-reduce runs beside.  Each split model's logits on a 256-token prompt are
compared with the single-process model's (in bf16 the routed outputs are summed
in another order, so they differ by rounding).  ``--gpus cpu:N`` runs N CPU
processes over gloo (a smoke test with ``--tiny``).

``--depth full`` builds every layer (V4-Flash's 43, or ``--config``'s own, such
as V4-Pro's 61), which one GPU cannot hold: ``--expert-gpu-fraction`` keeps that
share of the one-GPU row's routed experts on its device and the rest in host RAM
(the same logits), so the split layouts are measured against the one-GPU
deployment with offload at the same depth.
"""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path

ONE = "1"
"""The layout name of the sharded step on a single GPU."""


def add_parser(sub) -> None:
    p = sub.add_parser("parallel", help="a random DeepSeek-V4 model split over GPUs vs the same model on one")
    p.add_argument("--gpus", default="", help="GPU indices, e.g. 0,1 (default: every visible GPU), or cpu:N")
    p.add_argument("--layouts", default="",
                   help="comma-separated: 1 (sharded step on one GPU), ep, pp, STAGESxEP such as 2x2 "
                        "(default 1,ep,pp; ep,pp with --depth full)")
    p.add_argument("--config", default="", help="a V4 config.json for the widths (default: V4-Flash)")
    p.add_argument("--tiny", action="store_true", help="small widths (a smoke test that also runs on the CPU)")
    p.add_argument("--layers", default="0,0,4,128", help="compress ratio per layer (default: Flash's first 4)")
    p.add_argument("--depth", default="", choices=["", "full"],
                   help="full: every layer of the config (--config's compress_ratios, else V4-Flash's 43)")
    p.add_argument("--expert-gpu-fraction", type=float, default=1.0,
                   help="the one-GPU row: this share of the routed experts on the GPU, the rest in host RAM "
                        "(a full-depth model does not fit one GPU)")
    p.add_argument("--no-single", action="store_true",
                   help="no one-GPU row (a model one GPU and this host's RAM cannot hold, such as V4-Pro): the "
                        "floors from the config's shapes, the logits checked against the first split layout's")
    p.add_argument("--link-reps", type=int, default=20,
                   help="timed runs of each transfer a split step makes (0: the links are not timed)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--batches", default="1,8,64", help="decode batch sizes at 1K context")
    p.add_argument("--prefill", type=int, default=2048, help="prefill prompt tokens")
    p.add_argument("--context", type=int, default=1024, help="decode context tokens")
    p.add_argument("--prefill-chunk", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--native", action="store_true",
                   help="FP8 linears and MXFP4 experts as the release stores them, on every row")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads of each process, the single one included (0: torch's default)")
    p.add_argument("--json", default="", help="also write the results here")
    p.set_defaults(run=run)


def _prompt_logits(torch, model, ids: list[int]):
    """Logits of every position of ``ids`` as one fresh sequence (float32, on the CPU)."""
    from ds4d.contracts import ForwardBatch, SeqChunk

    blocks = -(-len(ids) // model.info.block_size_tokens)
    model.allocate_cache(blocks, 1)
    chunk = SeqChunk(0, tuple(ids), 0, tuple(range(blocks)), len(ids))
    return model.forward(ForwardBatch((chunk,))).float().cpu()


def _gpu_used(gpus) -> list[float]:
    """GiB in use on each of ``gpus``, all processes counted."""
    from ds4d.cuda.devices import gpu_memory

    return [gpu["used_bytes"] / 2**30 for gpu in gpu_memory() if gpu["index"] in gpus]


def run(args) -> int:
    import torch

    from ds4d.bench.model import _ds4d, _fmt, _guarded, _ratio
    from ds4d.bench.offload import stream_options
    from ds4d.bench.random_v4 import (
        Floors,
        base_config,
        bench_config,
        build,
        full_depth_ratios,
        issued_shapes,
        measure_ceilings,
        say,
    )
    from ds4d.models.deepseek_v4.parallel import RandomWeights, build_parallel_model

    on_cpu = args.gpus.startswith("cpu:")
    gpus = int(args.gpus[4:]) if on_cpu else [int(g) for g in args.gpus.split(",") if g.strip()]
    if not on_cpu and not gpus:
        gpus = list(range(torch.cuda.device_count()))
    if not on_cpu and not gpus:
        raise SystemExit("ds4d bench parallel: no CUDA GPU (use --gpus cpu:N --tiny on the CPU)")
    count = gpus if on_cpu else len(gpus)
    device = torch.device("cpu" if on_cpu else f"cuda:{gpus[0]}")
    if not on_cpu:
        torch.cuda.set_device(device)
    bandwidth, matmul = measure_ceilings(torch, device)
    say(f"ceilings of one GPU: copy {bandwidth / 1e12:.2f} TB/s, bf16 matmul {matmul / 1e12:.0f} TFLOP/s")
    sync = torch.cuda.synchronize if not on_cpu else (lambda: None)
    sync_all = (lambda: [torch.cuda.synchronize(g) for g in gpus]) if not on_cpu else (lambda: None)

    base = json.loads(Path(args.config).read_text()) if args.config else base_config(args.tiny)
    if args.depth == "full":
        args.layers = ",".join(map(str, full_depth_ratios(base if args.config else None)))
    args.layouts = args.layouts or ("ep,pp" if args.depth == "full" else "1,ep,pp")
    ratios = [int(x) for x in args.layers.split(",")]
    config = {**base, "num_hidden_layers": len(ratios), "compress_ratios": ratios}
    config.pop("quantization_config", None)
    args.device, args.no_hf = str(device), True
    gen = torch.Generator().manual_seed(args.seed)
    vocab = config["vocab_size"]
    check_ids = torch.randint(100, vocab, (256,), generator=gen).tolist()
    prefill_ids = torch.randint(100, vocab, (1, args.prefill), generator=gen).tolist()
    batches = [int(b) for b in args.batches.split(",") if b]
    decode_ids = {b: torch.randint(100, vocab, (b, args.context), generator=gen).tolist() for b in batches}

    def measure(model, label: str, prefill_only: bool = False):
        prefill = _guarded(torch, f"{label} prefill {args.prefill}", lambda: _ds4d(
            torch, model, prefill_ids, 1, chunk=args.prefill_chunk, sync=sync_all,
            warm_tokens=min(args.prefill, 2 * args.prefill_chunk))[0].prefill_tok_s)
        if prefill_only:
            return prefill
        out = {"prefill": prefill}
        for b in batches:
            out[f"decode b{b}"] = _guarded(torch, f"{label} decode b{b}", lambda b=b: _ds4d(
                torch, model, decode_ids[b], args.decode_tokens, chunk=args.prefill_chunk, sync=sync_all
            )[0].decode_tok_s)
        return out

    def row(model, label: str, cases) -> dict:
        """A result row: ``cases(model, label)``, the model's logits on a prompt against one process, and
        the seconds each step of the row's cases spends on the links."""
        logits = _prompt_logits(torch, model, check_ids)
        reference = checked.setdefault("logits", logits)
        diff = same = None
        if reference is not logits:
            diff = (logits - reference).abs().max().item() / reference.abs().max().item()
            same = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
        stages, ep = model.placement.stages, model.placement.ep_size
        out = {"layout": label, "stages": stages, "ep": ep, "gpu_gib": _gpu_used(gpus) if not on_cpu else [],
               "max_diff": diff, "argmax_same": same, **cases(model, label)}
        if args.link_reps and stages * ep > 1:
            steps = {"prefill": min(args.prefill, args.prefill_chunk), **{f"decode b{b}": b for b in batches}}
            out["link"] = {case: model.transfer_seconds(rows, args.link_reps) for case, rows in steps.items()
                           if case in out}
        return out

    checked: dict = {}  # "logits": the reference logits on the check prompt (the first row's)
    results: list[dict] = []
    single = "1 process" if on_cpu else "1 GPU"
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.no_single:
        cfg = bench_config(args)
        issued = issued_shapes(cfg, args.native)
        floors = {ep: Floors(cfg, issued, bandwidth, matmul, native=args.native, ep=ep) for ep in range(1, count + 1)}
    else:  # one GPU, single process: the reference logits and the one-GPU deployment's speed
        t0 = time.perf_counter()
        offload = stream_options(bench_config(args), args.expert_gpu_fraction, args) \
            if args.expert_gpu_fraction < 1 else None
        cfg, reader, model, _, _ = build(torch, args, device, offload)
        floors = {ep: Floors(cfg, reader.issued, bandwidth, matmul, native=args.native, ep=ep)
                  for ep in range(1, count + 1)}
        del reader
        say(f"one process built in {time.perf_counter() - t0:.1f} s: layers {list(cfg.compress_ratios)}")
        checked["logits"] = _prompt_logits(torch, model, check_ids)
        one = single
        if offload is not None:
            on_device = model.expert_offload.expert_stats()["gpu_experts"]
            one += f", {on_device}/{cfg.num_hidden_layers * cfg.n_routed_experts} experts on it, the rest in host RAM"
        results.append({"layout": one, "stages": 1, "ep": 1, "gpu_gib": _gpu_used(gpus) if not on_cpu else [],
                        "max_diff": None, "argmax_same": None, "expert_gpu_fraction": args.expert_gpu_fraction,
                        **measure(model, one)})
        del model
        gc.collect()
        if not on_cpu:
            torch.cuda.empty_cache()
            sync()

    for layout in [x.strip() for x in args.layouts.split(",") if x.strip()]:
        ranks = (1 if on_cpu else gpus[:1]) if layout == ONE else gpus
        t0 = time.perf_counter()
        try:
            split = build_parallel_model(RandomWeights(config, args.seed), ranks, "1x1" if layout == ONE else layout,
                                         dtype=args.dtype, native=args.native, threads=args.threads or None)
        except Exception as exc:  # noqa: BLE001 - one layout failing must not lose the others
            say(f"{layout}: could not start: {type(exc).__name__}: {exc}")
            continue
        stages, ep = split.placement.stages, split.placement.ep_size
        where = f"{count} processes" if on_cpu else f"GPUs {list(split.placement.devices)}"
        name = f"{single}, sharded step" if layout == ONE else f"{layout} ({stages} x {ep}, {where})"
        try:
            say(f"{name}: built in {time.perf_counter() - t0:.1f} s")
            cut = split.microbatches if stages > 1 else 1
            results.append(row(split, name + (f", pipeline_microbatches {cut}" if cut > 1 else ""), measure))
            if cut > 1:  # the same split model, its prompt steps flowing through the stages whole
                split.microbatches = 1
                results.append(row(split, name + ", pipeline_microbatches 1",
                                   lambda model, label: {"prefill": measure(model, label, prefill_only=True)}))
        finally:
            split.close()
            del split  # before the next layout loads: its weights would still hold GPU 0
            gc.collect()
            if not on_cpu:
                torch.cuda.empty_cache()

    _table(torch, results, floors, cfg, args, batches, device, bandwidth, matmul, _fmt, _ratio, say)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": results, "bandwidth": bandwidth, "matmul": matmul},
                                              indent=2, default=str))
    return 0


def _table(torch, results, floors, cfg, args, batches, device, bandwidth, matmul, fmt, ratio, say) -> None:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    base = next((r for r in results if r["layout"].endswith(", sharded step")), results[0])
    say()
    weights = " with FP8 linears + MXFP4 experts as stored" if args.native else ""
    say(f"# ds4d bench parallel — random V4 ({cfg.hidden_size} wide, {cfg.n_routed_experts} experts, layers "
        f"{list(cfg.compress_ratios)}), {args.dtype}{weights}, {name}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    say(f"# one GPU's ceilings: copy {bandwidth / 1e12:.2f} TB/s, bf16 matmul {matmul / 1e12:.0f} TFLOP/s; "
        f"prefill {args.prefill} tokens b1; decode {args.decode_tokens} tokens after {args.context}; "
        f"scaling = tok/s over '{base['layout']}'")
    if any(r.get("expert_gpu_fraction", 1) < 1 for r in results):
        say("# floors of a row with experts in host RAM count no PCIe: its floor is every expert on the GPU's")
    say("# link: a step's transfers timed on the ranks (the routed output's all-reduce each layer, the streams "
        "at each stage boundary, the logits to rank 0); floor with link: the floor's time plus theirs, less the "
        "shared expert each all-reduce can hide behind")
    cases = ["prefill"] + [f"decode b{b}" for b in batches]
    say("| layout | case | tok/s | scaling | floor tok/s | tok/s / floor | link ms a step | floor with link | "
        "tok/s / floor with link |")
    say("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        floor = floors.get(r["ep"], floors[1])
        for case in cases:
            value = r.get(case)
            ideal = floor.prefill(args.prefill) if case == "prefill" else floor.decode(int(case[8:]), args.context)
            scale = ratio(value, base.get(case)) if r is not base else "1.00x"
            link = r.get("link", {}).get(case)
            linked = _floor_with_link(floor, case, link, args) if link else None
            r.setdefault("floors", {})[case] = {"floor": ideal, "with_link": linked}
            link_ms = f"{link['step'] * 1e3:.3f}" if link else "-"
            say(f"| {r['layout']} | {case} | {fmt(value)} | {scale} | {fmt(ideal)} | {ratio(value, ideal)} | "
                f"{link_ms} | {fmt(linked)} | {ratio(value, linked) if linked else '-'} |")
    say("| layout | GPU memory in use (GiB) | logits on a 256-token prompt vs one process |")
    say("|---|---|---|")
    for r in results:
        memory = ", ".join(f"{g:.1f}" for g in r["gpu_gib"]) or "-"
        logits = "reference" if r["max_diff"] is None else \
            f"max diff {r['max_diff']:.2g} of max, argmax same at {r['argmax_same']:.0%}"
        say(f"| {r['layout']} | {memory} | {logits} |")


def _floor_with_link(floor, case: str, link: dict, args) -> float:
    """tok/s of ``case`` if its steps took the floor's time plus their transfers (``link``, one step's), less what
    each layer's all-reduce can hide behind: the shared expert, which runs while the sum is in flight (its bytes
    at the copy bandwidth in decode, its FLOPs at the matmul rate in prefill)."""
    if case == "prefill":
        tokens, rows = args.prefill, min(args.prefill, args.prefill_chunk)
        steps = -(-tokens // rows)
        shared_s = 2 * floor.shared_params * rows / floor.matmul
        seconds = tokens / floor.prefill(tokens)
    else:
        tokens, steps = int(case.removeprefix("decode b")), 1
        shared_s = floor.shared_params * (1 + 4 / 128**2 if args.native else 2) / floor.bandwidth
        seconds = tokens / floor.decode(tokens, args.context)
    hidden = floor.cfg.num_hidden_layers * min(link["all_reduce"] or 0.0, shared_s)
    return tokens / (seconds + steps * (link["step"] - hidden))
