"""Start-up and shutdown of a live daemon: the listener answers while the model loads, SIGTERM
drains (503 to new work, requests in flight finish, exit 0), a second SIGTERM exits at once, and SIGTERM
during the load exits 0 without waiting for it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
import urllib.error
import urllib.request

import openai

from tests.daemon import REPO, Daemon

# memory thresholds far below any test machine's free RAM: /ready must not depend on the host
ARGS = ("--threads", "2", "--kv-cache-tokens", "4096", "--max-context", "1024", "--mem-watermark-gib", "1",
        "--mem-floor-gib", "0.5")


def call(daemon, path: str, body: dict | None = None) -> tuple[int, dict, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(daemon.url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read()), dict(resp.headers)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read()), dict(err.headers)


def consume(stream, out: dict) -> None:
    try:
        for chunk in stream:
            for c in chunk.choices:
                out["text"] = out.get("text", "") + (c.text or "")
                out["finish"] = c.finish_reason or out.get("finish")
    except Exception as exc:  # noqa: BLE001 - recorded for the assertions
        out["error"] = exc


def test_loading_state_then_sigterm_drains_in_flight_and_exits_0():
    d = Daemon(*ARGS, "--drain-timeout-s", "60", wait_for="listening")
    try:
        health = call(d, "/health")
        assert health[0] == 200 and health[1]["status"] in ("loading", "ok")
        loading = health[1]["status"] == "loading"
        status, body, headers = call(d, "/v1/models")
        if status == 503:  # still loading (the usual case: loading takes seconds)
            assert body["error"]["code"] == "loading" and headers["Retry-After"]
            loading = True
        ready_status, ready, _ = call(d, "/ready")
        assert ready_status == 200 or ready["reasons"] == ["loading"]
        assert loading, "the listener never answered in the loading state"
        d.wait_ready()
        assert call(d, "/ready")[0] == 200 and call(d, "/health")[1]["status"] == "ok"

        sdk = openai.OpenAI(base_url=d.url + "/v1", api_key="x", max_retries=0, timeout=120)
        model = sdk.models.list().data[0].id
        stream = sdk.completions.create(model=model, prompt="Once upon a time", max_tokens=20, stream=True,
                                        temperature=0, extra_body={"ignore_eos": True})
        result: dict = {}
        chunks = iter(stream)
        next(chunks)  # it is running
        reader = threading.Thread(target=consume, args=(chunks, result))
        reader.start()
        d.signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while call(d, "/ready")[0] != 503:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert "draining" in call(d, "/ready")[1]["reasons"]
        status, body, headers = call(d, "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 2})
        assert status == 503 and body["error"]["code"] == "shutting_down" and headers["Retry-After"]
        reader.join(120)
        assert "error" not in result and result["finish"] == "length", result
        assert d.proc.wait(60) == 0
        assert any("stopped" in line for line in d.log_lines), d.log
    finally:
        d.stop()


def test_sigterm_while_the_model_loads_exits_0_without_waiting_for_the_load(tmp_path):
    """The weights file is a FIFO nobody writes: the load blocks for good, so the signal surely comes during
    it.  The process must end (exit 0) anyway, the load still running on its thread."""
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(REPO / "tests" / "fixtures" / "dsv41" / "tiny_a" / name, model / name)
    os.mkfifo(model / "model.safetensors")
    d = Daemon(*ARGS, "--model", str(model), wait_for="listening")
    try:
        deadline = time.monotonic() + 60
        while not any("tokenizer:" in line for line in d.log_lines):  # past the config, into the weights
            assert time.monotonic() < deadline and d.proc.poll() is None, d.log
            time.sleep(0.05)
        assert call(d, "/health")[1]["status"] == "loading"
        d.signal(signal.SIGTERM)
        assert d.proc.wait(30) == 0, d.log
        assert any("signal while loading" in line for line in d.log_lines), d.log
    finally:
        d.stop()


def test_second_sigterm_exits_at_once():
    d = Daemon(*ARGS, "--drain-timeout-s", "600")
    try:
        sdk = openai.OpenAI(base_url=d.url + "/v1", api_key="x", max_retries=0, timeout=120)
        model = sdk.models.list().data[0].id
        stream = sdk.completions.create(model=model, prompt="Once upon a time", max_tokens=900, stream=True,
                                        extra_body={"ignore_eos": True})
        result: dict = {}
        chunks = iter(stream)
        next(chunks)
        reader = threading.Thread(target=consume, args=(chunks, result))
        reader.start()
        d.signal(signal.SIGTERM)
        time.sleep(0.5)
        assert d.proc.poll() is None  # draining: the long request keeps it alive
        started = time.monotonic()
        d.signal(signal.SIGTERM)
        assert d.proc.wait(10) == 0
        assert time.monotonic() - started < 5
        reader.join(10)
        assert result.get("finish") is None  # cut short: an error event or a closed connection
    finally:
        d.stop()


def test_shutdown_hooks_run_after_the_engine_stopped(tmp_path):
    import asyncio

    from ds4d.config import load_config
    from ds4d.kernel import Kernel, LoadedModel
    from tests.http.toy_server import SlowToyModel

    async def scenario():
        kernel = Kernel(load_config({}, environ={"DS4D_CONFIG": str(tmp_path / "none.toml")}))
        state = kernel.build(LoadedModel(SlowToyModel(), "toy", tmp_path), asyncio.get_running_loop())
        seen = []

        async def hook():
            seen.append(state.client.alive)

        async def broken():
            raise OSError("disk full")

        kernel.on_shutdown += [broken, hook]
        await kernel.shutdown()
        assert seen == [False] and state.draining

    asyncio.run(scenario())
