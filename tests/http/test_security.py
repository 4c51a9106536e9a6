"""Auth, CORS, size limits and the error contract, through the real app on a toy model."""

from __future__ import annotations

import asyncio

from tests.http.toy_server import assert_error, chat, completion, error_of, toy_server

KEY = "sk-test-0123456789"
ROUTES = [("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
          ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/ready"), ("GET", "/metrics"),
          ("GET", "/v1/ds4d/stats"), ("GET", "/no/such/route")]


def test_api_key_required_on_every_route_but_health(tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text("# operators\nsk-from-file\n\n")

    async def scenario():
        async with toy_server(tmp_path, api_keys=[KEY], api_key_file=str(key_file)) as (c, state):
            assert (await c.get("/health")).status == 200
            for method, path in ROUTES:
                for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                                {"Authorization": f"Basic {KEY}"}):
                    resp = await c.request(method, path, json={}, headers=headers)
                    assert_error(resp.status, await error_of(resp), 401, "invalid_api_key")
            for key in (KEY, "sk-from-file"):
                resp = await c.post("/v1/completions", json=completion(state, max_tokens=2),
                                    headers={"Authorization": f"Bearer {key}"})
                assert resp.status == 200
            resp = await c.get("/no/such/route", headers={"Authorization": f"Bearer {KEY}"})
            assert_error(resp.status, await error_of(resp), 404, "not_found")

    asyncio.run(scenario())


def test_no_cors_headers_unless_configured(tmp_path):
    preflight = {"Origin": "http://evil.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}

    async def scenario():
        async with toy_server(tmp_path) as (c, state):
            resp = await c.options("/v1/chat/completions", headers=preflight)
            assert resp.status == 405 and not any(h.lower().startswith("access-control") for h in resp.headers)
            resp = await c.get("/v1/models", headers={"Origin": "http://evil.example"})
            assert resp.status == 200 and "Access-Control-Allow-Origin" not in resp.headers
        async with toy_server(tmp_path, cors_origins=["http://ok.example"], api_keys=[KEY]) as (c, state):
            resp = await c.options("/v1/chat/completions", headers={**preflight, "Origin": "http://ok.example"})
            assert resp.status == 204  # preflight needs no key
            assert resp.headers["Access-Control-Allow-Origin"] == "http://ok.example"
            assert "POST" in resp.headers["Access-Control-Allow-Methods"]
            assert "authorization" in resp.headers["Access-Control-Allow-Headers"]
            resp = await c.options("/v1/chat/completions", headers=preflight)
            assert "Access-Control-Allow-Origin" not in resp.headers
            auth = {"Authorization": f"Bearer {KEY}"}
            resp = await c.post("/v1/chat/completions", json=chat(state, max_tokens=2, stream=True),
                                headers={**auth, "Origin": "http://ok.example"})
            assert resp.status == 200 and resp.headers["Access-Control-Allow-Origin"] == "http://ok.example"
            await resp.read()
            resp = await c.get("/v1/models", headers={"Origin": "http://ok.example"})  # errors carry it too
            assert resp.status == 401 and resp.headers["Access-Control-Allow-Origin"] == "http://ok.example"
            resp = await c.get("/v1/models", headers={**auth, "Origin": "http://evil.example"})
            assert resp.status == 200 and "Access-Control-Allow-Origin" not in resp.headers

    asyncio.run(scenario())


def test_size_limits_and_daemon_keeps_serving(tmp_path):
    async def scenario():
        async with toy_server(tmp_path, max_body_bytes=2000) as (c, state):
            resp = await c.post("/v1/completions", json=completion(state, "a" * 5000, max_tokens=2))
            assert_error(resp.status, await error_of(resp), 413, "request_too_large")
            resp = await c.get("/v1/models", headers={"X-Big": "x" * 40000})
            assert 400 <= resp.status < 500
            resp = await c.get("/v1/models", headers={f"X-H{i}": "v" for i in range(500)})
            assert 400 <= resp.status < 500
            resp = await c.post("/v1/completions", json=completion(state, max_tokens=2))
            assert resp.status == 200

    asyncio.run(scenario())


def test_error_contract(tmp_path):
    async def scenario():
        async with toy_server(tmp_path, max_context=64) as (c, state):
            for stream in (False, True):
                for path, body in (("/v1/chat/completions", chat(state, "a" * 100, stream=stream)),
                                   ("/v1/completions", completion(state, "a" * 100, stream=stream))):
                    resp = await c.post(path, json=body)
                    err = assert_error(resp.status, await error_of(resp), 400, "context_length_exceeded")
                    assert "maximum context length is 64 tokens" in err["message"]
            resp = await c.get("/v1/chat/completions")
            assert_error(resp.status, await error_of(resp), 405, "method_not_allowed")
            resp = await c.delete("/v1/models")
            assert_error(resp.status, await error_of(resp), 405, "method_not_allowed")
            assert "GET" in resp.headers["Allow"]
            resp = await c.get("/v1/nothing")
            assert_error(resp.status, await error_of(resp), 404, "not_found")
            resp = await c.post("/v1/chat/completions", json=chat(state, stream=True, model="other"))
            assert_error(resp.status, await error_of(resp), 404, "model_not_found")
            resp = await c.post("/v1/chat/completions", json=chat(state, stream=True, max_tokens="many"))
            err = assert_error(resp.status, await error_of(resp), 400)
            assert err["param"] == "max_tokens" and "max_tokens" in err["message"]
            resp = await c.post("/v1/completions", data=b"[1, 2]", headers={"Content-Type": "application/json"})
            assert_error(resp.status, await error_of(resp), 400, "invalid_json")
            resp = await c.post("/v1/completions", data=b"\xff\xfe{", headers={"Content-Type": "application/json"})
            assert_error(resp.status, await error_of(resp), 400, "invalid_json")

    asyncio.run(scenario())
