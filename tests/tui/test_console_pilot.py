"""The console driven through Textual's Pilot: keys, replay stepping, bad data, unreachable daemons."""

from __future__ import annotations

import asyncio

from tests.tui.console_helpers import DATA, play, play_all, replay_app, shown, wait_until
from tui.app import ConsoleApp, HelpScreen
from tui.panels import Panel
from tui.source import HttpStatsSource, ReplayStatsSource
from tui.widgets import StatusLine


def run(coroutine) -> None:
    asyncio.run(coroutine)


def everything_shown(app: ConsoleApp) -> str:
    """Render every panel now (raising if any cannot), and return all their text."""
    widgets = [app.query_one(StatusLine), app.query_one("#config"), app.query_one("#requests-table")]
    return "\n".join(shown(widget) for widget in [*widgets, *app.query(Panel)])


def test_first_snapshot_is_shown_after_start():
    async def body():
        app = replay_app("cpu_only")
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.pause()
            assert app.state.frames == 1
            assert "no GPU" in shown(app.query_one("#gpu"))
            status = shown(app.query_one(StatusLine))
            assert "smollm2-135m" in status and "replay cpu_only.jsonl #1" in status
            assert not app.query_one("#experts").display  # "experts": null
            assert "chatcmpl-ab12" in shown(app.query_one("#requests-table"))

    run(body())


def test_replay_plays_at_the_interval_and_stops_at_the_end():
    async def body():
        app = replay_app("cpu_only", interval_s=0.01)
        async with app.run_test() as pilot:
            assert await wait_until(pilot, lambda: app.state.ended), app.state.frames
            assert app.state.frames == 24
            assert "#24 (end)" in shown(app.query_one(StatusLine))
            assert app.return_code is None  # the last snapshot stays on screen

    run(body())


def test_p_pauses_updates_and_resumes_them():
    async def body():
        app = replay_app("healthy")
        async with app.run_test() as pilot:
            await play(pilot, 2)
            await pilot.press("p")
            assert app.paused and "PAUSED" in shown(app.query_one(StatusLine))
            before = everything_shown(app)
            for _ in range(3):
                await app.poll()  # what the timer calls
            await pilot.pause()
            assert app.state.frames == 3
            assert everything_shown(app) == before
            await pilot.press("p")
            await app.poll()
            assert app.state.frames == 4
            assert "PAUSED" not in shown(app.query_one(StatusLine))

    run(body())


def test_pause_holds_the_timer_too():
    async def body():
        app = replay_app("healthy", interval_s=0.02)
        async with app.run_test() as pilot:
            assert await wait_until(pilot, lambda: app.state.frames >= 2), app.state.frames
            await pilot.press("p")
            frames = app.state.frames
            await pilot.pause(0.3)  # fifteen intervals: any tick that lands while paused must show nothing
            assert app.state.frames == frames
            await pilot.press("p")
            assert await wait_until(pilot, lambda: app.state.frames > frames), app.state.frames

    run(body())


def test_r_resets_peaks_to_the_current_readings():
    async def body():
        app = replay_app("healthy")
        async with app.run_test(size=(80, 24)) as pilot:
            await play_all(pilot)
            throughput = app.query_one("#throughput")
            assert "peak 53.9" in shown(throughput)  # the highest decode tok/s in the replay
            assert "45.9 tok/s" in shown(throughput)  # the last one
            await pilot.press("r")
            assert "peak 45.9" in shown(throughput)
            assert app.state.peaks["decode_tok_s"] == 45.9
            assert app.state.lows["mem_available_bytes"] == app.state.snapshot["host"][
                "mem_available_bytes"]

    run(body())


def test_question_mark_shows_help_and_escape_closes_it():
    async def body():
        app = replay_app("healthy")
        async with app.run_test() as pilot:
            await pilot.press("question_mark")
            assert isinstance(app.screen, HelpScreen)
            help_text = str(app.screen.query_one("Static").render())
            assert "reset peaks" in help_text and "watermark" in help_text
            await pilot.press("escape")
            assert not isinstance(app.screen, HelpScreen)
            await pilot.press("question_mark", "question_mark")
            assert not isinstance(app.screen, HelpScreen)

    run(body())


def test_q_exits_with_status_0_even_from_help():
    async def body():
        for keys in (["q"], ["question_mark", "q"]):
            app = replay_app("healthy")
            async with app.run_test() as pilot:
                await pilot.pause()
                await pilot.press(*keys)
                await pilot.pause()
                assert app.return_code == 0

    run(body())


def test_unreachable_daemon_is_reported_and_retried(closed_port):
    async def body():
        app = ConsoleApp(HttpStatsSource(f"http://127.0.0.1:{closed_port}"), interval_s=0.05)
        async with app.run_test(size=(80, 24)) as pilot:
            assert await wait_until(pilot, lambda: app.state.failures >= 3), app.state.failures
            status = shown(app.query_one(StatusLine))
            assert f"127.0.0.1:{closed_port} unreachable (connection refused)" in status
            assert "every 0.05s" in status
            assert app.return_code is None
            everything_shown(app)  # panels with no snapshot at all render dashes

    run(body())


def test_fields_missing_null_or_mistyped_never_crash():
    async def body():
        app = replay_app("missing_fields")
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.pause()
            errors = []
            while not app.state.ended:
                everything_shown(app)
                await app.step()
                await pilot.pause()
                if app.state.error:
                    errors.append(app.state.error)
            assert errors == ["bad stats at missing_fields.jsonl:5: not JSON",
                              "bad stats at missing_fields.jsonl:6: not a JSON object"]
            assert app.state.frames == 5
            text = everything_shown(app)
            assert "deepseek-v4-flash" in text and app.return_code is None

    run(body())


def test_a_log_recorded_by_the_daemon_plays_back():
    async def body():
        app = replay_app("recorded_cpu_daemon")
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.pause()
            running_seen = 0
            while not app.state.ended:
                await app.step()
                assert app.state.error is None
                running_seen = max(running_seen, app.state.snapshot["requests"]["running"])
            await pilot.pause()
            assert app.state.frames == 49 and running_seen == 3
            assert "no GPU" in shown(app.query_one("#gpu"))
            assert "model_family" not in shown(app.query_one("#config"))  # shown as "family"

    run(body())


def test_every_replay_renders_on_a_wide_terminal():
    """80x24 is covered by the snapshots; this takes each replay through the wide layouts."""

    async def body():
        for name in sorted(path.stem for path in DATA.glob("*.jsonl")):
            app = ConsoleApp(ReplayStatsSource(DATA / f"{name}.jsonl"), interval_s=3600)
            async with app.run_test(size=(200, 60)) as pilot:
                await play_all(pilot)
                everything_shown(app)

    run(body())
