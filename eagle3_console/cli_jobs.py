"""`eagle3-console jobs [list|logs ID|stacks ID|stop ID]`: the detached jobs of a workspace, headless.

`run` detaches its jobs (Ctrl-C stops watching, not the job); this is how a script or an SSH
session without the console lists them, reads their logs and stops one cleanly."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from engine.jobs.manager import JobState
from engine.registry import DEFAULT_GRACE_S, STOP_GRACE_S, stop_grace


def _grace_help() -> str:
    kinds = ", ".join(f"{kind} {grace:g}" for kind, grace in STOP_GRACE_S.items() if grace != DEFAULT_GRACE_S)
    return f"seconds between SIGTERM and SIGKILL (default: {kinds}, others {DEFAULT_GRACE_S:g})"


def add_jobs_parser(sub, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("jobs", help="list the workspace's jobs, show a job's log, stop a job", parents=[common])
    p.set_defaults(jobs_action="list", json=False)
    actions = p.add_subparsers(dest="jobs_action", metavar="ACTION")
    q = actions.add_parser("list", help="every job, newest first, with its progress (the default)", parents=[common])
    q.add_argument("--json", action="store_true")
    q = actions.add_parser("logs", help="the last lines of a job's log", parents=[common])
    q.add_argument("job_id", metavar="ID", help="job id (as `jobs list` shows it)")
    q.add_argument("-n", "--lines", type=int, default=50, help="log lines to show")
    q = actions.add_parser("stacks", help="a running job writes every thread's stack to its log; shows it",
                           parents=[common])
    q.add_argument("job_id", metavar="ID", help="job id (as `jobs list` shows it)")
    q.add_argument("-n", "--lines", type=int, default=80, help="log lines to show")
    q = actions.add_parser("stop", help="SIGTERM (the job checkpoints and exits), SIGKILL after the grace",
                           parents=[common])
    q.add_argument("job_id", metavar="ID", help="job id (as `jobs list` shows it)")
    q.add_argument("--grace", type=float, default=None, help=_grace_help())


def cmd_jobs(args) -> int:
    from eagle3_console.cliprint import (
        fail,
        job_dict,
        job_line,
        last_progress,
        progress_text,
        workspace_arg,
    )
    from engine.jobs.context import JobRecordError
    from engine.jobs.manager import JobError, JobManager
    from engine.io.names import UnsafeNameError
    from engine.workspace import Workspace, WorkspaceError, find_workspace

    # The config is not read: a job must be listable and stoppable even while console.toml is broken.
    ws = Workspace(find_workspace(workspace_arg(args))[0])
    if not ws.exists():
        raise WorkspaceError(f"{ws.root} is not a workspace (no console.toml): pass -w DIR")
    jobs = JobManager(ws.jobs_dir)
    action = args.jobs_action or "list"
    if action == "list":
        rows = [job_dict(j, with_progress=True) for j in jobs.list()]
        if args.json:
            print(json.dumps(rows, indent=2))
        else:
            print("\n".join(job_line(j) for j in rows) if rows else f"no jobs in {ws.jobs_dir}")
        return 0
    try:
        info = jobs.get(args.job_id)
    except (JobError, JobRecordError, UnsafeNameError) as exc:
        return fail(str(exc))
    if action == "logs":
        print("\n".join(jobs.tail(info.id, max(1, args.lines))))
        return 0
    if action == "stacks":
        pids = jobs.dump_stacks(info.id)
        if not pids:
            return fail(f"job {info.id} is {info.state}, not running: `jobs logs {info.id}` shows how it ended")
        time.sleep(1.0)  # the dump is written by the job itself, between two of its bytecodes
        print(f"# stacks of job {info.id} (pids {', '.join(map(str, pids))}); it goes on running")
        print("\n".join(jobs.tail(info.id, max(1, args.lines))))
        return 0
    # stop
    if not info.active:
        print(f"job {info.id} is not running ({info.state}"
              + ("" if info.exit_code is None else f", exit {info.exit_code}") + "): nothing to stop")
        return 0
    from engine.core import stop_detached_job
    from engine.workspace import WorkspaceLock

    probe = WorkspaceLock(ws.root)
    if not probe.acquire():
        return fail(f"{probe.holder_text('another console')} drives this workspace: "
                     "stop the job from that console (it asks first)")
    try:
        grace = args.grace if args.grace is not None else stop_grace(info.kind)
        if grace < 0:
            return fail("--grace must be >= 0 seconds")
        print(f"stopping {info.kind} job {info.id} (SIGTERM, SIGKILL after {grace:g} s)…", flush=True)
        started = time.monotonic()
        final = asyncio.run(stop_detached_job(ws, jobs, info.id, grace))
    finally:
        probe.release()
    progress = last_progress(final)
    print(f"job {final.id}: {final.state}" + ("" if final.exit_code is None else f", exit {final.exit_code}")
          + f" after {time.monotonic() - started:.1f} s{progress_text(progress)}")
    if final.state not in (JobState.STOPPED, JobState.SUCCEEDED):
        for line in final.last_log_lines[-5:]:
            print(f"  | {line}", file=sys.stderr)
    return 0 if not final.active else 1

