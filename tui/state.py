"""What the console remembers between polls: the latest snapshot, histories for sparklines, peaks.

Plain Python with no Textual or network in it, so it is tested on its own. Peaks are the highest
reading seen since start or since the operator last reset them (for MemAvailable: the lowest).
"""

from __future__ import annotations

from collections import deque
from typing import Any

from tui import fields

HISTORY_LENGTH = 512

# Readings whose highest value is kept; each is a path into the snapshot.
PEAK_PATHS: dict[str, tuple[str, ...]] = {
    "prefill_tok_s": ("throughput", "prefill_tok_s"),
    "decode_tok_s": ("throughput", "decode_tok_s"),
    "rss_bytes": ("host", "rss_bytes"),
}
# Readings whose lowest value is kept.
LOW_PATHS: dict[str, tuple[str, ...]] = {
    "mem_available_bytes": ("host", "mem_available_bytes"),
}


def gpu_key(gpu: Any, position: int) -> int:
    """A GPU's index as the daemon reports it, else its position in the list."""
    index = fields.integer(gpu, "index")
    return position if index is None else index


class ConsoleState:
    """Accumulates snapshots (apply) and failed polls (fail)."""

    def __init__(self, history_length: int = HISTORY_LENGTH) -> None:
        self.history_length = history_length
        self.snapshot: dict[str, Any] | None = None
        self.error: str | None = None  # the last poll's failure, cleared by the next success
        self.failures = 0  # consecutive failed polls
        self.frames = 0  # snapshots applied
        self.ended = False  # a replay ran out of snapshots
        self.prefill_tok_s: deque[float | None] = deque(maxlen=history_length)
        self.decode_tok_s: deque[float | None] = deque(maxlen=history_length)
        self.mem_available_bytes: deque[float | None] = deque(maxlen=history_length)
        self.gpu_used_bytes: dict[int, deque[float | None]] = {}
        self.peaks: dict[str, float] = {}
        self.lows: dict[str, float] = {}

    def apply(self, snapshot: dict[str, Any]) -> None:
        """Take one successful poll."""
        self.snapshot = snapshot
        self.error = None
        self.failures = 0
        self.frames += 1
        self.prefill_tok_s.append(fields.number(snapshot, "throughput", "prefill_tok_s"))
        self.decode_tok_s.append(fields.number(snapshot, "throughput", "decode_tok_s"))
        self.mem_available_bytes.append(fields.number(snapshot, "host", "mem_available_bytes"))
        seen = set()
        for position, gpu in enumerate(fields.sequence(snapshot, "gpus")):
            key = gpu_key(gpu, position)
            seen.add(key)
            history = self.gpu_used_bytes.setdefault(key, self._padded_history())
            history.append(fields.number(gpu, "used_bytes"))
        for key, history in self.gpu_used_bytes.items():
            if key not in seen:
                history.append(None)
        self._track_peaks(snapshot)

    def fail(self, message: str) -> None:
        """Take one failed poll; the last good snapshot stays on screen."""
        self.error = message
        self.failures += 1

    def end(self) -> None:
        """The source has no more snapshots."""
        self.ended = True

    def reset_peaks(self) -> None:
        """Forget peaks and lows; they restart from the snapshot on screen."""
        self.peaks.clear()
        self.lows.clear()
        if self.snapshot is not None:
            self._track_peaks(self.snapshot)

    def gpu_peak_key(self, key: int) -> str:
        return f"gpu{key}_used_bytes"

    def _padded_history(self) -> deque[float | None]:
        """A new GPU's history starts level with the others, so sparklines line up in time."""
        history: deque[float | None] = deque(maxlen=self.history_length)
        history.extend([None] * min(self.frames - 1, self.history_length))
        return history

    def _track_peaks(self, snapshot: dict[str, Any]) -> None:
        readings = {name: fields.number(snapshot, *path) for name, path in PEAK_PATHS.items()}
        for position, gpu in enumerate(fields.sequence(snapshot, "gpus")):
            readings[self.gpu_peak_key(gpu_key(gpu, position))] = fields.number(gpu, "used_bytes")
        for name, value in readings.items():
            if value is not None:
                self.peaks[name] = max(value, self.peaks.get(name, value))
        for name, path in LOW_PATHS.items():
            value = fields.number(snapshot, *path)
            if value is not None:
                self.lows[name] = min(value, self.lows.get(name, value))
