"""The console's job and server actions: start/stop the server, extraction and training.

Mixed into ConsoleApp. Every engine command runs in a worker, so the UI never waits on it;
failures come back as notifications that name the cause (and, for the server, in its pane
with the log tail). Stopping anything asks first (ConfirmScreen). Each key is shown in the
footer only while its pane is the active one (an 80-column footer cannot hold them all);
the command palette lists every action at all times, and running one from there switches
to its pane first so the user sees what it does.
"""

from __future__ import annotations

from functools import partial
from typing import Iterable

from textual.app import SystemCommand
from textual.binding import Binding
from textual.screen import ModalScreen, Screen

from eagle3_console.confirm import ConfirmScreen
from eagle3_console.messages import ServerActionFailed
from eagle3_console.panes import ExtractionPane, ServerPane, TrainingPane

# action name -> the pane whose key it is
ACTION_PANES = {
    "start_server": "server", "stop_server": "server",
    "start_extraction": "extraction", "toggle_pause": "extraction", "stop_extraction": "extraction",
    "start_training": "training", "stop_training": "training", "next_curve": "training",
    "start_stage_job": "pipeline", "reload_evaluation": "evaluation",
}
# stage -> the pane that shows its job
JOB_PANES = {"server": "server", "extract": "extraction", "train": "training", "evaluate": "evaluation"}

PANE_BINDINGS = [
    Binding("s", "start_server", "Start", tooltip="Start the server (capture on)", id="server-start"),
    Binding("S", "stop_server", "Stop", tooltip="Stop the server (asks first)", id="server-stop"),
    Binding("x", "start_extraction", "Extract", tooltip="Start or resume hidden-state extraction", id="extract-start"),
    Binding("p", "toggle_pause", "Pause", tooltip="Pause or resume extraction", id="extract-pause"),
    Binding("X", "stop_extraction", "Stop", tooltip="Stop extraction (asks first)", id="extract-stop"),
    Binding("T", "start_training", "Train", tooltip="Start training, or resume from its checkpoint", id="train-start"),
    Binding("K", "stop_training", "Stop", tooltip="Stop training; it checkpoints first (asks)", id="train-stop"),
    Binding("c", "next_curve", "Curve", tooltip="Show the next training curve", id="train-curve"),
    Binding("j", "start_stage_job", "Start job",
            tooltip="Start the selected stage's job (server, extract, train, evaluate)", id="stage-job"),
    Binding("l", "reload_evaluation", "Reload", tooltip="Read the evaluation report again", id="eval-reload"),
]


