"""Engine counters and live throughput (written by the engine thread, read by the API).

Throughput is tokens over a sliding window of recent steps' wall time, so an
idle engine decays to 0 tok/s instead of showing its last burst forever.
"""

from __future__ import annotations

import threading
import time
from collections import deque


class EngineStats:
    WINDOW_S = 5.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.arrived_total = 0
        self.finished_total = 0
        self.steps_total = 0
        self.prefill_tokens_total = 0
        self.decode_tokens_total = 0
        self.preemptions_total = 0
        self._recent: deque[tuple[float, int, int]] = deque()  # (time, prefill, decode)

    def on_arrival(self) -> None:
        with self._lock:
            self.arrived_total += 1

    def on_finish(self) -> None:
        with self._lock:
            self.finished_total += 1

    def on_step(self, prefill_tokens: int, decode_tokens: int, seconds: float, preemptions: int) -> None:
        now = time.monotonic()
        with self._lock:
            self.steps_total += 1
            self.prefill_tokens_total += prefill_tokens
            self.decode_tokens_total += decode_tokens
            self.preemptions_total += preemptions
            self._recent.append((now, prefill_tokens, decode_tokens))
            while self._recent and now - self._recent[0][0] > self.WINDOW_S:
                self._recent.popleft()

    def throughput(self) -> tuple[float, float]:
        """(prefill tok/s, decode tok/s) over the recent window."""
        now = time.monotonic()
        with self._lock:
            recent = [r for r in self._recent if now - r[0] <= self.WINDOW_S]
        if not recent:
            return 0.0, 0.0
        span = max(now - recent[0][0], 1e-3) if len(recent) > 1 else self.WINDOW_S
        span = min(max(span, 1.0), self.WINDOW_S)
        return sum(r[1] for r in recent) / span, sum(r[2] for r in recent) / span
