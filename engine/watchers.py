"""Async file watchers for the engine: an append-only JSONL file followed by byte offset, a JSON
file read again when it changes, and the last lines of a log. No UI; reads go through aiofiles,
so a slow disk holds a thread of aiofiles' pool, never the event loop.

Each watcher is polled by its owner (engine.core.Engine) once a tick and returns only what is
new. A followed file's identity (device, inode) is kept: a file replaced (a resumed run trims
metrics.jsonl atomically) or truncated is read again from the start, and the caller is told.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiofiles
import aiofiles.os

from engine.jobs.events import JobEvent, Skipped, parse_lines
from engine.io.jsonl import complete_objects

Identity = tuple[int, int]  # (st_dev, st_ino)


def _identity(stat: os.stat_result) -> Identity:
    return stat.st_dev, stat.st_ino


@dataclass
class JsonlTail:
    """Follows an append-only JSONL file: `read()` returns the complete lines added since the last
    call (a line still being written waits) and whether the file was replaced or truncated."""

    path: Path
    identity: Identity | None = None
    offset: int = 0

    async def read(self) -> tuple[bytes, bool]:
        """(new complete lines as bytes, reset). `reset`: what was read before is gone; the bytes are
        the new file from its start."""
        try:
            async with aiofiles.open(self.path, "rb") as handle:
                stat = os.fstat(handle.fileno())  # the file actually opened, not the name's next owner
                reset = self.identity is not None and (_identity(stat) != self.identity or stat.st_size < self.offset)
                if reset or self.identity is None:
                    self.identity, self.offset = _identity(stat), 0
                if stat.st_size == self.offset:
                    return b"", reset
                await handle.seek(self.offset)
                data = await handle.read()
        except FileNotFoundError:
            reset = self.identity is not None
            self.identity, self.offset = None, 0
            return b"", reset
        complete = data[: data.rfind(b"\n") + 1]
        self.offset += len(complete)
        return complete, reset


@dataclass
class EventsTail:
    """A job's events.jsonl as typed events (engine.jobs.events), malformed lines reported apart."""

    path: Path
    tail: JsonlTail = field(init=False)

    def __post_init__(self) -> None:
        self.tail = JsonlTail(self.path)

    async def read(self) -> tuple[list[JobEvent], list[Skipped], bool]:
        data, reset = await self.tail.read()
        events, skipped, _used = parse_lines(data)
        return events, skipped, reset


@dataclass
class ObjectsTail:
    """A JSONL file of plain objects (the drafter's metrics.jsonl); a non-object line is skipped."""

    path: Path
    tail: JsonlTail = field(init=False)

    def __post_init__(self) -> None:
        self.tail = JsonlTail(self.path)

    async def read(self) -> tuple[list[dict[str, Any]], bool]:
        data, reset = await self.tail.read()
        records, _used = complete_objects(data)
        return records, reset


Signature = tuple[int, int, int, int] | None  # (dev, inode, size, mtime_ns); None: missing


async def signature(path: Path) -> Signature:
    try:
        stat = await aiofiles.os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns


@dataclass
class JsonFileWatch:
    """A JSON object file (a report, a checkpoint pointer) read again only when its signature
    (identity, size, mtime) changes. `read()` returns (changed, object or None, problem)."""

    path: Path
    what: str = "file"
    fix: str = ""
    seen: Signature | bool = False  # False: never looked

    async def read(self, force: bool = False) -> tuple[bool, dict[str, Any] | None, str]:
        now = await signature(self.path)
        if not force and now == self.seen:
            return False, None, ""
        self.seen = now
        if now is None:
            return True, None, f"no {self.what} at {self.path}"
        try:
            async with aiofiles.open(self.path, "r", encoding="utf-8") as handle:
                text = await handle.read()
            data = json.loads(text)
        except FileNotFoundError:
            self.seen = None
            return True, None, f"no {self.what} at {self.path}"
        except (OSError, ValueError) as exc:
            return True, None, f"{self.what} {self.path} is unreadable ({exc}){self.fix}"
        if not isinstance(data, dict):
            return True, None, f"{self.what} {self.path} is not a JSON object{self.fix}"
        return True, data, ""


