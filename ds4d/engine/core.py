"""The engine thread: the only place that touches model tensors.

``EngineCore.step()`` is three calls — plan, run, publish.  Requests, aborts
and requests for a snapshot arrive through a thread-safe inbox; outputs leave
through the ``publish`` callback (the asyncio side hops them onto its loop).
Other threads see the engine's state only as frozen snapshots built here
(:mod:`ds4d.engine.snapshot`) and as its liveness.  If the loop dies, every
request in flight gets an error output and ``dead_reason`` says why, so
nothing waits forever.

Looking one step ahead (``lookahead``): while every running sequence decodes,
a step's successor is planned and queued on the device before the step's
tokens are read back, fed those tokens on the device
(``ForwardBatch.input_tokens``).  The host's work between two steps (reading
the tokens, publishing them, planning) then overlaps the device's work instead
of leaving the device idle.  Each ``step()`` still resolves exactly one step.
A sequence that ends at a step (a stop token, an abort) has one more position
computed in the step queued behind it; that result is dropped, and what it
wrote lies past the sequence's end (its window slot is one the continuation
overwrites before reading).  Conditions in :meth:`EngineCore._can_look_ahead`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from ds4d.engine.request import PENDING_TOKEN, EngineRequest, FinishReason, SeqStatus, Sequence, StepOutput
from ds4d.engine.runner import ChunkResult, LaunchedStep, ModelRunner
from ds4d.engine.scheduler import Scheduler, StepPlan
from ds4d.engine.snapshot import EngineCapabilities, EngineSnapshot, capabilities_of, take_snapshot
from ds4d.engine.stats import EngineStats

log = logging.getLogger("ds4d.engine")


@dataclass(frozen=True)
class _Add:
    request: EngineRequest


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Snapshot:
    answer: Future


class _Stop:
    pass


@dataclass
class _InFlight:
    launched: LaunchedStep
    started: float
    ahead: bool = False
    """Queued before the previous step's tokens were read: some of its sequences may have ended since."""
    committed: bool = False
    """Its chunks were committed to the scheduler when its successor was queued."""

    @property
    def plan(self) -> StepPlan:
        return self.launched.plan


