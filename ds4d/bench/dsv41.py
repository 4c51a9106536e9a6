"""`ds4d bench model --family deepseek_v41`: a random DeepSeek-V4.1 model of real widths on one device.

One process draws random weights for V4.1-Flash's widths (hidden 5,120, 64 heads of 512,
q rank 1,280, the real 129,280-token vocabulary and the tokenizer its Engram hash is built
from) with the layer pattern of ``--layers`` (compress ratios; default ``0,0,2,2,1,1``:
two window-only layers, a ratio-2 run whose first layer is a KV and index source and whose
second reuses it, a ratio-1 run with the candidate source; Engram on layers 1 and 3), in
bf16, on the device, and times what the engine runs:

* decode tok/s at batch 1 and 8 after a 1K-token prompt (``--context``), through ``DeepseekV41Serving.forward``
  (the chunks of a step run one after the other: batch 8 is 8 sequences stepped together);
* prefill tok/s of one 2K-token prompt (twice ``--context`` when given) as served (``last_only``: its
  triangle of rows), and where the window attention runs in its Triton kernel, the same prefill on the
  same weights with it as a dense mask (the reference's layout);
* the Engram lookup per step (hash, gather, copy to the device) from a page-locked table and
  from a memory-mapped file of the same bytes.

Each figure comes with its floor from BENCH.md: the bytes a step must read (every dense weight
of the layers, the head, the experts the step's tokens route to, as held: 2 bytes per bf16
parameter, FP4 codes and scales with ``--native``) over the copy bandwidth measured at the start
of the same run, and for prefill the larger of that and its matmul work over the measured bf16
rate.  ``--native`` draws the FP8 linears and the routed experts as the release stores them
(random e4m3 values and FP4 codes with e8m0 scales) and keeps them so (``weight_format = native``:
V4's FP8 and MXFP4 kernels); without it they are bf16.  ``--experts`` keeps fewer routed experts per layer than the release's 384 so more layers
fit in bf16 (decode reads the top-6 either way); the Engram tables are smaller than the release's
384M rows (``--engram-vocab``; a row costs the same to read).
With ``--oracle DIR`` the HF ``deepseek_v41`` model (``dsv41_oracle.py``) runs on the same tensors
after ds4d's model is freed: decode b1 after the same context, the prefill of the same prompt (its
cache path, every row), and how far its last logits are from ds4d's.
With ``--expert-gpu-fraction F`` the routed experts are offloaded (``models/deepseek_v41/offload.py``):
the first ``F`` of each layer's experts on the device, the rest in page-locked host RAM (static
placement), and each row's floor also counts the bytes the run moved over the link (copied cold
experts, and cold experts read in place by zero-copy decode) at the host-to-device bandwidth the
offload measured at start.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ds4d.bench.random_v4 import measure_ceilings
from ds4d.bench.random_v4 import say as _say

DEFAULT_LAYERS = "0,0,2,2,1,1"


@dataclass
class Row:
    case: str
    ds4d: float | None = None
    floor: float | None = None
    note: str = ""
    oracle: float | None = None
    """The HF ``deepseek_v41`` model's figure on the same weights in the same run (``--oracle``)."""
DECODE_CONTEXT = 1024
PREFILL_TOKENS = 2048


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--experts", type=int, default=128,
                   help="deepseek_v41: routed experts per layer (the release has 384; decode reads the top-6 either way)")
    p.add_argument("--engram-vocab", type=int, default=262_144,
                   help="deepseek_v41: each Engram head's prime modulus starts here (release: 16M, 98 GB per table)")
    p.add_argument("--oracle", default="",
                   help="deepseek_v41: a directory with the HF deepseek_v41 model files (configuration_, modeling_"
                        "deepseek_v41.py, shims.py for transformers 5.24): run it on the same weights as the peer")


