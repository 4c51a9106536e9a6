"""Defensive reads of a stats snapshot.

The console must outlive the daemon it watches, including daemons older or newer than itself, so it
trusts no field of GET /v1/ds4d/stats: every accessor walks a path of keys and list indices and gives
back None (or an empty container) when a step is missing, null, or of the wrong type. Panels read the
snapshot only through these functions.
"""

from __future__ import annotations

import math
from typing import Any

Key = str | int


def field(data: Any, *path: Key) -> Any:
    """The value at `path` inside nested dicts and lists, or None if any step is absent."""
    for key in path:
        if isinstance(key, int):
            if not isinstance(data, list) or not -len(data) <= key < len(data):
                return None
            data = data[key]
        elif isinstance(data, dict):
            data = data.get(key)
        else:
            return None
    return data


def number(data: Any, *path: Key) -> float | None:
    """A finite int or float at `path` as a float; booleans, strings and NaN read as None."""
    value = field(data, *path)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def integer(data: Any, *path: Key) -> int | None:
    """A number at `path` rounded down to an int, or None."""
    value = number(data, *path)
    return None if value is None else int(value)


def text(data: Any, *path: Key) -> str | None:
    """A string at `path`; numbers are shown as written, anything else reads as None."""
    value = field(data, *path)
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return None


def flag(data: Any, *path: Key) -> bool:
    """True only for a literal JSON true at `path`."""
    return field(data, *path) is True


def mapping(data: Any, *path: Key) -> dict[str, Any]:
    """A dict at `path`, or an empty dict."""
    value = field(data, *path)
    return value if isinstance(value, dict) else {}


def sequence(data: Any, *path: Key) -> list[Any]:
    """A list at `path`, or an empty list."""
    value = field(data, *path)
    return value if isinstance(value, list) else []


def present(data: Any, *path: Key) -> bool:
    """Whether `path` leads to a non-null value."""
    return field(data, *path) is not None
