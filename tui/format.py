"""Plain text formatting for the console: units, sparklines, bars, and the RAM colour rule.

Everything here is a pure function of its arguments (no clock, no terminal), so panels render the same
snapshot to the same text every time.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

MISSING = "—"
SPARK_LEVELS = " ▁▂▃▄▅▆▇█"
BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")

# MemAvailable within this factor of the watermark counts as "near" it (yellow).
RAM_NEAR_WATERMARK_FACTOR = 1.25


def bytes_text(count: float | None, short: bool = False) -> str:
    """1536 -> '1.5 KiB' (or '1.5K' when short)."""
    if count is None:
        return MISSING
    value = float(count)
    sign = "-" if value < 0 else ""
    value = abs(value)
    unit = 0
    while value >= 1024 and unit < len(BYTE_UNITS) - 1:
        value /= 1024
        unit += 1
    digits = f"{value:.0f}" if unit == 0 else f"{value:.1f}"
    if short:
        return f"{sign}{digits}{BYTE_UNITS[unit][0]}"
    return f"{sign}{digits} {BYTE_UNITS[unit]}"


def count_text(count: float | None) -> str:
    """12345 -> '12.3k'; small counts stay exact."""
    if count is None:
        return MISSING
    value = float(count)
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= limit:
            return f"{value / limit:.1f}{suffix}"
    return f"{value:.0f}"


def rate_text(tok_s: float | None) -> str:
    """Tokens per second with three significant figures: '812', '55.3', '1.2k'."""
    if tok_s is None:
        return MISSING
    if abs(tok_s) >= 10_000:
        return count_text(tok_s)
    if abs(tok_s) >= 100:
        return f"{tok_s:.0f}"
    if abs(tok_s) >= 10:
        return f"{tok_s:.1f}"
    return f"{tok_s:.2f}" if tok_s else "0"


def percent_text(fraction: float | None) -> str:
    """0.375 -> '37.5%'."""
    if fraction is None:
        return MISSING
    return f"{fraction * 100:.1f}%"


def duration_text(seconds: float | None) -> str:
    """3.4 -> '3.4s', 125 -> '2m05s', 3720 -> '1h02m', 273600 -> '3d04h'."""
    if seconds is None or seconds < 0:
        return MISSING
    if seconds < 60:
        return f"{seconds:.1f}s"
    whole = int(seconds)
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"


def clock_text(epoch_s: float | None) -> str:
    """A snapshot's own timestamp as UTC 'HH:MM:SSZ' (never the local clock or zone)."""
    if epoch_s is None:
        return MISSING
    try:
        return time.strftime("%H:%M:%SZ", time.gmtime(epoch_s))
    except (OverflowError, OSError, ValueError):
        return MISSING


def sparkline(values: Iterable[float | None], width: int, ceiling: float | None = None) -> str:
    """The newest `width` values as block characters, newest at the right, padded on the left.

    Bars are scaled to `ceiling` when given (e.g. a GPU's total memory), else to the largest value
    shown. Gaps (None) are blank; zero and tiny values show the lowest bar, so a reading of 0
    differs from no reading.
    """
    if width <= 0:
        return ""
    shown = list(values)[-width:]
    known = [value for value in shown if value is not None]
    top = ceiling if ceiling and ceiling > 0 else max(known, default=0.0)
    chars = []
    for value in shown:
        if value is None or value <= 0 or top <= 0:
            chars.append(SPARK_LEVELS[0] if value is None else SPARK_LEVELS[1])
            continue
        level = round(min(value / top, 1.0) * (len(SPARK_LEVELS) - 1))
        chars.append(SPARK_LEVELS[max(level, 1)])
    return " " * (width - len(chars)) + "".join(chars)


def segment_widths(parts: Sequence[float], width: int) -> list[int]:
    """Split `width` cells between `parts` in proportion (largest remainder), summing to `width`."""
    total = sum(part for part in parts if part > 0)
    if width <= 0 or total <= 0:
        return [0] * len(parts)
    exact = [max(part, 0) / total * width for part in parts]
    cells = [int(share) for share in exact]
    by_remainder = sorted(range(len(parts)), key=lambda i: exact[i] - cells[i], reverse=True)
    for index in by_remainder[: width - sum(cells)]:
        cells[index] += 1
    return cells


def ram_level(
    available_bytes: float | None, watermark_bytes: float | None, floor_bytes: float | None
) -> str | None:
    """'ok', 'near' (at or within 25% above the watermark, or below it) or 'low' (below the floor).

    None when MemAvailable is unknown; with neither limit known, any reading is 'ok'.
    """
    if available_bytes is None:
        return None
    if floor_bytes is not None and available_bytes < floor_bytes:
        return "low"
    if watermark_bytes is not None and available_bytes < watermark_bytes * RAM_NEAR_WATERMARK_FACTOR:
        return "near"
    return "ok"
