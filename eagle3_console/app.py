"""The Textual console: seven panes over one engine, under a one-line status strip.

The app owns no state of its own beyond the view: the engine samples GPUs and disks, runs
checks and watches jobs, and publishes events; the app turns each into a message for the
pane that shows it. Check runs go through workers, so the UI never waits on a check.
Quitting closes the view only: jobs are detached processes that keep running. So does losing
the terminal (a dropped SSH link): SIGHUP, or a terminal that can no longer be read, closes
the console cleanly (lock released, jobs untouched) instead of leaving it spinning on a dead tty.
Whatever the console is doing when its terminal goes (quitting, waiting on a check), a guard
thread outside the event loop ends the process once the terminal has been gone TTY_GONE_EXIT_S.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from functools import partial
from pathlib import Path
from typing import Callable, Iterable

from textual import work
from textual.app import App, ComposeResult, SystemCommand
from textual.screen import Screen
from textual.widgets import Tab, Tabs
from textual.worker import Worker, WorkerState

from eagle3_console.actions import JobActions
from eagle3_console.footer import ConsoleFooter
from eagle3_console.header import ConsoleHeader
from eagle3_console.help import HelpScreen
from eagle3_console.keys import bindings
from eagle3_console.layout import PaneDeck, layout_for
from eagle3_console.messages import (
    DiskChanged,
    EvaluationReportChanged,
    FollowLog,
    GpuChanged,
    JobEventsArrived,
    JobLogChanged,
    JobsChanged,
    ReloadEvaluation,
    RunChecks,
    ServerChanged,
    StageChanged,
    TrainingMetricsArrived,
)
from eagle3_console.panes import (
    EvaluationPane,
    ExtractionPane,
    GpuPane,
    JobsPane,
    PipelinePane,
    ServerPane,
    TrainingPane,
)
from eagle3_console.panes.base import Pane
from eagle3_console.fmt import finite
from eagle3_console.strip import JobProgress, StatusStrip
from eagle3_console.tabs import SHORT_LABELS, SHORT_TABS_BELOW, TABS
from engine.jobs.events import Paused, Progress, Resumed
from engine.registry import STAGE_JOBS, STAGE_PANES

ENGINE_START_DELAY_S = 0.1  # after the first paint: the footer is rebuilt just after it
TTY_CHECK_S = 1.0  # how often the app checks that its terminal is still there (then closes cleanly)
TTY_GUARD_S = 0.25  # how often the guard thread checks it
TTY_GONE_EXIT_S = 2.5  # a console whose terminal has been gone this long exits, whatever it is doing
SHIPPED_THEMES = ("eagle3-dark", "eagle3-light", "eagle3-contrast")


class ConsoleApp(JobActions, App[int]):
    """The eagle3 console. `engine` is an engine.core.Engine (driving or read-only)."""

    TITLE = "eagle3-console"
    CSS = """
    Screen { layout: vertical; }
    #tabs.-hidden { display: none; }
    Tab { color: $foreground 75%; }  /* Textual's 50 % is 3.1:1 on the light theme */
    """
    BINDINGS = bindings()  # eagle3_console.keys: the one key table
    MESSAGE_S = {"information": 5.0, "warning": 10.0, "error": 15.0}

    def __init__(self, engine) -> None:
        super().__init__()
        self.engine = engine
        self.workspace = engine.workspace
        self._unsubscribe: Callable[[], None] | None = None
        self._closed = False
        self.engine_closed = False  # the engine's pollers stopped and the lock released
        self.hung_up = False
        self.theme_errors: list[str] = []
        self.theme_names = self._register_themes()
        wanted = self.engine.config.ui.theme
        self._theme_warning = ""
        if wanted in self.available_themes:
            self.theme = wanted
        else:
            self._theme_warning = (f"theme '{wanted}' (ui.theme) is not installed; using eagle3-dark. "
                                   f"Installed: {', '.join(self.theme_names)}")
            self.theme = "eagle3-dark"
        self._saved_theme = self.theme  # a fallback theme is not written over the configured one
        self.job_progress: dict[str, JobProgress] = {}  # job id -> progress and smoothed rate (the strip)
        self._drift_checked = 0.0

    # -- setup
    def _register_themes(self) -> list[str]:
        """Shipped themes, then user themes from <workspace>/themes/*.toml (bad files reported)."""
        from themes import load_theme_dir, load_themes

        names = []
        for theme in load_themes():
            self.register_theme(theme)
            names.append(theme.name)
        report = load_theme_dir(self.workspace.root / "themes")
        for theme in report.themes:
            self.register_theme(theme)
            if theme.name not in names:
                names.append(theme.name)
        self.theme_errors = report.errors
        # Shipped order first (dark, light, contrast), then user themes alphabetically.
        return [n for n in SHIPPED_THEMES if n in names] + sorted(n for n in names if n not in SHIPPED_THEMES)

    def compose(self) -> ComposeResult:
        engine = self.engine
        holder = None
        if engine.read_only:  # by choice (--read-only, screenshots) or because another console drives
            nobody = engine.lock_holder is None and engine.attached_by_choice
            holder = "nobody" if nobody else describe_holder(engine.lock_holder)

        yield ConsoleHeader(self.workspace.root, holder, id="header")
        yield StatusStrip(id="strip")
        yield Tabs(*[Tab(f"{i} {label}", id=tab) for i, (tab, label) in enumerate(TABS, start=1)],
                   active="pipeline", id="tabs")
        from engine.pipeline import stages

        with PaneDeck(id="deck", classes="-narrow"):
            yield GpuPane(nccl_preset=engine.config.gpu.nccl_preset, disable_nvls=engine.config.gpu.disable_nvls)
            yield ServerPane()
            yield PipelinePane(stages(), engine.reports())
            yield ExtractionPane()
            yield TrainingPane()  # the panes read no file: the engine's watchers send what they show
            yield EvaluationPane()
            yield JobsPane()
        yield ConsoleFooter(compact=True)  # room for the active pane's keys at 80 columns

    async def on_mount(self) -> None:
        self._apply_layout(self.size.width)
        self.query_one(PaneDeck).activate("pipeline")
        strip = self.query_one(StatusStrip)
        strip.state.stages = {r.stage: r.state.value for r in self.engine.reports()}
        strip.state.server_port = self.engine.config.server.port
        strip.state.server_backend = self.engine.config.model.backend
        strip.state.gpu = self.engine.gpu_snapshot
        strip.refresh_strip()
        self.query_one("#stage-table").focus()
        self._unsubscribe = self.engine.subscribe(self._on_engine_event)
        self.theme_changed_signal.subscribe(self, self._on_theme_changed)
        for error in self.theme_errors:
            self.notify(error, title="theme file skipped", severity="warning", timeout=10)
        if self._theme_warning:
            self.notify(self._theme_warning, severity="warning", timeout=10)
        if self.engine.gpu_snapshot is not None:
            self.query_one(GpuPane).post_message(GpuChanged(self.engine.gpu_snapshot))
        if self.engine.server_status is not None:
            self.query_one(ServerPane).post_message(ServerChanged(self.engine.server_status))
            self._strip_server(self.engine.server_status)
        self._watch_terminal()
        # In a terminal the pollers start just after the first frame (screen and footer) is
        # painted: their first samples (NVML start-up, a job scan) would otherwise compete with
        # it for the CPU. Headless (tests) they start at once, so a test finds them running.
        if self.is_headless:
            await self._start_engine()
        else:
            self.call_after_refresh(lambda: self.set_timer(ENGINE_START_DELAY_S, self._start_engine))

    async def _start_engine(self) -> None:
        if not self._closed:
            await self.engine.start()

    # -- losing the terminal (SSH drop)
    def _watch_terminal(self) -> None:
        """Exit on SIGHUP, and when the terminal stops being one (checked every TTY_CHECK_S)."""
        if self.is_headless:
            return  # tests and benchmarks: there is no terminal to lose
        import asyncio

        try:
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self.hang_up)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no SIGHUP
            pass
        self._check_ctty = terminal_alive(check_ctty=True)
        self.set_interval(TTY_CHECK_S, self._check_terminal, name="tty-watchdog")
        # A terminal that hangs up sends SIGCONT along with SIGHUP, and Textual answers SIGCONT
        # (the return from Ctrl+Z) by starting application mode again: on a dead terminal, or
        # once the console is closing, that starts a new input thread that spins on EOF and,
        # not being a daemon, keeps the process alive after the app has closed.
        resume = signal.getsignal(signal.SIGCONT)
        if callable(resume):
            def on_sigcont(signum, frame) -> None:
                if not self._closed and terminal_alive(check_ctty=self._check_ctty):
                    resume(signum, frame)

            try:
                signal.signal(signal.SIGCONT, on_sigcont)
            except ValueError:  # not the main thread
                pass

    def _check_terminal(self) -> None:
        if not terminal_alive(check_ctty=self._check_ctty):
            self.hang_up()

    def hang_up(self) -> None:
        """The terminal went away: close like `q` (jobs keep running, lock released), quietly."""
        self.hung_up = True
        self.call_later(self.action_quit)

    async def on_unmount(self) -> None:
        await self.close_engine()

    async def close_engine(self) -> None:
        """Stop the engine's pollers and release the lock; jobs are left running."""
        if self._closed:
            return
        self._closed = True
        if self._unsubscribe is not None:
            self._unsubscribe()
        await self.engine.close()
        self.engine_closed = True

    # -- engine events -> pane messages
    def _on_engine_event(self, event) -> None:
        from engine.events import (
            DiskUpdated,
            EvaluationReport,
            GpuUpdated,
            JobEvents,
            JobLogTail,
            JobsUpdated,
            Notice,
            ServerUpdated,
            StageUpdated,
            TrainingMetrics,
        )

        strip = self.query_one(StatusStrip)
        if isinstance(event, GpuUpdated):
            pane = self.query_one(GpuPane)
            pane.record_sample(event.snapshot)
            pane.post_message(GpuChanged(event.snapshot))
            strip.state.gpu = event.snapshot
            strip.refresh_strip()
        elif isinstance(event, DiskUpdated):
            self.query_one(ExtractionPane).post_message(DiskChanged(event.usages))
            strip.state.below_reserve = [u.label for u in event.usages if u.below_reserve]
            strip.state.disk_free = min((u.free for u in event.usages), default=None)
            strip.refresh_strip()
        elif isinstance(event, StageUpdated):
            self.query_one(PipelinePane).post_message(StageChanged(event.report))
            strip.state.stages[event.report.stage] = event.report.state.value
            strip.refresh_strip()
        elif isinstance(event, JobsUpdated):
            self.post_message(JobsChanged(event.jobs))
        elif isinstance(event, ServerUpdated):
            self.query_one(ServerPane).post_message(ServerChanged(event.status))
            self._strip_server(event.status)
        elif isinstance(event, JobEvents):
            arrived = partial(JobEventsArrived, event.job_id, event.kind, event.events, event.history)
            self.query_one(JobsPane).post_message(arrived())
            self._track_progress(event)
            shown_in = STAGE_PANES.get(event.kind)  # the pane that follows this kind of job (engine.registry)
            if shown_in is not None and event.kind in STAGE_JOBS:
                self.query_one(f"#pane-{shown_in}", Pane).post_message(arrived())
        elif isinstance(event, TrainingMetrics):
            self.query_one(TrainingPane).post_message(
                TrainingMetricsArrived(event.records, event.reset, event.latest, event.best))
        elif isinstance(event, EvaluationReport):  # the engine re-reads it when it changes on disk
            self.query_one(EvaluationPane).post_message(EvaluationReportChanged(event.report, event.problem))
        elif isinstance(event, JobLogTail):
            self.query_one(JobsPane).post_message(JobLogChanged(event.job_id, event.lines))
        elif isinstance(event, Notice):
            severity = event.level if event.level in ("information", "warning", "error") else "information"
            self.notify(event.text, severity=severity)

    # -- the status strip
    def _track_progress(self, event) -> None:
        """Fold a job's progress events into its JobProgress (smoothed rate for the ETA)."""
        progress = self.job_progress.get(event.job_id)
        if progress is None:
            progress = self.job_progress[event.job_id] = JobProgress(event.kind, event.job_id)
        changed = False
        for e in event.events:
            if isinstance(e, Progress):
                progress.done, progress.total = e.done, e.total or progress.total
                progress.unit = e.unit or ""
                progress.eta_s = finite(e.eta_s)
                progress.paused = e.paused or ""
                progress.tracker.update(e.done, e.total, e.t)
                changed = True
            elif isinstance(e, Paused):
                progress.paused, changed = e.reason or "paused", True
            elif isinstance(e, Resumed):
                progress.paused, changed = "", True
        if changed:
            self.query_one(StatusStrip).refresh_strip()

    def _strip_server(self, status) -> None:
        from urllib.parse import urlparse

        strip = self.query_one(StatusStrip)
        strip.state.server_state = status.state
        if status.backend:
            strip.state.server_backend = status.backend
        try:
            port = urlparse(status.url).port if status.url else None
        except ValueError:
            port = None
        if port:
            strip.state.server_port = port
        strip.refresh_strip()
        self._check_drift(status)

    def _check_drift(self, status) -> None:
        """Settings where the running server differs from console.toml (Engine.server_drift, when the
        engine has it), at most every 5 s, in a worker: it may read files."""
        if not hasattr(self.engine, "server_drift"):
            return
        if status.state not in ("ready", "starting", "unhealthy"):
            strip = self.query_one(StatusStrip)
            if strip.state.drift:
                strip.state.drift = []
                strip.refresh_strip()
            return
        now = time.monotonic()
        if now - self._drift_checked < 5.0:
            return
        self._drift_checked = now
        self.run_worker(self._read_drift(), group="drift", exclusive=True, exit_on_error=False)

    async def _read_drift(self) -> None:
        import asyncio
        import inspect

        try:
            drift = await asyncio.to_thread(self.engine.server_drift)
            if inspect.isawaitable(drift):
                drift = await drift
        except Exception:  # the helper is another engineer's and may be mid-change: no strip warning
            return
        strip = self.query_one(StatusStrip)
        drift = list(drift or [])
        if drift != strip.state.drift:
            strip.state.drift = drift
            strip.refresh_strip()

    def on_jobs_changed(self, message: JobsChanged) -> None:
        running = [job for job in message.jobs if job.state in ("starting", "running")]
        self.query_one(ConsoleHeader).set_running_jobs(len(running))
        strip = self.query_one(StatusStrip)
        strip.state.running = [self.job_progress.setdefault(j.id, JobProgress(j.kind, j.id)) for j in running
                               if j.kind != "server"]
        strip.refresh_strip()
        self.query_one(JobsPane).post_message(JobsChanged(message.jobs))
        self.query_one(GpuPane).post_message(JobsChanged(message.jobs))
        for pane in (ExtractionPane, TrainingPane, EvaluationPane):
            self.query_one(pane).post_message(JobsChanged(message.jobs))

    # -- pane requests -> the engine
    def on_follow_log(self, message: FollowLog) -> None:
        """The Jobs pane selected a job: the engine follows its log and sends it at once."""
        message.stop()
        self.engine.follow_log(message.job_id)
        self.run_worker(self.engine.refresh_files(), group="engine-files", exit_on_error=False)

    def on_reload_evaluation(self, message: ReloadEvaluation) -> None:
        message.stop()
        self.run_worker(self.engine.reload_evaluation(), group="engine-files", exit_on_error=False)

    # -- layout
    def on_resize(self, event) -> None:
        self._apply_layout(event.size.width)

    def _apply_layout(self, width: int) -> None:
        name = layout_for(width)
        self.query_one(PaneDeck).set_layout(name)
        tabs = self.query_one("#tabs", Tabs)
        tabs.set_class(name == "wide", "-hidden")
        # Below 70 columns the palette hint gives its room to the pane's keys (Ctrl+P still works).
        self.query_one(ConsoleFooter).show_command_palette = width >= 70
        short = width < SHORT_TABS_BELOW
        for i, (tab, label) in enumerate(TABS, start=1):
            wanted = f"{i} {SHORT_LABELS[tab] if short else label}"
            for widget in tabs.query(f"#{tab}").results(Tab):
                if str(widget.label) != wanted:
                    widget.label = wanted

    def on_tabs_tab_activated(self, event: Tabs.TabActivated) -> None:
        if event.tab is not None and event.tab.id:
            self.query_one(PaneDeck).activate(event.tab.id)
            self.refresh_bindings()  # each pane's keys show only while it is active

    # -- actions
    def action_show_tab(self, tab: str) -> None:
        """Switch to a tab (narrow) or move focus into that pane (wide)."""
        deck = self.query_one(PaneDeck)
        self.query_one("#tabs", Tabs).active = tab
        deck.activate(tab)
        self.refresh_bindings()
        if tab == "pipeline":
            self.query_one("#stage-table").focus()
        elif tab == "jobs":
            self.query_one("#jobs-table").focus()
        elif not deck.wide:
            self.query_one("#tabs", Tabs).focus()
        else:  # several panes show: move focus into this one (its border lights up)
            pane = self.query_one(f"#pane-{tab}")
            target = next((w for w in pane.query("*") if w.focusable), None)
            (target or self.query_one("#tabs", Tabs)).focus()

    def action_run_selected(self) -> None:
        self.run_checks([self.query_one(PipelinePane).selected_stage])

    def action_run_all(self) -> None:
        self.run_checks(None)

    def action_cycle_theme(self) -> None:
        names = self.theme_names
        current = names.index(self.theme) if self.theme in names else -1
        self.theme = names[(current + 1) % len(names)]
        self.notify(f"theme: {self.theme}", timeout=2)

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen(read_only=self.engine.read_only))

    def _refresh_notifications(self) -> None:
        """Notifications are kept (Textual's list: the palette, tests) but never drawn as toasts over
        the panes; the header line shows each one (`notify`)."""

    def notify(self, message: str, *, title: str = "", severity="information", timeout: float | None = None,
               markup: bool = True) -> None:
        """Kept as Textual notifications (the palette, tests), shown on the header line instead of a
        toast over the panes: a message never hides a stage row or a figure."""
        super().notify(message, title=title, severity=severity, timeout=timeout, markup=markup)
        try:
            header = self.query_one(ConsoleHeader)
        except Exception:  # before compose
            return
        text = f"{title}: {message}" if title else message
        header.show_message(text, severity, timeout or self.MESSAGE_S.get(severity, 5.0))

    async def action_quit(self) -> None:
        await self.close_engine()
        self.exit(0)

    # -- checks
    def on_run_checks(self, message: RunChecks) -> None:
        self.run_checks(message.names)

    def run_checks(self, names: list[str] | None) -> None:
        """Run stage checks in a worker; a stage already being checked is not started twice."""
        reports = self.engine.pipeline.reports
        if names is not None:
            busy = [n for n in names if reports[n].state.value == "running"]
            names = [n for n in names if n not in busy]
            if busy:
                self.notify(f"already checking: {', '.join(busy)}", timeout=3)
            if not names:
                return
        what = ", ".join(names) if names else "all stages"
        self.run_worker(self.engine.run_checks(names), group="checks", exit_on_error=False,
                        description=f"checking {what}")

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        if event.worker.group == "checks" and event.state is WorkerState.ERROR:
            self.notify(f"{event.worker.description} failed: {event.worker.error}", severity="error", timeout=10)

    # -- themes
    def _on_theme_changed(self, theme) -> None:
        if theme.name == self._saved_theme:
            return
        if self.engine.read_only:
            self._saved_theme = theme.name  # remembered for this session only
            return
        self._saved_theme = theme.name
        self._save_theme(theme.name)

    @work(thread=True, group="config", exclusive=True, exit_on_error=False)
    def _save_theme(self, name: str) -> None:
        """Write ui.theme into console.toml in place: edits made meanwhile and the operator's notes survive."""
        from engine.config import ConfigError

        try:
            self.workspace.save_setting("ui.theme", name)
        except (ConfigError, OSError) as exc:
            self.call_from_thread(self.notify, f"theme not saved: {exc}", severity="warning", timeout=10)

    # -- command palette
    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        # Textual's own Quit, Keys and Maximize duplicate ours (or have no key): not listed.
        for command in super().get_system_commands(screen):
            if command.title not in ("Quit", "Keys", "Maximize", "Minimize"):
                yield command
        yield SystemCommand("Run stage checks", "Run the checks of the selected pipeline stage (r)",
                            self.action_run_selected)
        yield SystemCommand("Run all checks", "Run every stage's checks in pipeline order (R)", self.action_run_all)
        yield SystemCommand("Next theme", "Cycle eagle3-dark → light → contrast (t)", self.action_cycle_theme)
        yield SystemCommand("Keys and help", "Show every key binding (?)", self.action_help)
        yield from self.job_commands(screen)
        for i, (tab, label) in enumerate(TABS, start=1):
            yield SystemCommand(f"Show {label}", f"Switch to the {label} pane ({i})", partial(self.action_show_tab, tab))
        yield SystemCommand("Close console (jobs keep running)", "Quit the console; jobs keep running (q)",
                            self.action_quit)


def terminal_alive(check_ctty: bool = True) -> bool:
    """Whether the console still has a terminal: stdin is a tty and (check_ctty) /dev/tty opens.

    After an SSH drop the pty is hung up: /dev/tty no longer opens (ENXIO/EIO) and stdin
    reads return EOF, which would otherwise leave the input thread spinning. `check_ctty` is
    used only when /dev/tty opened at start (some containers run without a controlling tty).
    """
    stdin = sys.__stdin__
    try:
        if stdin is None or not os.isatty(stdin.fileno()):
            return False
    except (OSError, ValueError):
        return False
    if not check_ctty:
        return True
    try:
        fd = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError:
        return False
    os.close(fd)
    return True


def start_terminal_guard(app: ConsoleApp) -> threading.Thread | None:
    """End the process once its terminal is gone and the app has closed its engine, or once the
    terminal has been gone TTY_GONE_EXIT_S, whatever the console is doing.

    The app closes itself on SIGHUP or its own tty check, but only while its event loop runs,
    and the process then still waits for a check's thread to finish (seconds of imports) before
    it can exit; a console whose terminal goes while it quits got no SIGHUP handling at all.
    This daemon thread does not depend on the loop (it keeps running while the interpreter waits
    for other threads at exit). os._exit closes every file, so the kernel drops the workspace
    lock even if the engine never released it; jobs are detached processes and keep running.
    Nothing is started when there is no terminal to lose (stdin not a tty).
    """
    if not terminal_alive(check_ctty=False):
        return None
    check_ctty = terminal_alive(check_ctty=True)

    def guard() -> None:
        gone_since = None
        while True:
            time.sleep(TTY_GUARD_S)
            if terminal_alive(check_ctty=check_ctty):
                gone_since = None
                continue
            now = time.monotonic()
            if gone_since is None:
                gone_since = now
            if app.engine_closed or now - gone_since >= TTY_GONE_EXIT_S:
                os._exit(0)  # nobody is left to read anything; the lock goes with the process

    thread = threading.Thread(target=guard, name="tty-guard", daemon=True)
    thread.start()
    return thread


def describe_holder(holder) -> str:
    """Who drives the workspace, short enough for an 80-column header."""
    if holder is None:
        return "another console"
    since = time.strftime("%b %d %H:%M", time.localtime(holder.since))
    return f"pid {holder.pid} on {holder.host} since {since}"


def closing_summary(engine) -> str:
    """What the user sees after the console closes: which jobs are still running."""
    try:
        jobs = engine.jobs.active()
    except OSError as exc:
        return f"Console closed. Could not list jobs: {exc}"
    if not jobs:
        return "Console closed. No jobs running."
    listed = ", ".join(f"{job.id} ({job.kind}, pid {job.pid})" for job in jobs)
    return (f"Console closed. {len(jobs)} job(s) still running: {listed}. "
            f"Re-attach with `eagle3-console -w {engine.workspace.root}`.")


def run_console(ws, read_only: bool = False) -> int:
    """Run the console on a workspace until the user quits; returns the exit code."""
    from engine.core import Engine

    engine = Engine(ws, drive=not read_only)
    app = ConsoleApp(engine)
    start_terminal_guard(app)
    app.run()
    if app.hung_up:
        return 0  # nobody is left to read a summary; the jobs keep running regardless
    try:
        print(closing_summary(engine), flush=True)
    except OSError:  # the terminal went away while closing
        pass
    code = app.return_code
    return 0 if code is None else code


def save_screenshots(ws, out_dir: Path, tabs: list[str], size: tuple[int, int], settle_s: float) -> list[Path]:
    """Headless screenshots of a workspace as the console shows it now (read-only: never takes the
    lock, never drives a job): one SVG per tab, after `settle_s` seconds of live polling."""
    import asyncio

    from engine.core import Engine

    async def shoot() -> list[Path]:
        app = ConsoleApp(Engine(ws, drive=False))
        saved = []
        async with app.run_test(size=size) as pilot:
            await pilot.pause(settle_s)
            for tab in tabs:
                app.action_show_tab(tab)
                await pilot.pause(0.5)
                name = f"{tab}-{size[0]}x{size[1]}.svg"
                app.save_screenshot(name, str(out_dir))
                saved.append(out_dir / name)
        return saved

    out_dir.mkdir(parents=True, exist_ok=True)
    return asyncio.run(shoot())
