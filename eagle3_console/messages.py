"""Textual messages carrying engine events to the panes.

The engine calls its listeners on the app's own asyncio loop; the app turns each event into
one of these and posts it to the pane that shows it, so panes never hold engine references
for updates and never call each other. Samples that arrive faster than the screen repaints
replace the queued one (`can_replace`) instead of piling up.
"""

from __future__ import annotations

from typing import Any

from textual.message import Message


class GpuChanged(Message, bubble=False):
    """A new GPU snapshot (engine.gpu.GpuSnapshot)."""

    def __init__(self, snapshot: Any) -> None:
        super().__init__()
        self.snapshot = snapshot

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, GpuChanged)


class DiskChanged(Message, bubble=False):
    """New disk usage per filesystem (tuple of engine.disk.DiskUsage)."""

    def __init__(self, usages: tuple) -> None:
        super().__init__()
        self.usages = usages

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, DiskChanged)


class JobsChanged(Message, bubble=False):
    """The current job list (tuple of engine.jobs.JobInfo)."""

    def __init__(self, jobs: tuple) -> None:
        super().__init__()
        self.jobs = jobs

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, JobsChanged)


class StageChanged(Message, bubble=False):
    """One stage's report changed (engine.checks.base.StageReport); never coalesced."""

    def __init__(self, report: Any) -> None:
        super().__init__()
        self.report = report


class RunChecks(Message):
    """A request, bubbling up to the app, to run the checks of some stages (None: all)."""

    def __init__(self, names: list[str] | None) -> None:
        super().__init__()
        self.names = names
