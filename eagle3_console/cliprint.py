"""How the CLI prints: errors, and jobs with their progress (shared by `status`, `run` and `jobs`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from eagle3_console.fmt import finite


def fail(message: str, code: int = 2) -> int:
    print(f"eagle3-console: error: {message}", file=sys.stderr)
    return code


def workspace_arg(args) -> str | None:
    return getattr(args, "workspace", None)


def progress_line(event: dict) -> str:
    done, total = event.get("done") or 0, event.get("total") or 0
    frac = done / total if total else 0.0
    bar = "█" * int(30 * frac) + "░" * (30 - int(30 * frac))
    extra = []
    if event.get("tokens_per_s") is not None:
        extra.append(f"{event['tokens_per_s']:.0f} tok/s")
    if (eta := finite(event.get("eta_s"))) is not None:
        extra.append(f"ETA {int(eta)}s")
    if event.get("paused"):
        extra.append(f"PAUSED: {event['paused']}")
    return f"  {bar} {done}/{total} " + " ".join(extra)


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


def last_progress(job, tail_bytes: int = 65536) -> dict | None:
    """The newest `progress` event (plus a pause or end, if newer) from the end of events.jsonl.

    Reads only the file's last `tail_bytes`: events files of long runs are large.
    """
    path = Path(job.dir) / "events.jsonl"
    try:
        with open(path, "rb") as handle:
            handle.seek(0, 2)
            size = handle.tell()
            handle.seek(max(0, size - tail_bytes))
            data = handle.read()
    except OSError:
        return None
    progress, last = None, None
    for line in data.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue  # a torn first or last line
        if not isinstance(event, dict):
            continue
        if event.get("type") == "progress":
            progress = event
        elif event.get("type") in ("paused", "resumed", "finished", "stopped", "error", "incomplete"):
            last = event
    if progress is None and last is None:
        return None
    out: dict = {}
    if progress is not None:
        for key in ("done", "total", "eta_s", "tokens_per_s", "paused", "loss", "acceptance_length"):
            if progress.get(key) not in (None, ""):
                out[key] = progress[key]
        done, total = progress.get("done"), progress.get("total")
        if isinstance(done, (int, float)) and isinstance(total, (int, float)) and total:
            out["percent"] = round(100.0 * done / total, 1)
    if last is not None:
        out["last_event"] = last.get("type")
        if last.get("type") == "paused":
            out["paused"] = last.get("reason", "")
        if last.get("message"):
            out["message"] = last["message"]
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
