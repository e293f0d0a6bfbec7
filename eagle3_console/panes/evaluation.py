"""Evaluation pane: the three-way verdict (green faster, red slower, amber inconclusive: the 95 %
interval of the median speedup straddles 1.0) with its fix, one row per concurrency level, the
recommended SGLang settings per level, then the per-prompt table and acceptance per draft
position. While an evaluate job runs: requests x rounds done, the level and round, and the
running acceptance length.

The engine watches `report.json` (engine.watchers) and sends it whenever it changes; the pane
reads no file. `reload()` (the `u` key) asks the engine, through the app, to read it again. The
table is wider than 80 columns, so it sits in a container that scrolls sideways instead of being
cut off.

Imports only engine.evaluate.report (plain Python): no torch at console start-up.
"""

from __future__ import annotations

from typing import Any

from textual.app import ComposeResult
from textual.containers import ScrollableContainer
from textual.widgets import Static

from eagle3_console.keys import scroll_bindings
from eagle3_console.messages import EvaluationReportChanged, JobEventsArrived, JobsChanged, ReloadEvaluation
from eagle3_console.panes.base import Pane
from eagle3_console.render import job_state_colour
from engine.evaluate import stats
from engine.jobs.events import Error, Progress
from engine.jobs.manager import ACTIVE_STATES, JobState
from engine.evaluate.report import (
    best_setting,
    fix_line,
    header_line,
    level_lines,
    position_lines,
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


def compact_level_lines(report: dict[str, Any], rates: bool = True) -> list[str]:
    """One row per concurrency level in 76 cells: speedup [interval], verdict, tok/s each side, best.

    `rates=False` leaves the tok/s column out (56 cells: the pane beside the Pipeline at 120x40)."""
    levels = report.get("levels") or []
    if not levels:
        return []
    sglang = report.get("backend") == "sglang"
    best_head = "best steps/k/draft" if sglang else "best"  # fits 76 cells
    rates_head = f"{'tok/s base→spec':<17} " if rates else ""
    head = f"{'conc':>4} {'speedup [95%]':<19} {'verdict':<12} {rates_head}{best_head}"
    rows = []
    for level in levels:
        s = setting_of(level, level.get("configured")) or best_setting(level.get("settings") or []) or {}
        sp = s.get("speedup") or {}
        best = setting_of(level, level.get("best"))
        tps = s.get("base_tokens_per_s"), s.get("spec_tokens_per_s")
        rate_text = "—" if None in tps else f"{tps[0]:.0f}→{tps[1]:.0f}"
        # SGLang settings are keyed "steps/topk/draft" (the header says so); local ones by steps alone
        sglang_key = best.get("key") if best and isinstance(best.get("key"), str) else None
        best_label = sglang_key or f"{best['spec_steps']} steps" if best else ""
        best_text = f"{best_label} {best['speedup'].get('median') or 0:.2f}×" if best else "—"
        rows.append(f"{level['concurrency']:>4} {stats.fmt_interval(sp):<19} {str(sp.get('verdict') or '—'):<12} "
                    + (f"{rate_text:<17} " if rates else "") + best_text)
    return [head, "─" * max(len(line) for line in [head, *rows]), *rows]


EMPTY_TEXT = "no evaluation yet — run the evaluate stage to measure acceptance length and speedup"


class ReportScroll(ScrollableContainer):
    """The report's tables: Tab focuses them; j/k, arrows, PgUp/PgDn and ←/→ scroll."""

    BINDINGS = scroll_bindings()


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

    def __init__(self, report: dict[str, Any] | None = None, *, id: str | None = None,
                 classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self._report = report
        self.problem = ""  # why no report is shown ("" when one is, or none was looked for)
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

    @property
    def report(self) -> dict[str, Any] | None:
        return self._report

    def reload(self) -> None:
        """Have the engine read report.json again (the app forwards this); the pane updates when it comes."""
        self.post_message(ReloadEvaluation())

    # -- the evaluate job (from the app's job list and the job's own events)
    @property
    def running_job_id(self) -> str | None:
        return self.job_id if self.job_id and self.job_state in ACTIVE_STATES else None

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
            if isinstance(event, Progress):
                self.job_progress = progress_text(event)
            elif isinstance(event, Error):
                self.job_progress = f"error: {event.message or ''}"
        self._render_job()

    def _render_job(self) -> None:
        widget = self.query_one("#evaluation-job", Static)
        if not self.job_id or (self.job_state == JobState.SUCCEEDED and self._report):
            widget.display = False
            return
        colour = job_state_colour(self.job_state)
        from eagle3_console.render import esc

        text = f"[{colour}]● [b]{esc(self.job_state)}[/b][/] · job {esc(self.job_id)}"
        if self.job_progress:
            text += f" · {esc(self.job_progress)}"
        widget.display = True
        widget.update(text)

    def on_resize(self) -> None:
        if self._report:
            self._render_report(self._report)

    def on_evaluation_report_changed(self, message: EvaluationReportChanged) -> None:
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
        prefix = {stats.SLOWER: "SLOWER: ", stats.INCONCLUSIVE: "INCONCLUSIVE: "}.get(kind or "", "")
        verdict_line.update(prefix + al + verdict(report))
        verdict_line.set_class(kind == stats.SLOWER, "-slower")
        verdict_line.set_class(kind == stats.INCONCLUSIVE, "-inconclusive")
        fix_text = fix_line(report)
        fix.display = bool(fix_text)
        fix.update("fix: " + fix_text if fix_text else "")
        # This table sits above the scroll: a row that wraps loses its columns, so it narrows instead.
        rows = level_lines(report)
        if rows and width < max(len(line) for line in rows):
            rows = compact_level_lines(report)
        if rows and width < max(len(line) for line in rows):
            rows = compact_level_lines(report, rates=False)
        levels.display = bool(rows)
        levels.update("\n".join(rows))
        rec_lines = recommendation_lines(report)
        rec.display = bool(rec_lines)
        rec.update("\n".join(rec_lines))
        notes.update("\n".join(f"note: {n}" for n in report.get("notes") or []))


def progress_text(event: Progress) -> str:
    """A progress event of the evaluate job as one line."""
    done = "?" if event.done is None else event.done
    total = "?" if event.total is None else event.total
    text = f"{done}/{total} {event.unit or 'prompts'}"
    if event.concurrency is not None:
        text += f" · concurrency {event.concurrency} round {event.round}/{event.rounds}"
    if event.setting:
        text += f" · {event.setting}"
    if event.acceptance_length is not None:
        text += f" · acceptance length so far {event.acceptance_length:.2f}"
    if event.speedup is not None:
        text += f" · median speedup so far {event.speedup:.2f}×"
    return text
