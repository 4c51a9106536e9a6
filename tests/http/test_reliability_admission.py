"""Admission, timeouts and the loading state, through the real app on a toy model (no model load).

Every refusal happens before a stream starts and is an OpenAI error with Retry-After."""

from __future__ import annotations

import asyncio
import threading

from aiohttp.test_utils import TestClient, TestServer

from ds4d.config import load_config
from ds4d.server.app import build_app
from ds4d.server.state import Lifecycle
from tests.http.toy_server import (
    assert_error,
    chat,
    completion,
    error_of,
    first_event,
    sse_events,
    toy_server,
    wait_until,
)

LONG = 100000  # max_tokens that keep a request running until it is aborted or times out


def test_queued_request_and_token_caps_503_before_stream(tmp_path):
    async def scenario():
        async with toy_server(tmp_path, max_num_seqs=1, max_queued_requests=2, max_queued_tokens=12) as (c, state):
            running = await c.post("/v1/completions", json=completion(state, "ab", max_tokens=LONG, stream=True,
                                                                       ignore_eos=True))
            await first_event(running)  # it has output: no longer queued
            queued = asyncio.create_task(c.post("/v1/completions", json=completion(state, "abcdefgh", max_tokens=2)))
            await wait_until(lambda: state.client.num_queued == 1)
            # 8 queued tokens + 5 > 12
            resp = await c.post("/v1/completions", json=completion(state, "abcde", max_tokens=2, stream=True))
            err = assert_error(resp.status, await error_of(resp), 503, "overloaded")
            assert "tokens" in err["message"] and resp.headers["Retry-After"]
            small = asyncio.create_task(c.post("/v1/chat/completions", json=chat(state, "ab", max_tokens=2)))
            await wait_until(lambda: state.client.num_queued == 2)
            resp = await c.post("/v1/chat/completions", json=chat(state, "a", max_tokens=2, stream=True))
            assert_error(resp.status, await error_of(resp), 503, "overloaded")
            assert int(resp.headers["Retry-After"]) > 0
            running.close()  # the running request ends; the queued ones are served
            for task in (queued, small):
                assert (await task).status == 200
            await wait_until(lambda: state.client.num_open == 0)
            # an empty queue takes a prompt larger than the token cap
            resp = await c.post("/v1/completions", json=completion(state, "x" * 40, max_tokens=2))
            assert resp.status == 200, await resp.text()

    asyncio.run(scenario())


def test_memory_floor_refuses_new_work_and_watermark_only_unreadies(tmp_path):
    async def scenario():
        async with toy_server(tmp_path, mem_watermark_gib=1e6) as (c, state):
            ready = await c.get("/ready")
            assert ready.status == 503 and "watermark" in " ".join((await ready.json())["reasons"])
            resp = await c.post("/v1/completions", json=completion(state, max_tokens=2))
            assert resp.status == 200  # below the watermark but above the floor: still served
        async with toy_server(tmp_path, mem_watermark_gib=1e6, mem_floor_gib=1e6) as (c, state):
            resp = await c.post("/v1/chat/completions", json=chat(state, max_tokens=2, stream=True))
            err = assert_error(resp.status, await error_of(resp), 503, "insufficient_memory")
            assert "GiB" in err["message"] and resp.headers["Retry-After"]
            ready = await c.get("/ready")
            assert ready.status == 503 and "floor" in " ".join((await ready.json())["reasons"])

    asyncio.run(scenario())


def test_request_and_queue_timeouts(tmp_path):
    async def scenario():
        async with toy_server(tmp_path, max_num_seqs=1, request_timeout_s=0.5, queue_timeout_s=0.3) as (c, state):
            long = {"max_tokens": LONG, "ignore_eos": True}
            resp = await c.post("/v1/chat/completions", json=chat(state, **long))
            err = assert_error(resp.status, await error_of(resp), 504, "timeout")
            assert "0.5 s" in err["message"]
            for path, body in (("/v1/chat/completions", chat(state, stream=True, **long)),
                               ("/v1/completions", completion(state, stream=True, **long))):
                resp = await c.post(path, json=body)
                assert resp.status == 200
                events = await sse_events(resp)
                assert events[-1]["error"]["code"] == "timeout", (path, events[-1])
                assert set(events[-1]["error"]) == {"message", "type", "param", "code"}
            # the one slot is busy for 0.5 s; a second request waits longer than 0.3 s in the queue
            first = asyncio.create_task(c.post("/v1/completions", json=completion(state, **long)))
            await wait_until(lambda: state.client.num_open == 1 and state.client.num_queued == 0)
            resp = await c.post("/v1/completions", json=completion(state, "zz", **long))
            err = assert_error(resp.status, await error_of(resp), 504, "timeout")
            assert "queued" in err["message"]
            assert (await first).status == 504
            for _ in range(250):  # the engine's own account, once it has no work left
                engine = await state.client.fresh_snapshot()
                if not (engine.running or engine.waiting):
                    break
                await asyncio.sleep(0.02)
            assert not (engine.running or engine.waiting) and engine.used_blocks == 0

    asyncio.run(scenario())


