"""Jobs pane: every job of the workspace, and the live log of the selected one.

The list (newest first) shows state, stage, age, progress, exit code and, for a job that failed,
the reason (its last error line, engine.jobs.manager.JobInfo.reason). Below it the selected job's log
follows its end like `tail -f` (`f` toggles), scrolls with j/k/PgUp/PgDn once focused (Tab), and
`/` searches it (n / N: next / previous match). `S` stops the selected job (asks first) and `d`
has a running job write its threads' stacks into this log (app actions, engine.jobs.manager). The pane
reads no file: it asks the engine (FollowLog, through the app) to follow the selected job's log,
and the engine sends the log's last lines whenever it grows (engine.watchers).
"""

from __future__ import annotations

import re
import time
from typing import Any, Callable

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.widgets import DataTable, Input, Static

from eagle3_console.fmt import finite, fmt_duration
from eagle3_console.keys import nav_bindings, scroll_bindings
from eagle3_console.messages import FollowLog, JobEventsArrived, JobLogChanged, JobsChanged
from eagle3_console.panes.base import Pane
from eagle3_console.render import JOB_STATE_COLOURS, clip, esc, set_markup
from engine.jobs.events import Progress

EMPTY_TEXT = "no jobs yet: start one with [b]s[/b] on a stage (Pipeline) or its pane"
LOG_LINES = 400  # lines of the selected job's log kept on screen


def job_age(job, now: float | None = None) -> str:
    """How long ago the job started (or was created)."""
    start = job.started_at or job.created_at or job.create_time
    if not start:
        return "?"
    return fmt_duration((now or time.time()) - float(start))


def progress_cell(progress: tuple | None, state: str) -> str:
    if progress is None:
        return "—"
    done, total = progress
    if total:
        return f"{100 * done / total:.0f}% {done:.0f}/{total:.0f}"
    return f"{done:.0f}"


class JobList(DataTable):
    BINDINGS = nav_bindings()
    DEFAULT_CSS = """
    JobList { height: auto; max-height: 10; background: $surface; overflow-x: hidden; }
    """


class LogScroll(VerticalScroll):
    BINDINGS = scroll_bindings()
    DEFAULT_CSS = """
    LogScroll { height: 1fr; min-height: 3; background: $surface; }
    LogScroll:focus { background-tint: $foreground 5%; }
    """


