"""The engine facade: one async API for the console and the CLI.

It opens a workspace (taking the driver lock, or attaching read-only), runs one poller per
data source (GPUs, disks, jobs), runs stage checks, and publishes typed events to
listeners. It never imports a UI toolkit and never stops jobs when it closes: jobs are
detached processes that outlive any console.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from engine.checks.base import StageReport, StageState
from engine.checks.context import CheckContext
from engine.events import (
    DiskUpdated,
    Event,
    GpuUpdated,
    JobEvents,
    JobsUpdated,
    Notice,
    ServerUpdated,
    StageUpdated,
)
from engine.jobs.context import EVENTS_FILE, LOG_FILE
from engine.jobs.events import Paused
from engine.pipeline import Pipeline
from engine.watchers import EventsTail, WorkspaceFiles
from engine.workspace import LockHolder, Workspace
from engine.jobs.manager import FINAL_STATES, JobInfo, JobManager
from engine.registry import STAGE_JOBS, stages_fed_by
from engine.errors import EngineError

if TYPE_CHECKING:
    from engine.runner import StageProgress
    from engine.server.manager import ServerManager
    from engine.status import EngineStatus

log = logging.getLogger(__name__)
Listener = Callable[[Event], None]
SERVER_STAGES = stages_fed_by("server")  # the stages whose results describe the running server
SERVER_PHASES = {"ready": "up", "stopped": "down", "crashed": "down"}  # starting/unhealthy: in between


class ReadOnlyError(EngineError):
    """A command that changes things was sent to a read-only (attached) engine."""


class Engine:
    def __init__(self, workspace: Workspace, *, drive: bool = True, gpu_sampler=None):
        from engine.system.disk import DiskSampler

        self.workspace = workspace
        self.config = workspace.config
        self.read_only = True
        self.lock_holder: LockHolder | None = None
        self.attached_by_choice = not drive  # read-only because asked, not because the lock is taken
        if drive and workspace.lock.acquire():
            self.read_only = False
        else:
            self.lock_holder = workspace.lock.live_holder()
        # The GPU sampler (pynvml) and the server manager (its launch specs) are made on first
        # use: the console paints its first frame before the pollers need them.
        self._gpu_sampler = gpu_sampler
        self._server = None
        self.disk_sampler = DiskSampler(workspace.written_paths(), workspace.reserves(), interval=5.0)
        self.jobs = JobManager(workspace.jobs_dir)
        self.pipeline = Pipeline(CheckContext(workspace, gpu_snapshot=self.latest_gpu), persist=not self.read_only)
        self.server_status = None
        self.gpu_snapshot = None
        self.disk_usages: tuple = ()
        self._event_tails: dict[str, EventsTail] = {}  # job id -> its events.jsonl, followed
        from engine.evaluate.report import REPORT  # plain Python, no torch

        self.files = WorkspaceFiles(workspace.drafter_dir, workspace.eval_dir, REPORT)
        self._files_lock = asyncio.Lock()  # one poll at a time: the watchers keep offsets
        self.job_list: tuple = ()
        self._listeners: list[Listener] = []
        self._tasks: list[asyncio.Task] = []
        self._recheck_pending: set[str] = set()
        self._recheck_task: asyncio.Task | None = None
        self._server_phase: str | None = None  # "up" or "down", the last one seen
        self._stage_views: dict[str, tuple] = {}  # stage -> (state, note) last published
        self._named_owners: set[tuple] = set()  # (port, owner) of foreign listeners already named
        self._drift_seen: tuple = ()  # the server's differences from console.toml last published
        self._owner_task: asyncio.Task | None = None
        self._closed = False

    @property
    def gpu_sampler(self):
        if self._gpu_sampler is None:
            from engine.system.gpu import GpuSampler

            self._gpu_sampler = GpuSampler(
                fast_interval=self.config.gpu.sample_interval_s,
                slow_interval=self.config.gpu.slow_sample_interval_s,
            )
        return self._gpu_sampler

    @gpu_sampler.setter
    def gpu_sampler(self, sampler) -> None:
        self._gpu_sampler = sampler

    @property
    def server(self):
        if self._server is None:
            from engine.server.manager import ServerManager

            self._server = ServerManager(self.workspace, self.jobs)
        return self._server

    @server.setter
    def server(self, manager) -> None:
        self._server = manager

    # -- listeners
    def subscribe(self, listener: Listener) -> Callable[[], None]:
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    def _emit(self, event: Event) -> None:
        for listener in list(self._listeners):
            try:
                listener(event)
            except Exception:  # a broken view must not stop the engine
                log.exception("listener failed on %s", type(event).__name__)

    def notify(self, level: str, text: str) -> None:
        self._emit(Notice(level=level, text=text))

    # -- pollers
    def latest_gpu(self):
        """The GPU poller's last snapshot; sampled now when no poller runs (a headless command)."""
        if self.gpu_snapshot is None or not self._tasks:
            self.gpu_snapshot = self.gpu_sampler.sample()
        return self.gpu_snapshot

    def _on_gpu(self, snapshot) -> None:
        self.gpu_snapshot = snapshot
        self._emit(GpuUpdated(snapshot=snapshot))

    def _on_disk(self, usages) -> None:
        self.disk_usages = tuple(usages)
        self._emit(DiskUpdated(usages=self.disk_usages))

    async def _watch_jobs(self, interval: float = 1.0) -> None:
        """List jobs and read new events every `interval` s; publish only what changed.

        The listing goes to a worker thread; events are read by the async tails (engine.watchers).
        JobsUpdated is sent on the first tick and on changes only.
        """
        previous: dict[str, object] = {}
        first = True
        while True:
            jobs = tuple(await asyncio.to_thread(self.jobs.list))
            new_events = await self._read_job_events(jobs)
            states: dict[str, object] = {j.id: j.state for j in jobs}
            if states != previous or not self.job_list:
                for job in jobs:
                    old = previous.get(job.id)
                    if old is not None and old != job.state and job.state in FINAL_STATES:
                        level = {"succeeded": "information", "stopped": "warning"}.get(job.state, "error")
                        reason = f": {job.reason}" if job.reason else ""
                        self.notify(level, f"job {job.id} {job.state}{reason}")
                        if job.kind in STAGE_JOBS:
                            self._recheck([job.kind])  # its stage said "running" or "missing" until now
                previous = states
            changed = first or jobs != self.job_list
            self.job_list = jobs
            first = False
            if changed:
                self._emit(JobsUpdated(jobs=jobs))
                self._publish_stage_views()
            self._publish_job_events(new_events)
            await asyncio.sleep(interval)

    def _publish_stage_views(self) -> None:
        """Stage rows follow the jobs: `running` while a stage's job runs, `stale` once a job that
        feeds it started or ended after its check. Only rows whose view changed are sent."""
        for report in self.reports():
            if self.pipeline.report(report.stage).state is StageState.RUNNING:
                continue  # being checked: run_checks sends its result
            shown = (report.state, report.note)
            if self._stage_views.get(report.stage) != shown:
                self._stage_views[report.stage] = shown
                self._emit(StageUpdated(report=report))

    async def _read_job_events(self, jobs: tuple[JobInfo, ...]) -> list[JobEvents]:
        """New events of the newest job of each kind (history first, then increments), typed."""
        newest: dict[str, JobInfo] = {}
        for job in jobs:  # newest first
            newest.setdefault(job.kind, job)
        for gone in set(self._event_tails) - {j.id for j in newest.values()}:
            del self._event_tails[gone]
        found = []
        for job in newest.values():
            tail = self._event_tails.setdefault(job.id, EventsTail(job.dir / EVENTS_FILE))
            history = tail.tail.identity is None
            events, skipped, _reset = await tail.read()
            for line in skipped:
                log.warning("job %s: events.jsonl line skipped: %s", job.id, line.reason)
            if events or skipped:
                found.append(JobEvents(job_id=job.id, kind=job.kind, events=tuple(events), skipped=tuple(skipped),
                                       history=history))
        return found

    def _publish_job_events(self, found: list[JobEvents]) -> None:
        for batch in found:
            self._emit(batch)
            for event in batch.events:
                if isinstance(event, Paused) and not batch.history:
                    self.notify("warning", f"{batch.kind} paused: {event.reason or ''}")

    # -- files the jobs write (metrics, the evaluation report, a job's log)
    async def _watch_files(self) -> None:
        while True:
            await self.refresh_files()
            await asyncio.sleep(self.config.ui.refresh_s)

    async def refresh_files(self, reload_report: bool = False) -> None:
        """Read what changed in the watched files and publish it (TrainingMetrics, EvaluationReport,
        JobLogTail). `reload_report`: send the evaluation report even if it looks unchanged."""
        async with self._files_lock:
            try:
                events = await self.files.poll(reload_report=reload_report)
            except OSError as exc:  # a disk error must not take the watchers down; say it once a tick
                log.warning("reading the workspace's files failed: %s", exc)
                return
        for event in events:
            self._emit(event)

    async def reload_evaluation(self) -> None:
        """Read the evaluation report again and publish it, changed or not (the console's `u`)."""
        await self.refresh_files(reload_report=True)

    def follow_log(self, job_id: str | None, lines: int = 400) -> None:
        """Publish JobLogTail with the last `lines` lines of this job's log whenever it changes (None: stop)."""
        path = self.jobs.jobs_dir / job_id / LOG_FILE if job_id else None
        self.files.follow_log(job_id or "", path, lines)

    def _on_server(self, status) -> None:
        previous = self.server_status
        self.server_status = status
        if previous is not None and previous.state != status.state and status.state == "crashed":
            self.notify("error", f"server crashed (exit {status.exit_code}): {status.error}")
        self._emit(ServerUpdated(status=status))
        drift = tuple(getattr(status, "drift", ()) or ())
        if drift or status.state not in ("starting", "unhealthy"):  # a failed poll knows no better
            self._on_drift(drift)
        phase = SERVER_PHASES.get(status.state)
        if phase == "down" and self._server_phase != "down":
            self._check_port_owner()
        if phase is not None:
            # Came up or went down (a passing unhealthy poll is neither): the last `server` and
            # `capture` results describe a server that is gone.
            if self._server_phase is not None and phase != self._server_phase:
                self._recheck(SERVER_STAGES)
            self._server_phase = phase

    def _on_drift(self, drift: tuple) -> None:
        """The running server started differing from console.toml (or stopped differing): say it
        once, and re-check the stages that describe it (their last results describe other settings)."""
        if drift == self._drift_seen:
            return
        self._drift_seen = drift
        if drift:
            from engine.server.drift import RESTART_FIX, describe

            blocking = any(d.blocking for d in drift)
            self.notify("error" if blocking else "warning",
                        f"the running server differs from console.toml: {describe(list(drift))}; {RESTART_FIX}")
        self._recheck(SERVER_STAGES)

    def server_drift(self) -> list:
        """How the running server differs from console.toml on disk, one engine.server.drift.Difference
        per setting (setting, running, wanted, blocking); [] when none runs or nothing differs. The fix
        for any of them: restart_server()."""
        return self.server.drift()

    def _check_port_owner(self) -> None:
        """Our server is down: if something else listens on its port, say whose port it is, once
        (checks and extraction would talk to it; a start would fail to bind)."""
        if self._closed:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        if self._owner_task is None or self._owner_task.done():
            self._owner_task = loop.create_task(self._name_port_owner(), name="port-owner")

    async def _name_port_owner(self) -> None:
        from engine.client import port_owner

        host, port = self.config.server.host, self.config.server.port
        owner = await asyncio.to_thread(port_owner, host, port)
        if owner is None or (port, owner) in self._named_owners:
            return
        self._named_owners.add((port, owner))
        self.notify("warning", f"server.port {port} is held by {owner}, not by this workspace's server: checks and "
                               "extraction would talk to it and a start cannot bind; stop it or set server.port")

    def _recheck(self, stages) -> None:
        """Run these stages' checks again, in the background, because what they describe changed
        (a real check, as a key press would run). Only the driving console: checks persist reports."""
        if self.read_only or self._closed:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # a synchronous caller (status --json) has no checks to refresh
        self._recheck_pending.update(stages)
        if self._recheck_task is None or self._recheck_task.done():
            self._recheck_task = loop.create_task(self._recheck_loop(), name="stage-recheck")

    async def _recheck_loop(self) -> None:
        from engine.pipeline import stage_names

        while self._recheck_pending:  # changes during a pass get one more pass
            # A stage being checked right now (a key press) is checked again after it: its
            # result may predate the change.
            busy = {n for n in self._recheck_pending if self.pipeline.report(n).state is StageState.RUNNING}
            stages = [name for name in stage_names() if name in self._recheck_pending - busy]
            self._recheck_pending = busy
            if not stages:
                await asyncio.sleep(0.5)
                continue
            try:
                await self.run_checks(stages)
            except Exception as exc:  # a check that crashes must not take the watchers down
                self.notify("error", f"re-checking {', '.join(stages)} failed: {exc}")

    async def start(self) -> None:
        """Start the pollers (call once, from the event loop that will own them)."""
        if self._tasks:
            return
        self._tasks = [
            asyncio.create_task(self.gpu_sampler.watch(self._on_gpu), name="gpu-sampler"),
            asyncio.create_task(self.disk_sampler.watch(self._on_disk), name="disk-sampler"),
            asyncio.create_task(self._watch_jobs(), name="job-watcher"),
            asyncio.create_task(self._watch_files(), name="file-watcher"),
            asyncio.create_task(self._watch_server(), name="server-watcher"),
        ]

    async def _watch_server(self) -> None:
        if self.read_only:  # an attached console watches but never restarts
            try:
                while True:
                    self._on_server(await self.server.poll(reuse_client=True))
                    await asyncio.sleep(self.config.ui.refresh_s)
            finally:
                await self.server.close_poll_client()
        await self.server.watch(self._on_server, interval=self.config.ui.refresh_s)

    async def close(self) -> None:
        """Stop watching. Jobs keep running; the lock is released for the next console."""
        self._closed = True  # a command finishing after this must not start checks
        if self._recheck_task is not None:
            self._tasks.append(self._recheck_task)
            self._recheck_task = None
        if self._owner_task is not None:
            self._tasks.append(self._owner_task)
            self._owner_task = None
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        self._tasks = []
        if self._gpu_sampler is not None:
            self._gpu_sampler.close()
        self.workspace.lock.release()

    # -- commands
    def _require_driver(self, what: str) -> None:
        if self.read_only:
            holder = self.lock_holder.describe() if self.lock_holder else "another console"
            raise ReadOnlyError(f"cannot {what}: this console is attached read-only ({holder} drives this workspace)")

    async def run_checks(self, names: list[str] | None = None) -> list[StageReport]:
        reports = []
        from engine.pipeline import stage_names

        from dataclasses import replace

        for name in names or stage_names():
            running = replace(self.pipeline.reports[name], state=StageState.RUNNING, note="checking…")
            self._emit(StageUpdated(report=running))
            await self.pipeline.run_stage(name)
            report = self.pipeline.view(name, self._known_jobs())
            self._stage_views[name] = (report.state, report.note)
            self._emit(StageUpdated(report=report))
            reports.append(report)
        return reports

    def _known_jobs(self) -> tuple:
        """The jobs as the watcher last listed them; listed now when it has not run (status, start-up)."""
        if self.job_list:
            return self.job_list
        try:
            return tuple(self.jobs.list())
        except OSError:
            return ()

    def reports(self) -> list[StageReport]:
        """Every stage's last report as it stands now: `running` while its job runs, `stale` when
        computed under another config or before a job that feeds it (engine.pipeline.live_report)."""
        from engine.pipeline import stage_names

        jobs = self._known_jobs()
        return [self.pipeline.view(n, jobs) for n in stage_names()]

    # -- jobs and the server (driver only)
    async def start_server(self, capture: bool = True):
        self._require_driver("start the server")
        status = await self.server.start(capture=capture)
        self._on_server(status)
        return status

    async def restart_server(self, capture: bool | None = None):
        """Stop the server and start it from console.toml as it is now ("restart the server to apply")."""
        self._require_driver("restart the server")
        status = await self.server.restart(capture=capture)
        self._on_server(status)
        return status

    async def stop_server(self):
        self._require_driver("stop the server")
        status = await self.server.stop()
        self._on_server(status)
        return status

    def server_users(self) -> list:
        """Running jobs that need the server (stopping it would disrupt them)."""
        from engine.config import ConfigError
        from engine.registry import server_users

        try:
            users = server_users(self.workspace.config)  # online training captures from the server
        except (ConfigError, OSError):
            users = server_users(None)
        return [j for j in self.running_jobs() if j.kind in users]

    async def start_stage_job(self, stage: str):
        from engine.registry import starter

        self._require_driver(f"start the {stage} job")
        start = starter(stage)
        if start is None:
            raise KeyError(f"stage {stage!r} has no job to start")
        job = await asyncio.to_thread(start, self.workspace, self.jobs)
        self.notify("information", f"{stage} job {job.id} started")
        return job

    def red_prerequisites(self, stage: str) -> list[StageReport]:
        """The prerequisite stages of `stage`'s job that are red now (engine.registry)."""
        from engine.registry import red_prerequisites

        return red_prerequisites(stage, self.reports(), self.workspace.config)  # train's depend on train.mode

    async def stop_job(self, job_id: str, grace: float | None = None) -> JobInfo:
        """SIGTERM the job, SIGKILL after `grace` s (default: its kind's, engine.registry.stop_grace)."""
        self._require_driver("stop a job")
        return await stop_detached_job(self.workspace, self.jobs, job_id, grace, server=self.server)

    async def run_stages(self, names: list[str], *, force: bool = False) -> AsyncIterator[StageProgress]:
        """Check each stage; start the server or job a red one needs, follow it, check again; stop at the
        first stage that stays red. Typed progress items (engine.runner); `force` starts a job even when
        its prerequisite stages are red."""
        from engine.runner import run_stages

        self._require_driver("run stages")
        async for item in run_stages(self, names, force=force):
            yield item

    async def status(self) -> EngineStatus:
        """A snapshot of everything `eagle3-console status` shows, read now (no poller needed)."""
        from engine.status import EngineStatus

        server = await self.server.poll()
        jobs, gpus, disks, evaluation, driver, owner = await asyncio.to_thread(self._status_parts, server.state)
        return EngineStatus(workspace=self.workspace.root, driver=driver, stages=tuple(self.reports()), jobs=jobs,
                            evaluation=evaluation, server=server, port_owner=owner, gpus=gpus, disks=disks)

    def _status_parts(self, server_state: str) -> tuple:
        """The blocking reads of status(), in a worker thread."""
        from engine.client import port_owner
        from engine.status import SERVER_DOWN, evaluation_summary

        jobs = tuple(self.jobs.list())
        owner = None
        if server_state in SERVER_DOWN:
            owner = port_owner(self.config.server.host, self.config.server.port)
        return (jobs, self.gpu_sampler.sample(), tuple(self.disk_sampler.sample()),
                evaluation_summary(self.workspace.eval_dir), self._driver(), owner)

    def _driver(self) -> LockHolder | None:
        """Who drives the workspace: this engine, another live console, or no one."""
        from engine.workspace import WorkspaceLock

        holder = self.workspace.lock.holder()
        if holder is None or not self.read_only:
            return holder
        probe = WorkspaceLock(self.workspace.root)  # the lock file outlives its holder: is it held now?
        if probe.acquire():
            probe.release()
            return None
        return holder

    def set_paused(self, job_id: str, paused: bool) -> None:
        """Ask a pausable job (extraction) to hold after its requests in flight, or to go on."""
        from engine.extract.layout import PAUSE_FILE

        self._require_driver("pause a job")
        flag = self.jobs.get(job_id).dir / PAUSE_FILE
        if paused:
            flag.touch()
        else:
            flag.unlink(missing_ok=True)

    def running_jobs(self) -> list:
        return [j for j in self.job_list if j.active]


async def stop_detached_job(workspace: Workspace, jobs: JobManager, job_id: str, grace: float | None = None, *,
                            server: ServerManager | None = None) -> JobInfo:
    """SIGTERM a job's process group, SIGKILL it after `grace` s (default: its kind's grace from
    engine.registry), and return its final record. The server's job goes through the server manager,
    which first records that the server is meant to be down (else a console's restart policy would take
    the stop for a crash). Reads no console.toml: a job stays stoppable while the config is broken."""
    from engine.server.manager import ServerManager
    from engine.registry import stop_grace

    info = await asyncio.to_thread(jobs.get, job_id)
    wait = stop_grace(info.kind) if grace is None else grace
    if info.kind == "server":
        manager = server or ServerManager(workspace, jobs)
        if manager.record().get("job_id") == info.id:
            await manager.stop(grace=wait)
            return await asyncio.to_thread(jobs.get, info.id)
    return await jobs.stop(info.id, grace=wait)
