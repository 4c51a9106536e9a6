"""The console's command line, declared once for `ds4d console` and `python -m tui`.

Only argparse: `ds4d --help` builds this parser without importing Textual or aiohttp.
"""

from __future__ import annotations

import argparse

DEFAULT_URL = "http://127.0.0.1:8000"
DESCRIPTION = ("Operator console for a ds4d daemon: GPU memory, host RAM against its watermarks, tok/s, "
               "requests, prefix cache, experts and non-default config.")


def positive_seconds(value: str) -> float:
    seconds = float(value)
    if not seconds > 0:
        raise argparse.ArgumentTypeError("must be a positive number of seconds")
    return seconds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=DEFAULT_URL, help="daemon base URL (default: %(default)s)")
    parser.add_argument("--api-key", metavar="KEY", help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument(
        "--replay", metavar="FILE",
        help="play back a stats log (JSON Lines, as written by --stats-log) instead of polling",
    )
    parser.add_argument(
        "--interval", metavar="SECONDS", type=positive_seconds, default=1.0,
        help="seconds between polls, or between replayed snapshots (default: %(default)s)",
    )
