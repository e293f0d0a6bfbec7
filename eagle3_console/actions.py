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
from typing import TYPE_CHECKING, Iterable

from textual.app import App, SystemCommand
from textual.screen import ModalScreen, Screen

from eagle3_console.confirm import ConfirmScreen
from eagle3_console.keys import KEYS
from eagle3_console.messages import ServerActionFailed
from eagle3_console.panes import ExtractionPane, ServerPane, TrainingPane
from engine.registry import STAGE_JOBS, STAGE_PANES

if TYPE_CHECKING:
    from engine.core import Engine
    from engine.workspace import Workspace

    # The type checker reads the mixin as the App it is mixed into (query_one, notify, workers...).
    _AppBase = App[int]
else:
    _AppBase = object

# stage -> the pane that shows its job (engine.registry)
JOB_PANES = STAGE_PANES
# pane -> the stage whose job `s` / `S` start and stop there
PANE_STAGES = {pane: stage for stage, pane in JOB_PANES.items()}
# Actions by name (without parameters) -> their row in the key table.
ACTION_KEYS = {k.action.split("(")[0]: k for k in KEYS if not k.action.startswith("show_tab")}


def start_estimate(stage: str, jobs, reports: dict, workspace) -> tuple[str, str]:
    """(duration, disk need) of a stage's job, from what is known before it starts: the last
    successful run of the same kind, and the disk stage's budget."""
    from engine.system.disk import fmt_bytes  # noqa: F401  (engine helpers only; no I/O here)
    from eagle3_console.fmt import fmt_duration

    done = [j for j in jobs if j.kind == stage and j.state == "succeeded" and j.started_at and j.ended_at]
    if done:
        last = done[0]  # newest first
        duration = f"about {fmt_duration(last.ended_at - last.started_at)} (the last {stage} job, {last.id})"
    else:
        duration = "unknown: no earlier run finished here"
    if stage == "extract":
        report = reports.get("disk")
        budget = next((r for r in (report.results if report else ()) if r.name == "budget"), None)
        disk = budget.evidence if budget is not None else "unknown: run the disk stage's checks (r on disk)"
    elif stage == "train":
        disk = f"checkpoints and the export in {workspace.drafter_dir} (small beside the hidden states)"
    else:
        disk = f"a report of a few kB in {workspace.eval_dir}"
    return duration, disk


