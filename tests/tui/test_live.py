"""The console against a live daemon: one started here on the embedded model, or the one
DS4D_LIVE_URL points at.

    DS4D_LIVE_URL=http://127.0.0.1:8000 [DS4D_LIVE_API_KEY=...] python -m pytest tests/tui/test_live.py

The test puts its own load on the daemon (two streamed chat completions on the first served model)
and watches through the console until it shows decode tok/s and running requests.
"""

from __future__ import annotations

import asyncio
import os
import re

import aiohttp
import pytest

from tests.tui.console_helpers import shown
from tui.app import ConsoleApp
from tui.source import HttpStatsSource

from tests.daemon import Daemon

API_KEY = os.environ.get("DS4D_LIVE_API_KEY") or None
WATCH_S = 120.0


@pytest.fixture(scope="module")
def live_url():
    url = os.environ.get("DS4D_LIVE_URL", "").rstrip("/")
    if url:
        yield url
        return
    daemon = Daemon("--max-context", "2048", "--max-num-seqs", "4", "--kv-cache-tokens", "8192", "--threads", "2")
    try:
        yield daemon.url
    finally:
        daemon.stop()


async def generate(session: aiohttp.ClientSession, url: str, model: str) -> None:
    """A long streamed completion, read to the end."""
    body = {"model": model, "stream": True, "max_tokens": 512, "temperature": 0,
            "messages": [{"role": "user", "content": "Count from 1 to 500, one number per line."}]}
    async with session.post(f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for _ in response.content:
            pass


def test_console_shows_decode_rate_and_running_requests(live_url):
    async def body():
        headers = {"Authorization": f"Bearer {API_KEY}"} if API_KEY else {}
        async with aiohttp.ClientSession(headers=headers) as session:
            async with session.get(f"{live_url}/v1/models") as response:
                response.raise_for_status()
                model = (await response.json())["data"][0]["id"]
            load = [asyncio.create_task(generate(session, live_url, model)) for _ in range(2)]
            app = ConsoleApp(HttpStatsSource(live_url, api_key=API_KEY), interval_s=0.25)
            try:
                async with app.run_test(size=(100, 30)) as pilot:
                    decode = running = None
                    deadline = asyncio.get_running_loop().time() + WATCH_S
                    while asyncio.get_running_loop().time() < deadline:
                        await pilot.pause(0.25)
                        throughput = shown(app.query_one("#throughput"))
                        title = str(app.query_one("#requests").border_title)
                        decode = re.search(r"decode\s+(\S+) tok/s", throughput)
                        running = re.search(r"(\d+) running", title)
                        if (decode and decode.group(1) not in ("0", "—")
                                and running and int(running.group(1)) > 0):
                            break
                        if all(task.done() for task in load):
                            break
                    assert app.state.error is None, app.state.error
                    assert decode and decode.group(1) not in ("0", "—"), throughput
                    assert running and int(running.group(1)) > 0, title
                    assert "no active requests" not in shown(app.query_one("#requests-table"))
            finally:
                for task in load:
                    task.cancel()
                await asyncio.gather(*load, return_exceptions=True)

    asyncio.run(body())
