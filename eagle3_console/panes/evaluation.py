"""Evaluation pane: the report's table, acceptance per draft position as bars, and the verdict —
red "slower than no speculation" when speculation does not pay for itself.

Imports only engine.evaluate.report (plain Python): no torch at console start-up.
"""

from __future__ import annotations

from typing import Any

from textual.app import ComposeResult
from textual.widgets import Static

from eagle3_console.panes.base import Pane
from engine.evaluate.report import (
    header_line,
    is_slower,
    position_lines,
    table_lines,
    verdict,
)


class EvaluationPane(Pane):
    """Shows one evaluation report (`show_report(dict)`), or the empty state."""

    PANE_ID = "evaluation"
    TITLE = "Evaluation"
    DEFAULT_CSS = """
    EvaluationPane #evaluation-header { height: auto; color: $text-muted; }
    EvaluationPane #evaluation-table { height: auto; margin: 1 0 0 0; }
    EvaluationPane #evaluation-positions { height: auto; margin: 1 0 0 0; color: $accent; }
    EvaluationPane #evaluation-verdict { height: auto; margin: 1 0 0 0; text-style: bold; color: $success; }
    EvaluationPane #evaluation-verdict.-slower { color: $error; }
    EvaluationPane #evaluation-notes { height: auto; color: $text-muted; }
    """

    def __init__(self, report: dict[str, Any] | None = None, *, id: str | None = None,
                 classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self._report = report

    def compose(self) -> ComposeResult:
        yield Static("", id="evaluation-header", markup=False)
        yield Static("", id="evaluation-table", markup=False)
        yield Static("", id="evaluation-positions", markup=False)
        yield Static("", id="evaluation-verdict", markup=False)
        yield Static("", id="evaluation-notes", markup=False)

    def on_mount(self) -> None:
        self._render_report(self._report)

    def show_report(self, report: dict[str, Any] | None) -> None:
        """Render `report` (engine.evaluate.report.read_report's dict); None shows the empty state."""
        self._report = report
        if self.children:  # before compose, on_mount renders it
            self._render_report(report)

    def _render_report(self, report: dict[str, Any] | None) -> None:
        header = self.query_one("#evaluation-header", Static)
        table = self.query_one("#evaluation-table", Static)
        positions = self.query_one("#evaluation-positions", Static)
        verdict_line = self.query_one("#evaluation-verdict", Static)
        notes = self.query_one("#evaluation-notes", Static)
        if not report:
            header.update("no evaluation yet — run the evaluate stage to measure acceptance length and speedup")
            for widget in (table, positions, verdict_line, notes):
                widget.update("")
            verdict_line.remove_class("-slower")
            return
        header.update(header_line(report))
        table.update("\n".join(table_lines(report)))
        positions.update("\n".join(["acceptance per draft position"] + ["  " + line for line in position_lines(report)]))
        slower = is_slower(report)
        verdict_line.update(("SLOWER: " if slower else "") + verdict(report))
        verdict_line.set_class(slower, "-slower")
        notes.update("\n".join(f"note: {n}" for n in report.get("notes") or []))