class JobActions(_AppBase):
    """Actions over the engine's server and stage jobs (a mixin for ConsoleApp)."""

    engine: Engine  # set by ConsoleApp.__init__
    workspace: Workspace

    if TYPE_CHECKING:
        def action_show_tab(self, tab: str) -> None: ...  # ConsoleApp's

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
        key = ACTION_KEYS.get(action)
        if key is not None:
            if key.mutates and self.engine.read_only:
                return False  # neither shown nor accepted: a read-only console cannot do it
            # Never behind a modal (no `s` while a stop question is open), else only on its own panes.
            if key.panes and (isinstance(self.screen, ModalScreen) or self.active_pane() not in key.panes):
                return False
        return super().check_action(action, parameters)

    # -- the same two keys everywhere: s starts, S stops
    def action_start(self) -> None:
        pane = self.active_pane()
        if pane == "pipeline":
            self.action_start_stage_job()
        elif pane == "server":
            self.action_start_server()
        elif pane in PANE_STAGES:
            self.action_start_stage_job(PANE_STAGES[pane])

    def action_stop(self) -> None:
        pane = self.active_pane()
        if pane == "jobs":
            from eagle3_console.panes.jobs import JobsPane

            job = self.query_one(JobsPane).selected_job
            if job is None:
                self.notify("no job selected", timeout=3)
            else:
                self.stop_job_asking(job)
            return
        if pane == "pipeline":
            from eagle3_console.panes import PipelinePane

            stage = self.query_one(PipelinePane).selected_stage
        else:
            stage = PANE_STAGES.get(pane, "")
        if stage == "server":
            self.action_stop_server()
        elif stage == "extract":
            self.action_stop_extraction()
        elif stage == "train":
            self.action_stop_training()
        elif stage:
            job = next((j for j in self.engine.running_jobs() if j.kind == stage), None)
            if job is None:
                self.notify(f"no {stage} job is running", timeout=4)
            else:
                self.stop_job_asking(job)
        else:
            self.notify("this stage has no job to stop", timeout=3)

    def stop_job_asking(self, job) -> None:
        """Stop any job (the Jobs pane's row, evaluate) after a yes; the server through its manager."""
        from engine.registry import stop_grace

        if not job.active:
            self.notify(f"job {job.id} is {job.state}: nothing to stop", timeout=4)
            return
        if job.kind == "server":
            self.action_stop_server(focus=False)
            return
        grace = stop_grace(job.kind)
        body = (f"SIGTERM: the job finishes its unit of work and checkpoints; SIGKILL after {grace:g} s. "
                "s on its stage starts it again and resumes.")

        def answered(yes: bool | None) -> None:
            if yes:
                self._run(self._guarded(f"stopping {job.id}", self.engine.stop_job(job.id, grace=grace)),
                          f"stopping {job.id}")

        self.push_screen(ConfirmScreen(f"Stop {job.kind} job {job.id}?", body), answered)

    # -- the Jobs pane
    def _jobs_pane(self):
        from eagle3_console.panes.jobs import JobsPane

        return self.query_one(JobsPane)

    def action_stacks(self) -> None:
        job = self._jobs_pane().selected_job
        if job is None or not job.active:
            self.notify("select a running job: only a running job can write its stacks", timeout=4)
            return
        self._run(self._stacks(job.id), f"stacks of {job.id}")

    async def _stacks(self, job_id: str) -> None:
        import asyncio

        pids = await asyncio.to_thread(self.engine.jobs.dump_stacks, job_id)
        if pids:
            pane = self._jobs_pane()
            pane.follow = True
            self.notify(f"{job_id} wrote its stacks to its log (pids {', '.join(map(str, pids))}); it goes on",
                        timeout=5)
        else:
            self.notify(f"{job_id} is not running: no stacks", severity="warning", timeout=5)

    def action_search(self) -> None:
        if self.active_pane() == "pipeline":
            from eagle3_console.panes import PipelinePane

            self.query_one(PipelinePane).open_filter()
        else:
            self._jobs_pane().open_search()

    def action_search_next(self) -> None:
        self._jobs_pane().next_match(1)

    def action_search_previous(self) -> None:
        self._jobs_pane().next_match(-1)

    def action_follow(self) -> None:
        following = self._jobs_pane().toggle_follow()
        self.notify("log: following its end" if following else "log: follow off", timeout=2)

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

    def action_stop_server(self, focus: bool = True) -> None:
        if focus:
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

    def action_apply_settings(self) -> None:
        """Restart the server from console.toml ("restart the server to apply"), after a yes that
        names each setting it changes and the jobs the restart interrupts."""
        self._focus_pane("server")
        drift = self.engine.server_drift()
        if not drift:
            self.notify("the server already runs with console.toml's settings", timeout=4)
            return
        lines = [d.describe() for d in drift]
        users = self.engine.server_users()
        warning = ("Running jobs use this server: " + ", ".join(f"{j.kind} {j.id}" for j in users)
                   + ". The restart interrupts them (extraction waits for it to come back).") if users else ""

        def answered(yes: bool | None) -> None:
            if yes:
                self._run(self._guarded("restarting the server", self.engine.restart_server()),
                          "restarting the server")

        self.push_screen(ConfirmScreen("Restart the server to apply console.toml?", "\n".join(lines), warning),
                         answered)

    # -- starting a stage's job: a long job asks first (duration, disk need, red prerequisites)
    def _start_after_prerequisites(self, stage: str, start) -> None:
        """Call `start()` now, or after a yes: a long job (extract, train, evaluate) asks with its
        estimated duration and disk need, and names the stages it needs that are red (started then,
        it may fail, or wait forever: an extraction with no server sits at 0 %). A job already running
        is not asked about (starting it again resumes or reports it)."""
        from engine.config import ConfigError
        from engine.pipeline import last_failure

        if any(job.kind == stage for job in self.engine.running_jobs()):
            start()
            return
        try:
            red = self.engine.red_prerequisites(stage)
        except (ConfigError, OSError):  # a broken config or jobs folder: the start itself says what is wrong
            red = []
        if not red and stage not in STAGE_JOBS:  # a stage's job is long: its start asks first
            start()
            return
        warning = ""
        lines = []
        if stage in STAGE_JOBS:
            reports = {r.stage: r for r in self.engine.reports()}
            duration, disk = start_estimate(stage, self.engine.job_list, reports, self.workspace)
            lines += [f"Estimated duration: {duration}", f"Disk: {disk}"]
        names = ", ".join(r.stage for r in red)
        if red:
            warning = (f"Red prerequisite stage{'s' if len(red) > 1 else ''}: {names}. The {stage} job needs "
                       f"{'them' if len(red) > 1 else 'it'} green; started now it may fail or wait without progress.")
            lines += [""] + [f"✘ {r.stage}: {last_failure(r)}" for r in red]
        lines += ["", "It runs detached: closing the console does not stop it. S stops it (asks)."]
        title = f"Start the {stage} job with {names} red?" if red else f"Start the {stage} job?"

        def answered(yes: bool | None) -> None:
            if yes:
                start()
            else:
                self.notify(f"{stage} job not started" + (f": {names} red" if red else ""), timeout=5)

        self.push_screen(ConfirmScreen(title, "\n".join(lines).strip(), warning), answered)

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
            self.notify("no extraction is running: s starts one", timeout=4)
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
                "s starts it again and resumes where it stopped.")

        def answered(yes: bool | None) -> None:
            if yes:
                self._run(self._guarded("stopping extraction", self.engine.stop_job(job_id)),
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
        body = "Stop training? The job checkpoints on SIGTERM; s resumes from that checkpoint."
        warning = ""
        if pane.latest_ckpt is None:
            warning = ("No checkpoint has been written yet: the one written on stop will be the first; "
                       "if the job is killed before it finishes, training restarts from step 0.")
        else:
            body += f" Last checkpoint so far: step {pane.latest_ckpt.get('step', '?')}."

        def answered(yes: bool | None) -> None:
            if yes:
                self._run(self._guarded("stopping training", self.engine.stop_job(job_id)),
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
        """Every job action once; a read-only console lists none that it would refuse."""
        if not self.engine.read_only:
            yield SystemCommand("Start server", "Start the server with capture on (s on Server)",
                                self.action_start_server)
            yield SystemCommand("Stop server", "Stop the server; asks first (S on Server)", self.action_stop_server)
            for stage, pane in (("extract", "Extraction"), ("train", "Training"), ("evaluate", "Evaluation")):
                yield SystemCommand(f"Start the {stage} job", f"Asks first, with its estimated time and disk need "
                                    f"(s on {pane}, or on the {stage} stage)", partial(self.action_start_stage_job, stage))
            yield SystemCommand("Pause/resume extraction", "Hold extraction after the requests in flight (p)",
                                self.action_toggle_pause)
            yield SystemCommand("Stop extraction", "Stop extraction; asks first (S on Extraction)",
                                self.action_stop_extraction)
            yield SystemCommand("Stop training", "It checkpoints first; asks first (S on Training)",
                                self.action_stop_training)
        yield SystemCommand("Next training curve", "Loss → accuracy → acceptance length (c)", self.action_next_curve)
        yield SystemCommand("Reload evaluation report", "Read eval/<run>/report.json again (u)",
                            self.action_reload_evaluation)