class EngineCore:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        eos_token_ids: frozenset[int],
        publish: Callable[[list[StepOutput]], None],
        *,
        queue_timeout_s: float = 0.0,
        request_timeout_s: float = 0.0,
        lookahead: bool = False,
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.eos_token_ids = eos_token_ids
        self.publish = publish
        self.queue_timeout_s = queue_timeout_s
        self.request_timeout_s = request_timeout_s
        self.stats = EngineStats()
        self.last_progress = time.monotonic()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._seqs: dict[str, Sequence] = {}
        self._thread: threading.Thread | None = None
        self.dead_reason: str | None = None
        self.lookahead = lookahead and bool(getattr(runner.model, "accepts_input_tokens", False))
        self._inflight: _InFlight | None = None
        self._resolved_at = 0.0
        self.steps_ahead = 0
        """Steps queued behind their predecessor (looking ahead)."""
        self.capabilities: EngineCapabilities = capabilities_of(scheduler, self.lookahead)
        self._working = False
        """The scheduler had work when the engine thread last looked (read by :meth:`stalled_for`)."""
        self._snapshot: EngineSnapshot = self.take_snapshot()

    # ------------------------------------------------------------------ any thread

    def submit(self, request: EngineRequest) -> None:
        self._inbox.put(_Add(request))

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ds4d-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._inbox.put(_Stop())
        if self._thread is not None:
            self._thread.join(timeout)

    def request_snapshot(self) -> Future:
        """A future of a fresh :class:`EngineSnapshot`, built by the engine thread before its next
        step; with no engine thread running, one that is done already with the latest snapshot."""
        answer: Future = Future()
        if self.alive:
            self._inbox.put(_Snapshot(answer))
        else:
            answer.set_result(self._snapshot)
        return answer

    def snapshot(self) -> EngineSnapshot:
        """The latest snapshot the engine thread built (at a request, or when it ended)."""
        return self._snapshot

    def stalled_for(self) -> float:
        """Seconds work has waited without any step finishing (0 when idle)."""
        if not self._working:
            return 0.0
        return time.monotonic() - self.last_progress

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_reason is None

    @property
    def step_queued_ahead(self) -> bool:
        """A step is queued on the device behind the one last resolved (looking ahead)."""
        return self._inflight is not None

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        try:
            while self._apply_inbox(block=not self.scheduler.has_work):
                self._working = self.scheduler.has_work
                if self._working:
                    self.step()
                self._working = self.scheduler.has_work
        except BaseException as exc:  # noqa: BLE001 - the supervisor reports any death
            self.dead_reason = f"{type(exc).__name__}: {exc}"
            log.exception("engine thread died")
            self._fail_all(f"engine stopped: {self.dead_reason}")
        else:
            self._fail_all("engine shut down")
        finally:
            self._working = False
            self._answer_snapshots()

    def _apply_inbox(self, *, block: bool) -> bool:
        """Apply queued adds, aborts and snapshot requests; False when asked to stop."""
        while True:
            try:
                item = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if isinstance(item, _Stop):
                return False
            if isinstance(item, _Add):
                self.add_request(item.request)
            elif isinstance(item, _Abort):
                self.abort_request(item.request_id)
            elif isinstance(item, _Snapshot) and item.answer.set_running_or_notify_cancel():  # not given up
                item.answer.set_result(self._publish_snapshot())

    def _publish_snapshot(self) -> EngineSnapshot:
        self._snapshot = self.take_snapshot()
        return self._snapshot

    def _answer_snapshots(self) -> None:
        """As the engine thread ends: a last snapshot, also for every request for one still queued."""
        try:
            last = self._publish_snapshot()
        except Exception:  # noqa: BLE001 - bookkeeping may be what broke; keep the one before
            log.exception("engine snapshot failed")
            last = self._snapshot
        while True:
            try:
                item = self._inbox.get(block=False)
            except queue.Empty:
                return
            if isinstance(item, _Snapshot) and item.answer.set_running_or_notify_cancel():
                item.answer.set_result(last)

    def take_snapshot(self) -> EngineSnapshot:
        """The engine's state now, as a frozen :class:`EngineSnapshot`.  Engine thread only (an
        offline driver is one): other threads :meth:`request_snapshot`."""
        return take_snapshot(self.scheduler, list(self._seqs.values()), self.stats, self.runner.model,
                             self.steps_ahead)

    def add_request(self, request: EngineRequest) -> None:
        """Queue ``request`` for scheduling now.  Engine thread only: :meth:`submit` from any
        other thread (an offline driver, :class:`ds4d.engine.offline.OfflineEngine`, is the
        engine thread)."""
        if not self.scheduler.has_work:
            self.last_progress = time.monotonic()  # the stall clock starts with the work
        seq = Sequence(request)
        self._seqs[seq.request_id] = seq
        self.scheduler.add(seq)
        self.stats.on_arrival()

    def abort_request(self, request_id: str) -> None:
        """End the request now, publishing nothing (unknown ids are ignored).  Engine thread
        only: :meth:`abort` from any other thread."""
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self._finish(seq, FinishReason.ABORT, publish=False)

    def step(self) -> None:
        self._expire(time.monotonic())
        current, self._inflight = self._inflight, None
        if current is None:
            plan = self.scheduler.plan()
            if plan.empty:
                time.sleep(0.001)  # every sequence is blocked on memory; aborts will free some
                return
            current = _InFlight(self.runner.launch(plan), time.perf_counter())
        if self.lookahead:
            self._inflight = self._look_ahead(current)
        results = current.launched.results()
        self.last_progress = time.monotonic()
        began = max(current.started, self._resolved_at)  # a step queued ahead overlapped the one before
        self._resolved_at = time.perf_counter()
        self.publish(self._postprocess(current, results, self._resolved_at - began))
        if self._inflight is not None and not any(_live(c) for c in self._inflight.plan.chunks):
            self._inflight = None  # every sequence it computes has ended: nothing to resolve

    def _can_look_ahead(self, current: _InFlight) -> bool:
        """Every running sequence decodes in ``current`` with plain sampling (no constraint, no
        logprobs), none ends by length there, nothing could be admitted (no request waits, or every
        state slot is taken), and the pool has a block for each of them: the next plan is then the
        same sequences one position on, with no preemption, and it can be fed ``current``'s tokens
        on the device."""
        sched = self.scheduler
        live = [c for c in current.plan.chunks if _live(c)]
        if not live or len(live) != len(sched.running) or (sched.waiting and len(sched.running) < sched.max_num_seqs):
            return False
        for c in live:
            params, seq = c.seq.request.params, c.seq
            if not (c.num_tokens == 1 and c.sample and c.logits_tokens == 1 and seq.output_ids) or \
                    params.constraint is not None or params.logprobs is not None or \
                    params.prompt_logprobs is not None or len(seq.output_ids) + 1 >= params.max_tokens:
                return False
        return sched.pool.num_free >= len(live)

    def _look_ahead(self, current: _InFlight) -> _InFlight | None:
        """Commit ``current`` before its tokens are known and queue the next step behind it."""
        if not self._can_look_ahead(current):
            return None
        rows = [i for i, c in enumerate(current.plan.chunks) if _live(c)]
        for i in rows:
            chunk = current.plan.chunks[i]
            self.scheduler.committed(chunk)
            chunk.seq.output_ids.append(PENDING_TOKEN)
        current.committed = True
        plan = self.scheduler.plan()
        seqs = [current.plan.chunks[i].seq for i in rows]
        if [c.seq for c in plan.chunks] != seqs or plan.preempted:
            raise RuntimeError("the plan after a committed decode step is not the same sequences one position on")
        tokens = current.launched.tokens_of(rows)
        self.steps_ahead += 1
        return _InFlight(self.runner.launch(plan, input_tokens=tokens), time.perf_counter(), ahead=True)

    def _expire(self, now: float) -> None:
        """End requests past their queue-wait or total-time limit."""
        expired = []
        if self.queue_timeout_s > 0:
            expired += [(s, "queued", self.queue_timeout_s) for s in self.scheduler.waiting
                        if s.state_slot is None and s.num_computed_tokens == 0 and not s.output_ids
                        and now - s.arrival_time > self.queue_timeout_s]
        if self.request_timeout_s > 0:
            expired += [(s, "running", self.request_timeout_s) for s in self.scheduler.running
                        if now - s.arrival_time > self.request_timeout_s]
        for seq, where, limit in expired:
            self._seqs.pop(seq.request_id, None)
            self._finish(seq, FinishReason.TIMEOUT, publish=True,
                         error=f"request {where} longer than the {limit:g} s limit")

    def _postprocess(self, current: _InFlight, results: list[ChunkResult], seconds: float) -> list[StepOutput]:
        outputs = []
        prefill_tokens = decode_tokens = 0
        now = time.monotonic()
        plan = current.plan
        for chunk, result in zip(plan.chunks, results):
            seq = chunk.seq
            if current.ahead and not _live(chunk):
                continue  # it ended while this step was queued: the position past its end is dropped
            if current.committed:
                seq.output_ids.pop()  # the placeholder; the token goes in below
            else:
                self.scheduler.committed(chunk)
            is_decode = chunk.num_tokens == 1 and bool(seq.output_ids)
            if is_decode:
                decode_tokens += 1
            else:
                prefill_tokens += chunk.num_tokens
                seq.chunks_done += 1
                if seq.prefill_started_at is None:
                    seq.prefill_started_at = now
            prompt_lp = result.prompt_logprobs
            if prompt_lp:
                fresh = prompt_lp[max(0, seq.prompt_logprobs_sent - chunk.start_pos - (chunk.start_pos > 0)):]
                seq.prompt_logprobs_sent += len(fresh)
                prompt_lp = fresh
            if result.token_id is None:
                if prompt_lp:
                    outputs.append(StepOutput(seq.request_id, prompt_logprobs=prompt_lp,
                                              cached_tokens=seq.cached_tokens, cached_by_tier=_by_tier(seq),
                                              cache_note=seq.cache_note))
                continue
            first = not seq.output_ids
            if first:
                seq.first_token_at = now
                seq.prefill_ms = (now - (seq.prefill_started_at or now)) * 1000 + seconds * 1000
            seq.output_ids.append(result.token_id)
            finish = self._finish_reason(seq, result.token_id)
            outputs.append(StepOutput(
                seq.request_id,
                new_token_ids=(result.token_id,),
                logprobs=(result.logprob,) if result.logprob else (),
                prompt_logprobs=prompt_lp,
                finish_reason=finish,
                cached_tokens=seq.cached_tokens,
                cached_by_tier=_by_tier(seq), cache_note=seq.cache_note,
                first_token=first,
            ))
            if finish is not None:
                self._seqs.pop(seq.request_id, None)
                self._finish(seq, finish, publish=False)
        self.stats.on_step(prefill_tokens, decode_tokens, seconds, len(plan.preempted))
        return outputs

    def _finish_reason(self, seq: Sequence, token_id: int) -> FinishReason | None:
        params = seq.request.params
        if not params.ignore_eos and token_id in self.eos_token_ids:
            return FinishReason.STOP
        if token_id in params.stop_token_ids:
            return FinishReason.STOP
        if len(seq.output_ids) >= params.max_tokens:
            return FinishReason.LENGTH
        return None

    def _finish(self, seq: Sequence, reason: FinishReason, *, publish: bool, error: str | None = None) -> None:
        self.scheduler.remove(seq, checkpoint=reason is not FinishReason.ERROR)
        self.runner.sampler.forget(seq.request_id)
        self.stats.on_finish()
        if publish:
            self.publish([StepOutput(seq.request_id, finish_reason=reason, error=error, cached_tokens=seq.cached_tokens,
                                     cached_by_tier=_by_tier(seq), cache_note=seq.cache_note)])

    def _fail_all(self, message: str) -> None:
        seqs = list(self._seqs.values())
        self._seqs.clear()
        for seq in seqs:
            try:
                self.scheduler.remove(seq)
            except Exception:  # noqa: BLE001 - bookkeeping may be what broke; still answer
                pass
        if seqs:
            self.publish([StepOutput(s.request_id, finish_reason=FinishReason.ERROR, error=message) for s in seqs])

    def flush_cache(self) -> bool:
        """At shutdown, after :meth:`stop`: write what the prefix cache holds to its persistent
        tier (disk).  Skipped (False) if the engine thread is still running."""
        if self._thread is not None and self._thread.is_alive():
            log.warning("engine thread still running: prefix cache not flushed")
            return False
        self.scheduler.cache.flush()
        return True


def _live(chunk) -> bool:
    return chunk.seq.status is SeqStatus.RUNNING


def _by_tier(seq: Sequence) -> tuple[tuple[str, int], ...]:
    return tuple(seq.cached_by_tier.items())
