"""Evaluation pane: the three-way verdict (green faster, red slower, amber inconclusive: the 95 %
interval of the median speedup straddles 1.0) with its fix, one row per concurrency level, the
recommended SGLang settings per level, then the per-prompt table and acceptance per draft
position. While an evaluate job runs: requests x rounds done, the level and round, and the
running acceptance length.

With `eval_dir`, the pane reads `<eval_dir>/report.json` in a thread worker (never on the UI
thread): on mount and whenever `reload()` is called (the app calls it when an evaluate job
ends). The table is wider than 80 columns, so it sits in a container that scrolls sideways
instead of being cut off.

Imports only engine.evaluate.report (plain Python): no torch at console start-up.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from textual import work
from textual.app import ComposeResult
from textual.containers import ScrollableContainer
from textual.message import Message
from textual.widgets import Static

from eagle3_console.keys import scroll_bindings
from eagle3_console.messages import JobEventsArrived, JobsChanged
from eagle3_console.panes.base import Pane
from engine.evaluate import stats
from engine.evaluate.report import (
    ReportError,
    best_setting,
    fix_line,
    header_line,
    level_lines,
    position_lines,
    read_report,
    recommendation_lines,
    setting_of,
    table_lines,
    verdict,
    verdict_kind,
)

WIDE_TABLE = 84  # cells the full table needs; narrower panes get the compact one


def compact_table_lines(report: dict[str, Any], max_rows: int = 50) -> list[str]:
    """The per-prompt table in 47 cells: prompt, tokens, acceptance length, spec tok/s, speedup, greedy."""
    head = f"{'prompt':<10} {'tokens':>6} {'AL':>5} {'tok/s':>6} {'speedup':>7} greedy"
    rule = "─" * len(head)

    def row(name: str, p: dict[str, Any], greedy: str) -> str:
        speedup = p.get("speedup")
        al, tps = p.get("acceptance_length"), p.get("spec_tokens_per_s")
        return (f"{name[:10]:<10} {p.get('completion_tokens', 0):>6} "
                f"{'—' if al is None else f'{al:.2f}':>5} {'—' if tps is None else f'{tps:.1f}':>6} "
                f"{'—' if speedup is None else f'{speedup:.2f}×':>7} {greedy}")

    lines = [head, rule]
    prompts = list(report.get("prompts") or [])
    for p in prompts[:max_rows]:
        match = p.get("matches_greedy")
        lines.append(row(str(p.get("id", "?")), p, "—" if match is None else ("same" if match else "differs")))
    if len(prompts) > max_rows:
        lines.append(f"… {len(prompts) - max_rows} more prompt(s) in report.json")
    o = report.get("overall") or {}
    compared = o.get("greedy_compared") or 0
    lines += [rule, row("overall", o, f"{o.get('greedy_matches', 0)}/{compared}" if compared else "—")]
    return lines


def compact_level_lines(report: dict[str, Any]) -> list[str]:
    """One row per concurrency level in 76 cells: speedup [interval], verdict, tok/s each side, best."""
    levels = report.get("levels") or []
    if not levels:
        return []
    head = f"{'conc':>4} {'speedup [95%]':<19} {'verdict':<12} {'tok/s base→spec':<17} best"
    lines = [head, "─" * 66]
    for level in levels:
        s = setting_of(level, level.get("configured")) or best_setting(level.get("settings") or []) or {}
        sp = s.get("speedup") or {}
        best = setting_of(level, level.get("best"))
        tps = s.get("base_tokens_per_s"), s.get("spec_tokens_per_s")
        rates = "—" if None in tps else f"{tps[0]:.0f}→{tps[1]:.0f}"
        best_text = f"{best['spec_steps']} steps {best['speedup'].get('median') or 0:.2f}×" if best else "—"
        lines.append(f"{level['concurrency']:>4} {stats.fmt_interval(sp):<19} {str(sp.get('verdict') or '—'):<12} "
                     f"{rates:<17} {best_text}")
    return lines


EMPTY_TEXT = "no evaluation yet — run the evaluate stage to measure acceptance length and speedup"


class ReportScroll(ScrollableContainer):
    """The report's tables: Tab focuses them; j/k, arrows, PgUp/PgDn and ←/→ scroll."""

    BINDINGS = scroll_bindings()


