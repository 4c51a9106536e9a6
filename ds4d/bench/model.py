"""`ds4d bench model`: a random DeepSeek-V4 model of real widths on a GPU, ds4d vs HF transformers.

One process builds random weights of the chosen widths and layer pattern
(default: V4-Flash widths, 4 layers with the published pattern SWA, SWA, CSA,
HCA, bf16, the real 129,280-token vocabulary), gives the very same tensors to
ds4d's model and to HF's ``DeepseekV4ForCausalLM`` (``grouped_mm`` experts when
the installed transformers has them), and times:

* decode tok/s at batch 1, 8 and 64 after a 1K-token prompt (and batch 1 after
  32K with ``--long``), greedy, through ds4d's engine (scheduler, runner,
  sampler, model: ``ds4d.bench.harness``) and through HF's forward with its cache;
* prefill tok/s of one 2K-token prompt (and 16K with ``--long``).

Each figure comes with its floor from BENCH.md's formulas, using the copy
bandwidth and bf16 matmul rate measured at the start of the same run.  Rows
marked "reference path" run ds4d's portable path (one expert at a time, one
sequence at a time, no graphs): the before of the GPU paths.  Runs from a plain
source tree: ``PYTHONPATH=. python -m ds4d.cli bench model``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ds4d.bench.random_v4 import FLASH_RATIOS, Floors, build, measure_ceilings, on_path, say

DECODE_CONTEXT, PREFILL_TOKENS = 1024, 2048
"""V4's decode rows' prompt and its prefill row's, in tokens (``--decode-context``, ``--prefill-tokens``)."""


