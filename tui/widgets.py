"""The console's chrome around the panels: status line, plugins/config banner, requests table.

Like the panels, these read the snapshot only through tui.fields and render the shared ConsoleState.
"""

from __future__ import annotations

import json
from typing import Any

from rich.console import RenderableType
from rich.table import Table
from rich.text import Text
from textual.widget import Widget

from tui import fields
from tui.format import MISSING, clock_text, count_text, duration_text, rate_text
from tui.source import StatsSource
from tui.state import ConsoleState

STATE_STYLES = {"ready": "bold green", "loading": "bold yellow", "draining": "bold yellow", "dead": "bold red"}
# Short names for the plugin kinds in the banner; kinds not listed show under their own name.
PLUGIN_LABELS = {"model_family": "family", "chat_encoder": "encoder", "reasoning_parser": "reasoning",
                 "tool_parser": "tool", "scheduler_policy": "scheduler"}


class StatusLine(Widget):
    """One line: the daemon's state and model, and where the numbers come from."""

    DEFAULT_CSS = """
    StatusLine { height: 1; background: $panel; text-wrap: nowrap; text-overflow: ellipsis; }
    """

    def __init__(self, state: ConsoleState, source: StatsSource, interval_s: float) -> None:
        super().__init__(id="status")
        self.state = state
        self.source = source
        self.interval_s = interval_s
        self.paused = False

    def render(self) -> RenderableType:
        snapshot = self.state.snapshot
        line = Text()
        if self.paused:
            line.append(" PAUSED ", style="bold black on yellow")
            line.append(" ")
        if self.state.error is not None:
            line.append(f"● {self.state.error}", style="bold red")
            line.append(f" · retry {self.state.failures} every {self.interval_s:g}s  ", style="red")
        elif snapshot is None:
            line.append("● waiting for stats  ", style="yellow")
        if snapshot is not None:
            if self.state.error is not None:
                line.append("last seen ", style="dim")
            daemon_state = fields.text(snapshot, "state") or "unknown"
            line.append(f"● {daemon_state}", style=STATE_STYLES.get(daemon_state, "bold"))
            model = fields.mapping(snapshot, "model")
            name = fields.text(model, "served_name") or fields.text(model, "name") or MISSING
            line.append(f"  {name}  ", style="bold")
        line.append(self.source.description, style="dim")
        if snapshot is not None:
            line.append_text(self.details(snapshot))
        line.truncate(max(self.content_size.width, 1), overflow="ellipsis")
        return line

    def details(self, snapshot: Any) -> Text:
        """Uptime, dtype, device, context length, version, and the snapshot's own time (UTC)."""
        model = fields.mapping(snapshot, "model")
        context = fields.integer(model, "max_context_tokens")
        words = [fields.text(model, "dtype"), fields.text(model, "device"),
                 None if context is None else f"ctx {context}"]
        details = Text(f"  up {duration_text(fields.number(snapshot, 'uptime_s'))}  ")
        details.append(" ".join(word for word in words if word))
        version = fields.text(snapshot, "version") or MISSING
        details.append(f"  ds4d {version} at {clock_text(fields.number(snapshot, 'time'))}", style="dim")
        return details


class ConfigBanner(Widget):
    """Loaded plugins, and every config knob that differs from its default (debug knobs in red)."""

    DEFAULT_CSS = "ConfigBanner { height: auto; }"

    def __init__(self, state: ConsoleState) -> None:
        super().__init__(id="config")
        self.state = state

    def render(self) -> RenderableType:
        snapshot = self.state.snapshot
        plugins = Text("plugins ", style="bold")
        loaded = fields.mapping(snapshot, "plugins")
        for key, value in loaded.items():
            plugins.append(f"{PLUGIN_LABELS.get(key, key)}=", style="dim")
            plugins.append(f"{knob_value(value)} ")
        if not loaded:
            plugins.append(MISSING, style="dim")
        knobs = fields.mapping(snapshot, "config", "non_default")
        changed = Text("config  ", style="bold")
        if not knobs:
            changed.append("defaults" if snapshot is not None else MISSING, style="dim")
        ordered = sorted(knobs.items(), key=lambda item: (not fields.flag(item[1], "debug"), item[0]))
        for name, knob in ordered:
            debug = fields.flag(knob, "debug")
            value = knob_value(fields.field(knob, "value"))
            changed.append(f"{'DEBUG ' if debug else ''}{name}={value}",
                           style="bold red" if debug else "bold")
            source = fields.text(knob, "source")
            changed.append(f" ({source}) " if source else " ", style="red" if debug else "dim")
        return Text("\n").join([plugins, changed])


class RequestsTable(Widget):
    """Active requests, in the daemon's order."""

    DEFAULT_CSS = "RequestsTable { height: auto; }"

    def __init__(self, state: ConsoleState) -> None:
        super().__init__(id="requests-table")
        self.state = state

    def render(self) -> RenderableType:
        active = fields.sequence(self.state.snapshot, "requests", "active")
        if not active:
            return Text("no active requests", style="dim")
        table = Table(box=None, pad_edge=False, header_style="bold", padding=(0, 1))
        table.add_column("id", no_wrap=True, overflow="ellipsis", min_width=8)
        table.add_column("phase", no_wrap=True, min_width=8)
        for heading in ("prompt", "reused", "gen", "tok/s", "age"):
            table.add_column(heading, justify="right", no_wrap=True)
        for request in active:
            table.add_row(
                fields.text(request, "id") or MISSING,
                phase_text(request),
                count_text(fields.number(request, "prompt_tokens")),
                count_text(fields.number(request, "cached_tokens")),
                count_text(fields.number(request, "generated_tokens")),
                rate_text(fields.number(request, "tok_s")),
                duration_text(fields.number(request, "age_s")),
            )
        return table


def phase_text(request: Any) -> Text:
    """'queued', 'prefill k/N' (chunks) or 'decode'; an unknown phase is shown as sent."""
    phase = fields.text(request, "phase") or MISSING
    if phase == "prefill":
        chunk = fields.integer(request, "prefill_chunk")
        chunks = fields.integer(request, "prefill_chunks")
        progress = f" {MISSING if chunk is None else chunk}/{MISSING if chunks is None else chunks}"
        return Text("prefill" + progress, style="cyan")
    return Text(phase, style={"decode": "green", "queued": "yellow"}.get(phase, ""))


def knob_value(value: Any) -> str:
    """A config value or plugin name as the operator would type it."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return ",".join(value)
    return json.dumps(value, separators=(",", ":"), sort_keys=True)