class EvaluationReportRead(Message, bubble=False):
    """A worker read report.json: the report, or None with the reason (missing, unreadable)."""

    def __init__(self, report: dict[str, Any] | None, problem: str = "") -> None:
        super().__init__()
        self.report = report
        self.problem = problem


class EvaluationPane(Pane):
    """Shows one evaluation report (`show_report(dict)`), or the empty state."""

    PANE_ID = "evaluation"
    TITLE = "Evaluation"
    DEFAULT_CSS = """
    EvaluationPane #evaluation-scroll { height: 1fr; overflow-x: auto; overflow-y: auto; }
    EvaluationPane #evaluation-scroll > Static { width: auto; min-width: 100%; }
    EvaluationPane #evaluation-header { height: auto; color: $text-muted; }
    EvaluationPane #evaluation-table { height: auto; margin: 1 0 0 0; }
    EvaluationPane #evaluation-positions { height: auto; margin: 1 0 0 0; color: $accent; }
    EvaluationPane #evaluation-job { height: auto; }
    EvaluationPane #evaluation-verdict { height: auto; text-style: bold; color: $success; }
    EvaluationPane #evaluation-verdict.-slower { color: $error; }
    EvaluationPane #evaluation-verdict.-inconclusive { color: $warning; }
    EvaluationPane #evaluation-fix { height: auto; color: $warning; }
    EvaluationPane #evaluation-levels { height: auto; margin: 1 0 0 0; }
    EvaluationPane #evaluation-recommendation { height: auto; color: $accent; }
    EvaluationPane #evaluation-notes { height: auto; color: $text-muted; width: 100%; }
    """

    def __init__(self, report: dict[str, Any] | None = None, *, eval_dir: Path | str | None = None,
                 id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self._report = report
        self.eval_dir = Path(eval_dir) if eval_dir else None
        self.problem = ""  # why no report is shown ("" when one is, or none was looked for)
        self._read_lock = threading.Lock()
        self.job_id = ""
        self.job_state = ""
        self.job_progress = ""  # "3/8 prompts · acceptance length 2.1" while an evaluate job runs

    def compose(self) -> ComposeResult:
        # The verdict goes first: at 80x24 it is the line that matters, the table scrolls.
        yield Static("", id="evaluation-job")
        yield Static("", id="evaluation-verdict", markup=False)
        yield Static("", id="evaluation-fix", markup=False)
        yield Static("", id="evaluation-levels", markup=False)  # one row per concurrency, above the scroll
        yield Static("", id="evaluation-recommendation", markup=False)
        yield Static("", id="evaluation-header", markup=False)
        with ReportScroll(id="evaluation-scroll"):  # a table wider than the pane scrolls sideways
            yield Static("", id="evaluation-table", markup=False)
            yield Static("", id="evaluation-positions", markup=False)
            yield Static("", id="evaluation-notes", markup=False)

    def on_mount(self) -> None:
        self._render_report(self._report)
        self._render_job()
        if self.eval_dir is not None and self._report is None:
            self.reload()

    @property
    def report(self) -> dict[str, Any] | None:
        return self._report

    def reload(self) -> None:
        """Read report.json again (in a worker); the pane updates when it is read."""
        if self.eval_dir is not None:
            self._read_report()

    @work(thread=True, group="evaluation-report", exit_on_error=False)
    def _read_report(self) -> None:
        if not self._read_lock.acquire(blocking=False):
            return  # a read is under way
        try:
            report, problem = read_report(self.eval_dir), ""
        except ReportError as exc:
            report, problem = None, str(exc)
        finally:
            self._read_lock.release()
        self.post_message(EvaluationReportRead(report, problem))

    # -- the evaluate job (from the app's job list and the job's own events)
    @property
    def running_job_id(self) -> str | None:
        return self.job_id if self.job_id and self.job_state in ("starting", "running") else None

    def on_jobs_changed(self, message: JobsChanged) -> None:
        newest = next((j for j in message.jobs if j.kind == "evaluate"), None)
        if newest is not None and (newest.id, newest.state) != (self.job_id, self.job_state):
            if newest.id != self.job_id:
                self.job_progress = ""
            self.job_id, self.job_state = newest.id, newest.state
            self._render_job()

    def on_job_events_arrived(self, message: JobEventsArrived) -> None:
        if message.kind != "evaluate":
            return
        for event in message.events:
            if event.get("type") == "progress":
                self.job_progress = progress_text(event)
            elif event.get("type") == "error":
                self.job_progress = f"error: {event.get('message', '')}"
        self._render_job()

    def _render_job(self) -> None:
        widget = self.query_one("#evaluation-job", Static)
        if not self.job_id or (self.job_state == "succeeded" and self._report):
            widget.display = False
            return
        colour = {"running": "$success", "starting": "$warning", "failed": "$error"}.get(self.job_state, "$text-muted")
        from eagle3_console.render import esc

        text = f"[{colour}]● [b]{esc(self.job_state)}[/b][/] · job {esc(self.job_id)}"
        if self.job_progress:
            text += f" · {esc(self.job_progress)}"
        widget.display = True
        widget.update(text)

    def on_resize(self) -> None:
        if self._report:
            self._render_report(self._report)

    def on_evaluation_report_read(self, message: EvaluationReportRead) -> None:
        self.problem = message.problem
        self.show_report(message.report)
        self._render_job()

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
        fix = self.query_one("#evaluation-fix", Static)
        levels = self.query_one("#evaluation-levels", Static)
        rec = self.query_one("#evaluation-recommendation", Static)
        if not report:
            header.update(EMPTY_TEXT)
            unreadable = self.problem and "no evaluation report at" not in self.problem
            notes.update(self.problem if unreadable else "")
            for widget in (table, positions, verdict_line, fix, levels, rec):
                widget.update("")
            for widget in (verdict_line, fix, levels, rec):
                widget.display = False
            verdict_line.remove_class("-slower", "-inconclusive")
            return
        verdict_line.display = True
        header.update(header_line(report))
        width = self.content_region.width or 76
        table.update("\n".join(compact_table_lines(report) if width < WIDE_TABLE else table_lines(report)))
        positions.update("\n".join(["acceptance per draft position"] + ["  " + line for line in position_lines(report)]))
        kind = verdict_kind(report)
        acceptance = (report.get("overall") or {}).get("acceptance_length")
        al = f"acceptance length {acceptance:.2f} · " if isinstance(acceptance, (int, float)) else ""
        prefix = {stats.SLOWER: "SLOWER: ", stats.INCONCLUSIVE: "INCONCLUSIVE: "}.get(kind, "")
        verdict_line.update(prefix + al + verdict(report))
        verdict_line.set_class(kind == stats.SLOWER, "-slower")
        verdict_line.set_class(kind == stats.INCONCLUSIVE, "-inconclusive")
        fix_text = fix_line(report)
        fix.display = bool(fix_text)
        fix.update("fix: " + fix_text if fix_text else "")
        rows = level_lines(report)
        if rows and width < max(len(line) for line in rows):
            rows = compact_level_lines(report)
        levels.display = bool(rows)
        levels.update("\n".join(rows))
        rec_lines = recommendation_lines(report)
        rec.display = bool(rec_lines)
        rec.update("\n".join(rec_lines))
        notes.update("\n".join(f"note: {n}" for n in report.get("notes") or []))


def progress_text(event: dict[str, Any]) -> str:
    """A progress event of the evaluate job as one line."""
    text = f"{event.get('done', '?')}/{event.get('total', '?')} {event.get('unit') or 'prompts'}"
    if event.get("concurrency") is not None:
        text += f" · concurrency {event['concurrency']} round {event.get('round')}/{event.get('rounds')}"
    al = event.get("acceptance_length")
    if isinstance(al, (int, float)):
        text += f" · acceptance length so far {al:.2f}"
    sp = event.get("speedup")
    if isinstance(sp, (int, float)):
        text += f" · median speedup so far {sp:.2f}×"
    return text
