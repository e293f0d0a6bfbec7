"""Real detached jobs started through the engine's JobManager, for tests of what shows them."""

from __future__ import annotations

import sys
import time

from engine.jobs.manager import JobInfo, JobManager
from engine.workspace import Workspace

PAUSED_EXTRACTION = """
import time
from engine.jobs.context import JobContext
ctx = JobContext.from_env()
ctx.event("started", samples=40)
ctx.progress(10, 40, eta_s=30, tokens_per_s=100.0)
ctx.event("paused", reason="output disk below reserve")
time.sleep(60)
"""


def start_job_and_wait(ws: Workspace, kind: str, script: str, until: bytes) -> tuple[JobManager, JobInfo]:
    """A real detached job of `kind` running `script`; returns once its events.jsonl holds `until` (20 s at most)."""
    jobs = JobManager(ws.jobs_dir)
    job = jobs.start(kind, [sys.executable, "-c", script])
    deadline = time.monotonic() + 20
    events = job.dir / "events.jsonl"
    while time.monotonic() < deadline and not (events.exists() and until in events.read_bytes()):
        time.sleep(0.1)
    return jobs, job


def start_paused_job(ws: Workspace) -> tuple[JobManager, JobInfo]:
    """A real extraction-kind job that reports progress 10/40 and then "paused"; waits for that event."""
    return start_job_and_wait(ws, "extract", PAUSED_EXTRACTION, b"paused")
