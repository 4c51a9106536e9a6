"""Where stats snapshots come from: a live daemon over HTTP, or a recorded stats log.

A source has one coroutine, `fetch()`, which returns the next snapshot (a JSON object), returns None
when there will be no more (the end of a replay), or raises `SourceError` with a message for the
operator. The console polls it on a timer; a source never sleeps or retries on its own.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any, Protocol

import aiohttp

STATS_PATH = "/v1/ds4d/stats"


class SourceError(Exception):
    """A poll that produced no snapshot; str(error) is shown in the console's status line."""


class StatsSource(Protocol):
    description: str  # shown in the status line, e.g. "live http://127.0.0.1:8000"

    async def fetch(self) -> dict[str, Any] | None: ...

    async def close(self) -> None: ...


class HttpStatsSource:
    """Polls GET {url}/v1/ds4d/stats, with a Bearer token when an API key is given."""

    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 5.0):
        self.base_url = url.rstrip("/")
        self.stats_url = self.base_url + STATS_PATH
        self.description = f"live {self.base_url}"
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def fetch(self) -> dict[str, Any]:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self._timeout, headers=self._headers)
        try:
            async with self._session.get(self.stats_url) as response:
                if response.status in (401, 403):
                    raise SourceError(f"HTTP {response.status} from {self.base_url}: check --api-key")
                if response.status != 200:
                    raise SourceError(f"HTTP {response.status} from {self.stats_url}")
                body = await response.read()
        except aiohttp.ClientConnectorError as error:
            raise SourceError(f"{self.base_url} unreachable ({connect_reason(error)})") from error
        except TimeoutError as error:
            raise SourceError(f"{self.base_url} unreachable (no answer in time)") from error
        except aiohttp.ClientError as error:
            raise SourceError(f"{self.base_url} unreachable ({error})") from error
        return _parse_snapshot(body, where=self.stats_url)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class ReplayStatsSource:
    """Plays back a stats log: JSON Lines, one snapshot per line, as the daemon writes with --stats-log.

    Each fetch reads the next non-blank line, so a log of any length streams from disk. A line that is
    not a JSON object is reported (by line number) and skipped on the next fetch.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._file = self.path.open("rb")  # fails here, before the console starts, if unreadable
        self.line_number = 0
        self.played = 0  # snapshots returned so far
        self.finished = False

    @property
    def description(self) -> str:
        return f"replay {self.path.name} #{self.played}{' (end)' if self.finished else ''}"

    async def fetch(self) -> dict[str, Any] | None:
        while True:
            line = self._file.readline()
            if not line:
                self.finished = True
                return None
            self.line_number += 1
            if line.strip():
                break
        snapshot = _parse_snapshot(line, where=f"{self.path.name}:{self.line_number}")
        self.played += 1
        return snapshot

    async def close(self) -> None:
        self._file.close()


def connect_reason(error: aiohttp.ClientConnectorError) -> str:
    """A short cause for a failed connection: 'connection refused', 'unknown host', ..."""
    cause = error.os_error
    if isinstance(cause, ConnectionRefusedError):
        return "connection refused"
    if isinstance(cause, socket.gaierror):
        return "unknown host"
    if isinstance(cause, TimeoutError):
        return "connect timed out"
    return (cause.strerror if cause is not None else None) or str(error)


def _parse_snapshot(body: bytes, where: str) -> dict[str, Any]:
    try:
        snapshot = json.loads(body)
    except ValueError as error:
        raise SourceError(f"bad stats at {where}: not JSON") from error
    if not isinstance(snapshot, dict):
        raise SourceError(f"bad stats at {where}: not a JSON object")
    return snapshot
