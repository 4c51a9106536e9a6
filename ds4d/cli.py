"""Command line: ds4d serve | config | doctor | calibrate | plugins | console | bench | make-tiny."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path

from ds4d import __version__
from ds4d.bench import add_parsers as add_bench_parsers
from ds4d.config import ConfigError, add_cli_flags, describe, load_config
from ds4d.registry import KINDS, PluginError, available
from tui.cli import DESCRIPTION as CONSOLE_DESCRIPTION
from tui.cli import add_arguments as add_console_arguments


def _loaded(args: argparse.Namespace):
    return load_config(vars(args), config_file=args.config_file)


def cmd_serve(args: argparse.Namespace) -> int:
    from ds4d.kernel import Kernel, abandon_load
    from ds4d.parallel.gpus import is_torchrun

    # GPU indices (--gpus, cuda:N) in the order nvidia-smi and NVML use, not CUDA's fastest-first
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    loaded = _loaded(args)
    if not loaded.config.gpus:
        # Steps of many shapes share one device: segments that grow in place keep what the process
        # holds near the memory plan's peak instead of piling up cached blocks of each shape.
        # (Before the first CUDA allocation; an operator's own setting wins.)
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    logging.basicConfig(level=loaded.config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if is_torchrun(loaded.config.gpus) and os.environ.get("RANK", "0") != "0":
        return Kernel(loaded).serve_worker()
    kernel = Kernel(loaded)
    asyncio.run(kernel.serve())
    if kernel.load_abandoned:
        abandon_load()
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    print(describe(_loaded(args)))
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from ds4d.doctor import main as doctor_main

    return doctor_main(_loaded(args).config, as_json=args.json)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from ds4d.kernel import Kernel
    from ds4d.models.deepseek_v4.calibrate import can_count, read_prompts, routing_counts, write_counts
    from ds4d.registry import resolve

    loaded = _loaded(args)
    logging.basicConfig(level=loaded.config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    kernel = Kernel(loaded)
    model = kernel.load_model().model
    if not can_count(model):
        print("ds4d: calibrate needs a DeepSeek-V4 model loaded in this process (no --gpus split)", file=sys.stderr)
        return 2
    encoder = resolve("chat_encoder", model.info.default_chat_encoder)(kernel.ctx, {}, model.tokenizer, model.info)

    def render(messages):
        from ds4d.contracts import ChatRenderRequest

        return encoder.render(ChatRenderRequest(messages=tuple(messages))).token_ids

    prompts = read_prompts(Path(args.prompts), model.tokenizer, render, max_tokens=args.max_prompt_tokens)
    counts = routing_counts(model, prompts)
    write_counts(Path(args.out), counts, model_name=model.info.name, prompts=len(prompts))
    print(f"{len(prompts)} prompts, {sum(len(p) for p in prompts)} tokens: routing counts of "
          f"{len(counts)} layers written to {args.out} (use expert_calibration = \"{args.out}\")")
    return 0


def cmd_plugins(args: argparse.Namespace) -> int:
    for kind in KINDS:
        specs = available(kind)
        print(f"{kind}:" + ("" if specs else " (none installed)"))
        for name, spec in sorted(specs.items()):
            print(f"  {name:14} {spec.target}  ({spec.origin})")
    return 0


def cmd_console(args: argparse.Namespace) -> int:
    from tui.app import run

    return run(args)


def cmd_make_tiny(args: argparse.Namespace) -> int:
    if args.family == "deepseek_v41":
        if args.widths != "tiny":
            raise PluginError("make-tiny --family deepseek_v41 writes tiny widths only")
        if args.gguf:
            raise PluginError("make-tiny --gguf writes DeepSeek-V4 files only (--family deepseek_v4)")
        from ds4d.models.deepseek_v41.make_tiny import main as make_tiny_v41

        return make_tiny_v41(args)
    if args.family != "deepseek_v4":
        raise PluginError(f"make-tiny knows --family deepseek_v4 and deepseek_v41, not {args.family!r}")
    if args.tokenizer != "tiny":
        raise PluginError("make-tiny --tokenizer is for --family deepseek_v41 (V4 checkpoints carry V4's tokenizer)")
    layers = [int(x) for x in args.layers.split(",")] if args.layers else None
    if args.gguf:  # the config the random load formats and the benchmarks build (V4-Flash's, or small widths)
        from ds4d.bench.random_v4 import base_config
        from ds4d.models.deepseek_v4.config import DeepseekV4Config
        from ds4d.models.deepseek_v4.gguf_writer import main_random_gguf

        ratios = layers or [0, 0, 4, 128]
        data = {**base_config(args.widths == "tiny"), "num_hidden_layers": len(ratios), "compress_ratios": ratios}
        cfg = DeepseekV4Config.from_dict(data, name=Path(args.out).name.removesuffix(".gguf"))
        main_random_gguf(Path(args.out), cfg, args.gguf, args.seed, widths=args.widths, device=args.device)
        return 0
    from ds4d.models.deepseek_v4.make_tiny import main_make_tiny

    main_make_tiny(Path(args.out), args.seed, layers, widths=args.widths, device=args.device)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    return args.run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ds4d", description="DeepSeek-V4 inference daemon")
    parser.add_argument("--version", action="version", version=f"ds4d {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="start the daemon")
    add_cli_flags(serve)
    serve.set_defaults(func=cmd_serve)

    config = sub.add_parser("config", help="print the effective configuration and where each value came from")
    add_cli_flags(config)
    config.set_defaults(func=cmd_config)

    doctor = sub.add_parser("doctor", help="check the machine for what serve would use, and say how to fix problems")
    add_cli_flags(doctor)
    doctor.add_argument("--json", action="store_true", help="print the checks as JSON")
    doctor.set_defaults(func=cmd_doctor)

    calibrate = sub.add_parser("calibrate", help="DeepSeek-V4: expert routing counts of a prompt set, for the "
                                                 "hot-expert placement (expert_calibration)")
    add_cli_flags(calibrate)
    calibrate.add_argument("--prompts", required=True, help=".jsonl of {prompt} or {messages}, or one prompt a line")
    calibrate.add_argument("--out", required=True, help="where to write the counts (JSON)")
    calibrate.add_argument("--max-prompt-tokens", type=int, default=8192, help="cut longer prompts (0 = no cut)")
    calibrate.set_defaults(func=cmd_calibrate)

    plugins = sub.add_parser("plugins", help="list installed plugins")
    plugins.set_defaults(func=cmd_plugins)

    console = sub.add_parser("console", help="operator console (Textual)", description=CONSOLE_DESCRIPTION)
    add_console_arguments(console)
    console.set_defaults(func=cmd_console)

    bench = sub.add_parser("bench", help="benchmarks (ds4d bench --help)",
                           description="benchmarks whose results go into docs/BENCHMARKS.md")
    add_bench_parsers(bench)
    bench.set_defaults(func=cmd_bench)

    tiny = sub.add_parser("make-tiny", help="write a random checkpoint in the official format")
    tiny.add_argument("--family", default="deepseek_v4", choices=["deepseek_v4", "deepseek_v41"])
    tiny.add_argument("--out", required=True)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--layers", default="", help="comma-separated compress ratios, e.g. 0,4,128")
    tiny.add_argument("--widths", default="tiny", choices=["tiny", "flash"],
                      help="tiny widths, or V4-Flash's (about 3.3 GB per layer; for benchmarks)")
    tiny.add_argument("--device", default="cpu", help="where to draw and quantise (cuda: far faster at flash widths)")
    tiny.add_argument("--tokenizer", default="tiny", choices=["tiny", "v4"],
                      help="deepseek_v41: tiny (a small byte-level tokenizer.json) or v4 (the real 129,280 ids: "
                           "V4's tokenizer with V4.1's added tokens, derived at load)")
    tiny.add_argument("--gguf", default="", choices=["", "q2"],
                      help="deepseek_v4: write one GGUF file (--out FILE.gguf) in llama.cpp's converter layout with "
                           "the linears and routed experts in random blocks of this recipe (q2: the ds4 q2 files'), "
                           "the bytes load_format = random-q2 draws on the same --device and --seed")
    tiny.set_defaults(func=cmd_make_tiny)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, PluginError) as exc:
        print(f"ds4d: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
