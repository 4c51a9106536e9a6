"""The real aiohttp app in-process on a toy model: HTTP behaviour tests that need no model load."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from contextlib import asynccontextmanager
from pathlib import Path

from aiohttp.test_utils import TestClient, TestServer

from ds4d.config import load_config
from ds4d.kernel import Kernel, LoadedModel
from ds4d.server.app import build_app
from tests.toy_model import ToyModel


class SlowToyModel(ToyModel):
    """The toy model with a fixed delay per engine step, so a long request stays in flight."""

    def __init__(self, step_delay_s: float = 0.01) -> None:
        super().__init__()
        self.step_delay_s = step_delay_s
        self.info = dataclasses.replace(self.info, chat_template="{{ messages[-1]['content'] }}")

    def forward(self, batch):
        time.sleep(self.step_delay_s)
        self.forward_calls.clear()  # a long run must not keep every batch
        return super().forward(batch)


@asynccontextmanager
async def toy_server(tmp_path: Path, step_delay_s: float = 0.01, **knobs):
    """Yields (TestClient, ServingState) for an app built exactly as the daemon builds it."""
    loaded = load_config(knobs, environ={"DS4D_CONFIG": str(tmp_path / "none.toml")})
    kernel = Kernel(loaded)
    state = kernel.build(LoadedModel(SlowToyModel(step_delay_s), "toy", tmp_path), asyncio.get_running_loop())
    client = TestClient(TestServer(build_app(state)))
    await client.start_server()
    try:
        yield client, state
    finally:
        await client.close()
        kernel.engine.stop(2)


def completion(state, prompt="abcdef", **kw) -> dict:
    return {"model": state.served_model_name, "prompt": prompt, "temperature": 0, **kw}


def chat(state, content="abcdef", **kw) -> dict:
    return {"model": state.served_model_name, "messages": [{"role": "user", "content": content}],
            "temperature": 0, **kw}


def assert_error(status: int, body: dict, expected: int, code: str | None = None) -> dict:
    assert status == expected, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and isinstance(err["code"], str) and len(err["message"]) <= 500
    assert "Traceback" not in err["message"] and "/" + "work" not in err["message"]
    if code is not None:
        assert err["code"] == code, err
    return err


async def error_of(resp) -> dict:
    assert resp.content_type == "application/json", resp.content_type
    return await resp.json()


async def sse_events(resp) -> list:
    """The JSON events of an SSE response, up to [DONE]."""
    events = []
    async for raw in resp.content:
        line = raw.decode().strip()
        if line == "data: [DONE]":
            break
        if line.startswith("data: "):
            events.append(json.loads(line[6:]))
    return events


async def first_event(resp) -> dict:
    async for raw in resp.content:
        line = raw.decode().strip()
        if line.startswith("data: "):
            return json.loads(line[6:])
    raise AssertionError("stream ended without an event")


async def wait_until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)
