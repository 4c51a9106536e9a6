"""`ds4d bench embedded`: the embedded GGUF model on the CPU, ds4d's engine vs llama.cpp.

Both run in this process on the same GGUF file with the same thread count and the
same prompts (the GGUF's own tokenizer, real English text): prefill tok/s and
greedy decode tok/s at batch 1 and batch 8.  The llama.cpp peer is the
``llama-cpp-python`` package (the ``bench`` extra builds it from source); if it is
missing the table says so and shows ds4d alone.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import time
import types
from pathlib import Path

TEXT = ("The history of the city begins with a small fishing settlement on the banks of a wide river. "
        "Over the centuries traders arrived from the south, bringing salt, cloth and stories, and the "
        "settlement grew into a market town with stone bridges, narrow streets and a busy harbour. ")


def add_parser(sub) -> None:
    p = sub.add_parser("embedded", help="embedded GGUF model on the CPU vs llama.cpp")
    p.add_argument("--model", default="", help="GGUF file (default: the embedded SmolLM2-135M Q4_1)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads for both engines (0 = all cores)")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--weight-format", default="auto", choices=["auto", "dense", "int4"],
                   help="llama weight_format knob: dense float weights or the file's 4-bit blocks")
    p.add_argument("--no-peer", action="store_true", help="skip llama.cpp")
    p.add_argument("--json", default="", help="also write the results to this JSON file")
    p.set_defaults(run=run)


def _prompts(tokenizer, n_prompts: int, n_tokens: int) -> list[list[int]]:
    base = tokenizer.encode(TEXT * (n_tokens // 40 + 2))
    # different prompts per sequence so batching cannot share work
    return [base[i * 7:i * 7 + n_tokens] for i in range(n_prompts)]


def run(args: argparse.Namespace) -> int:
    import torch

    from ds4d.bench.harness import make_engine, run_batch
    from ds4d.contracts import PluginContext
    from ds4d.kernel import embedded_model_path
    from ds4d.models.llama import LlamaFamily

    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    path = Path(args.model) if args.model else embedded_model_path()
    cfg = types.SimpleNamespace(dtype=args.dtype, device="cpu", threads=threads, weight_format=args.weight_format)
    model = LlamaFamily(PluginContext(cfg, logging.getLogger("ds4d.bench")), {}).load(path)
    max_batch = max(args.batch)
    engine = make_engine(model, max_num_seqs=max_batch, context_tokens=args.prompt_tokens + args.decode_tokens,
                         prefill_chunk=args.prompt_tokens)
    rows = []
    warm = _prompts(model.tokenizer, 1, 32)
    run_batch(engine, warm, 4)
    peer = None
    if not args.no_peer:
        from ds4d.bench.llamacpp_peer import LlamaCppPeer, PeerUnavailable

        try:
            peer = LlamaCppPeer(path, threads=threads, n_ctx=max_batch * (args.prompt_tokens + args.decode_tokens + 8),
                                n_seq=max_batch)
        except PeerUnavailable as exc:
            print(f"llama.cpp peer unavailable: {exc}")
    for batch in args.batch:
        prompts = _prompts(model.tokenizer, batch, args.prompt_tokens)
        ours = run_batch(engine, prompts, args.decode_tokens)
        row = {"batch": batch, "ds4d_prefill_tok_s": ours.prefill_tok_s, "ds4d_decode_tok_s": ours.decode_tok_s}
        if peer is not None:
            theirs = peer.run(prompts, args.decode_tokens)
            row.update(llamacpp_prefill_tok_s=theirs[0], llamacpp_decode_tok_s=theirs[1])
        rows.append(row)

    print()
    weights = model.info.extra.get("weight_format", "dense")
    print(f"# ds4d bench embedded — {path.name}, {threads} threads, {weights} weights, {args.dtype} activations, "
          f"{platform.processor() or platform.machine()}, {time.strftime('%Y-%m-%d')}")
    print(f"# prompt {args.prompt_tokens} tokens, decode {args.decode_tokens} tokens (greedy)")
    print("| batch | ds4d prefill tok/s | llama.cpp prefill tok/s | ratio | ds4d decode tok/s | llama.cpp decode tok/s | ratio |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        lp, ld = r.get("llamacpp_prefill_tok_s"), r.get("llamacpp_decode_tok_s")
        print(f"| {r['batch']} | {r['ds4d_prefill_tok_s']:.1f} | {_fmt(lp)} | {_ratio(r['ds4d_prefill_tok_s'], lp)} "
              f"| {r['ds4d_decode_tok_s']:.1f} | {_fmt(ld)} | {_ratio(r['ds4d_decode_tok_s'], ld)} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "threads": threads, "model": str(path),
                                               "weight_format": weights, "dtype": args.dtype}, indent=2))
    return 0


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1f}"


def _ratio(ours: float, theirs: float | None) -> str:
    return "n/a" if not theirs else f"{ours / theirs:.2f}x"
