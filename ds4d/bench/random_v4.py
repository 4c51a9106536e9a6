"""The random DeepSeek-V4 model the model benchmarks time (``ds4d bench model``, its offload and
parallel variants): widths, weights, the floors of BENCH.md, and the forward path each row runs.

Imports no torch at the top (ds4d's parser imports the bench modules).
"""

from __future__ import annotations

import json
from pathlib import Path


def say(*parts) -> None:
    print(*parts, flush=True)


FLASH_RATIOS = (0, 0) + (4, 128) * 20 + (4,)
"""V4-Flash's compress ratio per layer, all 43 (its config.json's list without the MTP layer's entry)."""


def full_depth_ratios(config: dict | None = None) -> tuple[int, ...]:
    """Every layer's compress ratio: ``config``'s own (its ``compress_ratios`` without the MTP layers' entries
    after ``num_hidden_layers``), or V4-Flash's."""
    if config is None:
        return FLASH_RATIOS
    layers, ratios = config["num_hidden_layers"], config.get("compress_ratios") or []
    if len(ratios) < layers:
        raise SystemExit(f"the config has {len(ratios)} compress_ratios for {layers} layers")
    return tuple(ratios[:layers])


def measure_ceilings(torch, device) -> tuple[float, float]:
    """(device-to-device copy bytes/s counting read + write, bf16 matmul FLOP/s) on random data."""
    if device.type != "cuda":
        return 20e9, 1e12
    src = torch.randn(1 << 29, device=device, dtype=torch.bfloat16)  # 1 GiB
    dst = torch.empty_like(src)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)

    def timed(fn, reps: int) -> float:
        for _ in range(3):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(reps):
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return sorted(times)[len(times) // 2]

    copy_s = timed(lambda: dst.copy_(src), 20)
    mm_s = timed(lambda: torch.mm(a, b), 10)
    return 2 * src.numel() * 2 / copy_s, 2 * 8192**3 / mm_s


class Floors:
    """BENCH.md's floors for one model, from its issued tensors: 2 bytes per parameter, except
    with ``native`` weights, where FP8 linears take 1 byte (plus a float32 scale per 128 x 128)
    and MXFP4 experts 17/32 of a byte.

    ``ep``: routed experts split over that many GPUs working at once (each reads
    and multiplies its share; everything else is replicated)."""

    def __init__(self, cfg, issued, bandwidth: float, matmul: float, native: bool = False, ep: int = 1,
                 gguf: str = "") -> None:
        from ds4d.models.deepseek_v4.random_init import FP8_IN_RELEASE, GGUF_RECIPES

        self.cfg, self.bandwidth, self.matmul, self.ep = cfg, bandwidth, matmul, ep
        dense = {n: t.numel() for n, t in issued.items() if ".experts." not in n and not n.endswith("tid2eid")}
        self.dense_params = sum(dense.values()) - issued["embed.weight"].numel() + cfg.hidden_size  # one row
        fp8 = sum(v for n, v in dense.items() if (native or gguf) and FP8_IN_RELEASE.search(n))
        self.dense_bytes = 2 * self.dense_params - fp8 * (1 - 4 / 128**2)
        self.head_params = issued["head.weight"].numel()
        self.expert_params = 3 * cfg.moe_intermediate_size * cfg.hidden_size
        self.expert_bytes = self.expert_params * (17 / 32 if native else 2)
        if gguf:  # the recipe's bytes per value: its linears in place of FP8's, its experts
            recipe = GGUF_RECIPES[gguf]
            self.dense_bytes = 2 * self.dense_params - fp8 * (2 - _bytes_per_value(recipe["linear"]))
            self.expert_bytes = self.expert_params * sum(_bytes_per_value(recipe[w]) for w in ("w1", "w2", "w3")) / 3
        self.shared_params = sum(t.numel() for n, t in issued.items() if ".shared_experts." in n)

    def _kv_bytes(self, context: int) -> float:
        cfg, total = self.cfg, 0.0
        for ratio in cfg.compress_ratios:
            total += min(context, cfg.sliding_window) * cfg.head_dim
            if ratio == 4:
                total += context / 4 * cfg.index_head_dim + min(cfg.index_topk, context / 4) * cfg.head_dim
            elif ratio:
                total += context / ratio * cfg.head_dim
        return 2 * total

    def decode(self, batch: int, context: int) -> float:
        cfg = self.cfg
        experts, k = cfg.n_routed_experts, cfg.num_experts_per_tok
        used = experts * (1 - (1 - k / experts) ** batch)  # expected distinct experts per layer
        step = self.dense_bytes + cfg.num_hidden_layers * used * self.expert_bytes / self.ep
        step += batch * self._kv_bytes(context)
        return batch * self.bandwidth / step

    def head_seconds(self) -> float:
        """The output head read once at the copy bandwidth, as the floors count its bytes (2 a parameter)."""
        return 2 * self.head_params / self.bandwidth

    def layer_seconds(self, batch: int, context: int) -> float:
        """A decode step's floor per layer: the step's floor time less the head's, over the layers."""
        return (batch / self.decode(batch, context) - self.head_seconds()) / self.cfg.num_hidden_layers

    def prefill(self, tokens: int) -> float:
        cfg = self.cfg
        routed = cfg.num_hidden_layers * cfg.num_experts_per_tok * self.expert_params / self.ep
        flops_s = 2 * (self.dense_params - self.head_params + routed) * tokens / self.matmul
        all_bytes = self.dense_bytes + cfg.num_hidden_layers * cfg.n_routed_experts * self.expert_bytes / self.ep
        return tokens / max(flops_s, all_bytes / self.bandwidth)


def issued_shapes(cfg, native: bool = False) -> dict:
    """The tensors a random model of ``cfg`` would issue, as meta tensors (shapes and dtypes, no values): what
    :class:`Floors` counts, for a model too large to build in this process (its ranks build it)."""
    import torch

    from ds4d.models.deepseek_v4.random_init import RandomReader
    from ds4d.models.deepseek_v4.weights import read_weights

    class ShapeReader(RandomReader):
        """Draws nothing: every tensor a meta tensor of its shape; experts and FP8 linears as plain matrices."""

        def _randn(self, shape, name):
            return torch.empty(shape, device="meta", dtype=torch.float32)

        def index(self, name):
            table = torch.empty(self.index_shape(name), dtype=torch.long, device="meta")
            self._issue(name, table)
            return table

        def stored_linear(self, name):
            return None

        def expert_stored(self, layer, expert, which):
            name = f"layers.{layer}.ffn.experts.{expert}.{which}.weight"
            return "float", self._randn(self.tensor_shape(name), name), None

    reader = ShapeReader(cfg, dtype=torch.bfloat16, device="meta", native=native, keep_values=False)
    read_weights(reader)
    return reader.issued


def _bytes_per_value(qtype: str) -> float:
    from ds4d.cuda import gguf_matmul

    values, nbytes = gguf_matmul.block_shape(qtype)
    return nbytes / values


def base_config(tiny: bool) -> dict:
    """V4-Flash's config (reference/dsv4/config.flash.json), or small widths with ``tiny``; depth and pattern
    come from --layers.  (Built on demand: the V4 package imports torch, and ds4d's parser imports this module.)"""
    from ds4d.models.deepseek_v4.config import FLASH_WIDTHS

    flash = {
        "model_type": "deepseek_v4", "vocab_size": 129280, **FLASH_WIDTHS, "sliding_window": 128,
        "n_shared_experts": 1, "num_hash_layers": 3, "routed_scaling_factor": 1.5,
        "scoring_func": "sqrtsoftplus", "norm_topk_prob": True, "swiglu_limit": 10.0, "hc_mult": 4,
        "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6, "rope_theta": 10000,
        "compress_rope_theta": 160000,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
        "max_position_embeddings": 1048576, "bos_token_id": 0, "eos_token_id": 1,
    }
    if not tiny:
        return flash
    return {**flash, "hidden_size": 256, "num_attention_heads": 8, "head_dim": 128, "q_lora_rank": 128,
            "o_groups": 2, "o_lora_rank": 64, "n_routed_experts": 16, "moe_intermediate_size": 128,
            "index_n_heads": 8, "index_head_dim": 64, "index_topk": 32, "qk_rope_head_dim": 64}


def bench_config(args):
    """The random model's config: widths from ``--config`` / ``--tiny`` / V4-Flash, layers from ``--layers``."""
    from ds4d.models.deepseek_v4.config import DeepseekV4Config

    base = json.loads(Path(args.config).read_text()) if args.config else base_config(args.tiny)
    layers = [int(x) for x in (args.layers or "0,0,4,128").split(",")]  # V4-Flash's first 4 by default
    data = {**base, "num_hidden_layers": len(layers), "compress_ratios": layers}
    data.pop("quantization_config", None)
    return DeepseekV4Config.from_dict(data, name="random-v4")


def build(torch, args, device, offload_options=None):
    """(cfg, reader, model, HF peer or None, note).  With ``offload_options`` the routed experts go to
    an ``ExpertOffload`` layer by layer as they are drawn (device banks for the hot ones, host RAM for
    the rest), so a model whose experts do not fit the device at once can be built; no HF peer then."""
    from ds4d.models.deepseek_v4.model import DeepseekV4Model
    from ds4d.models.deepseek_v4.offload import ExpertOffload
    from ds4d.models.deepseek_v4.random_init import RandomReader
    from ds4d.models.deepseek_v4.weights import read_weights

    cfg = bench_config(args)
    dtype = getattr(torch, args.dtype)
    if getattr(args, "gguf", ""):
        from ds4d.models.deepseek_v4.random_init import RandomGgufReader

        args.no_hf = True
        reader = RandomGgufReader(cfg, dtype=dtype, device=device, recipe=args.gguf, seed=args.seed,
                                  int8_inputs=getattr(args, "gguf_int8", "off") == "on")
    else:
        reader = RandomReader(cfg, dtype=dtype, device=device, seed=args.seed, native=args.native,
                              keep_values=offload_options is None)
    offload = None
    if offload_options is not None:
        args.no_hf = True
        offload = ExpertOffload(None, cfg, device=device, dtype=dtype, options=offload_options)
    weights = read_weights(reader, expert_sink=offload.adopt if offload is not None else None)
    if offload is not None:
        offload.finish()
    model = DeepseekV4Model(cfg, weights, tokenizer=None, dtype=dtype, device=device, expert_offload=offload)
    hf, hf_note = None, "skipped"
    if not args.no_hf:
        from ds4d.models.deepseek_v4.hf_compat import hf_model_from_tensors

        for impl in ("grouped_mm", None):
            try:
                hf = hf_model_from_tensors(cfg, reader.issued, weights, dtype=dtype, device=device,
                                           experts_implementation=impl)
                hf_note = f"experts_implementation={impl or 'eager'}"
                break
            except (ValueError, ImportError) as exc:
                hf_note = f"unavailable: {exc}"
    return cfg, reader, model, hf, hf_note


BENCH_PATHS = ("graphs", "lookahead", "sampled", "sampled-top-p", "decode-kernel", "decode-kernel-lookahead",
               "torch-decode", "torch-decode-lookahead", "route-kernel", "route-kernel-lookahead",
               "torch-route", "torch-route-lookahead", "shared-beside", "shared-beside-lookahead", "pdl",
               "pdl-lookahead", "plain-hc", "numba-hc", "triton-hc", "torch-attention", "torch-token-wise", "all-rows",
               "eager", "reference")
GRAPH_PATHS = tuple(p for p in BENCH_PATHS if p not in ("eager", "reference"))
"""The paths that decode through CUDA graphs (where the device has them)."""


def bench_paths(path: str, best):
    """The ``ForwardPaths`` a row named ``path`` runs, from ``best`` (every path the device has).

    graphs: every GPU path; lookahead: the same, the engine queueing each decode step behind the one
    before (``decode_lookahead``); sampled, sampled-top-p: the same, sampling (``SAMPLED``) instead of greedy;
    decode-kernel (-lookahead): graphs (lookahead) with a decode step's compressors and attention in Triton kernels;
    torch-decode (-lookahead): graphs (lookahead) with them in torch's operators (every other path: ``best``'s);
    route-kernel (-lookahead): graphs (lookahead) with a decode step's routing in one Triton launch (``route_kernel``);
    torch-route (-lookahead): graphs (lookahead) with it in torch's operators;
    shared-beside (-lookahead): graphs (lookahead) with the shared expert on a second stream (``shared_beside``);
    pdl (-lookahead): graphs (lookahead); the bench launches a step's GEMVs and hyper-connection kernels as
    programmatic dependent launches (``devices.LAUNCH["pdl"]``) while it times these rows;
    plain-hc: without the fused hyper-connection kernels; numba-hc: the Numba kernel for decode steps
    too (not the Triton ones); triton-hc: a decode step's hyper-connection weights from the Triton
    kernels, the update, collapse and norm in torch (not ``hc_triton.hc_boundary_step``); torch-attention:
    prefill attention in torch's score blocks, not the Triton kernel; torch-token-wise: a prefill's
    token-wise work in torch, not ``prefill_triton``; all-rows: the last layer's feed-forward on every
    row, not only those whose logits are asked for; eager: no CUDA graphs; reference: the portable path (expert loop, per-sequence attention,
    dense window masks)."""
    if path not in BENCH_PATHS:
        raise ValueError(f"unknown bench path {path!r}")
    hc = best.hc_kernels
    return best.replace(
        fast_path=path != "reference",
        decode_graphs=best.decode_graphs if path in GRAPH_PATHS else "off",
        hc_kernels={"plain-hc": "torch", "numba-hc": "numba" if hc != "torch" else "torch",
                    "triton-hc": "triton" if hc == "boundary" else hc}.get(path, hc),
        fused_attention=best.fused_attention and path != "torch-attention",
        fused_prefill=best.fused_prefill and path not in ("torch-token-wise", "plain-hc"),
        last_layer_rows_only=path != "all-rows",
        decode_kernel=path.startswith("decode-kernel") or best.decode_kernel and not path.startswith("torch-decode"),
        shared_beside=path.startswith("shared-beside"),
        route_kernel=path.startswith("route-kernel") or best.route_kernel and not path.startswith("torch-route"),
    )


def on_path(model, path: str, best):
    """``model``'s weights running the row ``path`` (``bench_paths``): a model of its own, same tensors."""
    return model.with_paths(bench_paths(path, best))
