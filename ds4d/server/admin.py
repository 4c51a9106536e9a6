"""Operator endpoints: /health, /ready, /metrics (Prometheus text), /v1/ds4d/stats."""

from __future__ import annotations

import os
import time
from dataclasses import asdict

import psutil
from aiohttp import web

from ds4d import __version__
from ds4d.config import GIB
from ds4d.cuda.devices import gpu_memory
from ds4d.engine.snapshot import EngineSnapshot
from ds4d.server.openapi import openapi_document
from ds4d.server.state import LIFECYCLE, ServingState, serving_state

routes = web.RouteTableDef()


def _state(request: web.Request) -> ServingState:
    return serving_state(request)


@routes.get("/health")
async def health(request: web.Request) -> web.Response:
    """Liveness: 200 while the process can make progress (loading and draining included), 503 once
    the engine is dead."""
    phase = request.app[LIFECYCLE].phase
    if phase == "dead":
        state = _state(request)
        return web.json_response({"status": "dead", "reason": state.client.dead_reason or "engine not running"},
                                 status=503)
    return web.json_response({"status": "ok" if phase == "ready" else phase})


@routes.get("/ready")
async def ready(request: web.Request) -> web.Response:
    """Readiness: 503 while loading, draining, stalled, dead or below the host-memory watermark."""
    if request.app[LIFECYCLE].state is None:
        return web.json_response({"ready": False, "reasons": ["loading"]}, status=503)
    state = _state(request)
    reasons = []
    memory, available = state.memory_state()
    if memory != "ok":
        limit = state.config.mem_floor_gib if memory == "below_floor" else state.config.mem_watermark_gib
        reasons.append(f"host memory {memory.replace('_', ' ')}: {available / GIB:.1f} GiB available < {limit:g} GiB")
    if not state.client.alive:
        reasons.append("engine not running")
    if state.draining:
        reasons.append("draining")
    stalled = state.client.stalled_for()
    if stalled > state.config.stall_timeout_s:
        reasons.append(f"stalled: work queued and no step finished for {stalled:.0f} s")
    ok = not reasons
    return web.json_response({"ready": ok, "reasons": reasons}, status=200 if ok else 503)


def host_memory(state: ServingState) -> dict:
    vm = psutil.virtual_memory()
    sw = psutil.swap_memory()
    proc = psutil.Process(os.getpid())
    try:
        daemon_swap = proc.memory_full_info().swap
    except (psutil.AccessDenied, AttributeError):
        daemon_swap = 0
    cfg = state.config
    return {
        "mem_total_bytes": vm.total, "mem_available_bytes": vm.available,
        "watermark_bytes": int(cfg.mem_watermark_gib * GIB), "floor_bytes": int(cfg.mem_floor_gib * GIB),
        "rss_bytes": proc.memory_info().rss, "pinned_bytes": 0,
        "swap_total_bytes": sw.total, "swap_used_bytes": sw.used, "daemon_swap_bytes": daemon_swap,
    }


def snapshot(state: ServingState, engine: EngineSnapshot | None = None) -> dict:
    """The body of ``/v1/ds4d/stats``, from ``engine`` (default: the latest engine snapshot)."""
    engine = engine or state.client.snapshot()
    looked = engine.cache_hits + engine.cache_misses
    hit_rate = engine.cache_hits / looked if looked else 0.0
    gpus = gpu_memory()
    experts = dict(engine.experts) if engine.experts else None
    _planned_breakdown(gpus, state.memory_plan, engine.cached_blocks * state.info.cache_bytes_per_block, experts)
    non_default = {k: {**v, "value": _jsonable(v["value"]), "default": _jsonable(v["default"])}
                   for k, v in state.loaded.non_default().items()}
    if "api_keys" in non_default:
        non_default["api_keys"]["value"] = f"<{len(state.config.api_keys)} keys>"
    return {
        "time": time.time(), "uptime_s": round(time.time() - state.started_at, 3), "version": __version__,
        "state": "dead" if not state.client.alive else ("draining" if state.draining else "ready"),
        "model": {"name": state.info.name, "served_name": state.served_model_name, "family": state.info.family,
                  "dtype": state.info.dtype, "device": state.info.device,
                  "max_context_tokens": state.max_context_tokens,
                  "parallel": state.info.extra.get("parallel"), "tokenizer": state.info.extra.get("tokenizer"),
                  "forward_paths": state.info.extra.get("forward_paths"),
                  "decode_graph_fallback": engine.decode_graph_failure,
                  "engram_storage": state.info.extra.get("engram_storage"),
                  "stored_weights": state.info.extra.get("stored_weights"),
                  "load_format": state.config.load_format},
        "requests": {"running": engine.running, "waiting": engine.waiting,
                     "finished_total": engine.finished_total, "active": [asdict(r) for r in engine.active]},
        "kv": {"total_blocks": engine.total_blocks, "free_blocks": engine.free_blocks,
               "used_blocks": engine.used_blocks, "cached_blocks": engine.cached_blocks,
               "block_size_tokens": engine.block_size_tokens},
        "throughput": {"prefill_tok_s": round(engine.prefill_tok_s, 2), "decode_tok_s": round(engine.decode_tok_s, 2),
                       "prefill_tokens_total": engine.prefill_tokens_total,
                       "decode_tokens_total": engine.decode_tokens_total},
        "host": host_memory(state),
        "gpus": gpus,
        "memory_plan": state.memory_plan,
        "warmup": state.warmup,
        "engine": {"decode_lookahead": state.client.capabilities.decode_lookahead,
                   "steps_ahead_total": engine.steps_ahead_total},
        "cache": {"hits": engine.cache_hits, "misses": engine.cache_misses, "hit_rate": round(hit_rate, 4),
                  "evictions": engine.evictions, **engine.cache},
        "sessions": state.sessions.stats(),
        "experts": experts,
        "config": {"non_default": non_default},
        "plugins": state.plugins,
    }


