"""The console's panels. Each renders the shared ConsoleState to text at its current width.

Panels read the snapshot only through tui.fields, so a missing or null field shows as a dash and never
raises. Wider panels spell units out; narrow ones (an 80-column terminal) use short forms.
"""

from __future__ import annotations

import textwrap
from functools import partial
from typing import Any

from rich.console import RenderableType
from rich.text import Text
from textual.widget import Widget

from tui import fields
from tui.format import (
    MISSING,
    bytes_text,
    count_text,
    percent_text,
    ram_level,
    rate_text,
    segment_widths,
    sparkline,
)
from tui.state import ConsoleState, gpu_key

WIDE = 50  # panels at least this wide spell units out

RAM_STYLES = {"ok": "green", "near": "yellow", "low": "bold red", None: ""}
# GPU memory breakdown: snapshot key, legend label, bar style.
BREAKDOWN = (
    ("weights", "weights", "blue"),
    ("kv", "kv", "magenta"),
    ("experts", "experts", "cyan"),
    ("prefix_cache", "prefix", "yellow"),
)
FREE_STYLE = "bright_black"
TIER_ORDER = ("gpu", "ram", "disk")


def lines_text(lines: list[Text], width: int) -> Text:
    """Join lines, each cut to `width` with an ellipsis."""
    for line in lines:
        line.truncate(max(width, 1), overflow="ellipsis")
    return Text("\n").join(lines)


