"""Helpers for the console tests: replay apps, stepping them, and reading what a widget shows."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

from rich.console import Console
from textual.widget import Widget

from tui.app import ConsoleApp
from tui.source import ReplayStatsSource

DATA = Path(__file__).parent / "data"
NEVER_S = 3600.0  # a poll interval no test waits for: replays advance only when a test steps them
PATIENCE_S = 120.0  # how long a test waits for a timer-driven change before it fails: far past any busy machine


def replay_app(name: str, interval_s: float = NEVER_S) -> ConsoleApp:
    """A console over tests/tui/data/<name>.jsonl; its first snapshot is shown after the first paint."""
    return ConsoleApp(ReplayStatsSource(DATA / f"{name}.jsonl"), interval_s=interval_s)


async def play_all(pilot) -> None:
    """Let the first poll land, then step the replay to its end (usable as snap_compare's run_before)."""
    app = pilot.app
    await pilot.pause()
    while not app.state.ended:
        await app.step()
    await pilot.pause()


async def play(pilot, frames: int) -> None:
    """Let the first poll land, then step `frames` more snapshots."""
    await pilot.pause()
    for _ in range(frames):
        await pilot.app.step()
    await pilot.pause()


async def wait_until(pilot, condition, step_s: float = 0.02, patience_s: float = PATIENCE_S) -> bool:
    """Let the app run until `condition()` holds; False if it still does not after `patience_s`.

    Timers and polls land when the event loop gets to them, so a test waits for what it needs to see, never for a
    fixed time: a loaded machine only makes the wait longer.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + patience_s
    while not condition():
        if loop.time() > deadline:
            return False
        await pilot.pause(step_s)
    return True


def shown(widget: Widget) -> str:
    """The text a widget renders at its current width, plus its border title."""
    console = Console(width=max(widget.content_size.width, 1), file=io.StringIO(), record=True,
                      color_system=None, legacy_windows=False)
    console.print(widget.render())
    return f"{widget.border_title or ''}\n{console.export_text()}"