def _planned_breakdown(gpus: list[dict], plan: dict | None, cached: int, experts: dict | None) -> None:
    """What the planned GPU holds (the console's bar): weights, hot expert banks and their staging,
    the KV pool and state in use, and the pool's cached prefix blocks (``cached`` bytes)."""
    if not plan:
        return
    device = plan["device"]
    index = int(device.split(":")[1]) if ":" in device else 0
    expert_bytes = (experts or {}).get("vram_bytes", 0)
    for gpu in gpus:
        if gpu.get("index") == index:
            gpu["breakdown"] = {"weights": max(0, plan["weights_bytes"] - expert_bytes), "experts": expert_bytes,
                                "kv": max(0, plan["kv_bytes"] - cached), "prefix_cache": cached}


def _jsonable(v):
    return list(v) if isinstance(v, tuple) else v


@routes.get("/openapi.json")
async def openapi(request: web.Request) -> web.Response:
    """The OpenAPI document of this API (served without an API key, like /health)."""
    return web.json_response(openapi_document())


@routes.get("/v1/ds4d/stats")
async def ds4d_stats(request: web.Request) -> web.Response:
    state = _state(request)
    return web.json_response(snapshot(state, await state.client.fresh_snapshot()))


@routes.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    state = _state(request)
    return web.Response(text=metrics_text(state, await state.client.fresh_snapshot()), content_type="text/plain",
                        charset="utf-8", headers={"X-Content-Type-Options": "nosniff"})


