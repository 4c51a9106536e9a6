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

import time


def _delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in ("bytes_copied", "bytes_skipped", "skipped_transfers", "host_read_bytes")}


def _cpu_experts(stats: dict) -> int:
    return sum(row["cpu_experts"] for row in stats["layers"])


def run_offload(args) -> int:
    import torch

    from ds4d.bench.harness import make_engine, run_batch
    from ds4d.bench.model import Floors, _say, _set_path, build, measure_ceilings
    from ds4d.models.deepseek_v4.offload import ExpertOffload, OffloadOptions

    fractions = [float(f) for f in args.expert_gpu_fraction.split(",") if f]
    device = torch.device(args.device if args.device != "cuda" or torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)
    bandwidth, matmul = measure_ceilings(torch, device)
    args.no_hf = True
    t0 = time.perf_counter()
    cfg, reader, model, _, _ = build(torch, args, device)
    floors = Floors(cfg, reader.issued, bandwidth, matmul, native=args.native)
    reader.issued.clear()
    _say(f"built in {time.perf_counter() - t0:.1f} s: layers {list(cfg.compress_ratios)}")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(args.seed)
    check_ids = torch.randint(100, cfg.vocab_size, (256,), generator=gen).tolist()
    prefill_ids = torch.randint(100, cfg.vocab_size, (1, 2048), generator=gen).tolist()
    decode_ids = torch.randint(100, cfg.vocab_size, (1, 1024), generator=gen).tolist()
    steps = args.decode_tokens

    def timed(label: str):
        """(prefill tok/s, decode tok/s, stats delta prefill, stats delta decode, cpu experts per token)."""
        offload = model.expert_offload
        core = make_engine(model, max_num_seqs=1, context_tokens=2048 + steps + 8, prefill_chunk=args.prefill_chunk)
        run_batch(core, prefill_ids, 4, sync)  # warm-up at the timed shapes (kernels compile on first use)
        s0 = offload.expert_stats() if offload else None
        prefill = run_batch(core, prefill_ids, 1, sync)
        s1 = offload.expert_stats() if offload else None
        run_batch(core, [decode_ids[0][:64]], 4, sync)
        s2 = offload.expert_stats() if offload else None
        run_batch(core, decode_ids, 1, sync)  # the prompt alone, to take its copies out of the decode figures
        s3 = offload.expert_stats() if offload else None
        decode = run_batch(core, decode_ids, steps, sync)
        s4 = offload.expert_stats() if offload else None
        tokens = max(1, decode.decode_tokens)
        per_token = None
        if offload:
            prompt, both = _delta(s3, s2), _delta(s4, s3)
            per_token = {k: (both[k] - prompt[k]) / tokens for k in both}
        result = (prefill.prefill_tok_s, decode.decode_tok_s, _delta(s1, s0) if offload else None, per_token,
                  (_cpu_experts(s4) - _cpu_experts(s3)) / tokens if offload else 0)
        _say(f"  {label}: prefill {result[0]:,.0f} tok/s, decode {result[1]:,.1f} tok/s, {result[2:]}")
        return result

    _set_path(model, "eager")
    reference = model.logits_for(check_ids)
    repeat = model.logits_for(check_ids)
    _say(f"all-on-device logits, run twice: equal {torch.equal(repeat, reference)}")
    from ds4d.models.deepseek_v4.moe import moe_forward

    layer = model.weights.layers[0]
    moe_x = torch.randn(2048, cfg.hidden_size, generator=gen).to(device, model.dtype)
    moe_ids = torch.tensor(prefill_ids[0], device=device)
    moe_ref = moe_forward(moe_x, moe_ids, layer.ffn, cfg, grouped=True)
    rows = []
    _set_path(model, "graphs")
    base = timed("all experts on the device (graphs)")
    rows.append(("all on device, no offload (graphs)", base, None))
    _set_path(model, "eager")
    rows.append(("all on device, no offload (eager)", timed("all experts on the device (eager)"), None))

    t0 = time.perf_counter()
    offload = ExpertOffload(model.weights, cfg, device=device, dtype=model.dtype,
                            options=OffloadOptions(vram_bytes=1 << 50, placement="static",
                                                   cpu_threads=args.expert_cpu_threads, native=args.native))
    model.expert_offload = offload
    _set_path(model, "graphs")  # decode steps that read cold experts in place (zero copy) replay graphs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    _say(f"zero-copy decode: {offload.zero_copy}")
    _say(f"experts to host RAM in {time.perf_counter() - t0:.1f} s (pinned in {offload.pinned.seconds:.1f} s, "
         f"huge pages {offload.arena.huge_pages}); PCIe {offload.pcie_bytes_s / 1e9:.1f} GB/s, "
         f"CPU expert {offload.cpu_expert_s * 1e3:.2f} ms")
    total = cfg.num_hidden_layers * cfg.n_routed_experts
    for fraction in fractions:
        offload.policy.capacity = round(fraction * total)
        offload.set_placement(offload.policy.initial())
        if device.type == "cuda":
            torch.cuda.empty_cache()
        got = model.logits_for(check_ids)
        moe_got = offload.moe_forward(0, moe_x, moe_ids, layer.ffn, cfg)
        same = (f"MoE layer {torch.equal(moe_got, moe_ref)}; logits {torch.equal(got, reference)} "
                f"(max |diff| {(got - reference).abs().max().item():.1e})")
        rows.append((f"{offload.expert_stats()['gpu_experts']}/{total} experts on device ({fraction:.0%})",
                     timed(f"{fraction:.0%} on device"), same))

    pcie = offload.pcie_bytes_s
    _say()
    _say(f"# ds4d bench model --expert-gpu-fraction — random V4 ({cfg.hidden_size} wide, {cfg.n_routed_experts} "
         f"experts, layers {list(cfg.compress_ratios)}), {args.dtype}"
         f"{', MXFP4 experts kept as stored on the device' if offload.native else ''}, "
         f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, {time.strftime('%Y-%m-%d')}")
    _say(f"# PCIe host->device {pcie / 1e9:.1f} GB/s (measured, one staging bank); HBM copy {bandwidth / 1e12:.2f} TB/s; "
         f"expert {offload.host_expert_bytes / 2**20:.0f} MiB; decode: {steps} tokens after 1K; prefill 2048 tokens")
    _say("| placement | prefill tok/s | floor | GB copied / skipped | decode b1 tok/s | floor | "
         "GB copied / skipped / read in place per token | CPU experts / token | bit-identical to all on device |")
    _say("|---|---|---|---|---|---|---|---|---|")
    for label, (pre, dec, dpre, ddec, cpu), same in rows:
        pre_floor, dec_floor = floors.prefill(2048), floors.decode(1, 1024)
        moved_p, moved_d = "0 / 0", "0 / 0 / 0"
        if dpre is not None:
            pre_floor = 2048 / max(2048 / pre_floor, dpre["bytes_copied"] / pcie)
            dec_floor = 1 / max(1 / dec_floor, (ddec["bytes_copied"] + ddec["host_read_bytes"]) / pcie)
            moved_p = f"{dpre['bytes_copied'] / 1e9:.1f} / {dpre['bytes_skipped'] / 1e9:.1f}"
            moved_d = (f"{ddec['bytes_copied'] / 1e9:.2f} / {ddec['bytes_skipped'] / 1e9:.2f} / "
                       f"{ddec['host_read_bytes'] / 1e9:.2f}")
        _say(f"| {label} | {pre:,.0f} | {pre_floor:,.0f} | {moved_p} | {dec:,.1f} | {dec_floor:,.0f} | {moved_d} | "
             f"{cpu:.1f} | {same or 'reference'} |")
    offload.close()
    return 0
