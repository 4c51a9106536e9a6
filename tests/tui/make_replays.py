"""Writes the replay fixtures in tests/tui/data/: stats logs in the shape GET /v1/ds4d/stats serves.

Run `python tests/tui/make_replays.py` after changing a scenario, then regenerate the snapshots with
`pytest tests/tui --snapshot-update` and look at the changed SVGs. The numbers are made up but
plausible; frames are a pure function of their index, so the files are reproducible.

data/recorded_cpu_daemon.jsonl is not generated: it was recorded from a real daemon serving the
embedded CPU model under load (`ds4d serve --stats-log FILE`), and keeps the console honest about the
format the daemon actually writes.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

DATA = Path(__file__).parent / "data"
GIB = 1024**3
START_TIME = 1764400000.0
FRAMES = 24

H200_TOTAL = 150_754_820_096
V100_TOTAL = 34_089_730_048

PLUGINS = {"model_family": "deepseek_v4", "chat_encoder": "dsv4", "reasoning_parser": "dsv4",
           "tool_parser": "dsml", "scheduler_policy": "fcfs"}


def wave(frame: int, period: float = 9.0) -> float:
    """A smooth 0..1 signal, so sparklines have something to show."""
    return 0.5 + 0.5 * math.sin(frame / period * 2 * math.pi)


def gpu(index: int, name: str, total: int, weights: int, experts: int, kv: int, prefix: int) -> dict:
    used = weights + experts + kv + prefix
    return {"index": index, "name": name, "used_bytes": used, "total_bytes": total,
            "breakdown": {"weights": weights, "kv": kv, "experts": experts,
                          "prefix_cache": prefix, "free": total - used}}


def requests(frame: int) -> dict:
    active = [
        {"id": "chatcmpl-9f1c2ab4e07d", "phase": "decode", "prefill_chunk": 5, "prefill_chunks": 5,
         "prompt_tokens": 31840, "cached_tokens": 30720, "generated_tokens": 120 + 37 * frame,
         "tok_s": round(38.0 + 4 * wave(frame), 1), "age_s": 41.5 + frame},
        {"id": "chatcmpl-4be88d01c6a2", "phase": "prefill", "prefill_chunk": 1 + frame % 6,
         "prefill_chunks": 6, "prompt_tokens": 48200, "cached_tokens": 8192,
         "generated_tokens": 0, "tok_s": 0.0, "age_s": 3.0 + frame},
        {"id": "chatcmpl-0d7e55f3a919", "phase": "queued", "prompt_tokens": 2210,
         "cached_tokens": 0, "generated_tokens": 0, "tok_s": None, "age_s": 0.4},
    ]
    return {"running": 2, "waiting": 1, "finished_total": 311 + frame // 4, "active": active}


def flash_on_h200(frame: int) -> dict:
    """DeepSeek-V4-Flash on one H200 with most routed experts in pinned host RAM."""
    kv = int((6.0 + 3.0 * wave(frame)) * GIB)
    return {
        "time": START_TIME + frame, "uptime_s": 5400.0 + frame, "version": "0.1.0", "state": "ready",
        "model": {"name": "DeepSeek-V4-Flash", "served_name": "deepseek-v4-flash",
                  "family": "deepseek_v4", "dtype": "fp8", "device": "cuda",
                  "max_context_tokens": 131072},
        "requests": requests(frame),
        "kv": {"total_blocks": 8192, "free_blocks": 5100 - 40 * frame, "used_blocks": 2400 + 40 * frame,
               "cached_blocks": 692, "block_size_tokens": 128},
        "throughput": {"prefill_tok_s": round(2400 + 1800 * wave(frame, 7), 1),
                       "decode_tok_s": round(42 + 12 * wave(frame), 1),
                       "prefill_tokens_total": 4_210_000 + 2400 * frame,
                       "decode_tokens_total": 188_400 + 45 * frame},
        "host": {"mem_total_bytes": 1024 * GIB, "mem_available_bytes": int((612 - frame) * GIB),
                 "watermark_bytes": 15 * GIB, "floor_bytes": 8 * GIB, "rss_bytes": 402 * GIB,
                 "pinned_bytes": 380 * GIB, "swap_total_bytes": 8 * GIB,
                 "swap_used_bytes": 64 * 1024**2, "daemon_swap_bytes": 0},
        "gpus": [gpu(0, "NVIDIA H200", H200_TOTAL, int(41.5 * GIB), int(62 * GIB), kv,
                     int(4.5 * GIB))],
        "cache": {"hits": 1840, "misses": 212, "hit_rate": 0.8967, "cached_tokens_total": 51_300_000,
                  "last_miss": "prefix diverged at token 30720 (tool result changed)",
                  "tiers": {"gpu": {"bytes": int(4.5 * GIB), "blocks": 692, "hits": 1510,
                                    "misses": 542, "hit_rate": 0.7359},
                            "ram": {"bytes": 48 * GIB, "blocks": 7380, "hits": 301,
                                    "misses": 241, "hit_rate": 0.5554},
                            "disk": {"bytes": 210 * GIB, "blocks": 32290, "hits": 29,
                                     "misses": 212, "hit_rate": 0.1203}}},
        "experts": {"gpu_experts": 3210, "ram_experts": 8054, "pcie_gb_s": 48.6,
                    "bytes_copied": 912 * GIB + frame * GIB, "bytes_skipped": 1410 * GIB,
                    "skipped_transfers": 1_204_300 + 900 * frame},
        "config": {"non_default": {
            "port": {"value": 8123, "default": 8000, "source": "cli", "debug": False}}},
        "plugins": dict(PLUGINS),
    }


def healthy(frame: int) -> dict:
    return flash_on_h200(frame)


def four_v100(frame: int) -> dict:
    """Four 32 GB V100s, experts spread over them and host RAM."""
    snapshot = flash_on_h200(frame)
    snapshot["model"]["dtype"] = "bfloat16"
    snapshot["gpus"] = [
        gpu(i, "Tesla V100-SXM2-32GB", V100_TOTAL, int(9.5 * GIB), int((14 + i) * GIB),
            int((2 + 2 * wave(frame + 3 * i)) * GIB), int(0.8 * GIB))
        for i in range(4)
    ]
    snapshot["experts"].update(gpu_experts=2640, ram_experts=8624, pcie_gb_s=11.8)
    snapshot["config"]["non_default"] = {
        "tensor_layout": {"value": "expert_parallel", "default": "auto", "source": "toml",
                          "debug": False}}
    return snapshot


def cpu_only(frame: int) -> dict:
    """The embedded demo model on the CPU: no GPU, no expert offload."""
    return {
        "time": START_TIME + frame, "uptime_s": 12.5 + frame, "version": "0.1.0", "state": "ready",
        "model": {"name": "SmolLM2-135M-Instruct", "served_name": "smollm2-135m", "family": "llama",
                  "dtype": "float32", "device": "cpu", "max_context_tokens": 8192},
        "requests": {"running": 1, "waiting": 0, "finished_total": 17 + frame // 3, "active": [
            {"id": "chatcmpl-ab12", "phase": "decode", "prefill_chunk": 1, "prefill_chunks": 1,
             "prompt_tokens": 7500, "cached_tokens": 7000, "generated_tokens": 12 + 5 * frame,
             "tok_s": 41.2, "age_s": 3.4 + frame}]},
        "kv": {"total_blocks": 4096, "free_blocks": 3900, "used_blocks": 150, "cached_blocks": 46,
               "block_size_tokens": 16},
        "throughput": {"prefill_tok_s": round(812.0 * wave(frame, 5), 1),
                       "decode_tok_s": round(55.3 - 6 * wave(frame), 1),
                       "prefill_tokens_total": 10000 + 300 * frame,
                       "decode_tokens_total": 900 + 50 * frame},
        "host": {"mem_total_bytes": 16 * GIB, "mem_available_bytes": int(11.2 * GIB),
                 "watermark_bytes": 2 * GIB, "floor_bytes": 1 * GIB, "rss_bytes": int(1.3 * GIB),
                 "pinned_bytes": 0, "swap_total_bytes": 2 * GIB, "swap_used_bytes": 0,
                 "daemon_swap_bytes": 0},
        "gpus": [],
        "cache": {"hits": 3, "misses": 5, "hit_rate": 0.375, "cached_tokens_total": 7000,
                  "last_miss": "no block matched (new prefix)",
                  "tiers": {"gpu": {"bytes": 0, "blocks": 0, "hits": 0, "misses": 0,
                                    "hit_rate": 0.0},
                            "ram": {"bytes": 2_359_296, "blocks": 46, "hits": 3, "misses": 5,
                                    "hit_rate": 0.375}}},
        "experts": None,
        "config": {"non_default": {}},
        "plugins": {"model_family": "llama", "chat_encoder": "jinja", "reasoning_parser": "none",
                    "tool_parser": "none", "scheduler_policy": "fcfs"},
    }


def ram_below_watermark(frame: int) -> dict:
    """MemAvailable sinks from well above the 15 GiB watermark to below it (still above the floor)."""
    snapshot = healthy(frame)
    snapshot["host"]["mem_available_bytes"] = int((40 - 1.2 * frame) * GIB)
    snapshot["state"] = "ready"
    return snapshot


def ram_below_floor(frame: int) -> dict:
    snapshot = healthy(frame)
    snapshot["host"]["mem_available_bytes"] = int((20 - 0.6 * frame) * GIB)
    return snapshot


def swap_in_use(frame: int) -> dict:
    snapshot = healthy(frame)
    snapshot["host"].update(swap_used_bytes=int(5.5 * GIB),
                            daemon_swap_bytes=int(min(frame, 12) * 96 * 1024**2))
    return snapshot


def debug_knob(frame: int) -> dict:
    snapshot = cpu_only(frame)
    snapshot["config"]["non_default"] = {
        "port": {"value": 8123, "default": 8000, "source": "cli", "debug": False},
        "debug_cold_prefill": {"value": True, "default": False, "source": "env DS4D_DEBUG_COLD_PREFILL",
                               "debug": True},
        "prefill_chunk_tokens": {"value": 512, "default": 2048, "source": "toml", "debug": False},
    }
    return snapshot


def missing_fields() -> list[str]:
    """Snapshots with fields absent, null, or of the wrong type, and lines that are not snapshots."""
    full = healthy(0)
    nulls = {key: None for key in full}
    wrong_types = {"state": 3, "model": "x", "requests": {"active": [None, 7, {"phase": 4}]},
                   "kv": [], "throughput": {"prefill_tok_s": "fast", "decode_tok_s": True},
                   "host": {"mem_available_bytes": "lots", "watermark_bytes": None},
                   "gpus": [None, "gpu", {"index": "zero", "breakdown": 5}],
                   "cache": {"tiers": {"gpu": None, "ram": [1, 2]}, "last_miss": {"why": 1}},
                   "experts": {}, "config": {"non_default": {"x": None, "y": {"debug": "yes"}}},
                   "plugins": {"model_family": ["a", "b"], "chat_encoder": None},
                   "time": 1e300, "uptime_s": float("inf")}
    partial = copy.deepcopy(full)
    del partial["host"]["watermark_bytes"], partial["gpus"][0]["breakdown"], partial["cache"]
    partial["requests"]["active"] = [{"id": "chatcmpl-partial"}]
    lines = [json.dumps(item) for item in ({}, nulls, wrong_types, partial)]
    return lines + ["this line is not JSON", "[1, 2, 3]", "", json.dumps(full)]


SCENARIOS = {
    "healthy": healthy,
    "gpu_4x_v100": four_v100,
    "cpu_only": cpu_only,
    "ram_below_watermark": ram_below_watermark,
    "ram_below_floor": ram_below_floor,
    "swap_in_use": swap_in_use,
    "debug_knob": debug_knob,
}


def write_all() -> None:
    DATA.mkdir(exist_ok=True)
    for name, scenario in SCENARIOS.items():
        lines = [json.dumps(scenario(frame), sort_keys=True) for frame in range(FRAMES)]
        (DATA / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    (DATA / "missing_fields.jsonl").write_text("\n".join(missing_fields()) + "\n")


if __name__ == "__main__":
    write_all()
