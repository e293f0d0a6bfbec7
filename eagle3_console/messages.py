"""Textual messages carrying engine events to the panes.

The engine calls its listeners on the app's own asyncio loop; the app turns each event into
one of these and posts it to the pane that shows it, so panes never hold engine references
for updates and never call each other. Samples that arrive faster than the screen repaints
replace the queued one (`can_replace`) instead of piling up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from textual.message import Message

if TYPE_CHECKING:
    from engine.checks.base import StageReport
    from engine.system.disk import DiskUsage
    from engine.system.gpu import GpuSnapshot
    from engine.jobs.events import JobEvent
    from engine.jobs.manager import JobInfo
    from engine.server.manager import ServerStatus


class GpuChanged(Message, bubble=False):
    """A new GPU snapshot."""

    def __init__(self, snapshot: GpuSnapshot) -> None:
        super().__init__()
        self.snapshot = snapshot

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, GpuChanged)


class DiskChanged(Message, bubble=False):
    """New disk usage per filesystem."""

    def __init__(self, usages: tuple[DiskUsage, ...]) -> None:
        super().__init__()
        self.usages = usages

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, DiskChanged)


class JobsChanged(Message, bubble=False):
    """The current job list."""

    def __init__(self, jobs: tuple[JobInfo, ...]) -> None:
        super().__init__()
        self.jobs = jobs

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, JobsChanged)


class StageChanged(Message, bubble=False):
    """One stage's report changed; never coalesced."""

    def __init__(self, report: StageReport) -> None:
        super().__init__()
        self.report = report


class RunChecks(Message):
    """A request, bubbling up to the app, to run the checks of some stages (None: all)."""

    def __init__(self, names: list[str] | None) -> None:
        super().__init__()
        self.names = names


class ServerChanged(Message, bubble=False):
    """A new server status."""

    def __init__(self, status: ServerStatus) -> None:
        super().__init__()
        self.status = status

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, ServerChanged)


class ServerActionFailed(Message, bubble=False):
    """Starting or stopping the server failed: the reason and the server log's last lines."""

    def __init__(self, reason: str, log_tail: list[str] | tuple[str, ...] = ()) -> None:
        super().__init__()
        self.reason = reason
        self.log_tail = tuple(log_tail)


class JobEventsArrived(Message, bubble=False):
    """New typed events of one job (engine.jobs.events); never coalesced: they are increments.
    `history`: already in the file when the engine began following it (replayed, not news)."""

    def __init__(self, job_id: str, kind: str, events: tuple[JobEvent, ...], history: bool = False) -> None:
        super().__init__()
        self.job_id = job_id
        self.kind = kind
        self.events = events
        self.history = history


class TrainingMetricsArrived(Message, bubble=False):
    """New lines of the drafter's metrics.jsonl, plus the checkpoint pointers (engine.events.TrainingMetrics).

    `reset` means the file was replaced or truncated (a new run): drop what was shown.
    """

    def __init__(self, records: tuple[dict[str, Any], ...], reset: bool, latest: dict[str, Any] | None,
                 best: dict[str, Any] | None) -> None:
        super().__init__()
        self.records = records
        self.reset = reset
        self.latest = latest
        self.best = best


class EvaluationReportChanged(Message, bubble=False):
    """The evaluation report as the engine read it, or None with the reason (missing, unreadable)."""

    def __init__(self, report: dict[str, Any] | None, problem: str = "") -> None:
        super().__init__()
        self.report = report
        self.problem = problem

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, EvaluationReportChanged)


class ReloadEvaluation(Message):
    """A request, bubbling up to the app, to have the engine read the evaluation report again."""


class JobLogChanged(Message, bubble=False):
    """The last lines of the followed job's log (engine.events.JobLogTail)."""

    def __init__(self, job_id: str, lines: tuple[str, ...]) -> None:
        super().__init__()
        self.job_id = job_id
        self.lines = lines

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, JobLogChanged)


class FollowLog(Message):
    """A request, bubbling up to the app, to follow this job's log (None: none)."""

    def __init__(self, job_id: str | None) -> None:
        super().__init__()
        self.job_id = job_id
