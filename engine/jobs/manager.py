"""Job manager: long work runs in detached, supervised processes that outlive the console.

Each job lives in `<jobs_dir>/<job-id>/` (see engine.jobs.context for the files). A manager
holds no state that matters: a fresh one on the same folder re-attaches to running jobs,
identifying their processes by pid AND create time (pids get reused).

Who writes job.json: the manager before the supervisor starts; the supervisor while it
lives; the manager again only once the supervisor is gone (lost, or SIGKILLed on stop).
"""

from __future__ import annotations

import asyncio
import builtins
import enum
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from stat import S_ISREG
from typing import Any, Generator, Mapping

from engine.io.atomic import write_text
from engine.io.jsonl import complete_objects
from engine.jobs.events import JobEvent, parse_lines
from engine.jobs.context import (
    EVENTS_FILE,
    JOB_DIR_ENV,
    LAST_LOG_LINES,
    LOG_FILE,
    RECORD_FILE,
    STOP_MARKER,
    JobRecordError,
    read_record,
    tail_lines,
    update_record,
)
from engine.io.names import check_name
from engine.system.procinfo import is_same_process
from engine.errors import EngineError

class JobState(str, enum.Enum):
    """A job's state as job.json records it. Compares (and hashes) equal to its string."""

    STARTING = "starting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"
    LOST = "lost"
    UNKNOWN = "unknown"  # a record that names no state we know

    __hash__ = str.__hash__

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def parse(cls, value: Any) -> "JobState":
        try:
            return cls(str(value))
        except ValueError:
            return cls.UNKNOWN


ACTIVE_STATES = frozenset({JobState.STARTING, JobState.RUNNING})
FINAL_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED, JobState.LOST})
START_WAIT_S = 5.0
POLL_S = 0.05
# A job stuck in "starting" with no supervisor on record this long never got going.
STARTING_STALE_S = 60.0
LOST_NOTE = "supervisor vanished; exit status unknown"

# `python -m engine.jobs.supervise` must import `engine` whatever cwd the job asks for.
_PACKAGE_ROOT = Path(__file__).resolve().parent.parent


class JobError(EngineError, RuntimeError):
    """A job request that cannot be carried out; the message says what to do."""


class JobNotFoundError(JobError, LookupError):
    pass


@dataclass(frozen=True)
class JobInfo:
    id: str
    kind: str
    argv: tuple[str, ...]
    state: JobState
    pid: int | None
    create_time: float | None
    exit_code: int | None
    started_at: float | None
    ended_at: float | None
    last_log_lines: tuple[str, ...]
    dir: Path
    created_at: float | None = None
    note: str | None = None
    supervisor_pid: int | None = None
    supervisor_create_time: float | None = None

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES

    @property
    def reason(self) -> str | None:
        """Why a failed (or lost) job ended, in one line: the last error line of its log, else the
        supervisor's note, else the last line it printed; None for a job that did not fail."""
        if self.state not in (JobState.FAILED, JobState.LOST):
            return None
        return failure_reason(self.last_log_lines, self.note, self.exit_code)

    @classmethod
    def from_record(cls, job_dir: Path, record: Mapping[str, Any]) -> "JobInfo":
        return cls(
            id=str(record.get("id") or job_dir.name),
            kind=str(record.get("kind", "")),
            argv=tuple(str(a) for a in record.get("argv") or ()),
            state=JobState.parse(record.get("state", "unknown")),
            pid=record.get("pid"),
            create_time=record.get("create_time"),
            exit_code=record.get("exit_code"),
            started_at=record.get("started_at"),
            ended_at=record.get("ended_at"),
            last_log_lines=tuple(record.get("last_log_lines") or ()),
            dir=job_dir,
            created_at=record.get("created_at"),
            note=record.get("note"),
            supervisor_pid=record.get("supervisor_pid"),
            supervisor_create_time=record.get("supervisor_create_time"),
        )