def add_parser(sub) -> None:
    p = sub.add_parser("model", help="random DeepSeek-V4 model on a GPU vs HF transformers")
    p.add_argument("--config", default="", help="a V4 config.json for the widths (default: V4-Flash)")
    p.add_argument("--tiny", action="store_true", help="small widths (a smoke test that also runs on the CPU)")
    p.add_argument("--family", default="deepseek_v4", choices=["deepseek_v4", "deepseek_v41"],
                   help="deepseek_v41: a random V4.1-Flash-width model (ds4d.bench.dsv41)")
    p.add_argument("--layers", default="",
                   help="compress ratio per layer (default: V4-Flash's first 4, 0,0,4,128; V4.1: 0,0,2,2,1,1)")
    p.add_argument("--depth", default="", choices=["", "full"],
                   help="full: the release's whole layer pattern (V4-Flash 43 layers, V4.1 40) instead of --layers; "
                        "experts that do not fit the device need --expert-gpu-fraction (and --stream-experts)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--batches", default="1,8,64", help="decode batch sizes at --decode-context")
    p.add_argument("--decode-context", type=int, default=DECODE_CONTEXT,
                   help="tokens of each sequence's prompt before the --batches decode rows (rows named @1K for 1024; V4)")
    p.add_argument("--prefill-tokens", type=int, default=PREFILL_TOKENS, help="tokens of the prefill row's one prompt (V4)")
    p.add_argument("--repeats", type=int, default=1,
                   help="time each prefill and decode row this many times after its warm-up; the row is their "
                        "median (the JSON row's extra also gives the lowest and highest)")
    p.add_argument("--long", action="store_true", help="also decode after 32K and prefill 16K")
    p.add_argument("--context", type=int, default=0,
                   help="also prefill one prompt of this many tokens and decode after it (e.g. 500000): "
                        "KV/state bytes per token, peak GPU memory, and the refusal of one token more")
    p.add_argument("--prefill-chunk", type=int, default=2048, help="ds4d's prefill chunk (tokens per step)")
    p.add_argument("--prefill-block", type=int, default=0,
                   help="with --expert-gpu-fraction and --context: also the --context prompt as one step, each "
                        "layer over blocks of this many tokens (prefill_block; cold experts copied once per layer)")
    p.add_argument("--no-hf", action="store_true", help="skip the HF peer")
    p.add_argument("--no-reference", action="store_true", help="skip ds4d's reference-path rows")
    p.add_argument("--main-only", action="store_true",
                   help="only the rows of every GPU path (and --lookahead's): no ablation rows")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", action="store_true", help="decode steps through torch.compile (inside the graphs)")
    p.add_argument("--inductor", action="append", default=[], metavar="KEY=VALUE",
                   help="with --compile: set an option of torch._inductor.config for every compiled path (repeat "
                        "for several; e.g. combo_kernels=true, triton.enable_pdl=true)")
    p.add_argument("--pdl", action="store_true",
                   help="also decode with the step's GEMVs (FP8, MXFP4, float32 rows) and hyper-connection boundary "
                        "kernels as programmatic dependent launches (devices.LAUNCH['pdl'], compute capability 9 "
                        "and up: each starts while the kernel before it drains), with --lookahead also queued ahead")
    p.add_argument("--lookahead", action="store_true",
                   help="also decode with the engine queueing each step behind the one before (decode_lookahead)")
    p.add_argument("--decode-kernel", action="store_true",
                   help="also decode with the other decode attention than the device's default "
                        "(ForwardPaths.decode_kernel: the compressor steps and the attention in Triton kernels, on "
                        "by default on CUDA): rows in torch's operators where the kernels are the default, else "
                        "rows with the kernels; with --lookahead also queued ahead")
    p.add_argument("--shared-beside", action="store_true",
                   help="also decode with the shared expert on a second CUDA stream (ForwardPaths.shared_beside), "
                        "with --lookahead also queued ahead")
    p.add_argument("--route-kernel", action="store_true",
                   help="also decode with the other routing than the device's default (ForwardPaths.route_kernel: "
                        "each token's routing after the router's logits in one Triton launch, V4's default on "
                        "CUDA): rows in torch's operators where the kernel is the default, else rows with it; with "
                        "--lookahead also queued ahead (--family deepseek_v41: its decode rows again with the other "
                        "routing, on the same weights)")
    p.add_argument("--sampled", action="store_true",
                   help="also decode sampling instead of greedy, steps queued ahead: temperature 1 (what a request "
                        "that sets nothing gets), and temperature 1 with top-p 0.95")
    p.add_argument("--profile", action="store_true",
                   help="only profile decode at batch 1 (1K context) per path (with --decode-kernel, --shared-beside, "
                        "--route-kernel or --pdl also that path): time and kernels per step, top kernels")
    p.add_argument("--profile-trace", default="",
                   help="with --profile: write each path's last profiled step, kernel by kernel in the order they "
                        "ran (start, time, gap before it, name), to this file's stem + the path + .tsv")
    p.add_argument("--gguf", default="", choices=["", "q2"],
                   help="the linears and routed experts in GGUF blocks of a recipe (q2: ds4's q2 files: routed "
                        "gate/up IQ2_XXS, down Q2_K, the FP8 linears Q8_0), random, kept as stored")
    p.add_argument("--gguf-int8", default="on", choices=["on", "off"],
                   help="with --gguf: the decode GEMVs of Q8_0, Q2_K and IQ2_XXS blocks on inputs rounded to int8, "
                        "byte products summed by dp4a (on, as the daemon's gguf_int8_inputs), or float32 products")
    p.add_argument("--native", action="store_true",
                   help="FP8 linears and MXFP4 experts as the release stores them (weight_format native)")
    p.add_argument("--kernels", action="store_true",
                   help="first time the FP8/MXFP4 weight kernels against bf16 at Flash shapes")
    p.add_argument("--sweep", action="store_true", help="first time the candidate tile settings of the FP8/MXFP4 kernels; use the best")
    p.add_argument("--json", default="", help="also write the results here")
    p.add_argument("--expert-gpu-fraction", default="",
                   help="e.g. 1,0.5,0.25: share of routed experts kept on the device, the rest in pinned host RAM "
                        "(runs the expert-offload bench instead: ds4d.bench.offload); deepseek_v41: one share, "
                        "the usual rows with the experts offloaded")
    p.add_argument("--expert-cpu-threads", type=int, default=8, help="host threads for cold experts in decode")
    p.add_argument("--gather-only", action="store_true",
                   help="with --expert-gpu-fraction and native weights: skip the rows whose decode reads cold experts "
                        "in place (time only the default, gathered reads)")
    p.add_argument("--fetch-ahead", type=int, default=0,
                   help="with --expert-gpu-fraction and native weights: decode steps of up to this many (token, "
                        "expert) rows fetch each layer's predicted cold experts a layer ahead (OffloadOptions."
                        "fetch_ahead); each fraction also runs without, same placement (deepseek_v41: the rows "
                        "run with it only)")
    p.add_argument("--stream-experts", action="store_true",
                   help="with --expert-gpu-fraction: place each layer's experts as it is built (the first fraction), "
                        "for models whose experts do not fit the device; no all-on-device rows")
    from ds4d.bench.dsv41 import add_arguments

    add_arguments(p)
    p.set_defaults(run=run)


