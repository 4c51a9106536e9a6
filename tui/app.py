"""The operator console: a Textual app that polls a stats source on a timer and redraws its panels.

`main()` is what `python -m tui` runs and `run()` what `ds4d console` runs, both with the options of
tui/cli.py. The app only talks to a StatsSource (HTTP or replay); it never imports the daemon.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import ClassVar

from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.css.query import NoMatches
from textual.screen import ModalScreen
from textual.widgets import Footer, Static

from tui import fields
from tui.cli import DESCRIPTION, add_arguments
from tui.format import count_text
from tui.panels import CachePanel, ExpertsPanel, GpuPanel, HostPanel, Panel, ThroughputPanel
from tui.source import HttpStatsSource, ReplayStatsSource, SourceError, StatsSource
from tui.state import HISTORY_LENGTH, ConsoleState
from tui.widgets import ConfigBanner, RequestsTable, StatusLine

HELP_TEXT = """\
[b]keys[/b]  [b]q[/b] quit  [b]p[/b] pause/resume updates  [b]r[/b] reset peaks  [b]?[/b]/[b]esc[/b] close help

[b]host RAM[/b]  MemAvailable against the daemon's watermark and floor:
  [green]green[/] well above the watermark   [yellow]yellow[/] within 25% of it, or below it
  [red]red[/] below the floor (new work waits or is refused)
  swap shows [red]red[/] when the daemon itself has pages in swap
  bar: [yellow]┃[/] watermark [red]┃[/] floor; its full scale is printed at its end and
  zooms in to twice the watermark when RAM runs low
  min/lowest: lowest MemAvailable since start or the last reset

[b]GPU memory[/b]  used of total, its history, and what the memory holds:
  [blue]■[/]weights [magenta]■[/]kv [cyan]■[/]experts [yellow]■[/]prefix cache ■other [bright_black]░[/]free

[b]experts[/b]  experts placed on GPU / in RAM, measured PCIe GB/s, bytes copied,
  and transfers skipped because no token was routed to the expert

[b]requests[/b]  prompt, reused (prefix cache) and generated tokens;
  prefill k/N is the chunk being computed; ages are the daemon's own

[b]config[/b]  knobs that differ from their defaults, with where they were set;
  [bold red]DEBUG[/] knobs are debugging switches: not for production\
"""


class HelpScreen(ModalScreen[None]):
    """Key and colour reference over the console."""

    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > Static {
        width: auto; max-width: 100%; height: auto; max-height: 100%;
        border: round $primary; background: $surface; padding: 0 1;
    }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "dismiss", "close"),
        Binding("question_mark", "dismiss", "close", key_display="?"),
        Binding("q", "app.quit", "quit"),  # a modal screen hides the app's own bindings
    ]

    def compose(self) -> ComposeResult:
        yield Static(HELP_TEXT)


class ConsoleApp(App[int]):
    """Polls `source` every `interval_s` seconds; the first poll happens right after the first paint."""

    TITLE = "ds4d console"
    ENABLE_COMMAND_PALETTE = False
    CSS = """
    #panels { height: auto; }
    #left, #right { width: 1fr; height: auto; }
    #requests {
        height: 1fr; min-height: 3;
        border-top: solid $primary; border-title-style: bold; border-title-color: $text;
    }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "quit", "quit"),
        Binding("p", "toggle_pause", "pause"),
        Binding("r", "reset_peaks", "reset peaks"),
        Binding("question_mark", "help", "help", key_display="?"),
    ]

    def __init__(
        self, source: StatsSource, interval_s: float = 1.0, history_length: int = HISTORY_LENGTH
    ) -> None:
        super().__init__()
        self.source = source
        self.interval_s = interval_s
        self.state = ConsoleState(history_length)
        self.paused = False
        self._poll_lock = asyncio.Lock()

    def compose(self) -> ComposeResult:
        yield StatusLine(self.state, self.source, self.interval_s)
        yield ConfigBanner(self.state)
        with Horizontal(id="panels"):
            with Vertical(id="left"):
                yield GpuPanel(self.state, id="gpu")
                yield ExpertsPanel(self.state, id="experts")
                yield ThroughputPanel(self.state, id="throughput")
            with Vertical(id="right"):
                yield HostPanel(self.state, id="host")
                yield CachePanel(self.state, id="cache")
        with VerticalScroll(id="requests"):
            yield RequestsTable(self.state)
        yield Footer()

    def on_mount(self) -> None:
        self.redraw()
        self.call_after_refresh(self.poll)
        self.set_interval(self.interval_s, self.poll)

    async def on_unmount(self) -> None:
        await self.source.close()

    async def poll(self) -> None:
        """One timer tick: fetch and show the next snapshot, unless paused or the replay is over."""
        if not self.paused and not self.state.ended:
            await self.step()

    async def step(self) -> None:
        """Fetch one snapshot regardless of pause (tests drive replays with this)."""
        async with self._poll_lock:
            try:
                snapshot = await self.source.fetch()
            except SourceError as error:
                self.state.fail(str(error))
            except Exception as error:  # noqa: BLE001 - a bad poll is shown, never fatal
                self.state.fail(f"poll failed: {error!r}")
            else:
                if snapshot is None:
                    self.state.end()
                else:
                    self.state.apply(snapshot)
        if self.return_code is None:  # a fetch may finish after the operator quit
            self.redraw()

    def redraw(self) -> None:
        try:
            self._redraw()
        except NoMatches:  # a poll that ended while the app closes: its widgets are (partly) gone
            pass

    def _redraw(self) -> None:
        snapshot = self.state.snapshot
        self.query_one("#experts").display = fields.present(snapshot, "experts")
        status = self.query_one(StatusLine)
        status.paused = self.paused
        status.refresh()
        self.query_one(ConfigBanner).refresh(layout=True)
        for panel in self.query(Panel):
            panel.update_title()
            panel.refresh(layout=True)
        self.query_one(RequestsTable).refresh(layout=True)
        requests = self.query_one("#requests")
        requests.border_title = requests_title(snapshot)

    def action_toggle_pause(self) -> None:
        self.paused = not self.paused
        self.redraw()

    def action_reset_peaks(self) -> None:
        self.state.reset_peaks()
        self.redraw()

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())


def requests_title(snapshot: object) -> str:
    requests = fields.mapping(snapshot, "requests")
    counts = [f"{count_text(fields.number(requests, key))} {key}"
              for key in ("running", "waiting")]
    counts.append(f"{count_text(fields.number(requests, 'finished_total'))} finished")
    return "requests  " + " · ".join(counts)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ds4d console", description=DESCRIPTION)
    add_arguments(parser)
    return parser


def build_app(args: argparse.Namespace) -> ConsoleApp:
    """The console for parsed arguments; raises OSError if the replay file cannot be opened."""
    source: StatsSource
    if args.replay:
        source = ReplayStatsSource(args.replay)
    else:
        source = HttpStatsSource(args.url, api_key=args.api_key)
    return ConsoleApp(source, interval_s=args.interval)


def main(argv: list[str] | None = None) -> int:
    """`python -m tui`: parse the command line and run the console; returns the process exit status."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_request:  # --help, or a usage error already printed
        return exit_request.code if isinstance(exit_request.code, int) else 2
    return run(args)


def run(args: argparse.Namespace) -> int:
    """Run the console for parsed arguments (`ds4d console` parses them itself)."""
    try:
        app = build_app(args)
    except OSError as error:
        print(f"ds4d console: cannot read {args.replay}: {error.strerror}", file=sys.stderr)
        return 2
    app.run()
    return app.return_code or 0