async def tail_lines(path: Path, n: int, block: int = 8192) -> list[str]:
    """The last `n` lines of a text file without reading it whole (logs can be gigabytes); [] if missing."""
    if n <= 0:
        return []
    try:
        async with aiofiles.open(path, "rb") as handle:
            pos = await handle.seek(0, os.SEEK_END)
            data = b""
            while pos > 0 and data.count(b"\n") <= n:  # n lines need n+1 newlines in view
                step = min(block, pos)
                pos -= step
                await handle.seek(pos)
                data = await handle.read(step) + data
    except FileNotFoundError:
        return []
    return data.decode("utf-8", errors="replace").splitlines()[-n:]


@dataclass
class LogTail:
    """The last `lines` lines of a log, read again only when the file's signature changes."""

    path: Path
    lines: int = 400
    seen: Signature | bool = False

    async def read(self) -> tuple[bool, list[str]]:
        now = await signature(self.path)
        if now == self.seen:
            return False, []
        self.seen = now
        return True, await tail_lines(self.path, self.lines)


# The training job's files (engine.train.loop / engine.train.checkpoint; not imported: they pull in torch).
METRICS_FILE = "metrics.jsonl"
CKPT_DIR = "checkpoints"
CKPT_POINTERS = ("latest.json", "best.json")


class WorkspaceFiles:
    """What the console shows from files the jobs write: the drafter's metrics and checkpoint
    pointers, the evaluation report, and the log of one followed job. `poll()` returns the engine
    events for what changed since the last poll (engine.events); the first poll reports what is there."""

    def __init__(self, drafter_dir: Path, eval_dir: Path, report_name: str = "report.json") -> None:
        self.metrics = ObjectsTail(Path(drafter_dir) / METRICS_FILE)
        root = Path(drafter_dir) / CKPT_DIR
        self.pointers = [JsonFileWatch(root / name, "checkpoint pointer") for name in CKPT_POINTERS]
        self.pointer_values: list[dict[str, Any] | None] = [None] * len(CKPT_POINTERS)
        self.report = JsonFileWatch(Path(eval_dir) / report_name, "evaluation report", "; run the evaluate stage again")
        self.log: LogTail | None = None
        self.log_job = ""

    def follow_log(self, job_id: str, path: Path | None, lines: int = 400) -> None:
        """Follow this job's log (None: none); the next poll sends its last `lines` lines."""
        if job_id == self.log_job and path is not None and self.log is not None and self.log.lines == lines:
            return
        self.log_job = job_id if path is not None else ""
        self.log = LogTail(path, lines) if path is not None else None

    async def poll(self, reload_report: bool = False) -> list[Any]:
        from engine.events import EvaluationReport, JobLogTail, TrainingMetrics

        out: list[Any] = []
        records, reset = await self.metrics.read()
        pointers_changed = False
        for i, watch in enumerate(self.pointers):
            changed, value, _problem = await watch.read()
            if changed:
                pointers_changed = pointers_changed or value != self.pointer_values[i]
                self.pointer_values[i] = value
        if records or reset or pointers_changed:
            latest, best = self.pointer_values
            out.append(TrainingMetrics(records=tuple(records), reset=reset, latest=latest, best=best))
        changed, report, problem = await self.report.read(force=reload_report)
        if changed:
            if report is not None and not isinstance(report.get("overall"), dict):
                report, problem = None, f"{self.report.path} is not an evaluation report (no 'overall' section)"
            out.append(EvaluationReport(report=report, problem=problem))
        if self.log is not None:
            job_id, log = self.log_job, self.log
            changed, lines = await log.read()
            if changed and self.log is log:  # still the followed one
                out.append(JobLogTail(job_id=job_id, lines=tuple(lines)))
        return out


def last_events(path: Path, tail_bytes: int = 65536) -> list[JobEvent]:
    """The typed events on the last `tail_bytes` of an events.jsonl (synchronous, for the CLI's one-shot
    commands; events files of long runs are large). A torn first line is skipped; [] if missing."""
    try:
        with open(path, "rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            handle.seek(max(0, size - tail_bytes))
            data = handle.read()
    except OSError:
        return []
    events, _skipped, _used = parse_lines(data)
    return events
