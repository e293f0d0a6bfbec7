"""kill -9 of the server during extraction, 20 seeded trials on one running extraction.

The extraction job (forked from the zygote, see zygote.py) runs against a server the engine
owns, with restart on crash. The test SIGKILLs the server's process at random moments (seeded
delays: often mid-request, sometimes while it is still loading after a restart). The job must
restart it, redo what was in flight and finish: every sample exactly once, checksums valid.
Afterwards no server of an earlier trial survives and exactly one server process runs.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import psutil

from tests.helpers.workspaces import make_workspace, write_conversations
from engine.config import set_value
from engine.system.procinfo import is_same_process
from engine.server.manager import ServerManager
from faults import ledger, zygote
from faults.helpers import SEED, check_complete, plan_ids

TRIALS = 20


def _server_child(manager):
    job = manager.job()
    if job is None or job.state not in ("starting", "running") or not is_same_process(job.pid, job.create_time):
        return None
    return job


def test_server_kill_9_during_extraction(tiny_chat_model_dir, tmp_path):
    ws = make_workspace(tmp_path / "ws", tiny_chat_model_dir,
                        **{"dataset.path": "train.jsonl", "extract.concurrency": 2, "server.restart_on_crash": True})
    write_conversations(ws.root / "train.jsonl", 12, seed=3)
    expected = plan_ids(ws)
    manager = ServerManager(ws)
    asyncio.run(manager.start())
    rng = random.Random(SEED + 2)
    problems, kills, runs, killed_pids = [], 0, [], []
    proc = None
    try:
        run = 0
        while kills < TRIALS:
            ws.save_config(set_value(ws.config, "extract.run", f"run{run}"))
            ws.reload()
            proc = zygote.start("extract", ["--workspace", str(ws.root)], ws.jobs_dir / f"extract-r{run}")
            while proc.exitcode is None and kills < TRIALS:
                delay = rng.uniform(0.2, 3.0)
                deadline = time.monotonic() + delay
                while time.monotonic() < deadline and proc.exitcode is None:
                    time.sleep(0.02)
                job = _server_child(manager)
                if job is None or proc.exitcode is not None:
                    continue  # between restarts: the next delay decides
                os.kill(job.pid, signal.SIGKILL)
                killed_pids.append(job.pid)
                kills += 1
            proc.join(240)
            assert proc.exitcode == 0, (ws.jobs_dir / f"extract-r{run}" / "log.txt").read_text()[-3000:]
            runs.append(ws.hidden_dir)
            run += 1
        for run_dir in runs:
            problems += [f"{run_dir.name}: {p}" for p in check_complete(run_dir, expected)]
        # A last kill after the last run's last request meets no extraction to restart it: the console's
        # watcher does then (ensure_running), as here. Each run restarted what it needed: it completed.
        status = asyncio.run(manager.ensure_running())
        if status.state != "ready":
            problems.append(f"server not ready after the trials: {status.state} {status.error}")
        survivors = [pid for pid in killed_pids if psutil.pid_exists(pid)
                     and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
        if survivors:
            problems.append(f"killed servers still alive: {survivors}")
        for info in manager.jobs.list():
            if info.id != status.job_id and info.kind == "server":
                if is_same_process(info.supervisor_pid, info.supervisor_create_time) or info.state in ("running",):
                    problems.append(f"server job {info.id} left running ({info.state})")
        servers = [p for p in psutil.process_iter(["cmdline"])
                   if (p.info["cmdline"] or [])[1:3] == ["-m", "engine.localserver"] and _cwd(p) == str(ws.root)]
        if len(servers) != 1:
            problems.append(f"{len(servers)} server processes for this workspace, expected 1")
    finally:
        if proc is not None and proc.exitcode is None:
            zygote.kill(proc)
        asyncio.run(manager.stop(grace=5))
    ledger.add("kill -9 server during extraction", trials=TRIALS, faults=kills,
               records=len(runs) * len(expected), losses=len(problems))
    assert not problems, problems


def _cwd(proc) -> str:
    try:
        return proc.cwd()
    except psutil.Error:
        return ""