# The last line of a Python traceback (`OSError: [Errno 30] …`, `torch.OutOfMemoryError: …`) or a
# program's own error line (`extraction: error: …`, `[supervisor] could not start …`).
_ERROR_LINE = re.compile(
    r"^(?:[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Failure)\b(?::|$)"
    r"|.*\berror\b\s*:|\[supervisor\] could not start|Killed$)",
    re.IGNORECASE,
)
REASON_MAX = 300


def failure_reason(lines, note: str | None = None, exit_code: int | None = None) -> str:
    """The line that says why a job failed: the last error line of `lines` (its log tail), else
    `note`, else its last non-empty line, else its exit code."""
    text = [line.strip() for line in lines or () if line and line.strip()]
    found = next((line for line in reversed(text) if _ERROR_LINE.match(line)), None)
    if found is None:
        found = note or (text[-1] if text else None)
    if found is None:
        found = "no output" + ("" if exit_code is None else f"; exit code {exit_code}")
    return found if len(found) <= REASON_MAX else found[:REASON_MAX - 1] + "…"


def _child_alive(record: Mapping[str, Any]) -> bool:
    return is_same_process(record.get("pid"), record.get("create_time"), record.get("start_ticks"))


def _supervisor_alive(record: Mapping[str, Any]) -> bool:
    return is_same_process(
        record.get("supervisor_pid"), record.get("supervisor_create_time"), record.get("supervisor_start_ticks")
    )


SECRET_FLAGS = ("--api-key", "--admin-api-key")


def redact_argv(argv: list[str]) -> list[str]:
    """argv for the record: values of secret flags (SGLang's --api-key) replaced by '***'.
    job.json is read by status tools and other consoles; the key must not be written there."""
    out: list[str] = []
    hide = False
    for arg in argv:
        if hide:
            out.append("***")
            hide = False
        elif arg in SECRET_FLAGS:
            out.append(arg)
            hide = True
        elif arg.startswith(tuple(f"{flag}=" for flag in SECRET_FLAGS)):
            out.append(arg.split("=", 1)[0] + "=***")
        else:
            out.append(arg)
    return out


def _check_command(argv: list[str], env: Mapping[str, str]) -> None:
    if not argv or not all(isinstance(a, str) for a in argv):
        raise JobError("a job needs a command: a non-empty list of strings (argv), e.g. [sys.executable, '-m', ...]")
    program = argv[0]
    if os.sep in program:
        if not os.access(program, os.X_OK):
            raise JobError(f"job command {program!r} does not exist or is not executable; check the path")
    elif shutil.which(program, path=env.get("PATH")) is None:
        raise JobError(f"job command {program!r} is not on PATH; install it or give its full path")