def flash_overrides(experts: int, engram_vocab: int) -> dict:
    from ds4d.models.deepseek_v41.config import FLASH_WIDTHS

    return {**FLASH_WIDTHS, "n_routed_experts": experts, "engram_vocab_size": engram_vocab,
            "max_position_embeddings": 1048576,
            "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                             "original_max_position_embeddings": 65536}}


def bench_config(layers: list[int], tiny: bool, experts: int, engram_vocab: int):
    """(config dict, tokenizer): tiny widths and tokenizer, or V4.1-Flash widths on V4's tokenizer with V4.1's ids."""
    from ds4d.models.deepseek_v41.make_tiny import _tokenizer, engram_table_rows, tiny_config

    tokenizer = _tokenizer("tiny" if tiny else "v4")
    if tiny:
        return tiny_config(layers, tokenizer), tokenizer
    text = flash_overrides(experts, engram_vocab)
    config = tiny_config(layers, tokenizer, **text)
    engram_layers = config["text_config"]["engram_layer_ids"]
    config["text_config"]["engram_num_embeddings"] = engram_table_rows(
        len(engram_layers), text["engram_max_ngram_size"], text["engram_n_heads"], engram_vocab)
    return config, tokenizer


def random_tensors(torch, config: dict, device, seed: int, native: bool = False, fp8: bool = True) -> dict:
    """``{official name: tensor}`` of random weights (``models/deepseek_v41/random_init.py``) on ``device``,
    the Engram tables and the routed experts in host memory; with ``native`` the FP8 linears (unless
    not ``fp8``) and the routed experts as stored (e4m3 values, FP4 codes, with e8m0 scales)."""
    from ds4d.models.deepseek_v41.layout import FP4, FP8
    from ds4d.models.deepseek_v41.random_init import RandomTensors

    stored = ((FP8, FP4) if fp8 else (FP4,)) if native else ()
    return dict(RandomTensors(config, device=device, seed=seed, stored=stored))


def experts_to_host(tensors: dict) -> None:
    """The routed experts' tensors moved to host memory (an offloaded model reads them from there)."""
    for name, tensor in tensors.items():
        if ".ffn.experts." in name:
            tensors[name] = tensor.cpu()


def _sync(torch, device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(torch, device, fn) -> float:
    _sync(torch, device)
    start = time.perf_counter()
    fn()
    _sync(torch, device)
    return time.perf_counter() - start


def _numel(tensors) -> int:
    return sum(t.numel() for t in tensors)


class Floors:
    """Bytes and FLOPs a step must move, at 2 bytes per parameter."""

    def __init__(self, model, bandwidth: float, matmul: float) -> None:
        from ds4d.models.deepseek_v41.weights import tensors_of

        cfg, weights = model.cfg, model.weights
        self.bandwidth, self.matmul = bandwidth, matmul
        self.k = cfg.num_experts_per_tok
        self.experts = cfg.n_routed_experts
        self.layers = cfg.num_hidden_layers
        self.expert_params = 3 * cfg.moe_intermediate_size * cfg.hidden_size
        banks, offload = weights.layers[0].ffn.banks, model.expert_offload
        if offload is not None:
            self.expert_bytes = offload.host_expert_bytes if offload.native else 2 * self.expert_params
        else:
            self.expert_bytes = banks.stored_bytes() / banks.experts if banks.stored else 2 * self.expert_params
        """Bytes one routed expert's three matrices take: FP4 codes and scales as held, else bf16's."""
        dense, held = weights.head.numel(), 2 * weights.head.numel()
        for layer in weights.layers:
            # the routed experts are counted by the expert, the Engram tables by the rows read
            skip = {id(t) for t in tensors_of(layer.ffn.banks)}
            if layer.engram is not None:
                skip |= {id(layer.engram.table), id(layer.engram.table_scale)}
            rest = [t for t in tensors_of(layer) if id(t) not in skip]
            dense += _numel(rest)
            held += sum(min(2, t.element_size()) * t.numel() for t in rest)
        self.dense_params = dense
        self.dense_bytes = held
        """Bytes of the weights every step reads: FP8 values at one byte, the rest at bf16's two."""

    def _distinct(self, tokens: int) -> float:
        """Expected distinct experts per layer for ``tokens`` independent uniform top-k picks."""
        return self.experts * (1 - (1 - self.k / self.experts) ** tokens)

    def _bytes(self, tokens: int) -> float:
        return self.dense_bytes + self.layers * self._distinct(tokens) * self.expert_bytes

    def decode(self, batch: int, link_bytes: float = 0, link_bandwidth: float = 1.0) -> float:
        """``link_bytes``: what the step moved host -> device (offloaded experts), at ``link_bandwidth``."""
        return batch / max(self._bytes(batch) / self.bandwidth, link_bytes / link_bandwidth)

    def prefill(self, tokens: int, link_bytes: float = 0, link_bandwidth: float = 1.0) -> float:
        active = self.dense_params + self.layers * self.k * self.expert_params
        return tokens / max(self._bytes(tokens) / self.bandwidth, 2 * tokens * active / self.matmul,
                            link_bytes / link_bandwidth)


def _moved(model) -> int:
    """Host -> device bytes the offloaded experts have moved so far (copied, and read in place)."""
    if model.expert_offload is None:
        return 0
    stats = model.expert_offload.expert_stats()
    return stats["bytes_copied"] + stats["host_read_bytes"]


def offload_options(cfg, fraction: float, native: bool, fetch_ahead: int = 0):
    """Options that hold the first ``fraction`` of each layer's experts on the device (static placement,
    set after the build by :func:`place_first`), with room to spare for the staging banks; ``fetch_ahead``:
    ``OffloadOptions.fetch_ahead``."""
    from ds4d.cuda import moe_gemv
    from ds4d.models.deepseek_v4.offload import OffloadOptions

    per_expert = 3 * cfg.moe_intermediate_size * cfg.hidden_size * (17 / 32 if native else 2)
    hot = math.ceil(fraction * cfg.n_routed_experts) * cfg.num_hidden_layers
    return OffloadOptions(vram_bytes=int((hot + 16 + moe_gemv.MAX_ROWS + 2 * fetch_ahead) * per_expert * 1.05),
                          placement="static", stage_experts=8, fetch_ahead=fetch_ahead)


def place_first(model, fraction: float) -> None:
    """Every layer's first ``fraction`` of routed experts on the device, the rest in host RAM."""
    experts = model.cfg.n_routed_experts
    hot = list(range(math.ceil(fraction * experts)))
    model.expert_offload.set_placement([hot] * model.cfg.num_hidden_layers)


def _decode_rate(torch, device, serving, prompts, steps: int, moved=lambda: 0) -> tuple[float, float]:
    """(tokens/s, ``moved()`` bytes per step) of ``steps`` decode steps of ``len(prompts)`` sequences,
    after their prefill and one warm step."""
    from ds4d.contracts import ForwardBatch, SeqChunk

    block = serving.info.block_size_tokens
    per_seq = -(-(len(prompts[0]) + steps + 1) // block)
    tables = [tuple(range(s * per_seq, (s + 1) * per_seq)) for s in range(len(prompts))]
    for slot, prompt in enumerate(prompts):
        logits = serving.forward(ForwardBatch((SeqChunk(slot, tuple(prompt), 0, tables[slot], 1),)))
    nxt = [int(logits[-1].argmax())] * len(prompts)
    position = len(prompts[0])

    def step(at: int) -> list[int]:
        out = serving.forward(ForwardBatch(tuple(SeqChunk(s, (nxt[s],), at, tables[s], 1)
                                                 for s in range(len(prompts)))))
        return out.argmax(-1).tolist()

    nxt = step(position)  # warm
    position += 1

    def run() -> None:
        nonlocal nxt, position
        for _ in range(steps):
            nxt = step(position)
            position += 1

    before = moved()
    seconds = _timed(torch, device, run)
    return steps * len(prompts) / seconds, (moved() - before) / steps


def engram_lookup_rows(torch, device, model, steps: int, tokens: int) -> list[Row]:
    """The Engram lookup of a step (hash the ids, gather every Engram layer's rows, copy them to the
    device) with the tables page-locked in RAM and memory-mapped from a file of the same bytes."""
    from ds4d.models.deepseek_v41.engram import EngramWeights, gather_rows

    layers = [w.engram for w in model.weights.layers if w.engram is not None]
    hasher, plans = model.hasher, [p for p, w in zip(model.plans, model.weights.layers) if w.engram is not None]
    gen = torch.Generator().manual_seed(7)
    vocab = model.cfg.vocab_size
    rows_out = []
    table_bytes = sum(e.table.nbytes + e.table_scale.nbytes for e in layers)
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        mapped = []
        for index, engram in enumerate(layers):
            path = Path(tmp) / f"engram{index}.bin"
            with open(path, "wb") as f:
                f.write(engram.table.view(torch.uint8).numpy().tobytes())
            table = torch.from_file(str(path), shared=False, size=engram.table.numel(), dtype=torch.uint8)
            mapped.append(EngramWeights(table.view(torch.float8_e4m3fn).view(engram.table.shape),
                                        engram.table_scale, engram.wkv, engram.gate_weight))
            _drop_page_cache(path)
        first_touch = None
        ram = "page-locked RAM" if device.type == "cuda" else "RAM"
        stores = {ram: [EngramWeights(e.table.pin_memory() if device.type == "cuda" else e.table,
                                                    e.table_scale, e.wkv, e.gate_weight) for e in layers],
                  "mmap (first touch)": mapped, "mmap (cached)": mapped}
        warm_ids = hasher.row_ids(hasher.compress(torch.zeros(hasher.history, dtype=torch.long)),
                                  torch.randint(100, vocab, (tokens,), generator=torch.Generator().manual_seed(1)))
        for plan, table in zip(plans, stores[ram]):  # first-call costs of the gather and copy, not timed
            gather_rows(table, warm_ids[:, plan.engram_slot], device)
        for label, tables in stores.items():
            seconds = []
            if label == "mmap (first touch)":
                first_touch = gen.get_state()
            elif label == "mmap (cached)":
                gen.set_state(first_touch)  # the same rows again: now in the page cache
            for _ in range(steps):
                ids = torch.randint(100, vocab, (tokens,), generator=gen)
                earlier = torch.randint(100, vocab, (hasher.history,), generator=gen)
                earlier = hasher.compress(earlier)

                def lookup() -> None:
                    row_ids = hasher.row_ids(earlier, ids)
                    for plan, table in zip(plans, tables):
                        gather_rows(table, row_ids[:, plan.engram_slot], device)

                seconds.append(_timed(torch, device, lookup))
            median = sorted(seconds)[len(seconds) // 2]
            rows_out.append(Row(f"engram lookup {tokens} tok, {label}", ds4d=median * 1e3,
                                note=f"ms per step, {len(layers)} tables, {table_bytes / 2**30:.1f} GiB"))
    return rows_out


def _drop_page_cache(path: Path) -> None:
    """Ask the kernel to forget the file's cached pages (may be a no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    except (OSError, AttributeError):
        pass


def run(args: argparse.Namespace) -> int:
    import torch

    from ds4d.models.deepseek_v41.config import DeepseekV41Config
    from ds4d.models.deepseek_v41.model import DeepseekV41Model
    from ds4d.models.deepseek_v41.serving import DeepseekV41Serving

    device = torch.device(args.device if args.device != "cuda" or torch.cuda.is_available() else "cpu")
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    layers = [int(x) for x in (args.layers or DEFAULT_LAYERS).split(",")]
    bandwidth, matmul = measure_ceilings(torch, device)
    _say(f"ceilings: copy {bandwidth / 1e12:.2f} TB/s (read + write), bf16 matmul {matmul / 1e12:.0f} TFLOP/s")
    t0 = time.perf_counter()
    config, tokenizer = bench_config(layers, args.tiny, args.experts, args.engram_vocab)
    cfg = DeepseekV41Config.from_dict(config, name="random-v41")
    native = bool(getattr(args, "native", False))
    kinds = ()
    if native:
        from ds4d.models.deepseek_v41.family import stored_weight_choice

        kinds = stored_weight_choice("native", dtype, str(device))  # refuses where the kernels cannot run
    tensors = random_tensors(torch, config, device, args.seed, native=native, fp8="fp8" in kinds)
    from ds4d.models.deepseek_v41.paths import ForwardPaths

    paths = ForwardPaths.for_device(device).replace(compile_decode=bool(getattr(args, "compile", False)))
    fraction = _fraction(getattr(args, "expert_gpu_fraction", ""))
    offload = None
    if fraction is not None:
        if args.oracle:
            raise SystemExit("--oracle runs the HF model with every expert on the device: not with --expert-gpu-fraction")
        experts_to_host(tensors)
        offload = offload_options(cfg, fraction, native, getattr(args, "fetch_ahead", 0))
    model = DeepseekV41Model.from_tensors(cfg, tensors, tokenizer, dtype=dtype, device=device, paths=paths,
                                          stored_weights=native, offload=offload)
    if offload is not None:
        place_first(model, fraction)
    if not args.oracle:
        del tensors
    serving = DeepseekV41Serving(model, tokenizer, parameter_bytes=0)
    context = args.context or (64 if args.tiny else DECODE_CONTEXT)
    prefill_tokens = 2 * context if args.context or args.tiny else PREFILL_TOKENS
    batches = [int(b) for b in args.batches.split(",") if int(b) <= 8]
    block = serving.info.block_size_tokens
    per_seq = -(-(max(context + args.decode_tokens + 2, prefill_tokens)) // block)
    serving.allocate_cache(per_seq * max(batches + [1]), max(batches + [1]))
    floors = Floors(model, bandwidth, matmul)
    _say(f"built in {time.perf_counter() - t0:.1f} s: layers {layers}, {cfg.n_routed_experts} experts of "
         f"{floors.expert_params / 1e6:.1f}M ({floors.expert_bytes / 2**20:.1f} MiB, "
         f"{'FP4 as stored' if native else 'bf16'}), {floors.dense_params / 1e9:.2f}B dense parameters "
         f"({floors.dense_bytes / 2**30:.2f} GiB), "
         f"Engram on {list(cfg.engram_layer_ids)}, {args.dtype} on {device}")
    link = 1.0
    if model.expert_offload is not None:
        offloaded = model.expert_offload
        link = offloaded.pcie_bytes_s
        stats = offloaded.expert_stats()
        _say(f"experts offloaded: {stats['gpu_experts']} on the device, {stats['ram_experts']} in host RAM "
             f"({stats['host_ram_bytes'] / 2**30:.1f} GiB, pinned {bool(offloaded.pinned.enabled)}); host -> device "
             f"{link / 1e9:.1f} GB/s; zero-copy decode {offloaded.zero_copy}")
    gen = torch.Generator().manual_seed(args.seed)
    rows: list[Row] = []
    decoders = [(serving, "")]
    if getattr(args, "route_kernel", False):  # the same weights, each decode step's routing the other way
        other = not model.paths.route_kernel
        routed = DeepseekV41Model(cfg, model.weights, model.hasher, device=device, dtype=dtype,
                                  paths=model.paths.replace(route_kernel=other), expert_offload=model.expert_offload)
        label = " (routing in one kernel)" if other else " (routing in torch's operators)"
        decoders.append((DeepseekV41Serving(routed, tokenizer, parameter_bytes=0), label))
        decoders[-1][0].allocate_cache(per_seq * max(batches + [1]), max(batches + [1]))
    for decoder, label in decoders:
        for batch in batches:
            prompts = torch.randint(100, cfg.vocab_size, (batch, context), generator=gen).tolist()
            rate, moved = _decode_rate(torch, device, decoder, prompts, args.decode_tokens, lambda: _moved(model))
            rows.append(Row(f"decode b{batch} @{context}{label}", ds4d=rate, floor=floors.decode(batch, moved, link),
                            note=f"{moved / 1e9:.2f} GB over the link per step" if model.expert_offload else ""))
            _say(f"decode b{batch}{label}: {rate:.1f} tok/s")
    prompt = torch.randint(100, cfg.vocab_size, (prefill_tokens,), generator=gen).tolist()
    rate, moved = _prefill_rate(torch, device, model, prompt)
    last = model.prefill(model.new_state(), prompt, last_only=True)[-1].float().cpu()
    rows.append(Row(f"prefill {prefill_tokens} (triangle)", ds4d=rate,
                    floor=floors.prefill(prefill_tokens, moved, link),
                    note=f"{moved / 1e9:.2f} GB over the link" if model.expert_offload else ""))
    if model.paths.window_kernel:  # the same weights with the window attention as a dense mask: the kernel's peer
        dense = DeepseekV41Model(cfg, model.weights, model.hasher, device=model.device, dtype=model.dtype,
                                 paths=model.paths.replace(window_kernel=False), expert_offload=model.expert_offload)
        rate, moved = _prefill_rate(torch, device, dense, prompt)
        rows.append(Row(f"prefill {prefill_tokens} (triangle), window attention as a dense mask", ds4d=rate,
                        floor=floors.prefill(prefill_tokens, moved, link)))
        del dense
    for tokens in (1, prefill_tokens):
        rows += engram_lookup_rows(torch, device, model, steps=5, tokens=tokens)
    if args.oracle:
        decode_prompt = torch.randint(100, cfg.vocab_size, (context,), generator=torch.Generator().manual_seed(3))
        del serving, model
        _oracle_rows(torch, device, dtype, args, config, tensors, tokenizer, rows, decode_prompt.tolist(), prompt, last)
    _print(rows, layers, args, device)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "family": "deepseek_v41", "layers": layers, "experts": cfg.n_routed_experts, "device": str(device),
            "native": native, "expert_gpu_fraction": fraction,
            "dtype": args.dtype, "bandwidth": bandwidth, "matmul": matmul,
            "rows": [vars(r) for r in rows]}, indent=1))
    return 0


def _prefill_rate(torch, device, model, prompt: list[int]) -> tuple[float, float]:
    """(tok/s of the served prefill of ``prompt``: the median of three after a warm-up, bytes it moved
    over the link on average)."""
    seconds = []
    before = _moved(model)
    for _ in range(4):
        state = model.new_state()
        seconds.append(_timed(torch, device, lambda: model.prefill(state, prompt, last_only=True)))
    return len(prompt) / sorted(seconds[1:])[1], (_moved(model) - before) / 4


def _oracle_rows(torch, device, dtype, args, config, tensors, tokenizer, rows: list[Row], decode_prompt, prompt,
                 last) -> None:
    """The HF model on the same tensors: decode b1 and the prefill, set beside ds4d's rows."""
    import gc

    from ds4d.bench.dsv41_oracle import Oracle

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    t0 = time.perf_counter()
    oracle = Oracle(args.oracle, config, tensors, tokenizer, device, dtype)
    del tensors
    _say(f"oracle built in {time.perf_counter() - t0:.1f} s")
    by_case = {row.case: row for row in rows}
    decode = by_case.get(f"decode b1 @{len(decode_prompt)}")
    if decode is not None:
        decode.oracle = oracle.decode_rate(decode_prompt, args.decode_tokens)
        _say(f"oracle decode b1: {decode.oracle:.2f} tok/s")
    oracle.prefill(prompt[:64])  # first-call costs
    seconds, logits = oracle.prefill(prompt)
    by_case[f"prefill {len(prompt)} (triangle)"].oracle = len(prompt) / seconds
    scale = float(logits.abs().max())
    rows.append(Row(f"prefill {len(prompt)}: last logits, ds4d vs oracle", ds4d=float((last - logits).abs().max()) / scale,
                    note=f"max |difference| / max |logit| ({scale:.2f}), same next token: "
                         f"{int(last.argmax()) == int(logits.argmax())}"))


def _fraction(text: str) -> float | None:
    """``--expert-gpu-fraction`` for this family: one share of each layer's experts, or None (no offload)."""
    if not text:
        return None
    if "," in text:
        raise SystemExit("--family deepseek_v41 takes one --expert-gpu-fraction (a run per fraction)")
    value = float(text)
    if not 0 <= value < 1:
        raise SystemExit("--expert-gpu-fraction is a share of the experts in [0, 1)")
    return value


def _figure(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def _print(rows: list[Row], layers, args, device) -> None:
    _say("")
    experts = "FP8 linears + FP4 experts as stored" if getattr(args, "native", False) else "bf16 weights"
    if getattr(args, "expert_gpu_fraction", ""):
        experts += f", {float(args.expert_gpu_fraction):.0%} of the routed experts on the device"
    peer = any(row.oracle for row in rows)
    extra = " oracle | ds4d / oracle |" if peer else ""
    _say(f"| case | ds4d | floor | ratio |{extra}   ({args.dtype}, {experts}, {device}, layers {','.join(map(str, layers))})")
    _say("|---|---|---|---|" + ("---|---|" if peer else ""))
    for row in rows:
        unit = "ms" if row.case.startswith("engram") else "" if "logits" in row.case else "tok/s"
        floor = f"{row.floor:,.1f}" if row.floor else "-"
        ratio = f"{row.ds4d / row.floor:.2f}x" if row.floor and row.ds4d else "-"
        value = "-" if row.ds4d is None or math.isnan(row.ds4d) else f"{_figure(row.ds4d)} {unit}".rstrip()
        cells = ""
        if peer:
            cells = (f" {row.oracle:,.2f} | {row.ds4d / row.oracle:.2f}x |" if row.oracle and row.ds4d
                     else " - | - |")
        _say(f"| {row.case} | {value} | {floor} | {ratio} |{cells} {row.note}")