class JobsPane(Pane):
    """Jobs list + log tail of the selected job."""

    PANE_ID = "jobs"
    TITLE = "Jobs"
    DEFAULT_CSS = """
    JobsPane #jobs-empty { height: auto; color: $text-muted; }
    JobsPane #jobs-reason { height: auto; color: $error; }
    JobsPane #jobs-log-title { height: 1; margin-top: 1; color: $text-muted; }
    JobsPane #jobs-log { height: auto; }
    JobsPane #jobs-search { dock: bottom; height: 3; display: none; }
    JobsPane #jobs-search.-shown { display: block; }
    """
    BINDINGS = [Binding("escape", "close_search", "", show=False)]

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.jobs: tuple = ()
        self.progress: dict[str, tuple[float, float | None]] = {}
        self.lines: list[str] = []
        self.log_job = ""
        self.follow = True
        self.term = ""
        self.match_index = -1
        self.job_filter = ""  # `/` with the list focused: only jobs whose id, stage, state or reason match
        self._search_mode = "log"
        self._followed: str | None = None  # the job whose log the engine was asked to follow
        self._shown_columns: list[str] = []
        self._progress_width: int | None = None
        self.clock: Callable[[], float] = time.time  # ages are measured against it (fixed in snapshots)

    def compose(self) -> ComposeResult:
        yield Static(EMPTY_TEXT, id="jobs-empty")
        yield JobList(id="jobs-table", cursor_type="row")
        yield Static("", id="jobs-reason")
        yield Static("log", id="jobs-log-title")
        with LogScroll(id="jobs-log-scroll"):
            yield Static("", id="jobs-log", markup=True)
        yield Input(placeholder="search the log (Enter: find · Esc: close)", id="jobs-search")

    def on_mount(self) -> None:
        self._rebuild()

    # -- data in
    def on_jobs_changed(self, message: JobsChanged) -> None:
        self.jobs = tuple(message.jobs)
        self._rebuild()
        self._follow()

    def on_job_events_arrived(self, message: JobEventsArrived) -> None:
        for event in message.events:
            if isinstance(event, Progress):
                done = finite(event.done)
                if done is not None:
                    self.progress[message.job_id] = (done, finite(event.total))
        if self.jobs and self.shown:
            self._update_cells()

    def on_resize(self) -> None:
        self._rebuild()
        if self.follow and self.lines:  # shown (a tab opened) or resized: the end stays in view
            self.call_after_refresh(lambda: self.query_one(LogScroll).scroll_end(animate=False))

    # -- selection
    def shown_jobs(self) -> tuple:
        if not self.job_filter:
            return self.jobs
        needle = self.job_filter.lower()
        return tuple(j for j in self.jobs if needle in " ".join((j.id, j.kind, j.state, j.reason or "")).lower())

    @property
    def selected_job(self):
        table = self.query_one(JobList)
        shown = self.shown_jobs()
        if not shown or table.row_count == 0:
            return None
        row = max(0, min(table.cursor_row, len(shown) - 1))
        return shown[row]

    def select_job(self, job_id: str) -> None:
        if job_id not in {j.id for j in self.shown_jobs()}:
            self.job_filter = ""
            self._rebuild()
        for i, job in enumerate(self.shown_jobs()):
            if job.id == job_id:
                self.query_one(JobList).move_cursor(row=i)

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        event.stop()
        job = self.selected_job
        self._render_title()
        if job is not None and job.id != self.log_job:
            self.lines, self.log_job, self.follow = [], job.id, True
            self._render_log()
            self._follow()

    # -- the list
    def _columns(self) -> list[tuple[str, int]]:
        """Columns for the pane's width: the stage goes below 100 cells (the id names it), the reason
        takes what is left (the selected job's whole reason shows under the list)."""
        width = (self.content_region.width or 78) - 1
        progress_width = min(16, max(8, max([len(progress_cell(self.progress.get(j.id), j.state))
                                               for j in self.jobs] or [8])))
        # The id gives way first (its date stays, the random tail goes) so the progress is never cut.
        id_width = max(12, min(32, max([len(j.id) for j in self.jobs] or [20]), width - 12 - progress_width - 4))
        cols = [("state", 10), ("job", id_width), ("progress", progress_width)]
        for name, w, min_width in (("age", 6, 0), ("stage", 8, 110)):
            if width >= min_width and sum(c + 2 for _n, c in cols) + w + 2 <= width:
                cols.insert(2 if name == "age" else 2, (name, w))
        rest = width - sum(c + 2 for _n, c in cols) - 2
        if rest >= 10:
            cols.append(("reason", rest))
        return cols

    def _row(self, job) -> list:
        colour = self.app.theme_variables.get(JOB_STATE_COLOURS.get(job.state, "text-muted"), "")
        state = job.state + ("" if job.exit_code is None or job.exit_code == 0 else f" {job.exit_code}")
        cells = {"state": Text(state, style=colour), "job": job.id, "stage": job.kind,
                 "age": job_age(job, self.clock()), "progress": progress_cell(self.progress.get(job.id), job.state),
                 "reason": (job.reason or "").replace("\n", " ")}
        cols = self._columns()
        cells["reason"] = clip(cells["reason"], cols[-1][1]) if cols[-1][0] == "reason" else ""
        return [cells[name] for name, _w in cols]

    def _rebuild(self) -> None:
        table = self.query_one(JobList)
        row = table.cursor_row
        table.clear(columns=True)
        self._shown_columns = [name for name, _w in self._columns()]
        self._progress_width = dict(self._columns()).get("progress")
        for name, width in self._columns():
            table.add_column(name, key=name, width=width)
        shown = self.shown_jobs()
        for job in shown:
            table.add_row(*self._row(job), key=job.id)
        table.display = bool(shown)
        empty = self.query_one("#jobs-empty", Static)
        empty.display = not shown
        if self.jobs and not shown:
            set_markup(empty, f"no job matches /{esc(self.job_filter)} (Esc clears)")
        elif not self.jobs:
            set_markup(empty, EMPTY_TEXT)
        self.border_subtitle = f"/{self.job_filter}" if self.job_filter else ""
        if shown:
            table.move_cursor(row=max(0, min(row, len(shown) - 1)), animate=False)
            job = self.selected_job
            if job is not None and job.id != self.log_job:
                self.lines, self.log_job = [], job.id
        self._render_title()

    def _update_cells(self) -> None:
        table = self.query_one(JobList)
        widths = dict(self._columns())
        if widths.get("progress") != self._progress_width:
            self._rebuild()  # a longer progress figure: the column grows
            return
        for job in self.shown_jobs():
            try:
                table.update_cell(job.id, "progress", progress_cell(self.progress.get(job.id), job.state))
                if "age" in self._shown_columns:
                    table.update_cell(job.id, "age", job_age(job, self.clock()))
            except Exception:  # a row removed meanwhile
                continue

    # -- the log
    def _follow(self) -> None:
        """Ask the engine to follow the selected job's log (once per selection)."""
        job = self.selected_job
        wanted = job.id if job is not None else None
        if wanted != self._followed and self.is_mounted:
            self._followed = wanted
            self.post_message(FollowLog(wanted))

    def on_job_log_changed(self, message: JobLogChanged) -> None:
        if message.job_id != self.log_job and self.log_job:
            return
        self.log_job = message.job_id
        lines = list(message.lines)
        if lines != self.lines:
            self.lines = lines
            self._render_log()

    def _render_title(self) -> None:
        job = self.selected_job
        title = self.query_one("#jobs-log-title", Static)
        reason = self.query_one("#jobs-reason", Static)
        reason.display = bool(job is not None and job.reason)
        if job is not None and job.reason:
            set_markup(reason, f"✘ {esc(job.id)} {esc(job.state)}"
                       + ("" if job.exit_code is None else f", exit {job.exit_code}") + f": {esc(job.reason)}")
        if job is None:
            title.display = False
            return
        title.display = True
        follow = "following" if self.follow else "paused (f follows)"
        search = f" · /{esc(self.term)} {self.match_index + 1}/{len(self.matches())}" if self.term else ""
        set_markup(title, f"log of [b]{esc(job.id)}[/b] [$text-muted]· {follow}{search} · Tab, then j/k scrolls[/]")

    def matches(self) -> list[int]:
        if not self.term:
            return []
        needle = self.term.lower()
        return [i for i, line in enumerate(self.lines) if needle in line.lower()]

    def _render_log(self) -> None:
        widget = self.query_one("#jobs-log", Static)
        if not self.lines:
            set_markup(widget, "[$text-muted](no output yet)[/]" if self.log_job else "")
        else:
            pattern = re.compile(re.escape(self.term), re.IGNORECASE) if self.term else None
            out = []
            for line in self.lines:
                text = esc(line.rstrip())
                if pattern is not None and pattern.search(line):
                    text = "".join(f"[reverse $warning]{esc(part)}[/]" if pattern.fullmatch(part) else esc(part)
                                   for part in re.split(f"({pattern.pattern})", line.rstrip(), flags=re.IGNORECASE))
                out.append(text)
            set_markup(widget, "\n".join(out))
        self._render_title()
        if self.follow:
            self.call_after_refresh(lambda: self.query_one(LogScroll).scroll_end(animate=False))

    # -- keys (the app's actions call these)
    def toggle_follow(self) -> bool:
        self.follow = not self.follow
        self._render_log()
        return self.follow

    def open_search(self) -> None:
        """`/`: filter the job list when it has focus, else search the log."""
        box = self.query_one("#jobs-search", Input)
        self._search_mode = "list" if self.query_one(JobList).has_focus else "log"
        box.placeholder = ("filter jobs (id, stage, state, reason) · Enter · Esc clears" if self._search_mode == "list"
                           else "search the log (Enter: find · n/N next/previous · Esc: close)")
        box.add_class("-shown")
        box.value = self.job_filter if self._search_mode == "list" else self.term
        box.focus()

    def action_close_search(self) -> None:
        box = self.query_one("#jobs-search", Input)
        if box.has_class("-shown"):
            box.remove_class("-shown")
            (self.query_one(JobList) if self._search_mode == "list" else self.query_one(LogScroll)).focus()
        elif self.job_filter:
            self.job_filter = ""
            self._rebuild()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        if self._search_mode == "list":
            self.job_filter = event.value.strip()
            self.query_one("#jobs-search", Input).remove_class("-shown")
            self._rebuild()
            self.query_one(JobList).focus()
            return
        self.term = event.value if event.value.strip() else ""
        self.query_one("#jobs-search", Input).remove_class("-shown")
        self.follow = False
        found = self.matches()
        self.match_index = len(found) - 1 if found else -1  # the newest match first
        self._render_log()
        self._scroll_to_match()
        self.query_one(LogScroll).focus()

    def next_match(self, step: int) -> None:
        found = self.matches()
        if not found:
            return
        self.match_index = (self.match_index + step) % len(found)
        self.follow = False
        self._render_title()
        self._scroll_to_match()

    def _scroll_to_match(self) -> None:
        found = self.matches()
        if 0 <= self.match_index < len(found):
            line = found[self.match_index]
            scroll = self.query_one(LogScroll)
            self.call_after_refresh(lambda: scroll.scroll_to(y=max(0, line - 2), animate=False))
