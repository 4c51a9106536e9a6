"""Stats sources and the command line: HTTP polling against a stub daemon, replay files, main()."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
from aiohttp import web

from tests.tui.console_helpers import DATA, shown, wait_until
from tui.app import ConsoleApp, build_app, build_parser, main
from tui.source import HttpStatsSource, ReplayStatsSource, SourceError
from tui.widgets import StatusLine

API_KEY = "sk-test-console"
ROOT = Path(__file__).resolve().parents[2]


def first_snapshot(name: str) -> dict:
    with open(DATA / f"{name}.jsonl") as replay:
        return json.loads(replay.readline())


async def stub_daemon(handler) -> tuple[web.AppRunner, str]:
    """An aiohttp server on 127.0.0.1 answering GET /v1/ds4d/stats with `handler`."""
    app = web.Application()
    app.router.add_get("/v1/ds4d/stats", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}"


def authorised_stats(snapshot: dict):
    async def handler(request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != f"Bearer {API_KEY}":
            return web.json_response({"error": {"message": "bad key"}}, status=401)
        return web.json_response(snapshot)

    return handler


def test_http_source_sends_the_api_key_and_returns_the_snapshot():
    async def body():
        snapshot = first_snapshot("healthy")
        runner, url = await stub_daemon(authorised_stats(snapshot))
        try:
            source = HttpStatsSource(url + "/", api_key=API_KEY)
            assert await source.fetch() == snapshot
            assert source.description == f"live {url}"
            await source.close()
            keyless = HttpStatsSource(url)
            with pytest.raises(SourceError, match="HTTP 401 .*check --api-key"):
                await keyless.fetch()
            await keyless.close()
        finally:
            await runner.cleanup()

    asyncio.run(body())


@pytest.mark.parametrize(
    ("make_response", "message"),
    [
        (lambda: web.Response(status=503, text="draining"), "HTTP 503 from"),
        (lambda: web.Response(text="<html>proxy error</html>"), "not JSON"),
        (lambda: web.json_response([1, 2]), "not a JSON object"),
    ],
)
def test_http_source_reports_bad_answers(make_response, message):
    async def body():
        async def handler(request):
            return make_response()

        runner, url = await stub_daemon(handler)
        try:
            source = HttpStatsSource(url)
            with pytest.raises(SourceError, match=message):
                await source.fetch()
            await source.close()
        finally:
            await runner.cleanup()

    asyncio.run(body())


def test_console_polls_a_live_daemon_and_recovers_when_it_comes_back():
    async def body():
        snapshot = first_snapshot("healthy")
        answers = {"up": False}

        async def handler(request):
            if not answers["up"]:
                return web.Response(status=503)
            return await authorised_stats(snapshot)(request)

        runner, url = await stub_daemon(handler)
        app = ConsoleApp(HttpStatsSource(url, api_key=API_KEY), interval_s=0.05)
        try:
            async with app.run_test(size=(80, 24)) as pilot:
                status_line = app.query_one(StatusLine)
                assert await wait_until(pilot, lambda: "HTTP 503" in shown(status_line)), shown(status_line)
                answers["up"] = True
                assert await wait_until(pilot, lambda: app.state.frames >= 2), app.state.frames
                status = shown(app.query_one(StatusLine))
                assert app.state.error is None and "HTTP 503" not in status
                assert "deepseek-v4-flash" in status and f"live {url}" in status
                assert "48.0 tok/s" in shown(app.query_one("#throughput"))
        finally:
            await runner.cleanup()

    asyncio.run(body())


def test_replay_source_skips_blank_lines_and_reports_bad_ones(tmp_path):
    log = tmp_path / "stats.jsonl"
    log.write_text('{"uptime_s": 1}\n\n   \nnot json\n{"uptime_s": 2}\n')

    async def body():
        source = ReplayStatsSource(log)
        assert await source.fetch() == {"uptime_s": 1}
        with pytest.raises(SourceError, match="stats.jsonl:4: not JSON"):
            await source.fetch()
        assert await source.fetch() == {"uptime_s": 2}
        assert await source.fetch() is None
        assert source.description == "replay stats.jsonl #2 (end)"
        await source.close()

    asyncio.run(body())


def test_arguments_pick_the_source():
    live = build_app(build_parser().parse_args(["--url", "http://10.0.0.5:8123", "--api-key", "k",
                                                "--interval", "0.5"]))
    assert isinstance(live.source, HttpStatsSource)
    assert live.source.stats_url == "http://10.0.0.5:8123/v1/ds4d/stats"
    assert live.interval_s == 0.5
    replay = build_app(build_parser().parse_args(["--replay", str(DATA / "healthy.jsonl")]))
    assert isinstance(replay.source, ReplayStatsSource) and replay.interval_s == 1.0
    default = build_parser().parse_args([])
    assert default.url == "http://127.0.0.1:8000" and default.api_key is None


def test_main_exit_statuses(tmp_path, capsys):
    assert main(["--help"]) == 0
    assert "--replay FILE" in capsys.readouterr().out
    assert main(["--interval", "0"]) == 2
    assert main(["--replay", str(tmp_path / "absent.jsonl")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_python_dash_m_tui_runs_main():
    result = subprocess.run([sys.executable, "-m", "tui", "--help"], check=False, cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0 and "ds4d console" in result.stdout


def test_console_imports_neither_torch_nor_the_daemon():
    probe = ("import sys, tui.app; "
             "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'ds4d')); "
             "print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", probe], check=False, cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
