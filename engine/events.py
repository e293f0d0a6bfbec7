"""Typed events the engine publishes; the console and CLI render them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Event:
    at: float = field(default_factory=time.time, kw_only=True)


@dataclass(frozen=True)
class GpuUpdated(Event):
    snapshot: Any  # engine.gpu.GpuSnapshot


@dataclass(frozen=True)
class DiskUpdated(Event):
    usages: tuple  # tuple[engine.disk.DiskUsage, ...]


@dataclass(frozen=True)
class StageUpdated(Event):
    report: Any  # engine.checks.base.StageReport


@dataclass(frozen=True)
class JobsUpdated(Event):
    jobs: tuple  # tuple[engine.jobs.JobInfo, ...]


@dataclass(frozen=True)
class Notice(Event):
    level: str  # information | warning | error
    text: str


@dataclass(frozen=True)
class ServerUpdated(Event):
    status: Any  # engine.server.manager.ServerStatus


@dataclass(frozen=True)
class JobEvents(Event):
    """New lines of a job's events.jsonl (progress, metrics, paused, finished, ...)."""

    job_id: str
    kind: str
    events: tuple  # tuple[dict, ...]
