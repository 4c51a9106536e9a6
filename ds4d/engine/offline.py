"""Build an engine, and drive one in-process with no HTTP and no thread.

:func:`build_core` is the one place an :class:`EngineCore` is put together from a
model, a prefix cache (over its block pool) and a scheduling policy; the kernel
uses it for the daemon's engine thread.  :class:`OfflineEngine` builds one the
same way around a model and drives it from the caller's thread, which then *is*
the engine thread: requests are added and aborted at once, and each
:meth:`OfflineEngine.step` is one engine step.  Benchmarks, calibration and
tests drive the engine through it.

    engine = OfflineEngine(model, max_num_seqs=4, context_tokens=4096, prefill_chunk=512)
    engine.submit(EngineRequest("a", tuple(prompt), SamplingParams(max_tokens=16)))
    engine.run_until_idle()
    tokens = [t for o in engine.outputs for t in o.new_token_ids]
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ds4d.cache.blocks import BlockPool
from ds4d.cache.manager import PrefixCache
from ds4d.contracts import Model, PluginContext, SchedulerPolicy
from ds4d.engine.core import EngineCore
from ds4d.engine.request import EngineRequest, StepOutput
from ds4d.engine.runner import ModelRunner
from ds4d.engine.sampler import Sampler
from ds4d.engine.scheduler import Scheduler
from ds4d.engine.snapshot import EngineCapabilities, EngineSnapshot
from ds4d.engine.stats import EngineStats

log = logging.getLogger("ds4d.engine")


def build_core(model: Model, cache: PrefixCache, policy: SchedulerPolicy, *, max_num_seqs: int, step_tokens: int,
               prefill_chunk: int, namespace: bytes, publish: Callable[[list[StepOutput]], None],
               eos_token_ids: frozenset[int] = frozenset(), queue_timeout_s: float = 0.0,
               request_timeout_s: float = 0.0, lookahead: bool = False) -> EngineCore:
    """An engine over ``model`` whose scheduler allocates from ``cache``'s block pool.

    The model's cache must already be allocated for that pool and ``max_num_seqs`` state slots."""
    scheduler = Scheduler(cache.pool, policy, max_num_seqs=max_num_seqs, step_tokens=step_tokens,
                          prefill_chunk=prefill_chunk, namespace=namespace, cache=cache)
    return EngineCore(scheduler, ModelRunner(model, Sampler(model.info.device)), eos_token_ids, publish,
                      queue_timeout_s=queue_timeout_s, request_timeout_s=request_timeout_s, lookahead=lookahead)


def default_policy() -> SchedulerPolicy:
    """The registered ``fcfs`` policy, built with the default configuration."""
    from ds4d.config import Config
    from ds4d.registry import resolve

    return resolve("scheduler_policy", "fcfs")(PluginContext(Config(), log), {})


class OfflineEngine:
    """An engine around ``model``, stepped by the caller.

    The KV pool comes from ``cache`` (a :class:`PrefixCache` over its own pool, with
    whatever lower tiers it has), else ``num_blocks`` blocks, else enough blocks for
    ``max_num_seqs`` sequences of ``context_tokens`` each.  The model's cache is
    allocated for that pool.  ``step_tokens`` 0 gives every sequence a full
    ``prefill_chunk`` each step.  Step outputs go to ``publish``, or else are kept in
    :attr:`outputs`."""

    def __init__(
        self,
        model: Model,
        *,
        max_num_seqs: int,
        prefill_chunk: int,
        step_tokens: int = 0,
        context_tokens: int = 0,
        num_blocks: int = 0,
        cache: PrefixCache | None = None,
        prefix_caching: bool = True,
        policy: SchedulerPolicy | None = None,
        namespace: bytes = b"offline",
        eos_token_ids: frozenset[int] = frozenset(),
        lookahead: bool = False,
        queue_timeout_s: float = 0.0,
        request_timeout_s: float = 0.0,
        publish: Callable[[list[StepOutput]], None] | None = None,
    ) -> None:
        info = model.info
        if cache is None:
            if not num_blocks:
                if context_tokens <= 0:
                    raise ValueError("OfflineEngine needs a cache, num_blocks or context_tokens")
                num_blocks = max_num_seqs * (-(-context_tokens // info.block_size_tokens) + 1)
            cache = PrefixCache(BlockPool(num_blocks, info.block_size_tokens, prefix_caching=prefix_caching))
        model.allocate_cache(cache.pool.num_blocks, max_num_seqs)
        self.model = model
        self.pool_tokens = cache.pool.num_blocks * info.block_size_tokens
        """Tokens the KV pool holds: a longer prompt could never run (:meth:`submit` refuses it)."""
        self.outputs: list[StepOutput] = []
        """Every step output so far, when no ``publish`` was given (the caller may clear it)."""
        self.core = build_core(
            model, cache, policy or default_policy(), max_num_seqs=max_num_seqs,
            step_tokens=step_tokens or max(prefill_chunk * max_num_seqs, max_num_seqs),
            prefill_chunk=prefill_chunk, namespace=namespace, publish=publish or self.outputs.extend,
            eos_token_ids=eos_token_ids, queue_timeout_s=queue_timeout_s, request_timeout_s=request_timeout_s,
            lookahead=lookahead)

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def runner(self) -> ModelRunner:
        return self.core.runner

    @property
    def stats(self) -> EngineStats:
        return self.core.stats

    @property
    def lookahead(self) -> bool:
        """Steps are queued behind their predecessor (asked for, and the model takes device tokens)."""
        return self.core.lookahead

    @property
    def steps_ahead(self) -> int:
        """Steps queued behind their predecessor so far (looking ahead)."""
        return self.core.steps_ahead

    @property
    def has_work(self) -> bool:
        return self.core.scheduler.has_work

    @property
    def capabilities(self) -> EngineCapabilities:
        return self.core.capabilities

    def snapshot(self) -> EngineSnapshot:
        """The engine's state now (the caller is the engine thread)."""
        return self.core.take_snapshot()

    def submit(self, request: EngineRequest) -> None:
        """Queue ``request``; the next step may schedule it.  A prompt longer than the whole KV pool
        raises ValueError (it would wait for room forever; the daemon refuses it as too long)."""
        if len(request.prompt_ids) > self.pool_tokens:
            raise ValueError(f"a prompt of {len(request.prompt_ids)} tokens can never fit the KV pool "
                             f"({self.pool_tokens} tokens)")
        self.core.add_request(request)

    def abort(self, request_id: str) -> None:
        """End a request now; it publishes nothing more."""
        self.core.abort_request(request_id)

    def step(self) -> None:
        """One engine step: plan, run, publish."""
        self.core.step()

    def flush_cache(self) -> bool:
        """Write what the prefix cache holds to its persistent tier (disk), as the daemon does at
        shutdown."""
        return self.core.flush_cache()

    def run_until_idle(self, max_steps: int = 0) -> int:
        """Step until no request is left; the number of steps.  With ``max_steps`` > 0, more
        steps than that raise RuntimeError (a test's guard against a lack of progress)."""
        steps = 0
        while self.has_work:
            if max_steps and steps >= max_steps:
                raise RuntimeError(f"requests still unfinished after {steps} steps: no progress")
            self.core.step()
            steps += 1
        return steps