def test_loading_state_health_ok_ready_and_api_503(tmp_path):
    async def scenario():
        loaded = load_config({}, environ={"DS4D_CONFIG": str(tmp_path / "none.toml")})
        client = TestClient(TestServer(build_app(Lifecycle(loaded.config))))
        await client.start_server()
        try:
            health = await client.get("/health")
            assert health.status == 200 and (await health.json())["status"] == "loading"
            ready = await client.get("/ready")
            assert ready.status == 503 and (await ready.json())["reasons"] == ["loading"]
            for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("GET", "/metrics"),
                                 ("GET", "/v1/ds4d/stats")):
                resp = await client.request(method, path, json={"model": "m", "messages": []})
                assert_error(resp.status, await error_of(resp), 503, "loading")
                assert resp.headers["Retry-After"]
        finally:
            await client.close()

    asyncio.run(scenario())


def test_draining_refuses_new_work_but_finishes_in_flight(tmp_path):
    async def scenario():
        async with toy_server(tmp_path) as (c, state):
            pending = asyncio.create_task(c.post("/v1/completions", json=completion(state, max_tokens=60,
                                                                                    ignore_eos=True)))
            await wait_until(lambda: state.client.num_open == 1)
            state.draining = True
            resp = await c.post("/v1/completions", json=completion(state, max_tokens=2))
            assert_error(resp.status, await error_of(resp), 503, "shutting_down")
            assert (await c.get("/ready")).status == 503
            health = await c.get("/health")
            assert health.status == 200 and (await health.json())["status"] == "draining"
            done = await pending
            assert done.status == 200 and (await done.json())["usage"]["completion_tokens"] == 60

    asyncio.run(scenario())


def test_rendering_a_prompt_leaves_the_event_loop_free(tmp_path):
    """Rendering and tokenising a chat prompt (0.2 s for an agent's 68K tokens) runs off the event
    loop: while one is held inside the encoder, /health still answers, and the request then completes."""
    async def scenario():
        async with toy_server(tmp_path) as (c, state):
            entered, release = threading.Event(), threading.Event()
            render = state.encoder.render

            def held(req):
                entered.set()
                assert release.wait(30), "never released"
                return render(req)

            state.encoder.render = held
            pending = asyncio.create_task(c.post("/v1/chat/completions", json=chat(state, max_tokens=2)))
            assert await asyncio.to_thread(entered.wait, 30)
            health = await asyncio.wait_for(c.get("/health"), 10)  # times out if the loop is blocked
            assert health.status == 200
            release.set()
            reply = await asyncio.wait_for(pending, 30)
            assert reply.status == 200 and (await reply.json())["usage"]["completion_tokens"] >= 1

    asyncio.run(scenario())


def test_forced_tool_choice_needs_a_constraining_tool_parser(tmp_path):
    """The toy model's tool parser (``none``) cannot constrain decoding: a forced tool_choice is a 400
    before any stream, while auto and none are served."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}

    async def scenario():
        async with toy_server(tmp_path) as (c, state):
            for choice in ("required", {"type": "function", "function": {"name": "f"}}):
                resp = await c.post("/v1/chat/completions",
                                    json=chat(state, max_tokens=2, stream=True, tools=[tool], tool_choice=choice))
                err = assert_error(resp.status, await error_of(resp), 400, "unsupported_tool_choice")
                assert err["param"] == "tool_choice" and "'none'" in err["message"]
            for choice in ("auto", "none"):
                resp = await c.post("/v1/chat/completions",
                                    json=chat(state, max_tokens=2, tools=[tool], tool_choice=choice))
                assert resp.status == 200, await resp.text()

    asyncio.run(scenario())