class JobManager:
    def __init__(self, jobs_dir: Path) -> None:
        self.jobs_dir = Path(jobs_dir).absolute()
        # Supervisors this manager spawned, kept so they are reaped (no zombies) when they end.
        self._spawned: dict[str, subprocess.Popen[bytes]] = {}
        # list(): finished jobs by folder name -> (job.json identity, JobInfo), to skip re-reading them.
        self._finished_cache: dict[str, tuple[tuple[int, int, int], JobInfo]] = {}

    # ---- starting -------------------------------------------------------------------

    def start(
        self,
        kind: str,
        argv: list[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        job_id: str | None = None,
    ) -> JobInfo:
        """Start `argv` as a detached job. `env` is layered over the current environment."""
        check_name(kind, "job kind")
        argv = list(argv)
        if job_id is None:
            job_id = f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
        check_name(job_id, "job id")
        full_env = {**os.environ, **(env or {})}
        _check_command(argv, full_env)
        work_dir = Path(cwd).resolve() if cwd is not None else Path.cwd()
        if not work_dir.is_dir():
            raise JobError(f"job working directory {work_dir} does not exist; create it first")

        self.jobs_dir.mkdir(parents=True, exist_ok=True)
        job_dir = self.jobs_dir / job_id
        try:
            job_dir.mkdir()
        except FileExistsError:
            raise JobError(f"job {job_id!r} already exists in {self.jobs_dir}; choose another id") from None

        # The record exists before any process does, so a crash here leaves a trace.
        update_record(
            job_dir,
            id=job_id, kind=kind, argv=redact_argv(argv), cwd=str(work_dir), state=JobState.STARTING.value,
            created_at=time.time(), pid=None, create_time=None, exit_code=None,
            started_at=None, ended_at=None, last_log_lines=[],
        )
        full_env[JOB_DIR_ENV] = str(job_dir.resolve())
        full_env.setdefault("PYTHONUNBUFFERED", "1")  # python jobs: the log shows output live
        with open(job_dir / LOG_FILE, "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "engine.jobs.supervise", str(job_dir.resolve()), "--", *argv],
                cwd=_PACKAGE_ROOT, env=full_env, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
            )
        self._spawned[job_id] = proc

        deadline = time.monotonic() + START_WAIT_S
        while time.monotonic() < deadline:
            record = read_record(job_dir)
            if record.get("pid") is not None or record.get("state") in FINAL_STATES:
                return JobInfo.from_record(job_dir, record)
            if proc.poll() is not None:
                record = read_record(job_dir)  # it may have written just before exiting
                if record.get("pid") is None and record.get("state") not in FINAL_STATES:
                    record = update_record(
                        job_dir, state=JobState.FAILED.value, ended_at=time.time(),
                        note=f"supervisor exited with code {proc.returncode} before starting the job",
                        last_log_lines=tail_lines(job_dir / LOG_FILE, LAST_LOG_LINES),
                    )
                return JobInfo.from_record(job_dir, record)
            time.sleep(POLL_S)
        return self.get(job_id)

    # ---- reading --------------------------------------------------------------------

    def _job_dir(self, job_id: str) -> Path:
        check_name(job_id, "job id")
        job_dir = self.jobs_dir / job_id
        if not (job_dir / RECORD_FILE).is_file():
            raise JobNotFoundError(f"no job {job_id!r} in {self.jobs_dir}; list jobs to see the ids")
        return job_dir

    def _reap(self, job_id: str) -> None:
        proc = self._spawned.get(job_id)
        if proc is not None and proc.poll() is not None:
            del self._spawned[job_id]

    def get(self, job_id: str) -> JobInfo:
        job_dir = self._job_dir(job_id)
        return self.refresh(JobInfo.from_record(job_dir, read_record(job_dir)))

    def refresh(self, info: JobInfo) -> JobInfo:
        """Re-read a job and settle its state against the live processes.

        running/starting with supervisor AND child gone and no exit recorded -> "lost".
        Child gone but supervisor alive -> still running (it is recording the exit).
        """
        self._reap(info.id)
        record = read_record(info.dir)
        if record.get("state") not in ACTIVE_STATES or record.get("ended_at") is not None:
            return JobInfo.from_record(info.dir, record)
        if _supervisor_alive(record) or _child_alive(record):
            return JobInfo.from_record(info.dir, record)
        if record.get("supervisor_pid") is None and record.get("state") == JobState.STARTING:
            if info.id in self._spawned or time.time() - (record.get("created_at") or 0) < STARTING_STALE_S:
                return JobInfo.from_record(info.dir, record)  # supervisor still coming up
        # Check once more: the supervisor may have finished between our two reads.
        record = read_record(info.dir)
        if record.get("state") not in ACTIVE_STATES or record.get("ended_at") is not None:
            return JobInfo.from_record(info.dir, record)
        record = update_record(
            info.dir, state=JobState.LOST.value, note=LOST_NOTE,
            last_log_lines=tail_lines(info.dir / LOG_FILE, LAST_LOG_LINES),
        )
        return JobInfo.from_record(info.dir, record)

    # Below this method, `list` in an annotation names it; those annotations say builtins.list.
    def list(self) -> list[JobInfo]:
        """All jobs, newest first. Folders without a readable record are skipped.

        A finished job whose job.json is unchanged (same inode, size and mtime) is not read
        again: the console lists every second, and finished jobs pile up. Active jobs are
        always re-read and checked against their processes.
        """
        infos: list[JobInfo] = []
        if not self.jobs_dir.is_dir():
            return infos
        cache: dict[str, tuple[tuple[int, int, int], JobInfo]] = {}
        for job_dir in self.jobs_dir.iterdir():
            try:
                stat = os.stat(job_dir / RECORD_FILE)
            except OSError:
                continue
            if not S_ISREG(stat.st_mode):
                continue
            key = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
            cached = self._finished_cache.get(job_dir.name)
            if cached is not None and cached[0] == key:
                self._reap(cached[1].id)
                info = cached[1]
            else:
                try:
                    info = self.refresh(JobInfo.from_record(job_dir, read_record(job_dir)))
                except JobRecordError:
                    continue
            if not info.active:
                cache[job_dir.name] = (key, info)
            infos.append(info)
        self._finished_cache = cache  # jobs gone from disk drop out
        infos.sort(key=lambda i: (i.created_at or 0.0, i.id), reverse=True)
        return infos

    def active(self, kind: str | None = None) -> builtins.list[JobInfo]:
        """Jobs starting or running, optionally of one kind."""
        return [i for i in self.list() if i.active and (kind is None or i.kind == kind)]

    def tail(self, job_id: str, n: int = 50) -> builtins.list[str]:
        return tail_lines(self._job_dir(job_id) / LOG_FILE, n)

    def read_events(self, job_id: str, since_offset: int = 0) -> tuple[tuple[JobEvent, ...], int]:
        """The typed events (engine.jobs.events) of the complete lines after byte `since_offset`, and the
        offset to pass next time: how product code reads a job's events.

        A line still being written (no newline yet) is left for the next call; a complete line that breaks
        the contract is skipped (it stays in the file; the engine's watcher logs why).
        """
        data = self._events_after(job_id, since_offset)
        events, _skipped, used = parse_lines(data)
        return tuple(events), since_offset + used

    def events(self, job_id: str, since_offset: int = 0) -> tuple[builtins.list[dict[str, Any]], int]:
        """The raw JSON objects after byte `since_offset` (tests and bench read the file as written; product
        code reads `read_events`). A complete line that is not a JSON object is skipped."""
        events, used = complete_objects(self._events_after(job_id, since_offset))
        return events, since_offset + used

    def _events_after(self, job_id: str, since_offset: int) -> bytes:
        """events.jsonl from byte `since_offset` to its end (b"" while the job has written none)."""
        try:
            with open(self._job_dir(job_id) / EVENTS_FILE, "rb") as handle:
                handle.seek(since_offset)
                return handle.read()
        except FileNotFoundError:
            return b""

    # ---- looking inside -------------------------------------------------------------

    def dump_stacks(self, job_id: str) -> builtins.list[int]:
        """Ask a running job to write every thread's stack to its log (SIGUSR1, see
        engine.jobs.context); returns the pids signalled. Under torchrun the ranks are signalled, never
        torchrun itself (SIGUSR1 would kill it) nor anything below the ranks (compile workers)."""
        import psutil

        record = read_record(self._job_dir(job_id))
        if not _child_alive(record):
            return []
        try:
            child = psutil.Process(record["pid"])
            cmdline = child.cmdline()
            launcher = any(part.endswith("torchrun") or part == "torch.distributed.run" for part in cmdline[:3])
            targets = child.children() if launcher else [child]
            for proc in targets:
                proc.send_signal(signal.SIGUSR1)
        except psutil.Error:
            return []
        return [proc.pid for proc in targets]

    # ---- stopping -------------------------------------------------------------------

    def _signal_group(self, record: Mapping[str, Any], sig: int) -> bool:
        """Signal the job's process group, but only if a member we recorded is still
        the same process (a reused pid must never get our signal). True if sent."""
        pgid = record.get("pgid") or record.get("supervisor_pid")
        if not isinstance(pgid, int) or pgid <= 1:
            return False
        if not _supervisor_alive(record):
            # Supervisor gone: the group lives on only if our verified child is still in it.
            if not _child_alive(record):
                return False
            try:
                if os.getpgid(record["pid"]) != pgid:
                    return False
            except ProcessLookupError:
                return False
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return False
        return True

    def _all_gone(self, job_id: str, record: Mapping[str, Any]) -> bool:
        self._reap(job_id)
        return not _supervisor_alive(record) and not _child_alive(record)

    def _stop_steps(self, job_id: str, grace: float, force: bool = False) -> Generator[float, None, JobInfo]:
        """The stop procedure, shared by the sync and async variants: it yields how long
        to sleep and returns the final JobInfo."""
        job_dir = self._job_dir(job_id)
        record = read_record(job_dir)
        deadline = time.monotonic() + START_WAIT_S
        # A supervisor still coming up has no identity on record yet: wait for it.
        while record.get("state") == JobState.STARTING and record.get("supervisor_pid") is None:
            if time.monotonic() > deadline:
                break
            yield POLL_S
            record = read_record(job_dir)
        if record.get("state") not in ACTIVE_STATES:
            return self.get(job_id)

        # The marker tells the supervisor that the group got the signal (no second copy)
        # and that the ending was asked for.
        write_text(job_dir / STOP_MARKER, f"{time.time()}\n")
        killed = force
        if not force:
            self._signal_group(record, signal.SIGTERM)
            deadline = time.monotonic() + grace
            while not self._all_gone(job_id, record) and time.monotonic() < deadline:
                yield POLL_S
            killed = not self._all_gone(job_id, record)
        if killed:
            self._signal_group(record, signal.SIGKILL)
            deadline = time.monotonic() + 5.0
            while not self._all_gone(job_id, record) and time.monotonic() < deadline:
                yield POLL_S

        # Keep the supervisor's record; write one only if it could not (SIGKILLed, or gone).
        record = read_record(job_dir)
        if record.get("ended_at") is None and record.get("state") in ACTIVE_STATES:
            update_record(
                job_dir, state=JobState.STOPPED.value, ended_at=time.time(), stop_requested=True,
                exit_code=-signal.SIGKILL if killed else None,
                note="killed with SIGKILL" if killed else "supervisor was gone; exit status unknown",
                last_log_lines=tail_lines(job_dir / LOG_FILE, LAST_LOG_LINES),
            )
        return self.get(job_id)

    def stop_sync(self, job_id: str, grace: float = 10.0) -> JobInfo:
        """SIGTERM the job's process group, wait up to `grace` s, then SIGKILL it.
        Returns the final record (exit code, last log lines). A finished job is left as is."""
        steps = self._stop_steps(job_id, grace)
        try:
            while True:
                time.sleep(next(steps))
        except StopIteration as done:
            return done.value

    async def stop(self, job_id: str, grace: float = 10.0) -> JobInfo:
        """`stop_sync` that waits with asyncio.sleep, so the event loop keeps running."""
        steps = self._stop_steps(job_id, grace)
        try:
            while True:
                await asyncio.sleep(next(steps))
        except StopIteration as done:
            return done.value

    def kill(self, job_id: str) -> JobInfo:
        """SIGKILL the whole process group at once (fault injection, last resort)."""
        steps = self._stop_steps(job_id, 0.0, force=True)
        try:
            while True:
                time.sleep(next(steps))
        except StopIteration as done:
            return done.value
