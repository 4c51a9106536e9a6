"""EngineClient: the asyncio side's one door to the engine thread.

``submit`` -> a :class:`RequestStream` of StepOutputs, ``abort``, ``snapshot``
(frozen engine state, built on the engine thread) and ``capabilities`` (facts
fixed at build), plus the engine's liveness for /health.  The engine's
``publish`` callback is an :class:`OutputRouter`, built before the engine and
given to it: outputs hop onto the event loop with ``call_soon_threadsafe`` and
land in their request's asyncio queue.  If this ever becomes a process
boundary, only these two classes change.
"""

from __future__ import annotations

import asyncio

from ds4d.engine.core import EngineCore
from ds4d.engine.request import EngineRequest, FinishReason, StepOutput
from ds4d.engine.snapshot import EngineCapabilities, EngineSnapshot

SNAPSHOT_WAIT_S = 2.0
"""How long a fresh snapshot is waited for (the engine answers between two steps) before the latest
one is taken instead."""


class EngineDead(RuntimeError):
    pass


class OutputRouter:
    """The engine's ``publish`` callback and the per-request queues it fills (event loop side)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._queues: dict[str, asyncio.Queue[StepOutput]] = {}
        # requests with no output yet -> their prompt tokens (the backlog admission caps)
        self._queued: dict[str, int] = {}

    def publish(self, outputs: list[StepOutput]) -> None:
        """Called by the engine thread."""
        self.loop.call_soon_threadsafe(self._dispatch, outputs)

    def _dispatch(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            self._queued.pop(out.request_id, None)
            q = self._queues.get(out.request_id)
            if q is not None:
                q.put_nowait(out)

    @property
    def num_open(self) -> int:
        return len(self._queues)

    @property
    def num_queued(self) -> int:
        return len(self._queued)

    @property
    def queued_tokens(self) -> int:
        return sum(self._queued.values())

    def open(self, request: EngineRequest) -> asyncio.Queue[StepOutput]:
        q: asyncio.Queue[StepOutput] = asyncio.Queue()
        self._queues[request.request_id] = q
        self._queued[request.request_id] = len(request.prompt_ids)
        return q

    def close(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        self._queued.pop(request_id, None)

    def fail_all(self, message: str) -> None:
        for request_id in list(self._queues):
            self._dispatch([StepOutput(request_id, finish_reason=FinishReason.ERROR, error=message)])


class EngineClient:
    def __init__(self, core: EngineCore, router: OutputRouter) -> None:
        self._core = core
        self._router = router
        self.capabilities: EngineCapabilities = core.capabilities

    @property
    def num_open(self) -> int:
        return self._router.num_open

    @property
    def num_queued(self) -> int:
        """Open requests that have produced no output yet (queued, or prefilling their prompt)."""
        return self._router.num_queued

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens of the requests counted by ``num_queued``."""
        return self._router.queued_tokens

    def submit(self, request: EngineRequest) -> RequestStream:
        """Hand a request to the engine; read its outputs from the returned stream, close() it when done."""
        if not self._core.alive:
            raise EngineDead(self._core.dead_reason or "engine not running")
        q = self._router.open(request)
        self._core.submit(request)
        return RequestStream(self, request.request_id, q)

    def abort(self, request_id: str) -> None:
        """End a request; it publishes nothing more."""
        self._router.close(request_id)
        self._core.abort(request_id)

    def snapshot(self) -> EngineSnapshot:
        """The latest snapshot the engine thread built (no waiting; possibly old)."""
        return self._core.snapshot()

    async def fresh_snapshot(self) -> EngineSnapshot:
        """A snapshot the engine thread builds now, between two steps; the latest one when that takes
        longer than ``SNAPSHOT_WAIT_S`` (a long step) or no engine thread runs."""
        try:
            return await asyncio.wait_for(asyncio.wrap_future(self._core.request_snapshot()), SNAPSHOT_WAIT_S)
        except TimeoutError:
            return self._core.snapshot()

    @property
    def alive(self) -> bool:
        return self._core.alive

    @property
    def dead_reason(self) -> str | None:
        return self._core.dead_reason

    def stalled_for(self) -> float:
        """Seconds work has waited without any engine step finishing (0 when idle)."""
        return self._core.stalled_for()

    def fail_all(self, message: str) -> None:
        """Called by the supervisor when the engine thread is gone without saying so."""
        self._router.fail_all(message)

    def _closed(self, request_id: str, finished: bool) -> None:
        if finished:
            self._router.close(request_id)
        else:
            self.abort(request_id)


class RequestStream:
    """Outputs of one request.  ``next()`` may time out (for keep-alives) without
    losing anything; ``close()`` before the final output aborts the request."""

    def __init__(self, client: EngineClient, request_id: str, queue: asyncio.Queue[StepOutput]) -> None:
        self._client = client
        self.request_id = request_id
        self._queue = queue
        self.finished = False
        self._closed = False

    async def next(self, timeout: float | None = None) -> StepOutput | None:
        """The next output, or None if ``timeout`` seconds pass first.  A cancellation (a client gone) always
        raises here: ``asyncio.timeout``, not ``asyncio.wait_for``, which on Python 3.11 returns the result
        instead when the output arrives as the task is cancelled, so the request would run on unaborted."""
        try:
            async with asyncio.timeout(timeout):
                out = await self._queue.get()
        except TimeoutError:
            return None
        if out.finish_reason is not None:
            self.finished = True
        return out

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StepOutput:
        if self.finished:
            raise StopAsyncIteration
        out = await self.next()
        assert out is not None
        return out

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._client._closed(self.request_id, self.finished)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
