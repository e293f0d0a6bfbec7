"""How the CLI prints: errors, and jobs with their progress (shared by `status`, `run` and `jobs`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Sequence

from eagle3_console.fmt import finite
from engine.io.jsonl import finite_or_text
from engine.jobs.context import EVENTS_FILE
from engine.jobs.events import FINAL_KINDS, Finished, JobEvent, Paused, Progress, Resumed


def fail(message: str, code: int = 2) -> int:
    print(f"eagle3-console: error: {message}", file=sys.stderr)
    return code


def workspace_arg(args) -> str | None:
    return getattr(args, "workspace", None)


def progress_line(event: Progress) -> str:
    """A progress event as a one-line bar."""
    done, total = event.done or 0, event.total or 0
    frac = done / total if total else 0.0
    bar = "█" * int(30 * frac) + "░" * (30 - int(30 * frac))
    extra = []
    if event.tokens_per_s is not None:
        extra.append(f"{event.tokens_per_s:.0f} tok/s")
    if (eta := finite(event.eta_s)) is not None:
        extra.append(f"ETA {int(eta)}s")
    if event.paused:
        extra.append(f"PAUSED: {event.paused}")
    return f"  {bar} {done}/{total} " + " ".join(extra)


def event_line(event: JobEvent) -> str | None:
    """Any other event of a followed job as `run` prints it: an evaluation's table, or `[kind] {fields}` as
    the line was written (non-finite numbers as their text); None for a `metrics` line (no job of this
    version writes one; the CLI never printed them)."""
    if isinstance(event, Finished) and event.table:
        return event.table
    if event.kind == "metrics":
        return None
    detail = {k: v for k, v in event.to_dict().items() if k not in ("t", "type")}
    return f"  [{event.kind}] {json.dumps(finite_or_text(detail))[:200]}"


def job_dict(job, with_progress: bool = False) -> dict:
    data = {"id": job.id, "kind": job.kind, "state": job.state, "pid": job.pid, "exit_code": job.exit_code,
            "started_at": job.started_at, "ended_at": job.ended_at, "reason": job.reason}
    if with_progress:
        data["progress"] = last_progress(job)
    return data


def show_progress(job, jobs) -> bool:
    """Progress for running jobs and for the newest job of each kind (the one panes show)."""
    newest = next((j for j in jobs if j.kind == job.kind), None)
    return job.active or newest is job


def last_progress(job: Any, tail_bytes: int = 65536) -> dict[str, Any] | None:
    """The newest `progress` event (plus a pause or end, if newer) from the end of the job's events.jsonl,
    read by the engine (engine.watchers.last_events: only the file's last `tail_bytes`)."""
    from engine.watchers import last_events

    return progress_summary(last_events(Path(job.dir) / EVENTS_FILE, tail_bytes))


PROGRESS_KEYS = ("done", "total", "eta_s", "tokens_per_s", "paused", "loss", "acceptance_length")


def progress_summary(events: Sequence[JobEvent]) -> dict[str, Any] | None:
    """What `status` and `jobs` print of a job's events: its newest progress and its newest pause or end."""
    progress: Progress | None = None
    last: JobEvent | None = None
    for event in events:
        if isinstance(event, Progress):
            progress = event
        elif isinstance(event, (Paused, Resumed)) or event.kind in FINAL_KINDS:
            last = event
    if progress is None and last is None:
        return None
    out: dict[str, Any] = {}
    if progress is not None:
        for key in PROGRESS_KEYS:
            value = getattr(progress, key)
            if value not in (None, ""):
                out[key] = value
        done, total = progress.done, progress.total
        if done is not None and total:
            out["percent"] = round(100.0 * done / total, 1)
    if last is not None:
        out["last_event"] = last.kind
        if isinstance(last, Paused):
            out["paused"] = last.reason or ""
        message = getattr(last, "message", None)
        if message:
            out["message"] = message
    return out


def job_line(job: dict) -> str:
    """One job as `status` and `jobs list` print it: id, kind, state, exit code, progress."""
    code = "" if job["exit_code"] is None else f" exit {job['exit_code']}"
    reason = f" — {job['reason']}" if job.get("reason") else ""
    return f"{job['id']:<32} {job['kind']:<10} {job['state']}{code}{reason}{progress_text(job.get('progress'))}"


def progress_text(progress: dict | None) -> str:
    if not progress:
        return ""
    parts = []
    if "done" in progress:
        parts.append(f"{progress['done']}/{progress.get('total', '?')}"
                     + (f" ({progress['percent']:.0f}%)" if "percent" in progress else ""))
    if (eta := finite(progress.get("eta_s"))) is not None and not progress.get("last_event"):
        parts.append(f"ETA {int(eta)}s")
    if progress.get("paused"):
        parts.append(f"PAUSED: {progress['paused']}")
    if progress.get("message"):
        parts.append(str(progress["message"])[:80])
    return ("  " + " · ".join(parts)) if parts else ""
