"""Typed events the engine publishes; the console and CLI render them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the payloads' own modules import heavier things; the types are for readers and mypy
    from engine.checks.base import StageReport
    from engine.disk import DiskUsage
    from engine.gpu import GpuSnapshot
    from engine.jobs import JobInfo
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
    """New lines of a job's events.jsonl (progress, metrics, paused, finished, ...)."""

    job_id: str
    kind: str
    events: tuple[dict[str, Any], ...]
