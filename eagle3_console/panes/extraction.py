"""Extraction pane: progress of hidden-state extraction, and the disks it writes to."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.widgets import Static

from eagle3_console.messages import DiskChanged
from eagle3_console.panes.base import Pane
from eagle3_console.render import clip, esc


def disk_gauge(usage, width: int) -> list[str]:
    """Two lines for one filesystem: a used/total bar with the reserve marked, then figures.

    The bar's right end is the reserve (▒): space jobs must leave free. Used space fills
    from the left; it turns $error once free space is inside the reserve.
    """
    from engine.disk import fmt_bytes

    width = max(10, width)
    total = max(1, usage.total)
    used_cells = min(width, round(width * usage.used / total))
    reserve_cells = min(width, max(1 if usage.reserve else 0, round(width * usage.reserve / total)))
    reserve_start = width - reserve_cells
    colour = "$error" if usage.below_reserve else "$primary"
    cells = []
    for i in range(width):
        if i < used_cells:
            cells.append(f"[{colour}]█[/]")
        elif i >= reserve_start:
            cells.append("[$warning]▒[/]")
        else:
            cells.append("[$text-muted]·[/]")
    flag = "  [$error]below reserve[/]" if usage.below_reserve else ""
    label = esc(clip(usage.label, max(8, width - 10)))
    return [
        f"[b]{label}[/b] [$text-muted]on[/] {esc(usage.mount)}",
        "".join(cells),
        f"free {fmt_bytes(usage.free)} of {fmt_bytes(usage.total)} · used {fmt_bytes(usage.used)}"
        f" · reserve {fmt_bytes(usage.reserve)}{flag}",
    ]


class ExtractionPane(Pane):
    """Extraction progress (empty for now) and a disk gauge per written filesystem."""

    PANE_ID = "extraction"
    TITLE = "Extraction"
    DEFAULT_CSS = """
    ExtractionPane #extract-state { height: auto; margin-bottom: 1; }
    ExtractionPane #disk-gauges { height: auto; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.usages: tuple = ()

    def compose(self) -> ComposeResult:
        yield Static(
            "[b]no extraction run yet[/b]\n[$text-muted]Pass the checks up to `disk`, then extraction starts here.[/]",
            id="extract-state",
        )
        yield Static("[$text-muted]measuring disks…[/]", id="disk-gauges")

    def on_disk_changed(self, message: DiskChanged) -> None:
        self.usages = tuple(message.usages)
        self._render_gauges()

    def on_resize(self) -> None:
        if self.usages:
            self._render_gauges()

    def _render_gauges(self) -> None:
        width = max(20, (self.content_region.width or 76))
        lines: list[str] = []
        for usage in self.usages:
            lines.extend(disk_gauge(usage, width))
        self.query_one("#disk-gauges", Static).update("\n".join(lines) or "[$warning]no disk readable[/]")
