"""Plain-Python parts of the console: defensive field reads, formatting, and the state it keeps."""

from __future__ import annotations

import pytest

from tui import fields
from tui.format import (
    bytes_text,
    clock_text,
    count_text,
    duration_text,
    ram_level,
    rate_text,
    segment_widths,
    sparkline,
)
from tui.state import ConsoleState

GIB = 1024**3


def test_field_walks_dicts_and_lists_and_gives_none_on_any_bad_step():
    data = {"gpus": [{"index": 0, "breakdown": {"kv": 5}}], "host": None, "n": "x"}
    assert fields.field(data, "gpus", 0, "breakdown", "kv") == 5
    assert fields.field(data, "gpus", 1, "breakdown") is None
    assert fields.field(data, "host", "rss_bytes") is None
    assert fields.field(data, "n", "deeper") is None
    assert fields.field(None, "anything") is None
    assert fields.field([1], "key") is None


@pytest.mark.parametrize("value", [None, "12", True, float("nan"), float("inf"), [1], {"a": 1}])
def test_number_rejects_everything_but_finite_numbers(value):
    assert fields.number({"x": value}, "x") is None


def test_number_integer_text_and_containers():
    assert fields.number({"x": 3}, "x") == 3.0
    assert fields.integer({"x": 3.9}, "x") == 3
    assert fields.text({"x": 8123}, "x") == "8123"
    assert fields.text({"x": False}, "x") is None
    assert fields.mapping({"x": [1]}, "x") == {}
    assert fields.sequence({"x": {"a": 1}}, "x") == []
    assert fields.flag({"debug": "yes"}, "debug") is False
    assert fields.flag({"debug": True}, "debug") is True
    assert not fields.present({"experts": None}, "experts")
    assert fields.present({"experts": {}}, "experts")


def test_units():
    assert bytes_text(0) == "0 B"
    assert bytes_text(1536) == "1.5 KiB"
    assert bytes_text(15 * GIB, short=True) == "15.0G"
    assert bytes_text(None) == "—"
    assert count_text(12345) == "12.3k"
    assert count_text(900) == "900"
    assert rate_text(812.0) == "812"
    assert rate_text(55.25) == "55.2"
    assert rate_text(0.0) == "0"
    assert rate_text(None) == "—"
    assert duration_text(3.4) == "3.4s"
    assert duration_text(125) == "2m05s"
    assert duration_text(3720) == "1h02m"
    assert duration_text(273600) == "3d04h"
    assert duration_text(-1) == "—"


def test_clock_text_is_utc_and_survives_absurd_times():
    assert clock_text(1764400000.0) == "07:06:40Z"
    assert clock_text(1e300) == "—"
    assert clock_text(None) == "—"


def test_sparkline_puts_newest_on_the_right_and_scales_to_the_ceiling():
    assert sparkline([0, 4, 8], 5) == "  ▁▄█"
    assert sparkline([None, 8], 2) == " █"
    assert sparkline([1, 2, 3, 4, 5, 6, 7, 8], 3) == "▆▇█"
    assert sparkline([50], 1, ceiling=100) == "▄"
    assert sparkline([], 4) == "    "
    assert sparkline([1], 0) == ""


def test_segment_widths_fill_exactly_in_proportion():
    assert segment_widths([1, 1, 2], 8) == [2, 2, 4]
    cells = segment_widths([41.5, 7.0, 62.0, 4.5, 25.4], 37)
    assert sum(cells) == 37
    assert cells[2] == max(cells)
    assert segment_widths([0, 0], 10) == [0, 0]


@pytest.mark.parametrize(
    ("available", "level"),
    [(100 * GIB, "ok"), (18 * GIB, "near"), (12 * GIB, "near"), (7 * GIB, "low"), (None, None)],
)
def test_ram_level_against_watermark_15_gib_and_floor_8_gib(available, level):
    assert ram_level(available, 15 * GIB, 8 * GIB) == level


def test_ram_level_without_limits_is_ok():
    assert ram_level(1, None, None) == "ok"


def frame(decode_tok_s, available, gpu_used=None):
    snapshot = {"throughput": {"decode_tok_s": decode_tok_s, "prefill_tok_s": 100.0},
                "host": {"mem_available_bytes": available, "rss_bytes": 10}}
    if gpu_used is not None:
        snapshot["gpus"] = [{"index": 0, "used_bytes": gpu_used}]
    return snapshot


def test_state_keeps_peaks_and_lows_until_reset():
    state = ConsoleState()
    for decode, available in ((50.0, 30.0), (80.0, 10.0), (20.0, 25.0)):
        state.apply(frame(decode, available))
    assert state.peaks["decode_tok_s"] == 80.0
    assert state.lows["mem_available_bytes"] == 10.0
    state.reset_peaks()
    assert state.peaks["decode_tok_s"] == 20.0
    assert state.lows["mem_available_bytes"] == 25.0
    assert list(state.decode_tok_s) == [50.0, 80.0, 20.0]


def test_state_failure_keeps_last_snapshot_and_counts_until_success():
    state = ConsoleState()
    state.apply(frame(1.0, 1.0))
    state.fail("unreachable")
    state.fail("unreachable")
    assert state.failures == 2 and state.error == "unreachable"
    assert state.snapshot is not None
    state.apply(frame(2.0, 1.0))
    assert state.failures == 0 and state.error is None


def test_gpu_history_lines_up_when_a_gpu_appears_late_or_disappears():
    state = ConsoleState()
    state.apply(frame(1.0, 1.0))
    state.apply(frame(1.0, 1.0, gpu_used=5.0))
    state.apply(frame(1.0, 1.0))
    assert list(state.gpu_used_bytes[0]) == [None, 5.0, None]
    assert state.peaks["gpu0_used_bytes"] == 5.0


def test_state_ignores_garbage_values():
    state = ConsoleState()
    state.apply({"throughput": {"decode_tok_s": "fast"}, "gpus": "none", "host": []})
    assert list(state.decode_tok_s) == [None]
    assert state.peaks == {} and state.gpu_used_bytes == {}
    assert state.frames == 1


def test_experts_panel_shows_the_host_ram_its_cold_experts_take():
    from tui.panels import ExpertsPanel
    from tui.state import ConsoleState

    state = ConsoleState()
    state.snapshot = {"experts": {"gpu_experts": 8256, "ram_experts": 2752, "pcie_gb_s": 49.1,
                                  "host_ram_bytes": 2752 * 13_369_344, "bytes_copied": 0, "bytes_skipped": 0,
                                  "skipped_transfers": 0}}
    first = ExpertsPanel(state).lines(120)[0].plain
    assert first.startswith("GPU 8256  RAM 2752 (34.3 GiB)  PCIe 49.1 GB/s"), first
    del state.snapshot["experts"]["host_ram_bytes"]  # an older daemon: no size shown
    assert ExpertsPanel(state).lines(120)[0].plain.startswith("GPU 8256  RAM 2752  PCIe")
