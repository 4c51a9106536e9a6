"""EngineClient: the narrow asyncio-side boundary to the engine thread.

submit -> async stream of StepOutput, abort, stats.  The engine thread calls
``_publish`` from its own thread; outputs hop onto the event loop with
``call_soon_threadsafe`` and land in the request's asyncio queue.  If this ever
becomes a process boundary, only this class changes.
"""

from __future__ import annotations

import asyncio

from ds4d.engine.core import EngineCore
from ds4d.engine.request import EngineRequest, FinishReason, StepOutput


class EngineDead(RuntimeError):
    pass


class EngineClient:
    def __init__(self, core: EngineCore, loop: asyncio.AbstractEventLoop) -> None:
        self.core = core
        self.loop = loop
        self._queues: dict[str, asyncio.Queue[StepOutput]] = {}
        # requests with no output yet -> their prompt tokens (the backlog admission caps)
        self._queued: dict[str, int] = {}
        core.publish = self._publish

    def _publish(self, outputs: list[StepOutput]) -> None:
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
        """Open requests that have produced no output yet (queued, or prefilling their prompt)."""
        return len(self._queued)

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens of the requests counted by ``num_queued``."""
        return sum(self._queued.values())

    def open(self, request: EngineRequest) -> RequestStream:
        """Submit a request; read its outputs from the returned stream, close() it when done."""
        if not self.core.alive:
            raise EngineDead(self.core.dead_reason or "engine not running")
        q: asyncio.Queue[StepOutput] = asyncio.Queue()
        self._queues[request.request_id] = q
        self._queued[request.request_id] = len(request.prompt_ids)
        self.core.submit(request)
        return RequestStream(self, request.request_id, q)

    def _closed(self, request_id: str, finished: bool) -> None:
        self._queues.pop(request_id, None)
        self._queued.pop(request_id, None)
        if not finished:
            self.core.abort(request_id)

    def fail_all(self, message: str) -> None:
        """Called by the supervisor when the engine thread is gone without saying so."""
        for request_id in list(self._queues):
            self._dispatch([StepOutput(request_id, finish_reason=FinishReason.ERROR, error=message)])


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
        """The next output, or None if ``timeout`` seconds pass first."""
        try:
            out = await asyncio.wait_for(self._queue.get(), timeout)
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
