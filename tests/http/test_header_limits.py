"""Requests aiohttp's HTTP parser refuses before any route still get the OpenAI-shaped JSON error.

The daemon listens exactly as ``ds4d serve`` does (``Kernel._listen``) on 127.0.0.1 with the toy
model; requests go over real sockets, raw where the request itself must be malformed.  Every case
runs with aiohttp's C parser and with its pure-Python one.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp import http_parser, web_protocol

from ds4d.config import load_config
from ds4d.kernel import Kernel, LoadedModel
from ds4d.server.app import MAX_HEADER_BYTES
from tests.http.toy_server import assert_error
from tests.toy_model import ToyModel

KEY = "sk-test-0123456789"
GOOD = (f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
        "Connection: close\r\n\r\n").encode()


@pytest.fixture(params=["c", "python"])
def parser(request, monkeypatch):
    if request.param == "c":
        if http_parser.HttpRequestParser is http_parser.HttpRequestParserPy:
            pytest.skip("aiohttp's C parser is not available")
    else:
        monkeypatch.setattr(web_protocol, "HttpRequestParser", http_parser.HttpRequestParserPy)
    return request.param


@asynccontextmanager
async def live_daemon(tmp_path):
    loaded = load_config({"host": "127.0.0.1", "port": 0, "api_keys": [KEY], "served_model_name": "toy"},
                         environ={"DS4D_CONFIG": str(tmp_path / "none.toml")})
    kernel = Kernel(loaded)
    state = kernel.build(LoadedModel(ToyModel(), "toy", tmp_path), asyncio.get_running_loop())
    port = await kernel._listen(state)
    try:
        yield port
    finally:
        await kernel._runner.cleanup()
        kernel.engine.stop(2)


async def exchange(port: int, raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send raw bytes, read until the server closes the connection; (status, headers, body)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, _, value in (ln.partition(":") for ln in lines)}
    return int(status_line.split()[1]), headers, body


def json_error(status: int, headers: dict[str, str], body: bytes, expected: int, code: str) -> dict:
    assert headers.get("content-type", "").startswith("application/json"), (status, headers, body[:200])
    err = assert_error(status, json.loads(body), expected, code)
    assert len(err["message"]) < 500 and "Traceback" not in err["message"]
    return err


def request_with(*header_lines: str, target: str = "/v1/models") -> bytes:
    lines = [f"GET {target} HTTP/1.1", "Host: 127.0.0.1", f"Authorization: Bearer {KEY}", *header_lines]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


CASES = {
    "header value over the limit": (request_with("X-Big: " + "x" * (MAX_HEADER_BYTES + 1)), 431,
                                    "request_header_too_large"),
    "header name over the limit": (request_with("X-" + "x" * (MAX_HEADER_BYTES + 1) + ": v"), 431,
                                   "request_header_too_large"),
    "too many headers": (request_with(*(f"X-H{i}: v" for i in range(300))), 431, "request_header_too_large"),
    "request line over the limit": (request_with(target="/v1/models?q=" + "x" * (MAX_HEADER_BYTES + 1)), 414,
                                    "request_uri_too_long"),
    "invalid header character": (request_with("X-Bad: a\x01b"), 400, "bad_request"),
    "garbage request line": (b"NOT AN HTTP REQUEST\r\n\r\n", 400, "bad_request"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_parser_rejections_are_json_and_the_daemon_keeps_serving(tmp_path, parser, case):
    raw, expected, code = CASES[case]

    async def scenario():
        async with live_daemon(tmp_path) as port:
            status, headers, body = await exchange(port, raw)  # returns only once the server closed
            err = json_error(status, headers, body, expected, code)
            assert "xxxx" not in err["message"]  # the request's bytes are not echoed
            status, _, body = await exchange(port, GOOD)
            assert status == 200 and json.loads(body)["data"][0]["id"] == "toy"

    asyncio.run(scenario())


def test_header_at_the_limit_is_served(tmp_path, parser):
    name = "X-Big"
    at_limit = request_with(f"{name}: " + "x" * (MAX_HEADER_BYTES - len(name) - 2), "Connection: close")

    async def scenario():
        async with live_daemon(tmp_path) as port:
            status, _, body = await exchange(port, at_limit)
            assert status == 200, body[:300]
            assert json.loads(body)["data"][0]["id"] == "toy"

    asyncio.run(scenario())


def test_aiohttp_client_gets_431_json(tmp_path, parser):
    auth = {"Authorization": f"Bearer {KEY}"}

    async def scenario():
        async with live_daemon(tmp_path) as port, aiohttp.ClientSession(f"http://127.0.0.1:{port}") as s:
            async with s.get("/v1/models", headers={**auth, "X-Big": "x" * 40000}) as resp:
                assert resp.content_type == "application/json"
                err = assert_error(resp.status, await resp.json(), 431, "request_header_too_large")
                assert str(MAX_HEADER_BYTES) in err["message"]
            async with s.get("/v1/models", headers=auth) as resp:
                assert resp.status == 200 and (await resp.json())["data"][0]["id"] == "toy"
            async with s.get("/health") as resp:
                assert resp.status == 200

    asyncio.run(scenario())
