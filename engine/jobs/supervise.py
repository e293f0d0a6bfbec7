"""Detached job supervisor: `python -m engine.jobs.supervise <jobdir> -- <argv...>`.

The job manager starts this in its own session (so a closed console or a dropped SSH
link does not take it down). It runs the job's command in its own process group with
stdout/stderr appended to log.txt, records the child's identity in job.json, forwards
stop signals, waits, and records how the job ended. The environment it was given is
passed to the child unchanged; the working directory comes from job.json's "cwd".
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType

import psutil

from engine.jobs.context import LAST_LOG_LINES, LOG_FILE, STOP_MARKER, read_record, tail_lines, update_record
from engine.jobs.manager import JobState
from engine.system.procinfo import current_process_identity, process_start_ticks

USAGE = "usage: python -m engine.jobs.supervise <jobdir> -- <argv...>"


def _raw_create_time(pid: int) -> float | None:
    # Our own child may already be a zombie (fast exit); its create time is still readable.
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


class Supervisor:
    def __init__(self, job_dir: Path, argv: list[str]) -> None:
        self.job_dir = job_dir
        self.argv = argv
        self.log_path = job_dir / LOG_FILE
        self.child: subprocess.Popen[bytes] | None = None
        self.stop_requested = False

    def _on_stop_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stop_requested = True
        child = self.child
        if child is None or child.returncode is not None:
            return  # not started yet (run() sends it after spawning) or already reaped
        if (self.job_dir / STOP_MARKER).exists():
            return  # the manager signalled the whole group: the child has it already
        try:
            os.kill(child.pid, signum)
        except ProcessLookupError:
            pass

    def _finish(self, **fields: object) -> None:
        update_record(
            self.job_dir,
            ended_at=time.time(),
            last_log_lines=tail_lines(self.log_path, LAST_LOG_LINES),
            stop_requested=self.stop_requested,
            **fields,
        )

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_stop_signal)
        signal.signal(signal.SIGINT, self._on_stop_signal)
        sup_pid, sup_ctime, sup_ticks = current_process_identity()
        identity = {
            "supervisor_pid": sup_pid,
            "supervisor_create_time": sup_ctime,
            "supervisor_start_ticks": sup_ticks,
            "pgid": os.getpgid(0),
        }
        cwd = read_record(self.job_dir).get("cwd") or None
        if (self.job_dir / STOP_MARKER).exists():
            # Stopped before we got going (the manager gave up waiting for us): do not start.
            self.stop_requested = True
            self._finish(state=JobState.STOPPED.value, exit_code=None, note="stopped before the job started",
                         **identity)
            return 0
        try:
            with open(self.log_path, "ab") as log:
                # Same process group as us: one killpg reaches the job and all it spawned.
                self.child = subprocess.Popen(
                    self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    cwd=cwd, close_fds=True,
                )
        except OSError as exc:
            note = f"could not start {self.argv[0]!r}: {exc}"
            with open(self.log_path, "a", encoding="utf-8") as log:
                log.write(f"[supervisor] {note}\n")
            self._finish(state=JobState.FAILED.value, exit_code=127, note=note, started_at=time.time(), **identity)
            return 0

        child = self.child
        update_record(
            self.job_dir,
            pid=child.pid,
            create_time=_raw_create_time(child.pid),
            start_ticks=process_start_ticks(child.pid),
            state=JobState.RUNNING.value,
            started_at=time.time(),
            **identity,
        )
        if self.stop_requested or (self.job_dir / STOP_MARKER).exists():
            # A stop arrived while the child was being spawned: it may not have seen it.
            try:
                child.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass

        code = child.wait()
        self.stop_requested = self.stop_requested or (self.job_dir / STOP_MARKER).exists()
        if self.stop_requested:
            state = JobState.STOPPED.value  # even on exit 0: a job that checkpointed on request did not finish
        else:
            state = (JobState.SUCCEEDED if code == 0 else JobState.FAILED).value
        self._finish(state=state, exit_code=code)
        return 0


def main(args: list[str] | None = None) -> int:
    args = sys.argv[1:] if args is None else args
    if len(args) < 3 or args[1] != "--":
        print(USAGE, file=sys.stderr)
        return 2
    job_dir = Path(args[0])
    if not job_dir.is_dir():
        print(f"job folder {job_dir} does not exist; start jobs through JobManager.start", file=sys.stderr)
        return 2
    return Supervisor(job_dir, args[2:]).run()


if __name__ == "__main__":
    sys.exit(main())