class JobActions:
    """Actions over the engine's server and stage jobs (a mixin for ConsoleApp)."""

    # -- footer scoping
    def active_pane(self) -> str:
        from eagle3_console.layout import PaneDeck

        # The panes are the deck's children: a scan of six, not a selector query over every
        # widget (this runs for each pane key whenever the footer's bindings are refreshed).
        try:
            for pane in self.query_one(PaneDeck).children:
                if pane.has_class("-active"):
                    return (pane.id or "").removeprefix("pane-")
        except Exception:  # before compose, or while closing
            return ""
        return ""

    def check_action(self, action: str, parameters: tuple) -> bool | None:
        pane = ACTION_PANES.get(action)
        # Never behind a modal (no `s` while a stop question is open), else only on its own pane.
        if pane is not None and (isinstance(self.screen, ModalScreen) or self.active_pane() != pane):
            return False
        return super().check_action(action, parameters)

    def _focus_pane(self, pane: str) -> None:
        if self.active_pane() != pane:
            self.action_show_tab(pane)

    def _run(self, coro, description: str) -> None:
        self.run_worker(coro, group="commands", exit_on_error=False, description=description)

    async def _guarded(self, what: str, coro) -> object:
        """Await an engine command; a refusal or failure becomes a notification, never a crash."""
        from engine.core import ReadOnlyError

        try:
            return await coro
        except ReadOnlyError as exc:
            self.notify(str(exc), severity="warning", timeout=8)
        except Exception as exc:  # the engine's errors carry the cause and the fix
            self.notify(f"{what} failed: {exc}", severity="error", timeout=15)
        return None

    # -- server
    def action_start_server(self, focus: bool = True) -> None:
        if focus:
            self._focus_pane("server")
        if self.engine.server_status is not None and self.engine.server_status.state in ("ready", "starting"):
            self.notify(f"the server is already {self.engine.server_status.state}", timeout=3)
            return
        self.notify("starting the server…", timeout=3)
        self._run(self._start_server(), "starting the server")

    async def _start_server(self) -> None:
        from engine.core import ReadOnlyError
        from engine.server.manager import ServerStartError

        try:
            status = await self.engine.start_server()
        except ReadOnlyError as exc:
            self.notify(str(exc), severity="warning", timeout=8)
            return
        except ServerStartError as exc:
            tail = list(exc.log_tail)
            shown = "\n".join(tail[-5:])
            self.notify(f"{exc}\n{shown}".strip(), title="server did not start", severity="error", timeout=20)
            self.query_one(ServerPane).post_message(ServerActionFailed(str(exc), tail))
            return
        except Exception as exc:
            self.notify(f"server start failed: {exc}", severity="error", timeout=20)
            self.query_one(ServerPane).post_message(ServerActionFailed(str(exc)))
            return
        self.notify(f"server {status.state} at {status.url}", timeout=5)

    def action_stop_server(self) -> None:
        self._focus_pane("server")
        users = self.engine.server_users()
        warning = ""
        if users:
            names = ", ".join(f"{j.kind} {j.id}" for j in users)
            warning = (f"Running jobs use this server: {names}. Stopping it interrupts them "
                       "(extraction waits for the server to come back).")
        body = "The server process is stopped (SIGTERM, then SIGKILL after 15 s). Start it again with s."

        def answered(yes: bool | None) -> None:
            if yes:
                self._run(self._guarded("stopping the server", self.engine.stop_server()), "stopping the server")

        self.push_screen(ConfirmScreen("Stop the server?", body, warning), answered)

    # -- starting a stage's job: asks first when the stages it needs are red
    def _start_after_prerequisites(self, stage: str, start) -> None:
        """Call `start()` now, or after a yes when stages the job needs are red (it would fail, or
        wait forever: an extraction with no server sits at 0 %). A job already running is not asked about."""
        from engine.config import ConfigError
        from engine.pipeline import last_failure

        if any(job.kind == stage for job in self.engine.running_jobs()):
            start()
            return
        try:
            red = self.engine.red_prerequisites(stage)
        except (ConfigError, OSError):  # a broken config or jobs folder: the start itself says what is wrong
            red = []
        if not red:
            start()
            return
        names = ", ".join(r.stage for r in red)
        warning = (f"Red prerequisite stage{'s' if len(red) > 1 else ''}: {names}. The {stage} job needs "
                   f"{'them' if len(red) > 1 else 'it'} green; started now it may fail or wait without progress.")
        body = "\n".join(f"✘ {r.stage}: {last_failure(r)}" for r in red)
        body += "\n\nStart it anyway? (n, then fix those stages on the Pipeline pane)"

        def answered(yes: bool | None) -> None:
            if yes:
                start()
            else:
                self.notify(f"{stage} job not started: {names} red", timeout=5)

        self.push_screen(ConfirmScreen(f"Start the {stage} job with {names} red?", body, warning), answered)

    # -- extraction
    def action_start_extraction(self) -> None:
        self._focus_pane("extraction")
        self._start_after_prerequisites("extract", lambda: self._run(
            self._guarded("starting extraction", self.engine.start_stage_job("extract")), "starting extraction"))

    def action_toggle_pause(self) -> None:
        self._focus_pane("extraction")
        pane = self.query_one(ExtractionPane)
        job_id = pane.running_job_id
        if job_id is None:
            self.notify("no extraction is running: x starts one", timeout=4)
            return
        pause = not pane.wants_pause()
        pane.pause_requested = pause
        self._run(self._set_paused(job_id, pause), "pausing extraction" if pause else "resuming extraction")

    async def _set_paused(self, job_id: str, pause: bool) -> None:
        import asyncio

        from engine.core import ReadOnlyError

        try:
            await asyncio.to_thread(self.engine.set_paused, job_id, pause)
        except ReadOnlyError as exc:
            self.notify(str(exc), severity="warning", timeout=8)
            return
        except (OSError, LookupError) as exc:
            self.notify(f"could not {'pause' if pause else 'resume'} {job_id}: {exc}", severity="error", timeout=10)
            return
        self.notify(f"extraction {'pausing after the requests in flight' if pause else 'resuming'} ({job_id})",
                    timeout=4)

    def action_stop_extraction(self) -> None:
        self._focus_pane("extraction")
        job_id = self.query_one(ExtractionPane).running_job_id
        if job_id is None:
            self.notify("no extraction is running", timeout=4)
            return
        body = ("It stops after the requests in flight. Finished samples are kept and verified; "
                "x starts it again and resumes where it stopped.")

        def answered(yes: bool | None) -> None:
            if yes:
                self._run(self._guarded("stopping extraction", self.engine.stop_job(job_id, grace=60)),
                          "stopping extraction")

        self.push_screen(ConfirmScreen(f"Stop extraction job {job_id}?", body), answered)

    # -- training
    def action_start_training(self) -> None:
        self._focus_pane("training")
        self._start_after_prerequisites("train", lambda: self._run(
            self._guarded("starting training", self.engine.start_stage_job("train")), "starting training"))

    def action_stop_training(self) -> None:
        self._focus_pane("training")
        pane = self.query_one(TrainingPane)
        job_id = pane.running_job_id
        if job_id is None:
            self.notify("no training is running", timeout=4)
            return
        body = "Stop training? The job checkpoints on SIGTERM; T resumes from that checkpoint."
        warning = ""
        if pane.latest_ckpt is None:
            warning = ("No checkpoint has been written yet: the one written on stop will be the first; "
                       "if the job is killed before it finishes, training restarts from step 0.")
        else:
            body += f" Last checkpoint so far: step {pane.latest_ckpt.get('step', '?')}."

        def answered(yes: bool | None) -> None:
            if yes:
                self._run(self._guarded("stopping training", self.engine.stop_job(job_id, grace=120)),
                          "stopping training")

        self.push_screen(ConfirmScreen(f"Stop training job {job_id}?", body, warning), answered)

    def action_next_curve(self) -> None:
        self._focus_pane("training")
        self.query_one(TrainingPane).cycle_curve()

    # -- pipeline: the selected stage's job
    def action_start_stage_job(self, stage: str | None = None) -> None:
        """Start what makes `stage` (default: the selected one) green: the server or its job."""
        from eagle3_console.panes import PipelinePane

        stage = stage or self.query_one(PipelinePane).selected_stage
        if stage == "server":
            self.action_start_server(focus=False)
            return
        if stage not in JOB_PANES:
            self.notify(f"stage '{stage}' has no job: Enter runs its checks", timeout=4)
            return

        def start() -> None:
            self.notify(f"starting the {stage} job…", timeout=3)
            self._run(self._start_stage_job(stage), f"starting the {stage} job")

        self._start_after_prerequisites(stage, start)

    async def _start_stage_job(self, stage: str) -> None:
        import asyncio

        job = await self._guarded(f"starting the {stage} job", self.engine.start_stage_job(stage))
        if job is None:
            return
        # Show it in its pane now, not at the engine's next job poll.
        from eagle3_console.messages import JobsChanged

        jobs = tuple(await asyncio.to_thread(self.engine.jobs.list))
        self.post_message(JobsChanged(jobs))

    def action_reload_evaluation(self) -> None:
        from eagle3_console.panes import EvaluationPane

        self._focus_pane("evaluation")
        self.query_one(EvaluationPane).reload()

    # -- command palette
    def job_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield SystemCommand("Start server", "Start the server with capture on (s)", self.action_start_server)
        yield SystemCommand("Stop server", "Stop the server; asks first (S)", self.action_stop_server)
        yield SystemCommand("Start extraction", "Start or resume hidden-state extraction (x)",
                            self.action_start_extraction)
        yield SystemCommand("Pause/resume extraction", "Hold extraction after the requests in flight (p)",
                            self.action_toggle_pause)
        yield SystemCommand("Stop extraction", "Stop extraction; asks first (X)", self.action_stop_extraction)
        yield SystemCommand("Start training", "Start training, or resume from its last checkpoint (T)",
                            self.action_start_training)
        yield SystemCommand("Stop training", "Stop training; it checkpoints first; asks first (K)",
                            self.action_stop_training)
        yield SystemCommand("Next training curve", "Loss → accuracy → acceptance length (c)", self.action_next_curve)
        yield SystemCommand("Start the selected stage's job", "server start / extract / train / evaluate (j)",
                            self.action_start_stage_job)
        for stage in ("extract", "train", "evaluate"):
            yield SystemCommand(f"Start the {stage} job", f"Start the {stage} stage's job from anywhere",
                                partial(self.action_start_stage_job, stage))
        yield SystemCommand("Reload evaluation report", "Read eval/<run>/report.json again (l)",
                            self.action_reload_evaluation)
