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


class Daemon:
    def __init__(self, *args: str, env: dict[str, str] | None = None, startup_timeout: float = 180.0) -> None:
        self.args = ["--host", "127.0.0.1", "--port", "0", *args]
        self.log_lines: list[str] = []
        full_env = {**os.environ, "DS4D_CONFIG": str(REPO / "etc" / "ds4d.toml"), "PYTHONUNBUFFERED": "1",
                    **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ds4d.cli", "serve", *self.args], cwd=REPO, env=full_env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.port: int | None = None
        ready = threading.Event()

        def reader() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.log_lines.append(line.rstrip("\n"))
                m = re.search(r"ds4d ready on http://127\.0\.0\.1:(\d+)", line)
                if m:
                    self.port = int(m.group(1))
                    ready.set()
            ready.set()

        threading.Thread(target=reader, daemon=True).start()
        deadline = time.monotonic() + startup_timeout
        while not ready.wait(0.2):
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("daemon did not start:\n" + self.log)
        if self.port is None:
            raise RuntimeError("daemon exited during start:\n" + self.log)

    @property
    def log(self) -> str:
        return "\n".join(self.log_lines[-200:])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
