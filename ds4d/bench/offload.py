"""`ds4d bench model --expert-gpu-fraction 1,0.5,0.25`: routed experts split over VRAM and pinned host RAM.

Builds the random model of ``ds4d bench model`` (no HF peer), measures the
all-on-device run first (the peer: same weights, same process), then moves
every routed expert to pinned host RAM (``ExpertOffload``) and, for each
fraction, keeps that share of the experts on the device (spread evenly over
layers, as before any routing is known; static placement) and times prefill of
one 2K prompt and batch-1 decode after 1K tokens through the engine.  Each row
reports the bytes copied and skipped over PCIe in the timed part, the floor
those copies impose at the host -> device bandwidth measured in the run, and
whether the offloaded logits equal the all-on-device ones bit for bit.
"""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path

from ds4d.bench.random_v4 import Floors, bench_config, build, measure_ceilings, on_path, say


def _delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k]
            for k in ("bytes_copied", "bytes_skipped", "skipped_transfers", "host_read_bytes", "fetched_ahead_pairs")}


def _gb_copied(result: dict, moved: str) -> float:
    """GB the offload copied in one timed part of a row (0 without offload)."""
    return result.get(moved, {}).get("bytes_copied", 0) / 1e9


def _cpu_experts(stats: dict) -> int:
    return sum(row["cpu_experts"] for row in stats["layers"])


def stream_options(cfg, fraction: float, args):
    """Offload options whose VRAM budget holds ``fraction`` of the experts (plus the staging banks)."""
    from ds4d.cuda import moe_gemv
    from ds4d.models.deepseek_v4.offload import OffloadOptions

    gguf = getattr(args, "gguf", "")
    if gguf:
        from ds4d.models.deepseek_v4.random_init import gguf_expert_bytes

        per_expert = gguf_expert_bytes(cfg, gguf)
    else:
        element = 17 / 32 if args.native else (2 if args.dtype == "bfloat16" else 4)
        per_expert = int(3 * cfg.moe_intermediate_size * cfg.hidden_size * element)
    stage = 8
    experts = round(fraction * cfg.num_hidden_layers * cfg.n_routed_experts)
    scratch = moe_gemv.MAX_ROWS if args.native or gguf else 0  # decode's gather scratch (an upper bound)
    ahead = getattr(args, "fetch_ahead", 0) if scratch else 0
    return OffloadOptions(vram_bytes=(2 * stage + scratch + 2 * ahead + experts) * per_expert + per_expert // 2,
                          placement="static", stage_experts=stage, cpu_threads=getattr(args, "expert_cpu_threads", 0),
                          native=args.native, fetch_ahead=ahead)


