"""SVG snapshots of the console over recorded stats (tests/tui/data), at 80x24 and larger.

Regenerate with `pytest tests/tui --snapshot-update` and look at the changed SVGs before committing.
Everything on screen comes from the replay (ages, uptime, the clock in UTC), so snapshots are stable.
"""

from __future__ import annotations

import pytest

from tests.tui.console_helpers import play, play_all, replay_app

SMALL = (80, 24)


@pytest.mark.parametrize(
    "scenario",
    ["healthy", "gpu_4x_v100", "cpu_only", "ram_below_watermark", "ram_below_floor", "swap_in_use",
     "debug_knob"],
)
def test_scenario_at_80x24(snap_compare, scenario):
    assert snap_compare(replay_app(scenario), terminal_size=SMALL, run_before=play_all)


def test_healthy_scales_up_to_160x48(snap_compare):
    assert snap_compare(replay_app("healthy"), terminal_size=(160, 48), run_before=play_all)


def test_help_screen(snap_compare):
    assert snap_compare(replay_app("healthy"), terminal_size=SMALL, run_before=play_all,
                        press=["question_mark"])


def test_paused_after_peaks_reset(snap_compare):
    assert snap_compare(replay_app("healthy"), terminal_size=SMALL, run_before=play_all,
                        press=["r", "p"])


def test_before_the_first_snapshot(snap_compare):
    """What the console shows when it has no numbers yet: dashes, never a crash."""
    app = replay_app("healthy")

    async def hold_first_poll(pilot) -> None:
        app.paused = True

    app.paused = True  # the first poll after the first paint is skipped
    assert snap_compare(app, terminal_size=SMALL, run_before=hold_first_poll)


@pytest.mark.parametrize(("frames", "label"), [(1, "all_null"), (2, "wrong_types"), (3, "partial")])
def test_missing_and_mistyped_fields(snap_compare, frames, label):
    async def run_before(pilot) -> None:
        await play(pilot, frames)

    assert snap_compare(replay_app("missing_fields"), terminal_size=SMALL, run_before=run_before)
