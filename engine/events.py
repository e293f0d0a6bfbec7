"""Typed events the engine publishes; the console and CLI render them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the payloads' own modules import heavier things; the types are for readers and mypy
    from engine.checks.base import StageReport
    from engine.system.disk import DiskUsage
    from engine.system.gpu import GpuSnapshot
    from engine.jobs.events import JobEvent, Skipped
    from engine.jobs.manager import JobInfo
    from engine.server.manager import ServerStatus


@dataclass(frozen=True)
class Event:
    at: float = field(default_factory=time.time, kw_only=True)


@dataclass(frozen=True)
class GpuUpdated(Event):
    snapshot: GpuSnapshot


@dataclass(frozen=True)
class DiskUpdated(Event):
    usages: tuple[DiskUsage, ...]


@dataclass(frozen=True)
class StageUpdated(Event):
    report: StageReport


@dataclass(frozen=True)
class JobsUpdated(Event):
    jobs: tuple[JobInfo, ...]


@dataclass(frozen=True)
class Notice(Event):
    level: str  # information | warning | error
    text: str


@dataclass(frozen=True)
class ServerUpdated(Event):
    status: ServerStatus


@dataclass(frozen=True)
class JobEvents(Event):
    """New lines of a job's events.jsonl as typed events (engine.jobs.events: Progress, Paused,
    Finished, ...); `skipped`: complete lines that broke the contract, with why. `history`: the
    events were already in the file when the engine began following it (replayed, not news)."""

    job_id: str
    kind: str  # the job's kind (extract, train, evaluate, ...), not an event's
    events: tuple[JobEvent, ...]
    skipped: tuple[Skipped, ...] = ()
    history: bool = False


@dataclass(frozen=True)
class TrainingMetrics(Event):
    """New lines of the drafter's metrics.jsonl (engine.train.loop: type train|eval|failed, step, loss,
    acc, sim_al, ...) and the checkpoint pointers (checkpoints/latest.json, best.json; None if absent).
    `reset`: the file was replaced or truncated (a new or resumed run): drop the lines shown before."""

    records: tuple[dict[str, Any], ...]
    reset: bool
    latest: dict[str, Any] | None
    best: dict[str, Any] | None


@dataclass(frozen=True)
class EvaluationReport(Event):
    """The evaluation report (engine.evaluate.report's dict) as it is on disk now, or None with the
    reason (missing, unreadable, not a report)."""

    report: dict[str, Any] | None
    problem: str = ""


@dataclass(frozen=True)
class JobLogTail(Event):
    """The last lines of the followed job's log (Engine.follow_log), sent when they change."""

    job_id: str
    lines: tuple[str, ...]
