"""Running stages headless, once through: check a stage; if it is not green, start what makes it
(its server or its job), follow that to the end, and check it again.

`run_stages` yields typed progress items and prints nothing: the CLI's `run` prints them, any
other front end may show them its own way. Jobs are detached: leaving the loop (Ctrl-C) stops
the watching, never the job.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.checks.base import StageReport, StageState
from engine.jobs.events import JobEvent, Progress
from engine.jobs.manager import JobInfo
from engine.pipeline import get_stage, last_failure

if TYPE_CHECKING:
    from engine.core import Engine

FOLLOW_POLL_S = 0.5  # how often a followed job's events and state are read


@dataclass(frozen=True)
class Checking:
    """The stage's checks are about to run (first look, or again after its server or job)."""

    stage: str


@dataclass(frozen=True)
class StartingServer:
    stage: str


@dataclass(frozen=True)
class ServerStartFailed:
    """The server did not come up; the run ends here."""

    stage: str
    error: str  # what went wrong and the fix (engine.server.manager.ServerStartError)
    log_tail: tuple[str, ...]


@dataclass(frozen=True)
class PrerequisitesRed:
    """The stage's job was not started: stages it needs are red. The run ends here."""

    stage: str
    reds: tuple[StageReport, ...]

    @property
    def message(self) -> str:
        """The problem and the three ways out (the first failure of each red stage names its fix)."""
        named = "; ".join(f"{r.stage} ({last_failure(r) or r.state.value})" for r in self.reds)
        stages = " ".join(r.stage for r in self.reds)
        return (f"not starting {self.stage}: its prerequisite stage(s) are red: {named}. Fix them first "
                f"(eagle3-console check {stages}), run them in the same command (eagle3-console run {stages} "
                f"{self.stage}), or pass --force")


@dataclass(frozen=True)
class JobStarted:
    """The stage's job runs (started now, or the one already running)."""

    stage: str
    job: JobInfo


@dataclass(frozen=True)
class JobProgress:
    """A `progress` event of the followed job (done, total, tokens_per_s, eta_s, paused, ...)."""

    job_id: str
    event: Progress


@dataclass(frozen=True)
class JobEventRead:
    """Any other event of the followed job (started, paused, finished with its table, ...), typed."""

    job_id: str
    event: JobEvent

    @property
    def kind(self) -> str:
        return self.event.kind


@dataclass(frozen=True)
class JobEnded:
    job: JobInfo


@dataclass(frozen=True)
class StageResult:
    """A stage's result: green at first look, or after its server or job."""

    report: StageReport


@dataclass(frozen=True)
class StageNotGreen:
    """The stage is not green after its server or job (or has no checks); the run ends here."""

    stage: str
    report: StageReport


StageProgress = (Checking | StartingServer | ServerStartFailed | PrerequisitesRed | JobStarted | JobProgress
                 | JobEventRead | JobEnded | StageResult | StageNotGreen)
ENDS_RUN = (ServerStartFailed, PrerequisitesRed, StageNotGreen)  # the items after which nothing follows


def _green(report: StageReport) -> bool:
    return report.state in (StageState.PASSED, StageState.WARNED)


async def run_stages(engine: Engine, names: list[str], *, force: bool = False) -> AsyncIterator[StageProgress]:
    """Each stage in turn, as described in the module docstring; stops at the first stage that does
    not turn green (ServerStartFailed, PrerequisitesRed or StageNotGreen is then the last item).
    `force` starts a job even when its prerequisite stages are red."""
    from engine.server.manager import ServerStartError
    from engine.registry import STAGE_JOBS

    for name in names:
        get_stage(name)  # an unknown name: KeyError with a suggestion, before anything runs
        yield Checking(name)
        report = await engine.pipeline.run_stage(name)
        if report.state is StageState.PASSED:
            yield StageResult(report)
            continue
        if name == "server":
            yield StartingServer(name)
            try:
                await engine.server.start()
            except ServerStartError as exc:
                yield ServerStartFailed(name, str(exc), tuple(exc.log_tail))
                return
        elif name in STAGE_JOBS:
            reds = engine.red_prerequisites(name)
            if reds and not force:
                yield PrerequisitesRed(name, tuple(reds))
                return
            job = await engine.start_stage_job(name)
            yield JobStarted(name, job)
            async for item in follow_job(engine, job.id):
                yield item
        yield Checking(name)
        report = await engine.pipeline.run_stage(name)
        yield StageResult(report)
        if not _green(report):
            yield StageNotGreen(name, report)
            return


async def follow_job(engine: Engine, job_id: str) -> AsyncIterator[StageProgress]:
    """The job's events as they are written, then JobEnded once it is no longer starting or running."""
    jobs = engine.jobs
    offset = 0
    while True:
        events, offset = await asyncio.to_thread(jobs.read_events, job_id, offset)
        for event in events:
            yield _item(job_id, event)
        info = await asyncio.to_thread(jobs.get, job_id)
        if not info.active:
            # Events written between the last read and the end: read them before saying it ended.
            events, offset = await asyncio.to_thread(jobs.read_events, job_id, offset)
            for event in events:
                yield _item(job_id, event)
            yield JobEnded(info)
            return
        await asyncio.sleep(FOLLOW_POLL_S)


def _item(job_id: str, event: JobEvent) -> JobProgress | JobEventRead:
    return JobProgress(job_id, event) if isinstance(event, Progress) else JobEventRead(job_id, event)