class Panel(Widget):
    """A titled block of lines computed from the state on every refresh."""

    DEFAULT_CSS = """
    Panel {
        height: auto;
        border-top: solid $primary;
        border-title-color: $text;
        border-title-style: bold;
        padding: 0 1 0 0;
        text-wrap: nowrap;
        text-overflow: ellipsis;
    }
    """
    TITLE = ""

    def __init__(self, state: ConsoleState, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.state = state
        self.border_title = self.TITLE

    def update_title(self) -> None:
        """Titles may carry warnings (e.g. host RAM below its watermark); set before each redraw."""
        self.border_title = self.title()

    def title(self) -> Text | str:
        return self.TITLE

    @property
    def snapshot(self) -> dict[str, Any] | None:
        return self.state.snapshot

    def render(self) -> RenderableType:
        width = max(self.content_size.width, 1)
        return lines_text(self.lines(width), width)

    def lines(self, width: int) -> list[Text]:
        raise NotImplementedError

    def size_text(self, count: float | None, width: int) -> str:
        return bytes_text(count, short=width < WIDE)


class GpuPanel(Panel):
    """Per-GPU memory: used of total, a history sparkline, and what the memory holds.

    One GPU gets four lines: heading, sparkline, breakdown bar, legend with sizes. Several GPUs get
    one line each (used/total, then sparkline and bar side by side) under a shared colour key, so
    four GPUs still fit an 80x24 terminal.
    """

    TITLE = "GPU memory"

    def title(self) -> str:
        gpus = fields.sequence(self.snapshot, "gpus")
        names = {fields.text(gpu, "name") or "GPU" for gpu in gpus}
        if len(gpus) > 1 and len(names) == 1:
            return f"{self.TITLE} {len(gpus)}× {names.pop()}"
        return self.TITLE

    def lines(self, width: int) -> list[Text]:
        gpus = fields.field(self.snapshot, "gpus")
        if not isinstance(gpus, list):
            return [Text(MISSING, style="dim")]
        if not gpus:
            return [Text("no GPU", style="dim")]
        if len(gpus) > 1:
            rows = [self.compact_row(gpu, position, width) for position, gpu in enumerate(gpus)]
            return rows + self.legend(None, width)
        gpu = gpus[0]
        key = gpu_key(gpu, 0)
        total = fields.number(gpu, "total_bytes")
        heading = Text(f"{key} {fields.text(gpu, 'name') or 'GPU'}  ", style="bold")
        heading.append_text(self.usage(gpu, width))
        history = self.state.gpu_used_bytes.get(key, [])
        peak = self.state.peaks.get(self.state.gpu_peak_key(key))
        out = [heading, Text(sparkline(history, width, ceiling=total), style="green"),
               self.breakdown_bar(gpu, total, width)]
        return out + self.legend(gpu, width, Text(f"peak {self.size_text(peak, width)}", style="dim"))

    def usage(self, gpu: Any, width: int) -> Text:
        used = fields.number(gpu, "used_bytes")
        total = fields.number(gpu, "total_bytes")
        usage = Text(f"{self.size_text(used, width)}/{self.size_text(total, width)}")
        if used is not None and total:
            usage.append(f" {percent_text(used / total):>6}")
        return usage

    def compact_row(self, gpu: Any, position: int, width: int) -> Text:
        key = gpu_key(gpu, position)
        total = fields.number(gpu, "total_bytes")
        row = Text(f"{key} ", style="bold")
        if width >= 2 * WIDE:
            row.append(f"{fields.text(gpu, 'name') or 'GPU'}  ", style="bold")
        row.append_text(self.usage(gpu, width))
        room = width - row.cell_len - 2
        if room >= 6:
            spark_width = room // 3
            history = self.state.gpu_used_bytes.get(key, [])
            row.append(" " + sparkline(history, spark_width, ceiling=total), style="green")
            row.append(" ")
            row.append_text(self.breakdown_bar(gpu, total, room - spark_width))
        return row

    def breakdown_bar(self, gpu: Any, total: float | None, width: int) -> Text:
        """A stacked bar of the breakdown; 'free' (or what the parts do not cover) is shaded."""
        parts = [fields.number(gpu, "breakdown", key) or 0.0 for key, _, _ in BREAKDOWN]
        free = fields.number(gpu, "breakdown", "free")
        if free is None:
            used = fields.number(gpu, "used_bytes")
            free = max((total or 0.0) - max(used or 0.0, sum(parts)), 0.0)
        other = max((total or 0.0) - sum(parts) - free, 0.0)  # used but not broken down
        cells = segment_widths([*parts, other, free], width)
        bar = Text()
        for (_, _, style), count in zip(BREAKDOWN, cells, strict=False):
            bar.append("█" * count, style=style)
        bar.append("█" * cells[-2], style="white")
        bar.append("░" * cells[-1], style=FREE_STYLE)
        return bar

    def legend(self, gpu: Any | None, width: int, tail: Text | None = None) -> list[Text]:
        """Colour key, with sizes when one GPU is shown; items wrap onto as many lines as needed."""
        items = []
        for key, label, style in (*BREAKDOWN, ("free", "free", FREE_STYLE)):
            item = Text("■", style=style)
            item.append(label)
            if gpu is not None:
                item.append(f" {self.size_text(fields.number(gpu, 'breakdown', key), width)}")
            items.append(item)
        if tail is not None:
            items.append(tail)
        out = [Text()]
        for item in items:
            if out[-1].cell_len and out[-1].cell_len + 1 + item.cell_len > width:
                out.append(Text())
            if out[-1].cell_len:
                out[-1].append(" ")
            out[-1].append_text(item)
        return out


class HostPanel(Panel):
    """Host RAM against the daemon's watermark and floor, the daemon's RSS, pinned memory and swap."""

    TITLE = "host RAM"

    def title(self) -> Text:
        host = fields.mapping(self.snapshot, "host")
        available = fields.number(host, "mem_available_bytes")
        watermark = fields.number(host, "watermark_bytes")
        level = ram_level(available, watermark, fields.number(host, "floor_bytes"))
        title = Text(self.TITLE)
        if level == "low":
            title.append(" BELOW FLOOR", style="bold red")
        elif level == "near" and watermark is not None and available is not None:
            below = available < watermark
            title.append(" BELOW WATERMARK" if below else " near watermark", style="bold yellow")
        daemon_swap = fields.number(host, "daemon_swap_bytes")
        if daemon_swap is not None and daemon_swap > 0:
            title.append(" DAEMON SWAPS", style="bold red")
        return title

    def lines(self, width: int) -> list[Text]:
        host = fields.mapping(self.snapshot, "host")
        size = partial(self.size_text, width=width)
        available = fields.number(host, "mem_available_bytes")
        total = fields.number(host, "mem_total_bytes")
        watermark = fields.number(host, "watermark_bytes")
        floor = fields.number(host, "floor_bytes")
        style = RAM_STYLES[ram_level(available, watermark, floor)]
        first = Text("available ")
        first.append(size(available), style=f"bold {style}".strip())
        first.append(f" of {size(total)}")
        lowest = self.state.lows.get("mem_available_bytes")
        first.append(f"  {'lowest' if width >= WIDE else 'min'} {size(lowest)}", style="dim")
        limits = Text("watermark ")
        limits.append(size(watermark), style="yellow")
        limits.append("  floor ")
        limits.append(size(floor), style="red")
        rss = Text(f"RSS {size(fields.number(host, 'rss_bytes'))}")
        rss.append(f" (peak {size(self.state.peaks.get('rss_bytes'))})", style="dim")
        rss.append(f" pinned {size(fields.number(host, 'pinned_bytes'))}")
        daemon_swap = fields.number(host, "daemon_swap_bytes")
        swapping = daemon_swap is not None and daemon_swap > 0
        swap = Text(f"swap {size(fields.number(host, 'swap_used_bytes'))}"
                    f" of {size(fields.number(host, 'swap_total_bytes'))}  ")
        swap.append(f"daemon {size(daemon_swap)}", style="bold red" if swapping else "")
        return [first, self.gauge(available, total, watermark, floor, width, style), limits, rss, swap]

    def gauge(self, available, total, watermark, floor, width: int, style: str) -> Text:
        """MemAvailable as a bar, the watermark and floor marked, and the bar's full scale at the end.

        The scale is the total RAM, zoomed in to twice the watermark when MemAvailable is that low,
        so that on a 1 TiB host the margin above a 15 GiB watermark is still visible.
        """
        if available is None or not total:
            return Text("░" * width, style=FREE_STYLE)
        scale = min(total, max(2 * (watermark or 0), 1.25 * available))
        label = f" {self.size_text(scale, width)}"
        cells = max(width - len(label), 1)
        cell_bytes = scale / cells
        marks = {}
        for limit, mark_style in ((floor, "bold red"), (watermark, "bold yellow")):
            if limit is not None and 0 <= limit < scale:
                marks[min(int(limit / cell_bytes), cells - 1)] = mark_style
        bar = Text()
        for cell in range(cells):
            if cell in marks:
                bar.append("┃", style=marks[cell])
            elif (cell + 0.5) * cell_bytes <= available:
                bar.append("█", style=style or "green")
            else:
                bar.append("░", style=FREE_STYLE)
        bar.append(label, style="dim")
        return bar


class ThroughputPanel(Panel):
    """Prefill and decode tokens per second: now, peak, history, and (when wide) tokens so far."""

    TITLE = "throughput"

    def lines(self, width: int) -> list[Text]:
        out = []
        for name, style, history in (
            ("prefill", "cyan", self.state.prefill_tok_s),
            ("decode", "green", self.state.decode_tok_s),
        ):
            now = fields.number(self.snapshot, "throughput", f"{name}_tok_s")
            line = Text(f"{name:<8}", style=f"bold {style}")
            line.append(f"{rate_text(now):>6} tok/s", style="bold")
            line.append(f"  peak {rate_text(self.state.peaks.get(f'{name}_tok_s'))}", style="dim")
            if width >= WIDE:
                total = fields.number(self.snapshot, "throughput", f"{name}_tokens_total")
                line.append(f"  total {count_text(total)} tok", style="dim")
            out += [line, Text(sparkline(history, width), style=style)]
        return out


class CachePanel(Panel):
    """The prefix cache per tier, overall hit rate, and why the last lookup missed."""

    TITLE = "prefix cache"
    LAST_MISS_LINES = 2

    def lines(self, width: int) -> list[Text]:
        cache = fields.mapping(self.snapshot, "cache")
        tiers = fields.mapping(cache, "tiers")
        names = [name for name in TIER_ORDER if name in tiers]
        names += sorted(name for name in tiers if name not in TIER_ORDER)
        size_width = 7 if width < WIDE else 10
        out = [Text(f"{'tier':<5}{'bytes':>{size_width}}{'blocks':>7}{'hit/miss':>10}{'rate':>7}",
                    style="dim")]
        for name in names:
            tier = tiers[name]
            hits = count_text(fields.number(tier, "hits"))
            misses = count_text(fields.number(tier, "misses"))
            out.append(Text(
                f"{name[:4]:<5}{self.size_text(fields.number(tier, 'bytes'), width):>{size_width}}"
                f"{count_text(fields.number(tier, 'blocks')):>7}{hits + '/' + misses:>10}"
                f"{percent_text(fields.number(tier, 'hit_rate')):>7}"
            ))
        if not names:
            out.append(Text("no tiers reported", style="dim"))
        summary = Text(f"all  hit {percent_text(fields.number(cache, 'hit_rate'))}", style="bold")
        summary.append(f"  reused {count_text(fields.number(cache, 'cached_tokens_total'))} tok")
        out += [summary, self.kv_line(width)]
        explanation = fields.text(cache, "last_miss") or MISSING
        wrapped = textwrap.wrap("last miss: " + explanation, width, max_lines=self.LAST_MISS_LINES,
                                placeholder="…") or ["last miss:"]
        last_miss = [Text(line) for line in wrapped]
        last_miss[0].stylize("dim", 0, len("last miss:"))
        return out + last_miss

    def kv_line(self, width: int) -> Text:
        """The KV block pool: blocks used by running requests, kept for reuse, and free."""
        kv = fields.mapping(self.snapshot, "kv")
        line = Text("KV   ", style="bold")
        used, cached, free, total = (
            count_text(fields.number(kv, key))
            for key in ("used_blocks", "cached_blocks", "free_blocks", "total_blocks")
        )
        line.append(f"{used} used {cached} cached {free} free")
        block = fields.integer(kv, "block_size_tokens")
        if width >= WIDE:
            line.append(f" of {total} blocks" + (f" × {block} tok" if block else ""), style="dim")
        return line


class ExpertsPanel(Panel):
    """Routed-expert placement and host-to-GPU traffic; shown only when the snapshot has experts."""

    TITLE = "experts"

    def lines(self, width: int) -> list[Text]:
        experts = fields.mapping(self.snapshot, "experts")
        size = partial(self.size_text, width=width)
        bandwidth = fields.number(experts, "pcie_gb_s")
        host_bytes = fields.number(experts, "host_ram_bytes")
        placement = Text(f"GPU {exact_count(fields.integer(experts, 'gpu_experts'))}"
                         f"  RAM {exact_count(fields.integer(experts, 'ram_experts'))}"
                         f"{'' if host_bytes is None else f' ({size(host_bytes)})'}  PCIe ")
        placement.append(MISSING if bandwidth is None else f"{bandwidth:.1f} GB/s", style="bold")
        skipped = count_text(fields.number(experts, "skipped_transfers"))
        traffic = Text(f"copied {size(fields.number(experts, 'bytes_copied'))}  skipped "
                       f"{skipped}{' transfers' if width >= WIDE else ''}"
                       f" ({size(fields.number(experts, 'bytes_skipped'))})")
        if not experts.get("zero_copy"):
            return [placement, traffic]
        return [placement, traffic, Text(f"read in place {size(fields.number(experts, 'host_read_bytes'))}")]


def exact_count(count: int | None) -> str:
    return MISSING if count is None else str(count)
