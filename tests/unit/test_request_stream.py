"""``RequestStream.next`` (the engine's outputs of one request, read on the event loop): a cancellation of the
reading task (aiohttp cancels a handler whose client went away) raises even when an output arrives at the same
moment, so the handler's ``finally`` aborts the request.  ``asyncio.wait_for`` returned the output instead on
Python 3.11, and under load a non-streaming request whose client had left ran to its end."""

from __future__ import annotations

import asyncio

import pytest

from ds4d.engine.client import RequestStream
from ds4d.engine.request import StepOutput


class _Client:
    def __init__(self) -> None:
        self.aborted: list[str] = []

    def _closed(self, request_id: str, finished: bool) -> None:
        if not finished:
            self.aborted.append(request_id)


def test_a_cancellation_as_an_output_arrives_still_raises_and_the_request_is_aborted():
    async def run() -> _Client:
        client, queue = _Client(), asyncio.Queue()
        stream = RequestStream(client, "r1", queue)

        async def handler() -> None:
            try:
                await stream.next(5.0)  # with a keep-alive timeout, as the server reads
                await asyncio.sleep(3600)  # had the cancellation been lost, nothing would end this
            finally:
                stream.close()

        task = asyncio.create_task(handler())
        await asyncio.sleep(0)  # the handler waits for an output
        queue.put_nowait(StepOutput("r1", new_token_ids=(7,)))
        task.cancel()  # the client is gone, in the same turn of the loop as the output
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 5)
        return client

    assert asyncio.run(run()).aborted == ["r1"]


def test_outputs_and_the_keepalive_timeout_are_as_before():
    async def run() -> tuple:
        queue = asyncio.Queue()
        stream = RequestStream(_Client(), "r2", queue)
        idle = await stream.next(0.01)
        queue.put_nowait(StepOutput("r2", new_token_ids=(1,)))
        return idle, await stream.next(5.0), stream.finished

    idle, out, finished = asyncio.run(run())
    assert idle is None and out.new_token_ids == (1,) and not finished