def metrics_text(state: ServingState, engine: EngineSnapshot | None = None) -> str:
    """The Prometheus text of ``/metrics``, from ``engine`` (default: the latest engine snapshot)."""
    engine = engine or state.client.snapshot()
    s = snapshot(state, engine)
    lines = []

    def metric(name: str, kind: str, help_text: str, value: float, labels: str = "") -> None:
        lines.append(f"# HELP ds4d_{name} {help_text}")
        lines.append(f"# TYPE ds4d_{name} {kind}")
        lines.append(f"ds4d_{name}{labels} {value}")

    metric("engine_alive", "gauge", "1 while the engine thread runs.", int(state.client.alive))
    metric("requests_running", "gauge", "Requests being computed.", s["requests"]["running"])
    metric("requests_waiting", "gauge", "Requests queued.", s["requests"]["waiting"])
    metric("requests_finished_total", "counter", "Requests finished.", engine.finished_total)
    metric("prompt_tokens_computed_total", "counter", "Prompt tokens computed (prefill).",
           engine.prefill_tokens_total)
    metric("generation_tokens_total", "counter", "Tokens generated (decode).", engine.decode_tokens_total)
    metric("preemptions_total", "counter", "Requests preempted for memory and recomputed.",
           engine.preemptions_total)
    metric("kv_blocks_total", "gauge", "Blocks in the KV pool.", s["kv"]["total_blocks"])
    metric("kv_blocks_free", "gauge", "KV blocks free or evictable.", s["kv"]["free_blocks"])
    metric("prefix_cache_hits_total", "counter", "Requests that reused cached blocks.", s["cache"]["hits"])
    metric("prefix_cache_misses_total", "counter", "Requests that reused nothing.", s["cache"]["misses"])
    promotions = s["cache"]["promotions"]
    metric("cache_promotions_pending", "gauge",
           "Blocks read from disk in the background for waiting requests, not yet promoted.",
           promotions["pending_blocks"])
    metric("cache_promotions_completed_total", "counter",
           "Blocks promoted into the KV pool after a background disk read.", promotions["completed_blocks"])
    metric("cache_background_read_bytes_total", "counter", "Bytes read from the disk tier in the background.",
           promotions["background_read_bytes"])
    tier_metric = {"hits": ("counter", "Blocks served by the tier."),
                   "misses": ("counter", "Block lookups that reached the tier and missed."),
                   "bytes_in": ("counter", "Bytes written into the tier."),
                   "bytes_out": ("counter", "Bytes read out of the tier."),
                   "evictions": ("counter", "Blocks evicted from the tier."),
                   "bytes": ("gauge", "Bytes the tier holds."), "blocks": ("gauge", "Blocks the tier holds.")}
    for key, (kind, help_text) in tier_metric.items():
        name = f"cache_tier_{key}" + ("_total" if kind == "counter" else "")
        lines += [f"# HELP ds4d_{name} {help_text}", f"# TYPE ds4d_{name} {kind}"]
        lines += [f'ds4d_{name}{{tier="{tier}"}} {values.get(key, 0)}' for tier, values in s["cache"]["tiers"].items()]
    metric("session_reuse_misses_total", "counter",
           "Requests that reused less than their session's previous prompt and output.",
           s["sessions"]["reuse_misses_total"])
    metric("prompts_continued_total", "counter",
           "Prompts tokenised with the ids of their session's previous turn.", s["sessions"]["prompts_continued_total"])
    metric("tool_calls_malformed_total", "counter",
           "Responses whose tool-call markup did not parse and was returned as content.",
           state.malformed_tool_calls_total)
    metric("throughput_prefill_tok_s", "gauge", "Recent prefill tokens per second.",
           s["throughput"]["prefill_tok_s"])
    metric("throughput_decode_tok_s", "gauge", "Recent decode tokens per second.", s["throughput"]["decode_tok_s"])
    metric("host_mem_available_bytes", "gauge", "Host MemAvailable.", s["host"]["mem_available_bytes"])
    _expert_metrics(lines, s.get("experts"))
    for gpu in s["gpus"]:
        metric("gpu_memory_used_bytes", "gauge", "GPU memory in use.", gpu["used_bytes"], f'{{gpu="{gpu["index"]}"}}')
    plan = s["memory_plan"]
    if plan:
        lines += ["# HELP ds4d_gpu_memory_planned_bytes The start-up GPU memory plan, by part.",
                  "# TYPE ds4d_gpu_memory_planned_bytes gauge"]
        lines += [f'ds4d_gpu_memory_planned_bytes{{part="{part}"}} {plan[f"{part}_bytes"]}'
                  for part in ("weights", "activations", "graphs", "kv", "headroom")]
    metric("decode_steps_ahead_total", "counter", "Decode steps queued before the previous step's tokens were read.",
           s["engine"]["steps_ahead_total"])
    return "\n".join(lines) + "\n"


EXPERT_LAYER_METRICS = (
    ("expert_gpu_hit_rate", "gauge", "hit_rate", 1.0,
     "Share of routed (token, expert) pairs served by experts held in GPU memory."),
    ("expert_bytes_copied_total", "counter", "bytes_copied", 1.0, "Cold-expert bytes copied host -> GPU."),
    ("expert_bytes_skipped_total", "counter", "bytes_skipped", 1.0,
     "Cold-expert bytes not copied because the expert got no token."),
    ("expert_host_read_pairs_total", "counter", "host_read_pairs", 1.0,
     "(token, expert) pairs whose expert the GPU read in place from host memory (decode)."),
    ("expert_cpu_seconds_total", "counter", "cpu_expert_ms", 1e-3, "Host CPU time spent computing cold experts."),
)


def _expert_metrics(lines: list[str], experts: dict | None) -> None:
    """Per-layer expert-offload metrics (``layer`` label), when the model offloads experts."""
    if not experts:
        return
    for name, key, where in (("experts_on_gpu", "gpu_experts", "in GPU memory"),
                             ("experts_in_ram", "ram_experts", "only in host RAM")):
        lines += [f"# HELP ds4d_{name} Routed experts held {where}.", f"# TYPE ds4d_{name} gauge",
                  f"ds4d_{name} {experts.get(key, 0)}"]
    if "host_ram_bytes" in experts:
        lines += ["# HELP ds4d_expert_host_ram_bytes Page-locked host RAM holding cold routed experts.",
                  "# TYPE ds4d_expert_host_ram_bytes gauge", f"ds4d_expert_host_ram_bytes {experts['host_ram_bytes']}"]
    for name, kind, key, scale, help_text in EXPERT_LAYER_METRICS:
        rows = [(_layer_labels(row), row[key]) for row in experts.get("layers", []) if row.get(key) is not None]
        if rows:
            lines += [f"# HELP ds4d_{name} {help_text}", f"# TYPE ds4d_{name} {kind}"]
            lines += [f"ds4d_{name}{{{labels}}} {value * scale}" for labels, value in rows]


def _layer_labels(row: dict) -> str:
    """``layer="3"``, plus ``rank="1"`` for a model split over processes (its ranks share layers)."""
    labels = f'layer="{row["layer"]}"'
    return labels + (f',rank="{row["rank"]}"' if "rank" in row else "")
