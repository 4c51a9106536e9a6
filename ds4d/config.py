"""One frozen configuration object, and where each value came from.

Precedence, lowest first: built-in defaults < ``etc/ds4d.toml`` (or ``--config
FILE``) < ``DS4D_<KNOB>`` environment variables < command-line flags.  Every
knob is a field of :class:`Config` with its help text in the field metadata;
``etc/ds4d.toml`` is rendered from the same metadata (a test keeps them equal),
so a knob cannot exist without documentation.  This module is the only place
that reads ``DS4D_*`` variables.

Knobs marked ``debug`` change behaviour in ways an operator must notice (they
are logged loudly at start and shown in red by the console).
"""

from __future__ import annotations

import argparse
import os
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

GIB = 1024**3
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG_FILE = REPO_ROOT / "etc" / "ds4d.toml"


def knob(default: Any, help: str, *, section: str, debug: bool = False, choices: Sequence[str] = ()):
    meta = {"help": help, "section": section, "debug": debug, "choices": tuple(choices)}
    if isinstance(default, (list, tuple)):
        return field(default=tuple(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class Config:
    # --- server
    host: str = knob("127.0.0.1", "Address to bind. Keep 127.0.0.1 unless a key is set.", section="server")
    port: int = knob(8000, "TCP port of the HTTP API; 0 = any free port (printed at start).", section="server")
    api_keys: tuple[str, ...] = knob((), "Accepted Bearer keys; empty = no auth (only sane on 127.0.0.1).", section="server")
    api_key_file: str = knob("", "File with one accepted key per line (added to api_keys).", section="server")
    served_model_name: str = knob("", "Model id shown by /v1/models and accepted in requests; empty = derived from the checkpoint.", section="server")
    max_body_bytes: int = knob(16 * 1024 * 1024, "Largest accepted request body (larger gets 413).", section="server")
    cors_origins: tuple[str, ...] = knob((), "Browser origins allowed by CORS (e.g. http://localhost:3000; \"*\" = any); empty = no CORS headers at all.", section="server")
    stats_log: str = knob("", "Append one /v1/ds4d/stats snapshot per second to this JSONL file (console --replay).", section="server")
    # --- model
    model: str = knob("", "Checkpoint path (GGUF file or DeepSeek-V4 directory); empty = the embedded SmolLM2-135M demo model.", section="model")
    model_family: str = knob("auto", "Model family plugin; auto = the first family whose can_load() accepts the path.", section="model")
    device: str = knob("auto", "cpu, cuda, cuda:N; auto = cuda if available else cpu.", section="model")
    dtype: str = knob("auto", "Activation dtype: float32, bfloat16, float16; auto = float32 on cpu, bfloat16 on cuda.", section="model", choices=("auto", "float32", "bfloat16", "float16"))
    threads: int = knob(0, "CPU threads for torch; 0 = all cores.", section="model")
    compile_decode: bool = knob(False, "DeepSeek-V4 and V4.1 on CUDA: decode steps through torch.compile inside the CUDA graphs (about 1.6x faster at batch 1; each new batch/context bucket compiles once, tens of seconds, on first use).", section="model")
    gpus: str = knob("", "Split one DeepSeek-V4 model over several processes: GPU indices such as 0,1,2,3 (one process per GPU, NCCL), or cpu:N for N CPU processes over gloo, or torchrun when torchrun starts every rank (one host or several; `device` cpu = gloo); empty = one process on `device`.", section="model")
    parallel_layout: str = knob("auto", "How `gpus` share the model: auto (widest expert parallelism whose groups are NVLink cliques), ep (experts split), pp (layers split), or SxE such as 2x2 (S layer stages of E expert-parallel GPUs); under torchrun auto = one stage per host.", section="model")
    pipeline_microbatches: int = knob(0, "DeepSeek-V4 split into layer stages (`gpus` with pp or SxE layouts): a prompt step of at least 64 tokens per part is cut into this many micro-batches that flow through the stages, so stage s+1 runs one while stage s runs the next (decode steps are not cut); 0 = as many as there are stages, 1 = not cut.", section="model")
    weight_format: str = knob("auto", "Weights of quantised tensors: dense = dequantise to the activation dtype at load; int4 = GGUF Q4_0/Q4_1 blocks kept and multiplied with int4 kernels (less memory, faster decode on CPU); native = DeepSeek-V4 and V4.1 FP8 linears and MXFP4/FP4 experts kept as stored and multiplied by Triton kernels that read those bytes (CUDA, bfloat16; V4.1 also float16, and below compute capability 8.9 only its FP4 experts), and a DeepSeek-V4 GGUF file's blocks (CUDA, any dtype); auto = int4 for Q4_0/Q4_1 files on the CPU, native for DeepSeek-V4 in bfloat16 and V4.1 in bfloat16 or float16 on one CUDA device, native for a DeepSeek-V4 GGUF file on CUDA (the linears and routed experts whose GGUF type has a kernel stay in their blocks) (a model split over `gpus` stays dense unless native is set), dense otherwise.", section="model", choices=("auto", "dense", "int4", "native"))
    gguf_int8_inputs: bool = knob(True, "A DeepSeek-V4 GGUF file's Q8_0, Q2_K and IQ2_XXS blocks kept as stored (weight_format native, CUDA): a decode step's GEMVs (one row of a linear, or rows by expert) round their inputs to int8 in runs of 32 and sum byte products four at a time (dp4a), as llama.cpp's CUDA GEMVs do; false: float32 products, the decoded model's logits within float32 rounding. The output head and prompt steps stay float either way.", section="model")
    load_format: str = knob("auto", "Where the weights come from: auto = the checkpoint in `model`; random = drawn at random for the config.json in `model` (DeepSeek-V4 and V4.1; the directory needs nothing else but a tokenizer for a config whose vocabulary is not V4's), in the formats `weight_format` keeps, layer by layer, experts offloaded as planned (DeepSeek-V4 split over `gpus` too: each rank draws only its own layers and experts, the same values as one process). random-q2 (DeepSeek-V4) = the same with the linears and routed experts in random GGUF blocks of the ds4 q2 recipe (routed gate/up IQ2_XXS, down Q2_K, the FP8 linears Q8_0), kept as stored on CUDA. A benchmark mode: the daemon serves noise at the real model's size and speed, and says so in its log and /v1/ds4d/stats.", section="model", choices=("auto", "random", "random-q2"))
    expert_vram_gib: float = knob(0.0, "GPU memory for routed experts (device banks plus two staging banks); 0 keeps every expert on the device.", section="model")
    expert_placement: str = knob("online", "Hot-expert placement: static = chosen once at start; online = moved as routing statistics change.", section="model", choices=("static", "online"))
    expert_cpu_threads: int = knob(4, "Host threads that compute cold experts during decode.", section="model")
    expert_calibration: str = knob("", "Routing counts written by `ds4d calibrate` that seed the hot-expert placement; empty = start from no counts.", section="model")
    expert_decode_cold: str = knob("auto", "Decode with cold experts: cpu = compute on the host, copy = stream them in, auto = whichever the bandwidths measured at start favour.", section="model", choices=("auto", "cpu", "copy"))
    expert_fetch_ahead: int = knob(12, "DeepSeek-V4 and V4.1 on CUDA with experts offloaded, decode reading them where they sit (native MXFP4/FP4 or GGUF blocks, CUDA graphs): steps of up to this many (token, expert) rows start copying each layer's cold experts a layer early, as its router predicts them from the feed-forward input of the layer before (hash-routed layers: exactly), on a side stream beside the compute; a wrong guess costs link time, never a different result; 0 = off. Costs two device buffers of this many experts.", section="model")
    prefill_block: int = knob(0, "DeepSeek-V4: a prompt step of more tokens than this runs layer by layer, each layer over the step's tokens this many at a time (the activations of one block; with routed experts offloaded, each cold expert a step uses crosses to the GPU once per layer per step instead of once per block, so raise prefill_chunk and step_tokens with offload: state checkpoints, every cache_checkpoint_every_tokens, still end a step); 0 = auto: 4096 with expert offload, otherwise every layer takes the whole step at once.", section="model")
    engram_storage: str = knob("auto", "DeepSeek-V4.1 Engram tables: ram = read into host memory (page-locked with CUDA); mmap = kept as read-only memory maps of the checkpoint shards, paged in as rows are gathered; auto = ram when the tables fit in MemAvailable minus mem_watermark_gib, else mmap. The choice is logged at load.", section="model", choices=("auto", "ram", "mmap"))
    # --- engine
    max_context: int = knob(0, "Longest prompt + output in tokens; 0 = the model's own limit.", section="engine")
    prefill_chunk: int = knob(4096, "Most prompt tokens one request feeds in one engine step.", section="engine")
    step_tokens: int = knob(8192, "Token budget of one engine step (decode tokens + prefill chunks).", section="engine")
    max_num_seqs: int = knob(16, "Most requests running at once (state slots).", section="engine")
    kv_cache_tokens: int = knob(0, "KV pool size in tokens; 0 = enough for max_num_seqs full contexts, capped by memory.", section="engine")
    kv_cache_gib: float = knob(4.0, "Upper bound on the KV pool in GiB when kv_cache_tokens is 0.", section="engine")
    gpu_memory_utilization: float = knob(
        0.92, "Share of a GPU's memory planned for weights, activations, CUDA graphs and the KV/state pool "
        "(the pool gets what is left of it; the rest is headroom).", section="engine")
    decode_lookahead: bool = knob(
        True, "While every running request decodes, queue each step behind the one before it, fed that "
        "step's tokens on the GPU, so the host's work between steps overlaps the GPU's (not while a request "
        "asks for logprobs or a constraint; not with expert offload or a model split over GPUs). Off: each "
        "step's tokens are read before the next step is planned.", section="engine")
    warmup: str = knob("auto", "Before /ready, run the kernel variants serving will meet: a few requests of random tokens through a throwaway engine over the model (prompts of 1 token to past twice prefill_chunk, a prompt step of every matmul row class up to step_tokens, prompts resumed from a prefix hit with 1 to 1000 new tokens, greedy, sampled, logprobs, a constraint, decode batches of every bucket up to max_num_seqs), then the decode CUDA graph of every (batch, block-table) bucket up to max_context; nothing it computes can be reused. on, off, or auto = on with CUDA. The time it took is logged and in /v1/ds4d/stats.", section="engine", choices=("auto", "on", "off"))
    prefix_caching: bool = knob(True, "Reuse KV blocks of identical prompt prefixes. Turning it off is a debugging aid.", section="engine", debug=True)
    # --- cache
    cache_tiers: tuple[str, ...] = knob(("gpu", "ram", "disk"), "Prefix-cache tiers, fastest first (cache_tier plugins); the KV pool (gpu) always comes first. A block evicted from one tier moves to the next; a hit below the pool is copied back. A tier with a zero budget or no directory is off.", section="cache")
    cache_ram_gib: float = knob(4.0, "Host-RAM tier budget in GiB (pinned memory with CUDA); 0 = off. Shed when MemAvailable falls below mem_watermark_gib.", section="cache")
    cache_disk_dir: str = knob("", "Directory of the disk tier (one file per block, kept across restarts); empty = off.", section="cache")
    cache_disk_gib: float = knob(64.0, "Disk tier budget in GiB.", section="cache")
    cache_disk_read_ahead_gib: float = knob(1.0, "Host memory in GiB for disk-tier blocks read in the background for requests waiting to be admitted (reads in flight or loaded, not yet promoted); past it a block is read on the engine thread at admission. 0 = every disk read on the engine thread.", section="cache")
    cache_checkpoints: int = knob(64, "State checkpoints of models with per-sequence state (DeepSeek-V4) held in host memory beside the KV pool; one leaves it (for the RAM, then disk tier, counted in their budgets) when its blocks leave the pool or more recent ones push it out. 0 = no prefix reuse for such models.", section="cache")
    cache_checkpoint_every_tokens: int = knob(8192, "Models with per-sequence state: also checkpoint a prefill every this many tokens (rounded up to whole KV blocks), so a prompt that parts from a cached one recomputes at most this many tokens; each checkpoint costs one state slot (17 MiB for V4-Flash in bf16). 0 = only at request, system-prompt and message boundaries.", section="cache")
    # --- plugins
    chat_encoder: str = knob("auto", "ChatEncoder plugin; auto = the model family's default.", section="plugins")
    reasoning_parser: str = knob("auto", "ReasoningParser plugin; auto = the model family's default.", section="plugins")
    tool_parser: str = knob("auto", "ToolCallParser plugin; auto = the model family's default.", section="plugins")
    scheduler_policy: str = knob("fcfs", "SchedulerPolicy plugin: ordering and preemption victims.", section="plugins")
    thinking_default: bool = knob(True, "Thinking mode when a request does not set chat_template_kwargs.thinking.", section="plugins")
    tool_markup_guard: bool = knob(False, "DSML models: with tool_choice auto, the DSML marker can only open a tool-call block, which is then constrained to valid markup over the request's tools until it closes; with tool_choice none the marker cannot be sampled. Such requests decode without look-ahead.", section="plugins")
    # --- limits
    max_queued_requests: int = knob(256, "Requests that have produced no output yet (queued or prefilling) beyond this: new ones get 503 with Retry-After.", section="limits")
    max_queued_tokens: int = knob(1048576, "Prompt tokens of requests with no output yet beyond this: new ones get 503 with Retry-After (an empty queue always takes a request); 0 = no cap.", section="limits")
    queue_timeout_s: float = knob(600.0, "A request still queued after this many seconds ends with a timeout error; 0 = never.", section="limits")
    request_timeout_s: float = knob(0.0, "A request running longer than this many seconds ends with a timeout error; 0 = never.", section="limits")
    drain_timeout_s: float = knob(30.0, "On SIGTERM, wait this long for requests in flight before exiting (a second SIGTERM exits at once).", section="limits")
    stall_timeout_s: float = knob(120.0, "/ready turns false when work is queued but no token was produced for this many seconds.", section="limits")
    mem_watermark_gib: float = knob(15.0, "Host MemAvailable watermark in GiB: below it /ready is false and cache tiers shed, but requests are still admitted (a small host keeps serving).", section="limits")
    mem_floor_gib: float = knob(8.0, "Host MemAvailable floor in GiB: below it new requests get 503 with Retry-After (requests in flight finish); at most mem_watermark_gib.", section="limits")
    # --- logging
    log_level: str = knob("info", "debug, info, warning, error.", section="logging", choices=("debug", "info", "warning", "error"))

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "float32" if self.resolved_device() == "cpu" else "bfloat16"


@dataclass(frozen=True)
class LoadedConfig:
    """The effective config plus the source of every value (default, file, env, cli)."""

    config: Config
    sources: Mapping[str, str]
    file: Path | None

    def non_default(self) -> dict[str, dict[str, Any]]:
        out = {}
        for f in fields(Config):
            value, default = getattr(self.config, f.name), f.default
            if value != default:
                out[f.name] = {"value": value, "default": default, "source": self.sources[f.name],
                               "debug": f.metadata["debug"]}
        return out


class ConfigError(ValueError):
    pass


def _field_map() -> dict[str, Any]:
    return {f.name: f for f in fields(Config)}


def _coerce(name: str, raw: Any, *, from_text: bool) -> Any:
    f = _field_map()[name]
    default = f.default if f.default is not MISSING else None
    try:
        if isinstance(default, bool):
            if from_text:
                low = str(raw).strip().lower()
                if low in ("1", "true", "yes", "on"):
                    return True
                if low in ("0", "false", "no", "off"):
                    return False
                raise ValueError(raw)
            if not isinstance(raw, bool):
                raise ValueError(raw)
            return raw
        if isinstance(default, int):
            return int(raw)
        if isinstance(default, float):
            return float(raw)
        if isinstance(default, tuple):
            if from_text:
                return tuple(x for x in str(raw).split(",") if x)
            if isinstance(raw, str):
                return (raw,)
            return tuple(str(x) for x in raw)
        value = str(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"config knob {name!r}: cannot use value {raw!r}") from None
    choices = f.metadata["choices"]
    if choices and value not in choices:
        raise ConfigError(f"config knob {name!r}: {value!r} is not one of {', '.join(choices)}")
    return value


def add_cli_flags(parser: argparse.ArgumentParser) -> None:
    """One ``--kebab-name`` flag per knob (repeatable for list knobs, --no-x for booleans)."""
    parser.add_argument("--config", dest="config_file", default=None, help="TOML config file (default etc/ds4d.toml)")
    for f in fields(Config):
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata["help"]
        if isinstance(f.default, bool):
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif isinstance(f.default, tuple):
            single = flag[:-1] if flag.endswith("s") else flag
            parser.add_argument(single, dest=f.name, action="append", default=None, help=help_text)
        else:
            parser.add_argument(flag, dest=f.name, default=None, help=help_text)


def load_config(
    cli: Mapping[str, Any] | None = None,
    *,
    config_file: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
) -> LoadedConfig:
    """Merge defaults < file < env < cli into one frozen Config."""
    environ = os.environ if environ is None else environ
    cli = dict(cli or {})
    path = Path(config_file) if config_file else Path(environ.get("DS4D_CONFIG", DEFAULT_CONFIG_FILE))
    values: dict[str, Any] = {}
    sources = {f.name: "default" for f in fields(Config)}
    known = _field_map()

    file_used = None
    if path.exists():
        file_used = path
        with path.open("rb") as fh:
            try:
                data = tomllib.load(fh)
            except tomllib.TOMLDecodeError as exc:
                raise ConfigError(f"{path}: {exc}") from None
        for key, raw in data.items():
            if key not in known:
                raise ConfigError(f"{path}: unknown knob {key!r}")
            values[key] = _coerce(key, raw, from_text=False)
            sources[key] = "file"
    elif config_file:
        raise ConfigError(f"config file {path} does not exist")

    for name in known:
        env_name = "DS4D_" + name.upper()
        if env_name in environ:
            values[name] = _coerce(name, environ[env_name], from_text=True)
            sources[name] = "env"

    for name, raw in cli.items():
        if raw is None or name not in known:
            continue
        values[name] = _coerce(name, raw, from_text=not isinstance(raw, (bool, list, tuple)))
        sources[name] = "cli"

    config = replace(Config(), **values)
    _validate(config)
    return LoadedConfig(config=config, sources=sources, file=file_used)


def _validate(config: Config) -> None:
    if not 0 <= config.port <= 65535:
        raise ConfigError("config knob 'port' must be 0..65535 (0 = any free port)")
    positive = ("prefill_chunk", "step_tokens", "max_num_seqs", "max_body_bytes")
    for name in positive:
        if getattr(config, name) <= 0:
            raise ConfigError(f"config knob {name!r} must be positive")
    if config.mem_floor_gib > config.mem_watermark_gib:
        raise ConfigError("mem_floor_gib must not exceed mem_watermark_gib")
    for name in ("cache_ram_gib", "cache_disk_gib", "cache_disk_read_ahead_gib", "cache_checkpoints",
                 "cache_checkpoint_every_tokens", "prefill_block", "pipeline_microbatches"):
        if getattr(config, name) < 0:
            raise ConfigError(f"config knob {name!r} must not be negative")
    if config.step_tokens < config.max_num_seqs:
        raise ConfigError("step_tokens must be at least max_num_seqs (one decode token each)")
    if not 0 < config.gpu_memory_utilization <= 1:
        raise ConfigError("config knob 'gpu_memory_utilization' must be in (0, 1]")


def render_default_toml() -> str:
    """The documented default config file (etc/ds4d.toml is exactly this text)."""
    lines = ["# ds4d configuration: every knob, commented out at its default; uncomment to change one.",
             "# Precedence: this file < DS4D_<KNOB> environment variables < command-line flags.",
             "# `ds4d config` prints the effective values and where each came from.", ""]
    section = None
    for f in fields(Config):
        if f.metadata["section"] != section:
            section = f.metadata["section"]
            lines += [f"# ---- {section}", ""]
        debug = " [debug]" if f.metadata["debug"] else ""
        lines.append(f"# {f.metadata['help']}{debug}")
        lines.append(f"# {f.name} = {_toml_value(f.default)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def describe(loaded: LoadedConfig) -> str:
    """Human table for ``ds4d config``."""
    rows = []
    for f in fields(Config):
        value = getattr(loaded.config, f.name)
        flag = "  DEBUG" if f.metadata["debug"] and value != f.default else ""
        if f.name == "api_keys" and value:
            value = f"<{len(value)} keys>"
        rows.append(f"{f.name:22} = {value!r:34} ({loaded.sources[f.name]}){flag}")
    head = f"# config file: {loaded.file or 'none'}"
    return "\n".join([head, *rows])