@dataclass
class Row:
    case: str
    ds4d: float | None = None
    hf: float | None = None
    floor: float | None = None
    note: str = ""
    extra: dict = field(default_factory=dict)


# ------------------------------------------------------------------ ceilings and floors


# ------------------------------------------------------------------ the two engines


def inductor_options(pairs: list[str]) -> dict[str, object]:
    """``KEY=VALUE`` strings -> {key: value}; a value is read as JSON where it parses (true, 4, 0.5, "x"),
    else kept as the string."""
    options: dict[str, object] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"--inductor takes KEY=VALUE, not {pair!r}")
        try:
            options[key.strip()] = json.loads(text)
        except json.JSONDecodeError:
            options[key.strip()] = text
    return options


def set_inductor_option(option: str, value: object) -> None:
    """``torch._inductor.config.<option> = value`` (dotted names reach its sections: ``triton.cudagraphs``);
    a name the config lacks is an error, not a new attribute."""
    from torch._inductor import config

    *sections, name = option.split(".")
    target = config
    for section in sections:
        target = getattr(target, section, None)
        if target is None:
            raise SystemExit(f"torch._inductor.config has no section {section!r} (in {option!r})")
    if not hasattr(target, name):
        raise SystemExit(f"torch._inductor.config has no option {option!r}")
    setattr(target, name, value)


SAMPLED = {"sampled": {"temperature": 1.0}, "sampled-top-p": {"temperature": 1.0, "top_p": 0.95}}
"""What the ``--sampled`` rows decode with, per path (a request that sets no temperature gets 1.0)."""


def _ds4d(torch, model, prompts, max_tokens, *, chunk, sync, warm_tokens=0, lookahead=False, sampling=None,
          repeats=1):
    """Warm up (kernels, and graph capture for these shapes), then time ``max_tokens`` greedy tokens,
    ``repeats`` times over: a list of the runs' timings.

    ``warm_tokens``: warm up on that many prompt tokens only (prefill cases: the
    shapes repeat every chunk); 0 warms up on the whole prompts."""
    from ds4d.bench.harness import make_engine, run_batch

    context = len(prompts[0]) + max_tokens + 8
    engine = make_engine(model, max_num_seqs=len(prompts), context_tokens=context, prefill_chunk=chunk,
                         lookahead=lookahead)
    warm = [p[:warm_tokens] for p in prompts] if warm_tokens else prompts
    run_batch(engine, warm, min(max_tokens, 4), sync, sampling=sampling)
    runs = [run_batch(engine, prompts, max_tokens, sync, sampling=sampling) for _ in range(repeats)]
    failure = getattr(model, "graph_failure", None)
    if failure is not None:  # the steps fell back to eager: the row's label would not say what was timed
        raise RuntimeError(f"decode graph capture failed, so the steps ran eagerly: {failure[:300]}")
    return runs


def median_rate(runs, attr: str) -> tuple[float, dict]:
    """The median of the runs' ``attr`` (``prefill_tok_s`` or ``decode_tok_s``) and, for more than one
    run, their spread for the row's ``extra`` (``runs``, ``lowest``, ``highest``)."""
    rates = sorted(getattr(r, attr) for r in runs)
    spread = {"runs": len(rates), "lowest": rates[0], "highest": rates[-1]} if len(rates) > 1 else {}
    return statistics.median(rates), spread


