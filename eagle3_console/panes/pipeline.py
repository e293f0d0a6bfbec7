"""Pipeline pane: the stages in order, each green only when its checks passed, with evidence.

The table lists the nine stages; the detail area below shows every check of the highlighted
stage with its evidence and fix. Enter (or `r`) asks the app to re-run that stage's checks.
"""

from __future__ import annotations

import time
from typing import Sequence

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.binding import Binding
from textual.widgets import DataTable, Input, Static

from eagle3_console.keys import nav_bindings, scroll_bindings
from eagle3_console.messages import RunChecks, StageChanged
from eagle3_console.panes.base import Pane
from eagle3_console.render import STAGE_GLYPHS as GLYPHS, STATUS_GLYPHS, clip, esc, set_markup

# Theme variable per state: the table resolves them through the current theme.
STATE_COLOURS = {"passed": "success", "warned": "warning", "failed": "error", "pending": "text-muted",
                 "running": "primary", "stale": "warning"}
# States whose note, not the last results, is what the row must say (a job running, a stale result).
NOTE_STATES = ("running", "stale")
STATUS_COLOURS = {"pass": "success", "warn": "warning", "fail": "error"}


def last_evidence(report) -> str:
    """The one line that best explains a stage: what it is doing or why its result is stale, else the
    first failure, else warning, else a summary."""
    if report.state.value in NOTE_STATES and report.note:
        return report.note
    for wanted in ("fail", "warn"):
        for result in report.results:
            if result.status.value == wanted:
                return f"{result.name}: {result.evidence}"
    if report.results:
        return f"{len(report.results)} check(s) passed"
    return report.note


def detail_markup(stage, report) -> str:
    """Every check of a stage, with evidence and fix."""
    state = report.state.value
    colour = STATE_COLOURS.get(state, "text-muted")
    when = ""
    if report.ran_at:
        when = f" · checked {time.strftime('%H:%M:%S', time.localtime(report.ran_at))}"
    lines = [
        f"[b]{esc(stage.title)}[/b] [$text-muted]({esc(stage.name)})[/] [${colour}]{GLYPHS.get(state, '?')} {state}[/]"
        f"[$text-muted]{when}[/]",
        f"[$text-muted]{esc(stage.description)}[/]",
    ]
    if report.results and state in NOTE_STATES and report.note:
        lines.append(f"[${colour}]{esc(report.note)}[/]")
    if not report.results:
        lines.append(f"[$text-muted]{esc(report.note or 'not run yet')} — press Enter or r to check[/]"
                     if state == "pending" else f"[$text-muted]{esc(report.note)}[/]")
    for result in report.results:
        status = result.status.value
        lines.append(f"[${STATUS_COLOURS[status]}]{STATUS_GLYPHS[status]}[/] [b]{esc(result.name)}[/b]: "
                     f"{esc(result.evidence)}")
        if result.fix:
            lines.append(f"   [$text-muted]fix:[/] {esc(result.fix)}")
    return "\n".join(lines)


class StageTable(DataTable):
    """The stage list; Enter is "run this stage's checks" (DataTable's row selection); j/k move."""

    BINDINGS = nav_bindings()

    DEFAULT_CSS = """
    StageTable { height: auto; max-height: 11; background: $surface; overflow-x: hidden; }
    """


class DetailScroll(VerticalScroll):
    """The selected stage's checks; Tab focuses it, then j/k, arrows and PgUp/PgDn scroll it."""

    BINDINGS = scroll_bindings()
    DEFAULT_CSS = """
    DetailScroll:focus { background-tint: $foreground 5%; }
    """


