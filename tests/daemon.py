"""Start a real ds4d daemon on 127.0.0.1 with an ephemeral port, for HTTP tests."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LINE = re.compile(r"ds4d (ready|listening) on http://127\.0\.0\.1:(\d+)")


class Daemon:
    """``wait_for="listening"`` returns as soon as the listener is up (the model still loading);
    call :meth:`wait_ready` later.  The default waits for "ds4d ready on ..."."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, startup_timeout: float = 180.0,
                 wait_for: str = "ready", launcher: list[str] | None = None) -> None:
        """``launcher``: what runs ``-m ds4d.cli serve ...`` (default this Python; e.g. torchrun)."""
        self.args = ["--host", "127.0.0.1", "--port", "0", *args]
        self.log_lines: list[str] = []
        self.startup_timeout = startup_timeout
        full_env = {**os.environ, "DS4D_CONFIG": str(REPO / "etc" / "ds4d.toml"), "PYTHONUNBUFFERED": "1",
                    **(env or {})}
        self.proc = subprocess.Popen(
            [*(launcher or [sys.executable]), "-m", "ds4d.cli", "serve", *self.args], cwd=REPO, env=full_env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.port: int | None = None
        self._events = {"listening": threading.Event(), "ready": threading.Event()}
        self.seen: set[str] = set()

        def reader() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.log_lines.append(line.rstrip("\n"))
                m = LINE.search(line)
                if m:
                    self.port = int(m.group(2))
                    self.seen.add(m.group(1))
                    self._events[m.group(1)].set()
            for event in self._events.values():
                event.set()

        threading.Thread(target=reader, daemon=True).start()
        self._wait(wait_for)

    def _wait(self, what: str) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while not self._events[what].wait(0.2):
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"daemon not {what}:\n" + self.log)
        if what not in self.seen:
            raise RuntimeError("daemon exited during start:\n" + self.log)

    def wait_ready(self) -> None:
        self._wait("ready")

    @property
    def log(self) -> str:
        return "\n".join(self.log_lines[-200:])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