def _hf(torch, hf, prompts, max_tokens, *, device, chunk=0):
    """(prefill tok/s, decode tok/s) of HF's forward with its own cache, greedy."""
    ids = torch.tensor(prompts, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with torch.no_grad():
        warm = hf(input_ids=ids[:, :64], use_cache=True, logits_to_keep=1)
        hf(input_ids=warm.logits[:, -1].argmax(-1, keepdim=True), past_key_values=warm.past_key_values, use_cache=True)
        del warm
        sync()
        t0 = time.perf_counter()
        cache, out = None, None
        pieces = [ids] if not chunk else list(ids.split(chunk, dim=1))
        for piece in pieces:
            out = hf(input_ids=piece, past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache = out.past_key_values
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        sync()
        t1 = time.perf_counter()
        for _ in range(max_tokens - 1):
            out = hf(input_ids=token, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            token = out.logits[:, -1].argmax(-1, keepdim=True)
        sync()
        t2 = time.perf_counter()
    decode = len(prompts) * (max_tokens - 1) / (t2 - t1) if max_tokens > 1 else None
    return ids.numel() / (t1 - t0), decode


def _rate(got) -> tuple:
    """``(rate, spread)`` from what ``_guarded`` returned for a :func:`median_rate`: its ``"OOM"`` or
    ``"error"`` stands as the row's figure, with no spread."""
    return got if isinstance(got, tuple) else (got, {})


def _guarded(torch, label, fn):
    """fn() or None, printing why; an out-of-memory leaves the allocator cleared.  The models of rows
    before (a model and its decode graphs refer to each other) are collected first, so their caches
    and graphs are gone before this row allocates its own."""
    gc.collect()
    start = time.perf_counter()
    try:
        result = fn()
        say(f"  {label}: {result} ({time.perf_counter() - start:.1f} s)")
        return result
    except torch.OutOfMemoryError:
        say(f"  {label}: out of memory")
        return "OOM"
    except Exception as exc:  # noqa: BLE001 - one failed case must not lose the others
        say(f"  {label}: failed: {type(exc).__name__}: {exc}")
        return "error"
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# ------------------------------------------------------------------ run


PATH_NOTES = {"graphs": "", "lookahead": " (graphs, steps queued ahead)",
              "sampled": " (graphs, steps queued ahead, temperature 1)",
              "sampled-top-p": " (graphs, steps queued ahead, temperature 1, top-p 0.95)",
              "plain-hc": " (graphs, torch hyper-connections)",
              "numba-hc": " (graphs, Numba hyper-connection kernel only)",
              "triton-hc": " (graphs, Triton hyper-connection weights only)", "eager": " (no graphs)",
              "reference": " (reference path)", "decode-kernel": " (graphs, decode kernels)",
              "decode-kernel-lookahead": " (graphs, decode kernels, steps queued ahead)",
              "torch-decode": " (graphs, torch decode attention)",
              "torch-decode-lookahead": " (graphs, torch decode attention, steps queued ahead)",
              "route-kernel": " (graphs, routing in one kernel)",
              "route-kernel-lookahead": " (graphs, routing in one kernel, steps queued ahead)",
              "torch-route": " (graphs, routing in torch's operators)",
              "torch-route-lookahead": " (graphs, routing in torch's operators, steps queued ahead)",
              "shared-beside": " (graphs, shared expert on a second stream)",
              "shared-beside-lookahead": " (graphs, shared expert on a second stream, steps queued ahead)",
              "pdl": " (graphs, GEMVs as dependent launches)",
              "pdl-lookahead": " (graphs, GEMVs as dependent launches, steps queued ahead)"}


@contextlib.contextmanager
def gemv_launches(path: str):
    """While a row of ``path`` runs (and captures its graphs): a decode step's GEMVs and hyper-connection
    kernels launched as programmatic dependent launches (``devices.LAUNCH["pdl"]``) for the ``pdl`` paths,
    plainly for the others."""
    from ds4d.cuda import devices

    before = devices.LAUNCH["pdl"]
    devices.LAUNCH["pdl"] = path.startswith("pdl")
    try:
        yield
    finally:
        devices.LAUNCH["pdl"] = before


def full_depth_layers(family: str) -> str:
    """The release's compress ratios for every layer, as ``--layers`` takes them."""
    if family == "deepseek_v41":
        from ds4d.models.deepseek_v41.config import RELEASE_RATIOS

        return ",".join(map(str, RELEASE_RATIOS))
    return ",".join(map(str, FLASH_RATIOS))


def run(args: argparse.Namespace) -> int:
    if args.depth == "full":
        args.layers = full_depth_layers(args.family)
    for option, value in inductor_options(args.inductor).items():
        set_inductor_option(option, value)
        say(f"torch._inductor.config.{option} = {value!r}")
    if args.family == "deepseek_v41":
        from ds4d.bench.dsv41 import run as run_v41

        if (args.decode_context, args.prefill_tokens) != (DECODE_CONTEXT, PREFILL_TOKENS):
            raise SystemExit("--decode-context and --prefill-tokens are V4's rows; V4.1's take --context")

        return run_v41(args)
    import torch

    if args.expert_gpu_fraction:
        from ds4d.bench.offload import run_offload

        return run_offload(args)

    device = torch.device(args.device if args.device != "cuda" or torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)
    bandwidth, matmul = measure_ceilings(torch, device)
    say(f"ceilings: copy {bandwidth / 1e12:.2f} TB/s (read + write), bf16 matmul {matmul / 1e12:.0f} TFLOP/s")
    if args.sweep or args.kernels:
        from ds4d.bench.kernels import run_kernels, sweep
        from ds4d.cuda import quant_matmul

        if args.sweep:
            quant_matmul.TUNING.update(sweep(torch, device, say))
            say(f"tuning: {json.dumps(quant_matmul.TUNING)}")
        if args.kernels:
            kernel_rows = run_kernels(torch, device, say)
            if args.json:
                Path(args.json).with_suffix(".kernels.json").write_text(json.dumps(kernel_rows, indent=1))
    if args.gguf:
        say(f"GGUF decode GEMVs on int8 inputs: {args.gguf_int8}")
    t0 = time.perf_counter()
    cfg, reader, model, hf, hf_note = build(torch, args, device)
    floors = Floors(cfg, reader.issued, bandwidth, matmul, native=args.native, gguf=args.gguf)
    best = model.paths.replace(compile_decode=args.compile)  # each row runs a model of its own over these weights
    say(f"built in {time.perf_counter() - t0:.1f} s: layers {list(cfg.compress_ratios)}, HF {hf_note}, "
        f"hyper-connection kernel {'on' if best.hc_kernels != 'torch' else 'off'}")
    gen = torch.Generator().manual_seed(args.seed)

    def prompts(batch: int, length: int) -> list[list[int]]:
        return torch.randint(100, cfg.vocab_size, (batch, length), generator=gen).tolist()

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    other_decode = "torch-decode" if best.decode_kernel else "decode-kernel"  # --decode-kernel's rows
    other_route = "torch-route" if best.route_kernel else "route-kernel"  # --route-kernel's rows
    if args.profile:
        for path in ("graphs", *([other_decode] if args.decode_kernel else []),
                     *(["shared-beside"] if args.shared_beside else []), *([other_route] if args.route_kernel else []),
                     *(["pdl"] if args.pdl else []), "eager"):
            trace = Path(args.profile_trace).with_suffix(f".{path}.tsv") if args.profile_trace else None
            with gemv_launches(path):
                _profile_decode(torch, on_path(model, path, best), prompts(1, 1024)[0], path, sync, trace=trace)
        return 0
    check = _parity(torch, on_path(model, "eager", best), hf, prompts(1, 256)[0], device) if hf is not None \
        else "no HF peer"
    say(f"same weights check (256-token prompt, logits ds4d vs HF): {check}")
    paths = ["graphs"] if args.main_only else \
        ["graphs", "triton-hc", "plain-hc", "numba-hc", "eager"] + ([] if args.no_reference else ["reference"])
    rows: list[Row] = []
    n = args.decode_tokens

    def prefill_case(tokens: int, hf_ok: bool = True) -> None:
        ids = prompts(1, tokens)
        prefill_paths = [p for p in paths if p not in ("eager", "numba-hc", "triton-hc")] + \
            ([] if args.main_only else ["torch-attention", "torch-token-wise", "all-rows"])
        for path in prefill_paths if tokens <= 2048 or args.main_only else ["graphs", "torch-token-wise", "all-rows"]:
            timed = on_path(model, path, best)
            label = f"prefill {tokens} tok, b1" + {"graphs": "", "plain-hc": " (torch hyper-connections)",
                                                   "torch-attention": " (torch attention)",
                                                   "torch-token-wise": " (token-wise work in torch)",
                                                   "all-rows": " (last feed-forward on every row)",
                                                   "reference": " (reference path)"}[path]
            got, spread = _rate(_guarded(torch, f"ds4d {label}", lambda timed=timed: median_rate(_ds4d(
                torch, timed, ids, 1, chunk=args.prefill_chunk, sync=sync, warm_tokens=2 * args.prefill_chunk,
                repeats=args.repeats), "prefill_tok_s")))
            theirs = _guarded(torch, "HF", lambda: _hf(torch, hf, ids, 1, device=device)[0]) \
                if hf is not None and hf_ok and path == "graphs" else None
            rows.append(Row(label, got, theirs, floors.prefill(tokens),
                            note=f"ds4d chunk {min(tokens, args.prefill_chunk)}", extra=spread))

    def decode_case(batch: int, context: int, with_paths: list[str], hf_chunk: int = 0) -> None:
        ids = prompts(batch, context)
        hf_done = False
        for path in with_paths:
            timed = on_path(model, path, best)
            chunk = min(args.prefill_chunk, max(128, 16384 // batch))
            label = f"decode b{batch} @{_context_label(context)}" + PATH_NOTES[path]
            steps = n if path != "reference" else max(8, n // 4)
            def runs(timed=timed, steps=steps, chunk=chunk, path=path):
                with gemv_launches(path):
                    return _ds4d(torch, timed, ids, steps, chunk=chunk, sync=sync, sampling=SAMPLED.get(path),
                                 repeats=args.repeats, lookahead=path.endswith("lookahead") or path in SAMPLED)
            got, spread = _rate(_guarded(torch, f"ds4d {label}", lambda runs=runs: median_rate(runs(), "decode_tok_s")))
            theirs = None
            if hf is not None and not hf_done:
                hf_done = True
                theirs = _guarded(torch, "HF", lambda: _hf(torch, hf, ids, max(8, n // 2), device=device,
                                                           chunk=hf_chunk)[1])
            rows.append(Row(label, got, theirs, floors.decode(batch, context),
                            extra={**per_layer(floors, batch, context, got), **spread}))

    prefill_case(args.prefill_tokens)
    batches = [int(b) for b in args.batches.split(",") if b]
    ahead = (["lookahead"] if args.lookahead else []) + (list(SAMPLED) if args.sampled else [])
    if args.decode_kernel:
        ahead += [other_decode] + ([f"{other_decode}-lookahead"] if args.lookahead else [])
    if args.shared_beside:
        ahead += ["shared-beside"] + (["shared-beside-lookahead"] if args.lookahead else [])
    if args.route_kernel:
        ahead += [other_route] + ([f"{other_route}-lookahead"] if args.lookahead else [])
    if args.pdl:
        ahead += ["pdl"] + (["pdl-lookahead"] if args.lookahead else [])
    for batch in batches:
        decode_case(batch, args.decode_context, (paths[:1] + ahead + paths[1:]) if batch == 1 else ["graphs", *ahead])
    if args.long:
        prefill_case(16384)
        decode_case(1, 32768, ["graphs"], hf_chunk=2048)
    if args.context:
        rows.extend(_long_context(torch, on_path(model, "graphs", best), prompts(1, args.context), n, args.prefill_chunk, floors, sync))

    _print_table(rows, cfg, args, device, bandwidth, matmul, hf_note, check)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": [r.__dict__ for r in rows], "hf": hf_note,
                                               "bandwidth": bandwidth, "matmul": matmul, "check": check}, indent=2))
    return 0


def _long_context(torch, model, ids, decode_tokens: int, chunk: int, floors, sync) -> list[Row]:
    """Prefill one long prompt through the engine, decode after it; memory per token and the pool's capacity."""
    from ds4d.bench.harness import make_engine, run_batch

    tokens = len(ids[0])
    engine = make_engine(model, max_num_seqs=1, context_tokens=tokens + decode_tokens, prefill_chunk=chunk)
    pool = engine.scheduler.pool
    capacity = pool.num_blocks * pool.block_size
    info = model.info
    kv_bytes = -(-(tokens + decode_tokens) // info.block_size_tokens) * info.cache_bytes_per_block
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    stamps: list[float] = []
    timing = run_batch(engine, ids, decode_tokens, sync, after_decode_step=lambda: stamps.append(time.perf_counter()))
    steps = sorted(b - a for a, b in itertools.pairwise(stamps[2:]))  # past the first steps (graph capture)
    decode = 1 / steps[len(steps) // 2] if steps else None
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    say(f"context {tokens:,} tokens: KV blocks {kv_bytes / 2**20:.1f} MiB ({kv_bytes / tokens:.0f} B/token) + "
         f"state {info.state_bytes_per_seq / 2**20:.1f} MiB per sequence; peak GPU memory {peak / 2**30:.1f} GiB; "
         f"prefill {timing.prefill_s:.1f} s; the pool holds {capacity:,} tokens (the daemon caps max_context "
         f"there and refuses a longer prompt before any work)")
    label = f"{tokens // 1000}K"
    return [Row(f"prefill {label} tok, b1", timing.prefill_tok_s, None, floors.prefill(tokens)),
            Row(f"decode b1 @{label}", decode, None, floors.decode(1, tokens), extra=per_layer(floors, 1, tokens, decode))]


def _context_label(tokens: int) -> str:
    """A decode row's context in its name: ``1K`` for 1,024 tokens, ``32K`` for 32,768, ``100`` for 100."""
    return f"{tokens // 1024}K" if tokens % 1024 == 0 else str(tokens)


def per_layer(floors, batch: int, context: int, tok_s: float | None) -> dict:
    """A decode row's time per layer, with the head taken at its floor: (step time - the head's floor time) /
    layers, and the floor's per layer (``Floors.layer_seconds``), in ms."""
    if not tok_s:
        return {}
    step = batch / tok_s
    return {"layer_ms": (step - floors.head_seconds()) / floors.cfg.num_hidden_layers * 1e3,
            "layer_floor_ms": floors.layer_seconds(batch, context) * 1e3}


def _profile_decode(torch, model, prompt, path: str, sync, steps: int = 8, trace: Path | None = None) -> None:
    """Profile ``steps`` decode steps (after warm-up) and print where the device time goes; ``trace``: write the
    last step's kernels in the order they ran there."""
    from torch.profiler import ProfilerActivity, profile, schedule

    from ds4d.bench.harness import make_engine, run_batch

    engine = make_engine(model, max_num_seqs=1, context_tokens=len(prompt) + 3 * steps + 8, prefill_chunk=2048)
    run_batch(engine, [prompt[:64]], 4, sync)  # kernels, graph capture
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, schedule=schedule(wait=1, warmup=2, active=steps, repeat=1),
                 acc_events=True) as prof:
        timing = run_batch(engine, [prompt], 3 + steps + 2, sync, after_decode_step=prof.step)
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA" and not e.key.startswith("ProfilerStep")]
    device_us = sum(e.self_device_time_total for e in events) / steps
    kernels = sum(e.count for e in events) / steps
    say(f"\n## decode b1 @1K, {path}: {1e3 / timing.decode_tok_s:.3f} ms/step wall, "
         f"{device_us / 1e3:.3f} ms/step of device work in {kernels:.0f} kernels/step")
    say("| kernel | calls/step | us/step | share |")
    say("|---|---|---|---|")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:40]:
        say(f"| {e.key[:90]} | {e.count / steps:.0f} | {e.self_device_time_total / steps:.1f} | "
             f"{e.self_device_time_total / steps / max(device_us, 1e-9):.1%} |")
    if trace is not None:
        _write_trace(prof, round(kernels), trace)


def _write_trace(prof, count: int, path: Path) -> None:
    """The last ``count`` device kernels the profiler saw, in the order they started, as tab-separated
    rows: start (us after the first), time (us), gap after the one before (us), name."""
    kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA" and e.time_range.elapsed_us() > 0),
                     key=lambda e: e.time_range.start)
    kernels = kernels[max(len(kernels) - count, 0):]
    lines, begin, end = ["start_us\ttime_us\tgap_us\tname"], kernels[0].time_range.start if kernels else 0, None
    rows = []  # (time, gap, name) as written
    for e in kernels:
        start, stop = e.time_range.start, e.time_range.end
        time_us, gap_us = f"{stop - start:.1f}", f"{0.0 if end is None else start - end:.1f}"
        lines.append(f"{start - begin:.1f}\t{time_us}\t{gap_us}\t{e.name}")
        rows.append((float(time_us), float(gap_us), e.name))
        end = stop
    path.write_text("\n".join(lines) + "\n")
    say(f"trace of the last step's {len(kernels)} kernels: {path}")
    if rows:
        from ds4d.bench import trace_layers

        say("by layer and kind, us (kernels split at every second hyper-connection boundary):\n"
            + trace_layers.table(trace_layers.layers(rows)))


def _parity(torch, model, hf, ids, device) -> str:
    mine = model.logits_for(ids)
    with torch.no_grad():
        theirs = hf(input_ids=torch.tensor([ids], device=device)).logits[0].float()
    rel = ((mine - theirs).abs().max() / theirs.abs().max()).item()
    agree = (mine.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    return f"max |diff| / max |logit| = {rel:.2e}, argmax agreement {agree:.1%}"


def _fmt(v) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, str):
        return v
    return f"{v:,.0f}" if v >= 100 else f"{v:,.1f}"


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if isinstance(a, float) and isinstance(b, float) and b else "n/a"


def _print_table(rows, cfg, args, device, bandwidth, matmul, hf_note, check) -> None:
    import torch

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    say()
    say(f"# ds4d bench model — random V4 ({cfg.hidden_size} wide, {cfg.n_routed_experts} experts, layers "
         f"{list(cfg.compress_ratios)}), {args.dtype}{' with FP8 linears + MXFP4 experts as stored' if args.native else ''}, {name}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    say(f"# ceilings measured: copy {bandwidth / 1e12:.2f} TB/s, bf16 matmul {matmul / 1e12:.0f} TFLOP/s; "
         f"HF {hf_note}; {check}")
    say(f"# decode: {args.decode_tokens} greedy tokens per sequence after the prompt; tok/s = all sequences")
    say("| case | ds4d tok/s | HF tok/s | ds4d / HF | floor tok/s | ds4d / floor |")
    say("|---|---|---|---|---|---|")
    for r in rows:
        say(f"| {r.case} | {_fmt(r.ds4d)} | {_fmt(r.hf)} | {_ratio(r.ds4d, r.hf)} | {_fmt(r.floor)} | "
             f"{_ratio(r.ds4d, r.floor)} |")
    layered = [r for r in rows if "layer_ms" in r.extra]
    if layered:
        say(f"\n# per layer ({cfg.num_hidden_layers}): a decode step's time less the head's floor time, over the "
            "layers, against the floor's per layer")
        say("| case | ms per layer | floor ms per layer | time / floor |")
        say("|---|---|---|---|")
        for r in layered:
            layer, floor = r.extra["layer_ms"], r.extra["layer_floor_ms"]
            say(f"| {r.case} | {layer:.3f} | {floor:.3f} | {layer / floor:.2f}x |")
    spread = [r for r in rows if "runs" in r.extra]
    if spread:
        say(f"\n# each row above: the median of {spread[0].extra['runs']} timed runs; their lowest and highest")
        say("| case | lowest tok/s | highest tok/s | highest / lowest |")
        say("|---|---|---|---|")
        for r in spread:
            low, high = r.extra["lowest"], r.extra["highest"]
            say(f"| {r.case} | {_fmt(low)} | {_fmt(high)} | {_ratio(high, low)} |")
    sys.stdout.flush()
