"""Incremental detokenisation and stop strings (asyncio side).

Text is produced by decoding a small window of recent ids and emitting what
grew, holding back while the tail is an incomplete UTF-8 sequence (U+FFFD).
Stop strings are matched on the text; output that could still be the start of
a stop string is held back until it is decided, so a stop string never leaks
into the streamed content.
"""

from __future__ import annotations

from collections.abc import Sequence

from ds4d.contracts import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self.ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def add(self, new_ids: Sequence[int]) -> str:
        self.ids.extend(new_ids)
        dec = self.tokenizer.decode
        prefix = dec(self.ids[self._prefix_offset:self._read_offset], skip_special_tokens=self.skip_special)
        full = dec(self.ids[self._prefix_offset:], skip_special_tokens=self.skip_special)
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        new_text = full[len(prefix):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.ids)
        return new_text

    def flush(self) -> str:
        """Whatever is pending at the end (an incomplete character decodes as U+FFFD)."""
        dec = self.tokenizer.decode
        prefix = dec(self.ids[self._prefix_offset:self._read_offset], skip_special_tokens=self.skip_special)
        full = dec(self.ids[self._prefix_offset:], skip_special_tokens=self.skip_special)
        self._prefix_offset = self._read_offset = len(self.ids)
        return full[len(prefix):] if len(full) > len(prefix) else ""


class StopMatcher:
    """Feeds text; returns (text safe to emit, stopped)."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stops:
            return text, False
        buf = self._held + text
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self._held = ""
            self.stopped = True
            return buf[:cut], True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), 0, -1):
                if buf.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        self._held = buf[len(buf) - hold:] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.stopped else held
