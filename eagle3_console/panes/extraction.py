"""Extraction pane: progress of hidden-state extraction, and the disks it writes to.

Everything shown comes from the extraction job's own events (engine.extract.job): progress
(samples, tokens, rates, ETA, bytes written), pauses with their reason, bad samples and
retries, outages, and the final result. The disk gauge of the output filesystem also shows
where usage will be at completion (bytes per token so far × tokens still to go), against the
reserve. Keys (app-level, shown while this pane is active): `s` start, `p` pause/resume,
`S` stop (asks first).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from textual.app import ComposeResult
from textual.containers import Horizontal, VerticalScroll
from textual.notifications import SeverityLevel
from textual.widgets import ProgressBar, Sparkline, Static

from eagle3_console.fmt import finite, fmt_count, fmt_duration
from eagle3_console.keys import scroll_bindings
from eagle3_console.messages import DiskChanged, JobEventsArrived, JobsChanged
from eagle3_console.panes.base import Pane
from eagle3_console.render import clip, esc, set_markup
from engine.jobs.events import (
    BadSample,
    Error,
    Finished,
    Incomplete,
    JobEvent,
    Paused,
    Planning,
    Progress,
    Resumed,
    Retry,
    ServerDown,
    ServerUp,
    Started,
    Stopped,
)
from engine.jobs.manager import ACTIVE_STATES, JobState

HISTORY = 120  # rate samples kept for the sparklines (one per progress event, ~1/s)
USER_PAUSE = "paused by the user"  # the reason engine.extract.job gives for the pause flag


def disk_gauge(usage, width: int, projected_used: int | None = None) -> list[str]:
    """Lines for one filesystem: a used/total bar with the reserve marked, then figures.

    The bar's right end is the reserve (▒): space jobs must leave free. Used space fills
    from the left; it turns $error once free space is inside the reserve. With
    `projected_used`, the cells up to the usage expected at completion show as ▓, and a
    line says whether that projection stays clear of the reserve.
    """
    from engine.system.disk import fmt_bytes

    width = max(10, width)
    total = max(1, usage.total)
    used_cells = min(width, round(width * usage.used / total))
    proj_cells = used_cells
    if projected_used is not None:
        proj_cells = min(width, max(used_cells, round(width * projected_used / total)))
    reserve_cells = min(width, max(1 if usage.reserve else 0, round(width * usage.reserve / total)))
    reserve_start = width - reserve_cells
    colour = "$error" if usage.below_reserve else "$primary"
    cells = []
    for i in range(width):
        if i < used_cells:
            cells.append(f"[{colour}]█[/]")
        elif i < proj_cells:
            cells.append(f"[{'$error' if i >= reserve_start else '$accent'}]▓[/]")
        elif i >= reserve_start:
            cells.append("[$warning]▒[/]")
        else:
            cells.append("[$text-muted]·[/]")
    flag = "  [$error]below reserve[/]" if usage.below_reserve else ""
    label = esc(clip(usage.label, max(8, width - 10)))
    lines = [
        f"[b]{label}[/b] [$text-muted]on[/] {esc(usage.mount)}",
        "".join(cells),
        f"free {fmt_bytes(usage.free)} of {fmt_bytes(usage.total)} · used {fmt_bytes(usage.used)}"
        f" · reserve {fmt_bytes(usage.reserve)}{flag}",
    ]
    if projected_used is not None:
        # From free space, not total - used: filesystems keep blocks back (root reserve, overlays).
        free_after = usage.free - max(0, projected_used - usage.used)
        ok = free_after >= usage.reserve
        verdict = "[$success]clear of the reserve[/]" if ok else "[$error]INSIDE the reserve: extraction will pause[/]"
        lines.append(f"at completion ▓ used {fmt_bytes(projected_used)}, free {fmt_bytes(max(0, free_after))} · {verdict}")
    return lines


@dataclass
class ExtractionView:
    """What the pane knows about the newest extraction job, folded from its events."""

    job_id: str = ""
    job_state: str = ""
    phase: str = ""  # planning | running | paused | finished | stopped | error | incomplete
    done: int = 0
    total: int = 0
    tokens: int = 0
    total_tokens: int = 0
    bytes: int = 0
    bad: int = 0
    tokens_per_s: float | None = None
    mb_per_s: float | None = None
    eta_s: float | None = None
    paused: str = ""
    output_mount: str = ""
    budget: str = ""
    truncated: int = 0
    resumed: int = 0
    last_bad: str = ""
    retries: int = 0
    server_down: str = ""
    result: str = ""
    reason: str = ""  # why the job failed: its last error line (engine.jobs.manager.JobInfo.reason)
    tok_history: deque = field(default_factory=lambda: deque(maxlen=HISTORY))
    mb_history: deque = field(default_factory=lambda: deque(maxlen=HISTORY))

    def apply(self, event: JobEvent) -> None:
        if isinstance(event, Progress):
            for key in ("done", "total", "tokens", "total_tokens", "bytes", "bad"):
                if (value := finite(getattr(event, key))) is not None:
                    setattr(self, key, int(value))
            # NaN/inf (logged as "NaN"/"Infinity") read as unknown: "?" and a zero in the sparkline.
            self.tokens_per_s = finite(event.tokens_per_s)
            self.mb_per_s = finite(event.mb_per_s)
            self.eta_s = finite(event.eta_s)
            self.paused = event.paused or ""
            self.output_mount = event.output_mount or self.output_mount
            self.tok_history.append(float(self.tokens_per_s or 0.0))
            self.mb_history.append(float(self.mb_per_s or 0.0))
            if self.phase in ("", "planning", "running", "paused"):
                self.phase = "paused" if self.paused else "running"
        elif isinstance(event, Planning):
            self.phase = "planning"
        elif isinstance(event, Started):
            self.phase = "running"
            self.total = int(finite(event.samples) or self.total)
            self.budget = event.budget or ""
            self.truncated = int(finite(event.truncated) or 0)
            self.resumed = int(finite(event.resumed) or 0)
        elif isinstance(event, Paused):
            self.phase, self.paused = "paused", event.reason or "paused"
        elif isinstance(event, Resumed):
            self.phase, self.paused = "running", ""
        elif isinstance(event, BadSample):
            self.last_bad = f"{_or(event.id, '?')}: {_or(event.reason, '')}"
        elif isinstance(event, Retry):
            self.retries += 1
        elif isinstance(event, ServerDown):
            self.server_down = event.url or "server"
        elif isinstance(event, ServerUp):
            self.server_down = ""
        elif isinstance(event, Finished):
            self.phase = "finished"
            self.result = f"finished: {_or(event.samples, '?')} samples, {fmt_count(event.tokens)} tokens"
        elif isinstance(event, Stopped):
            self.phase = "stopped"
            self.result = f"stopped at {_or(event.done, '?')}/{_or(event.total, '?')}; start again to resume"
        elif isinstance(event, Incomplete):
            self.phase = "incomplete"
            self.result = f"incomplete: {_or(event.count, '?')} samples missing; start again to redo them"
        elif isinstance(event, Error):
            self.phase = "error"
            self.result = f"error: {_or(event.message, '')}"

    @property
    def remaining_bytes(self) -> int | None:
        """Bytes still to write: bytes per token so far × tokens to go (None before any data)."""
        if self.tokens <= 0 or self.bytes <= 0 or self.total_tokens <= 0:
            return None
        return int(self.bytes / self.tokens * max(0, self.total_tokens - self.tokens))


def _or(value: object, default: str) -> object:
    """A field as the pane shows it: `default` where the job did not write it."""
    return default if value is None else value


def notice_for(event: JobEvent) -> tuple[SeverityLevel, str] | None:
    """(severity, text) for events worth a notification the engine does not send itself."""
    if isinstance(event, Finished):
        return "information", f"extraction finished: {_or(event.samples, '?')} samples, bad {_or(event.bad, '0')}"
    if isinstance(event, Error):
        return "error", f"extraction failed: {_or(event.message, '')}"
    if isinstance(event, Incomplete):
        return "warning", f"extraction incomplete: {_or(event.count, '?')} samples missing"
    if isinstance(event, BadSample):
        return "warning", f"bad sample {_or(event.id, '?')}: {_or(event.reason, '')}"
    return None


class ExtractScroll(VerticalScroll):
    """Progress and disks: Tab focuses it; j/k, arrows and PgUp/PgDn scroll."""

    BINDINGS = scroll_bindings()


PHASE_COLOURS = {"running": "$success", "paused": "$warning", "finished": "$success", "stopped": "$warning",
                 "error": "$error", "incomplete": "$warning", "planning": "$primary", "failed": "$error",
                 "lost": "$error"}


class ExtractionPane(Pane):
    """Extraction progress from the job's events, and a disk gauge per written filesystem."""

    PANE_ID = "extraction"
    TITLE = "Extraction"
    DEFAULT_CSS = """
    ExtractionPane #extract-scroll { height: 1fr; }
    ExtractionPane #extract-state { height: auto; }
    ExtractionPane #extract-bar { height: 1; }
    ExtractionPane #extract-bar Bar { width: 1fr; }
    ExtractionPane #extract-numbers { height: auto; }
    ExtractionPane .rate-row { height: 1; }
    ExtractionPane .rate-label { width: 18; }
    ExtractionPane .rate-spark { width: 1fr; height: 1; }
    ExtractionPane #extract-warnings { height: auto; }
    ExtractionPane #extract-paused { height: auto; background: $warning 20%; color: $text; text-style: bold; }
    ExtractionPane #disk-gauges { height: auto; margin-top: 1; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.usages: tuple = ()
        self.view = ExtractionView()
        self.mounted_at = time.time()
        # The user's last pause/resume request until the job's events confirm it (None: none pending).
        self.pause_requested: bool | None = None

    def compose(self) -> ComposeResult:
        # Scrolls (Tab focuses it) when the disks do not fit under the progress at 80x24.
        with ExtractScroll(id="extract-scroll"):
            yield Static(
                "[b]no extraction run yet[/b]\n[$text-muted]Pass the checks up to `disk`, then press [b]s[/b] to "
                "extract.[/]",
                id="extract-state",
            )
            yield Static("", id="extract-paused")
            # A known total from the start: an indeterminate bar animates on a 15 Hz timer even while
            # hidden (it is shown only once the job reports its total).
            yield ProgressBar(total=1, show_eta=False, id="extract-bar")
            yield Static("", id="extract-numbers")
            with Horizontal(classes="rate-row", id="tok-row"):
                yield Static("", classes="rate-label", id="tok-label")
                yield Sparkline([], classes="rate-spark", id="tok-spark")
            with Horizontal(classes="rate-row", id="mb-row"):
                yield Static("", classes="rate-label", id="mb-label")
                yield Sparkline([], classes="rate-spark", id="mb-spark")
            yield Static("", id="extract-warnings")
            yield Static("[$text-muted]measuring disks…[/]", id="disk-gauges")

    def on_mount(self) -> None:
        self.mounted_at = time.time()
        self._render_view()

    # -- messages
    def on_disk_changed(self, message: DiskChanged) -> None:
        self.usages = tuple(message.usages)
        self._render_gauges()

    def on_jobs_changed(self, message: JobsChanged) -> None:
        newest = next((j for j in message.jobs if j.kind == "extract"), None)
        if newest is None:
            return
        if newest.id != self.view.job_id:
            self.view = ExtractionView(job_id=newest.id)
        reason = newest.reason or ""
        if newest.state != self.view.job_state or reason != self.view.reason:
            self.view.job_state = newest.state
            self.view.reason = reason
            self._render_view()

    def on_job_events_arrived(self, message: JobEventsArrived) -> None:
        if message.kind != "extract":
            return
        if message.job_id != self.view.job_id:
            self.view = ExtractionView(job_id=message.job_id)  # its state comes with the next job list
        for event in message.events:
            self.view.apply(event)
            if self.pause_requested is not None and self.user_paused == self.pause_requested:
                self.pause_requested = None  # the job did what was asked
            notice = notice_for(event)
            # History replayed on attach is not news: only events newer than this console notify.
            if notice and (event.t or 0.0) >= self.mounted_at - 1:
                self.app.notify(notice[1], severity=notice[0], timeout=8 if notice[0] != "error" else 15)
        self._render_view()
        self._render_gauges()

    def on_resize(self) -> None:
        self._render_view()
        if self.usages:
            self._render_gauges()

    # -- read by the app's actions and by tests
    @property
    def running_job_id(self) -> str | None:
        return self.view.job_id if self.view.job_id and self.view.job_state in ACTIVE_STATES else None

    @property
    def user_paused(self) -> bool:
        return self.view.paused == USER_PAUSE

    def wants_pause(self) -> bool:
        """Whether the user's pause is in force (or asked for and not yet confirmed)."""
        return self.user_paused if self.pause_requested is None else self.pause_requested

    # -- rendering
    def _render_view(self) -> None:
        v = self.view
        state = self.query_one("#extract-state", Static)
        parts = [self.query_one("#extract-bar"), self.query_one("#extract-numbers"), self.query_one("#tok-row"),
                 self.query_one("#mb-row")]
        paused = self.query_one("#extract-paused", Static)
        if not v.job_id:
            for part in parts:
                part.display = False
            paused.display = False
            self.query_one("#extract-warnings", Static).display = False
            return
        phase = v.phase or v.job_state or "starting"
        if v.job_state in (JobState.FAILED, JobState.LOST) and phase in ("starting", "planning", "running", "paused"):
            phase = v.job_state  # it ended without saying so in its events: not "planning" any more
        colour = PHASE_COLOURS.get(phase, "$text-muted")
        job = f"job {esc(v.job_id)}" + (f" · {esc(v.job_state)}" if v.job_state and v.job_state != phase else "")
        lines = [f"[{colour}]● [b]{esc(phase)}[/b][/] · {job}"]
        if v.result:
            lines.append(f"[{colour}]{esc(v.result)}[/]")
        if v.reason and phase != "error":  # an "error" event already said why, in the job's own words
            width = max(20, (self.content_region.width or 78) - 1)
            lines.append(f"[$error]{esc(clip(f'{v.job_state}: {v.reason}', width))}[/]")
        set_markup(state, "\n".join(lines))
        paused.display = bool(v.paused) and phase == "paused"
        set_markup(paused, f"PAUSED: {esc(v.paused)}" + ("  (p resumes)" if v.paused == USER_PAUSE else ""))
        for part in parts:
            part.display = v.total > 0
        bar = self.query_one("#extract-bar", ProgressBar)
        if v.total:
            bar.update(total=v.total, progress=v.done)
        eta = fmt_duration(v.eta_s) if v.eta_s is not None and phase == "running" else "—"
        tokens = f"{fmt_count(v.tokens)}/{fmt_count(v.total_tokens)}" if v.total_tokens else fmt_count(v.tokens)
        per_token = _per_token(v.bytes, v.tokens)
        eta_part = f" · ETA {eta}"
        room = (self.content_region.width or 78) - 1
        plain = f"samples {v.done}/{v.total} · tokens {tokens} · bad {v.bad}"
        # Never wrap the line. Where it is tight, an ETA with no estimate goes before bytes per token
        # (the figure that sizes a run), which goes only where it still does not fit.
        if len(plain) + len(eta_part) + len(per_token) > room:
            if eta == "—" and len(plain) + len(per_token) <= room:
                eta_part = ""
            else:
                per_token = ""
        eta_markup = f" · ETA [b]{eta}[/b]" if eta_part else ""
        set_markup(self.query_one("#extract-numbers", Static),
            f"samples [b]{v.done}/{v.total}[/b] · tokens {tokens}{eta_markup} · "
            f"bad {'[$error]' if v.bad else ''}{v.bad}{'[/]' if v.bad else ''}{per_token}")
        tok_s = "?" if v.tokens_per_s is None else fmt_count(v.tokens_per_s)
        mb_s = "?" if v.mb_per_s is None else f"{v.mb_per_s:.1f}"
        set_markup(self.query_one("#tok-label", Static), f"tok/s [b]{tok_s}[/b]")
        set_markup(self.query_one("#mb-label", Static), f"MB/s  [b]{mb_s}[/b]")
        self.query_one("#tok-spark", Sparkline).data = list(v.tok_history) or [0.0]
        self.query_one("#mb-spark", Sparkline).data = list(v.mb_history) or [0.0]
        self._render_warnings()

    def _render_warnings(self) -> None:
        v = self.view
        width = max(30, self.content_region.width or 76)
        warnings = []
        if v.server_down:
            warnings.append(f"[$error]server down ({esc(clip(v.server_down, 40))}): waiting, restarting if ours[/]")
        if v.truncated:
            warnings.append(f"[$warning]{v.truncated} sample(s) truncated at dataset.max_seq_len[/]")
        if v.last_bad:
            warnings.append(f"[$warning]bad: {esc(clip(v.last_bad, width - 6))}[/]")
        if v.retries:
            warnings.append(f"[$text-muted]{v.retries} retried request(s)[/]")
        widget = self.query_one("#extract-warnings", Static)
        widget.display = bool(warnings)
        set_markup(widget, "\n".join(warnings))

    def _render_gauges(self) -> None:
        width = max(20, (self.content_region.width or 76))
        remaining = self.view.remaining_bytes if self.view.phase in ("running", "paused") else None
        lines: list[str] = []
        for usage in self.usages:
            projected = None
            if remaining is not None and usage.mount == self.view.output_mount:
                projected = usage.used + remaining
            lines.extend(disk_gauge(usage, width, projected))
        set_markup(self.query_one("#disk-gauges", Static), "\n".join(lines) or "[$warning]no disk readable[/]")


def _per_token(written: int, tokens: int) -> str:
    """Bytes on disk per token so far (the figure that sizes a run: aux + final states, ids, mask)."""
    if written <= 0 or tokens <= 0:
        return ""
    per = written / tokens
    return f" · {per / 1024:.1f} KiB/tok" if per >= 1024 else f" · {per:.0f} B/tok"