def run_offload(args) -> int:
    import torch

    from ds4d.bench.harness import make_engine, run_batch
    from ds4d.models.deepseek_v4.model import DeepseekV4Model
    from ds4d.models.deepseek_v4.offload import ExpertOffload, OffloadOptions

    fractions = [float(f) for f in args.expert_gpu_fraction.split(",") if f]
    device = torch.device(args.device if args.device != "cuda" or torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)
    bandwidth, matmul = measure_ceilings(torch, device)
    args.no_hf = True
    stream = args.stream_experts
    t0 = time.perf_counter()
    options = stream_options(bench_config(args), fractions[0], args) if stream else None
    cfg, reader, model, _, _ = build(torch, args, device, options)
    floors = Floors(cfg, reader.issued, bandwidth, matmul, native=args.native, gguf=args.gguf)
    reader.issued.clear()
    say(f"built in {time.perf_counter() - t0:.1f} s: layers {list(cfg.compress_ratios)}"
         + (f"; experts placed as built: {model.expert_offload.expert_stats()['gpu_experts']} on the device"
            if stream else ""))
    if device.type == "cuda":
        say(f"device memory: {torch.cuda.memory_allocated(device) / 2**30:.1f} GiB allocated")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(args.seed)
    check_ids = torch.randint(100, cfg.vocab_size, (256,), generator=gen).tolist()
    prefill_ids = torch.randint(100, cfg.vocab_size, (1, 2048), generator=gen).tolist()
    decode_ids = torch.randint(100, cfg.vocab_size, (1, 1024), generator=gen).tolist()
    long_ids = torch.randint(100, cfg.vocab_size, (1, args.context), generator=gen).tolist() if args.context else None
    steps = args.decode_tokens

    def timed(model, label: str, long: bool = True) -> dict:
        """Prefill 2K (and ``--context``) and decode b1 after 1K on ``model``: tok/s, and the offload's
        traffic in each."""
        gc.collect()  # models of rows before (they and their decode graphs refer to each other) go first
        offload = model.expert_offload
        stats = offload.expert_stats if offload else (lambda: None)
        engine = make_engine(model, max_num_seqs=1, context_tokens=max(2048, args.context) + steps + 8,
                             prefill_chunk=args.prefill_chunk)
        run_batch(engine, prefill_ids, 4, sync)  # warm-up at the timed shapes (kernels compile on first use)
        s0 = stats()
        prefill = run_batch(engine, prefill_ids, 1, sync)
        s1 = stats()
        run_batch(engine, decode_ids, 4, sync)  # decode warm-up at the timed context (graph capture, compile)
        s2 = stats()
        run_batch(engine, decode_ids, 1, sync)  # the prompt alone, to take its copies out of the decode figures
        s3 = stats()
        decode = run_batch(engine, decode_ids, steps, sync)
        s4 = stats()
        tokens = max(1, decode.decode_tokens)
        result = {"prefill": prefill.prefill_tok_s, "decode": decode.decode_tok_s}
        if offload:
            prompt, both = _delta(s3, s2), _delta(s4, s3)
            result.update(moved_prefill=_delta(s1, s0), moved_decode={k: (both[k] - prompt[k]) / tokens for k in both},
                          cpu=(_cpu_experts(s4) - _cpu_experts(s3)) / tokens)
        if long_ids is not None and long:
            s5 = stats()
            result["long"] = run_batch(engine, long_ids, 1, sync).prefill_tok_s
            if offload:
                result["moved_long"] = _delta(stats(), s5)
            if args.prefill_block:  # the same prompt as one step, run layer by layer in blocks
                del engine
                gc.collect()
                blocked = model.with_paths(model.paths.replace(prefill_block=args.prefill_block))
                engine = make_engine(blocked, max_num_seqs=1, context_tokens=max(2048, args.context) + 8,
                                     prefill_chunk=args.context)
                run_batch(engine, prefill_ids, 1, sync)  # its first step: compiles, the pass bank
                s6 = stats()
                result["long_blocks"] = run_batch(engine, long_ids, 1, sync).prefill_tok_s
                if offload:
                    result["moved_long_blocks"] = _delta(stats(), s6)
        if device.type == "cuda":
            result["peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 1)
        say(f"  {label}: {result}")
        return result

    rows, reference = [], None
    layer = model.weights.layers[0]
    moe_x = torch.randn(2048, cfg.hidden_size, generator=gen).to(device, model.dtype)
    moe_ids = torch.tensor(prefill_ids[0], device=device)
    base = model.paths  # every path the device has; each row runs a model of its own over these weights
    if not stream:
        eager = on_path(model, "eager", base)
        reference = eager.logits_for(check_ids)
        repeat = eager.logits_for(check_ids)
        say(f"all-on-device logits, run twice: equal {torch.equal(repeat, reference)}")
        from ds4d.models.deepseek_v4.moe import moe_forward

        moe_ref = moe_forward(moe_x, moe_ids, layer.ffn, cfg, grouped=True)
        rows.append(("all on device, no offload (graphs)",
                     timed(on_path(model, "graphs", base), "all experts on the device (graphs)"), None,
                     "all on device"))
        rows.append(("all on device, no offload (eager)", timed(eager, "all experts on the device (eager)"), None,
                     "all on device, eager"))
        del eager
        t0 = time.perf_counter()
        offload = ExpertOffload(
            model.weights, cfg, device=device, dtype=model.dtype,
            options=OffloadOptions(vram_bytes=1 << 50, placement="static", cpu_threads=args.expert_cpu_threads,
                                   native=args.native, fetch_ahead=args.fetch_ahead))
        model = DeepseekV4Model(cfg, model.weights, model.tokenizer, dtype=model.dtype, device=device,
                                expert_offload=offload, paths=base)
    offload = model.expert_offload
    best = base.replace(compile_decode=args.compile)
    graphs = on_path(model, "graphs", best)  # decode steps that read cold experts in place (zero copy) replay graphs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    say(f"zero-copy decode: {offload.zero_copy}")
    say(f"experts to host RAM in {time.perf_counter() - t0:.1f} s (pinned in {offload.pinned.seconds:.1f} s, "
         f"huge pages {offload.slots.arena.huge_pages}); PCIe {offload.pcie_bytes_s / 1e9:.1f} GB/s, "
         f"CPU expert {offload.cpu_expert_s * 1e3:.2f} ms")
    total = cfg.num_hidden_layers * cfg.n_routed_experts
    for fraction in fractions:
        if offload.policy.capacity != round(fraction * total):
            offload.policy.capacity = round(fraction * total)
            offload.set_placement(offload.policy.initial())
        if device.type == "cuda":
            torch.cuda.empty_cache()
        same = "not checked (no all-on-device run at this depth)"
        if reference is None and offload.expert_stats()["ram_experts"] == 0:  # every expert placed on the device
            reference = on_path(model, "eager", best).logits_for(check_ids)
            moe_ref = offload.moe_forward(0, moe_x, moe_ids, layer.ffn, cfg)
            same = "reference (every expert on the device, placed as built)"
        elif reference is not None:
            got = graphs.logits_for(check_ids)
            moe_got = offload.moe_forward(0, moe_x, moe_ids, layer.ffn, cfg)
            same = (f"MoE layer {torch.equal(moe_got, moe_ref)}; logits {torch.equal(got, reference)} "
                    f"(max |diff| {(got - reference).abs().max().item():.1e})")
        stats = offload.expert_stats()
        say(f"{fraction:.0%} on device: {stats['gpu_experts']} experts; host RAM {stats['host_ram_bytes'] / 2**30:.1f} "
             f"GiB for {stats['host_experts']} experts")
        label = f"{stats['gpu_experts']}/{total} experts on device ({fraction:.0%})"
        key = f"{fraction:.0%} on device"
        if offload.gather and not args.gather_only:  # the same placement, decode reading cold experts in place
            offload.gather = False
            rows.append((label + ", decode reads cold experts in place" + (", compiled" if args.compile else ""),
                         timed(graphs, f"{fraction:.0%} on device, in place", long=False), same,
                         key + ", cold experts read in place"))
            offload.gather = True
            label += ", decode gathers cold experts first"
        ahead = offload.zero_copy_experts.ahead_rows
        if offload.gather and ahead:  # the same placement, cold experts gathered at their layer only
            offload.zero_copy_experts.ahead_rows = 0
            rows.append((label + ", none fetched ahead" + (", compiled" if args.compile else ""),
                         timed(on_path(model, "graphs", best), f"{fraction:.0%} on device, none fetched ahead",
                               long=False), same, key + ", none fetched ahead"))
            offload.zero_copy_experts.ahead_rows = ahead
            graphs = on_path(model, "graphs", best)  # graphs of its own: those above were captured without
            label += f", predicted ones fetched a layer ahead (steps of up to {ahead} rows)"
        try:
            rows.append((label + (", compiled" if args.compile else ""), timed(graphs, f"{fraction:.0%} on device"),
                         same, key))
        except Exception as exc:  # a failed compile must not lose the uncompiled figures
            if not args.compile:
                raise
            say(f"  compiled decode failed ({type(exc).__name__}: {exc}); again without torch.compile")
            args.compile = False
            best = best.replace(compile_decode=False)
            graphs = on_path(model, "graphs", best)
            rows.append((label, timed(graphs, f"{fraction:.0%} on device"), same, key))

    pcie = offload.pcie_bytes_s
    stats = offload.expert_stats()
    say()
    say(f"# ds4d bench model --expert-gpu-fraction — random V4 ({cfg.hidden_size} wide, {cfg.n_routed_experts} "
         f"experts, {cfg.num_hidden_layers} layers {list(cfg.compress_ratios)}), {args.dtype}"
         f", routed experts held as {offload.form.label}, "
         f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, {time.strftime('%Y-%m-%d')}")
    say(f"# PCIe host->device {pcie / 1e9:.1f} GB/s (measured, one staging bank); HBM copy {bandwidth / 1e12:.2f} TB/s; "
         f"expert {offload.host_expert_bytes / 2**20:.1f} MiB; decode: {steps} tokens after 1K; prefill 2048 tokens"
         f"{f' and {args.context}' if args.context else ''} in chunks of {args.prefill_chunk}; host RAM at the end "
         f"{stats['host_ram_bytes'] / 2**30:.1f} GiB ({stats['host_experts']} experts)")
    long_head = f" prefill {args.context} tok/s | floor | GB copied / skipped |" if args.context else ""
    if args.context and args.prefill_block:
        long_head += (f" prefill {args.context} as one step, layers over {args.prefill_block}-token blocks tok/s | "
                      "floor | GB copied / skipped |")
    say("| placement | prefill tok/s | floor | GB copied / skipped | decode b1 tok/s | floor | "
         f"GB copied / skipped / read in place per token | CPU experts / token |{long_head} "
         "bit-identical to all on device |")
    say("|---|---|---|---|---|---|---|---|" + ("---|---|---|" if args.context else "")
        + ("---|---|---|" if args.context and args.prefill_block else "") + "---|")
    figures = []  # --json: one row per figure, keyed "<placement>: <case>" (tests/gpu/gate.py reads them)
    for label, result, same, key in rows:
        pre_floor, dec_floor = floors.prefill(2048), floors.decode(1, 1024)
        long_floor = floors.prefill(args.context) if args.context else 0
        moved_p, moved_d, moved_l, cpu = "0 / 0", "0 / 0 / 0", "0 / 0", 0.0
        if "moved_prefill" in result:
            dpre, ddec, cpu = result["moved_prefill"], result["moved_decode"], result["cpu"]
            pre_floor = 2048 / max(2048 / pre_floor, dpre["bytes_copied"] / pcie)
            dec_floor = 1 / max(1 / dec_floor, (ddec["bytes_copied"] + ddec["host_read_bytes"]) / pcie)
            moved_p = f"{dpre['bytes_copied'] / 1e9:.1f} / {dpre['bytes_skipped'] / 1e9:.1f}"
            moved_d = (f"{ddec['bytes_copied'] / 1e9:.2f} / {ddec['bytes_skipped'] / 1e9:.2f} / "
                       f"{ddec['host_read_bytes'] / 1e9:.2f}")
            if ddec["fetched_ahead_pairs"]:  # of the experts read from host RAM, those fetched a layer ahead
                read = ddec["host_read_bytes"] / offload.host_expert_bytes
                moved_d += f" ({ddec['fetched_ahead_pairs']:.1f} of {read:.1f} experts fetched ahead)"
            if "moved_long" in result:
                dlong = result["moved_long"]
                long_floor = args.context / max(args.context / long_floor, dlong["bytes_copied"] / pcie)
                moved_l = f"{dlong['bytes_copied'] / 1e9:.1f} / {dlong['bytes_skipped'] / 1e9:.1f}"
        long_cells = ""
        if args.context:
            long_cells = f" {result['long']:,.0f} | {long_floor:,.0f} | {moved_l} |" if "long" in result else " | | |"
        if args.context and args.prefill_block:
            if "long_blocks" in result:
                dblock = result.get("moved_long_blocks", {"bytes_copied": 0, "bytes_skipped": 0})
                block_floor = args.context / max(args.context / floors.prefill(args.context),
                                                 dblock["bytes_copied"] / pcie)
                long_cells += (f" {result['long_blocks']:,.0f} | {block_floor:,.0f} | "
                               f"{dblock['bytes_copied'] / 1e9:.1f} / {dblock['bytes_skipped'] / 1e9:.1f} |")
            else:
                long_cells += " | | |"
        say(f"| {label} | {result['prefill']:,.0f} | {pre_floor:,.0f} | {moved_p} | {result['decode']:,.1f} | "
             f"{dec_floor:,.0f} | {moved_d} | {cpu:.1f} |{long_cells} {same or 'reference'} |")
        figures += [{"case": f"{key}: prefill 2048 tok, b1", "ds4d": result["prefill"], "floor": pre_floor,
                     "gb_copied": _gb_copied(result, "moved_prefill")},
                    {"case": f"{key}: decode b1 @1K", "ds4d": result["decode"], "floor": dec_floor}]
        if "long" in result:
            figures.append({"case": f"{key}: prefill {args.context} tok, b1", "ds4d": result["long"],
                            "floor": long_floor, "gb_copied": _gb_copied(result, "moved_long")})
        if "long_blocks" in result:
            figures.append({"case": f"{key}: prefill {args.context} tok, b1 (one step, layer by layer)",
                            "ds4d": result["long_blocks"], "floor": block_floor,
                            "gb_copied": _gb_copied(result, "moved_long_blocks")})
    hit = [row["hit_rate"] for row in stats["layers"] if row["hit_rate"] is not None]
    if hit:
        say(f"# GPU hit rate per layer over the whole run: min {min(hit):.2f}, mean {sum(hit) / len(hit):.2f}, "
             f"max {max(hit):.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": figures, "layers": cfg.num_hidden_layers,
                                               "pcie_gb_s": pcie / 1e9}, indent=1))
    offload.close()
    return 0