class PipelinePane(Pane):
    """Stage checklist plus the highlighted stage's checks."""

    PANE_ID = "pipeline"
    TITLE = "Pipeline"
    BINDINGS = [Binding("escape", "close_filter", "", show=False)]
    DEFAULT_CSS = """
    PipelinePane #stage-detail-scroll { height: 1fr; min-height: 3; margin-top: 1; }
    PipelinePane #stage-detail { height: auto; }
    PipelinePane #stage-filter { dock: bottom; display: none; }
    PipelinePane #stage-filter.-shown { display: block; }
    """

    def __init__(self, stages: Sequence, reports: Sequence, **kwargs) -> None:
        super().__init__(**kwargs)
        self.stages = {s.name: s for s in stages}
        self.order = [s.name for s in stages]
        self.filter = ""  # `/`: only stages whose name, state or evidence contain it
        self.reports = {r.stage: r for r in reports}

    def compose(self) -> ComposeResult:
        yield StageTable(id="stage-table", cursor_type="row", show_cursor=True)
        with DetailScroll(id="stage-detail-scroll"):
            yield Static("", id="stage-detail")
        yield Input(placeholder="filter stages (name, state, evidence) · Enter · Esc clears", id="stage-filter")

    def on_mount(self) -> None:
        self._rebuild()
        self._render_detail()
        self.app.theme_changed_signal.subscribe(self, lambda _theme: self._rebuild())

    # -- public API
    @property
    def selected_stage(self) -> str:
        table = self.query_one(StageTable)
        shown = self.shown_stages()
        row = max(0, min(table.cursor_row, len(shown) - 1))
        return shown[row]

    def select_stage(self, name: str) -> None:
        if name not in self.shown_stages():
            self.set_filter("")
        self.query_one(StageTable).move_cursor(row=self.shown_stages().index(name))

    def shown_stages(self) -> list[str]:
        """The stages the table lists: all, or those matching the `/` filter (never none)."""
        if not self.filter:
            return list(self.order)
        needle = self.filter.lower()
        found = [n for n in self.order if needle in " ".join((n, self.reports[n].state.value,
                                                               last_evidence(self.reports[n]))).lower()]
        return found or list(self.order)

    def set_filter(self, text: str) -> None:
        self.filter = text.strip()
        self.border_subtitle = f"/{self.filter}" if self.filter else ""
        self._rebuild()
        self._render_detail()

    def open_filter(self) -> None:
        box = self.query_one("#stage-filter", Input)
        box.add_class("-shown")
        box.value = self.filter
        box.focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        box = self.query_one("#stage-filter", Input)
        box.remove_class("-shown")
        self.set_filter(event.value)
        self.query_one(StageTable).focus()

    def action_close_filter(self) -> None:
        box = self.query_one("#stage-filter", Input)
        if box.has_class("-shown") or self.filter:
            box.remove_class("-shown")
            self.set_filter("")
            self.query_one(StageTable).focus()

    def row_text(self, name: str) -> str:
        """The visible cells of one stage's row, joined by spaces (used by tests and the CLI)."""
        return " ".join(str(cell) for cell in self.query_one(StageTable).get_row(name))

    # -- events
    def on_stage_changed(self, message: StageChanged) -> None:
        report = message.report
        self.reports[report.stage] = report
        table = self.query_one(StageTable)
        if self.filter:  # the row may join or leave the filtered list
            self._rebuild()
            self._render_detail()
            return
        for key, value in zip(("glyph", "stage", "state", "evidence"), self._cells(report)):
            table.update_cell(report.stage, key, value)
        if report.stage == self.selected_stage:
            self._render_detail()

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        event.stop()
        self._render_detail()

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        self.post_message(RunChecks([str(event.row_key.value)]))

    def on_resize(self) -> None:
        self._rebuild()

    # -- rendering
    def _evidence_width(self) -> int:
        return max(12, (self.content_region.width or 78) - 1 - 9 - 11 - 8)

    def _cells(self, report) -> tuple[Text, str, Text, str]:
        state = report.state.value
        style = self.app.theme_variables.get(STATE_COLOURS.get(state, "text-muted"), "")
        return (
            Text(GLYPHS.get(state, "?"), style=style),
            report.stage,
            Text(state, style=style),
            clip(last_evidence(report).replace("\n", " "), self._evidence_width()),
        )

    def _rebuild(self) -> None:
        """Re-create columns and rows: on mount, on resize (evidence width) and on theme change."""
        table = self.query_one(StageTable)
        row = table.cursor_row
        table.clear(columns=True)
        table.add_column("", key="glyph", width=1)
        table.add_column("stage", key="stage", width=9)
        table.add_column("state", key="state", width=11)
        table.add_column("last evidence", key="evidence", width=self._evidence_width())
        for name in self.shown_stages():
            table.add_row(*self._cells(self.reports[name]), key=name)
        table.move_cursor(row=max(0, row), animate=False)

    def _render_detail(self) -> None:
        name = self.selected_stage
        set_markup(self.query_one("#stage-detail", Static), detail_markup(self.stages[name], self.reports[name]))
