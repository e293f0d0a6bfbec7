"""The job folder's files, and the API a job process uses to report from inside.

Layout of `<ws>/jobs/<job-id>/`:
  job.json      the record (written atomically; read-modify-write keeps others' fields)
  events.jsonl  append-only events written by the job itself, one JSON object a line
  log.txt       the job's stdout and stderr

Inside a job (the manager sets EAGLE3_JOB_DIR):

    ctx = JobContext.from_env()
    ctx.install_sigterm_handler()
    for i, item in enumerate(items):
        if ctx.stop_requested:
            save_checkpoint(); break
        ctx.progress(i + 1, len(items))
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from engine.io.atomic import append_line, write_json
from engine.io.jsonfile import read_json_object
from engine.jobs.events import JobEvent, MalformedEvent, UnknownEvent, parse_event
from engine.io.jsonl import dumps_line
from engine.errors import EngineError

JOB_DIR_ENV = "EAGLE3_JOB_DIR"
RECORD_FILE = "job.json"
EVENTS_FILE = "events.jsonl"
LOG_FILE = "log.txt"
# Written by the manager just before it signals the whole process group, so the
# supervisor knows the child got the signal too and does not send it a second time.
STOP_MARKER = "stop.requested"
LAST_LOG_LINES = 20
# Set (to anything) in tests: an event outside the contract (a kind, a field, or a type engine.jobs.events
# does not name) raises in the job instead of being written with a note in its log.
STRICT_EVENTS_ENV = "EAGLE3_STRICT_JOB_EVENTS"


class JobRecordError(EngineError, RuntimeError):
    """job.json is missing or unreadable."""


def read_record(job_dir: Path) -> dict[str, Any]:
    return read_json_object(Path(job_dir) / RECORD_FILE, JobRecordError, "job record",
                            "; inspect or remove that folder")


def update_record(job_dir: Path, **fields: Any) -> dict[str, Any]:
    """Merge `fields` into job.json and replace it atomically; returns the new record.

    Fields written by others are kept. Writers take turns by design (the manager before
    the supervisor starts and after it is gone, the supervisor in between), so no lock.
    """
    try:
        record = read_record(job_dir)
    except JobRecordError:
        if (Path(job_dir) / RECORD_FILE).exists():
            raise
        record = {}
    record.update(fields)
    write_json(Path(job_dir) / RECORD_FILE, record)
    return record


def tail_lines(path: Path, n: int, block: int = 8192) -> list[str]:
    """Last `n` lines of a text file without reading it whole (logs can be gigabytes)."""
    if n <= 0:
        return []
    try:
        handle = open(path, "rb")
    except FileNotFoundError:
        return []
    with handle:
        handle.seek(0, os.SEEK_END)
        pos = handle.tell()
        data = b""
        # n lines need n+1 newlines in view (the last line may end with one).
        while pos > 0 and data.count(b"\n") <= n:
            step = min(block, pos)
            pos -= step
            handle.seek(pos)
            data = handle.read(step) + data
    lines = data.decode("utf-8", errors="replace").splitlines()
    return lines[-n:]


@dataclass
class JobContext:
    """Reporting handle for code running inside a job process."""

    job_dir: Path
    stop_requested: bool = field(default=False)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "JobContext":
        env = os.environ if environ is None else environ
        value = env.get(JOB_DIR_ENV)
        if not value:
            raise RuntimeError(
                f"{JOB_DIR_ENV} is not set: this code reports to a job folder and must be "
                "started through the job manager (JobManager.start)"
            )
        job_dir = Path(value)
        if not job_dir.is_dir():
            raise RuntimeError(f"{JOB_DIR_ENV}={value} is not a directory; start the job through JobManager.start")
        _dump_stacks_on_sigusr1()
        return cls(job_dir)

    @property
    def events_path(self) -> Path:
        return self.job_dir / EVENTS_FILE

    def event(self, type: str, /, **data: Any) -> None:
        """Append one event of the contract in engine.jobs.events (`type` is its KIND). Each call fsyncs,
        so report at a human rate (not per token). A non-finite number is written as text ("NaN",
        "Infinity"): the line stays strict JSON."""
        if "t" in data or "type" in data:
            raise ValueError("event data must not use the reserved keys 't' or 'type'")
        record = {"t": time.time(), "type": type, **data}
        # Read back as the console will read it (values JSON-encoded first), then written from the
        # dataclass: writer and readers share the field names. A field of the wrong type is the
        # job's bug: said in its log, and the line is still written (a report is never dropped).
        decoded = json.loads(dumps_line(record, default=str))
        try:
            event = parse_event(decoded)
            decoded = event.to_dict()
            if os.environ.get(STRICT_EVENTS_ENV) and (isinstance(event, UnknownEvent) or event.extra):
                raise MalformedEvent(f"{type} event: kind or fields {sorted(event.extra)} are not named in "
                                     "engine/jobs/events.py; add them there")
        except MalformedEvent as exc:
            if os.environ.get(STRICT_EVENTS_ENV):
                raise
            print(f"job event not per the contract (engine.jobs.events), written as given: {exc}",
                  file=sys.stderr, flush=True)
        append_line(self.events_path, dumps_line(decoded))

    def emit(self, event: JobEvent) -> None:
        """Append one typed event (engine.jobs.events), stamped with the time now."""
        data = {k: v for k, v in event.to_dict().items() if k not in ("t", "type")}
        self.event(event.kind, **data)

    def progress(self, done: int | float, total: int | float | None, /, **extra: Any) -> None:
        self.event("progress", done=done, total=total, **extra)

    def install_sigterm_handler(self, also_sigint: bool = True) -> None:
        """On SIGTERM (and SIGINT) set `stop_requested` instead of dying, so the job can
        checkpoint and exit on its own. Idempotent: a repeated signal only sets it again."""

        def on_signal(signum: int, frame: object) -> None:
            self.stop_requested = True

        signal.signal(signal.SIGTERM, on_signal)
        if also_sigint:
            signal.signal(signal.SIGINT, on_signal)


def _dump_stacks_on_sigusr1() -> None:
    """SIGUSR1 writes every thread's stack to the job log (stderr): the way to see where a job that
    seems stuck is, without stopping it. Send it with JobManager.dump_stacks (`eagle3-console jobs
    stacks ID`), which spares torchrun (SIGUSR1 kills it)."""
    import faulthandler

    try:
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    except (AttributeError, ValueError, RuntimeError, OSError):  # no SIGUSR1 here, or stderr is closed
        pass


def say_error(ctx: JobContext | None, job: str, message: str) -> int:
    """A job's last word: its error event, where the disk still takes it, and its log line; exit code 2.
    An event that cannot be written (a full disk) must not replace the reason with a traceback."""
    if ctx is not None:
        try:
            ctx.event("error", message=message)
        except OSError:
            pass  # the log line below still says why
    print(f"{job}: error: {message}", flush=True)
    return 2
