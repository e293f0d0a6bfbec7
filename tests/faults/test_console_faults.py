"""kill -9 of the console at random moments (20 seeded trials), and two consoles on one workspace.

The console runs for real in a pty. After each kill: the workspace lock is free again (the
kernel drops the flock), a running job is untouched (same process, same record), the config
is unchanged, and nothing the console started outlives it. Two consoles: the first drives,
the second attaches read-only and says who drives; it never takes the lock.
"""

from __future__ import annotations

import hashlib
import random
import sys
import time

import psutil
import pytest

from tests.helpers.workspaces import make_workspace
from engine.jobs.context import read_record
from engine.jobs.manager import JobManager
from engine.system.procinfo import is_same_process
from engine.workspace import WorkspaceLock
from faults import ledger
from faults.helpers import SEED
from faults.console import ConsoleProcess

TRIALS = 20


@pytest.fixture
def ws_with_job(tiny_model_dir, tmp_path):
    ws = make_workspace(tmp_path / "ws", tiny_model_dir)
    jobs = JobManager(ws.jobs_dir)
    job = jobs.start("sleeper", [sys.executable, "-c", "import time; time.sleep(600)"], cwd=ws.root)
    yield ws, jobs, job
    jobs.stop_sync(job.id, grace=2)


def _lock_free(root) -> bool:
    lock = WorkspaceLock(root)
    if lock.acquire():
        lock.release()
        return True
    return False


def _wait(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def _holder_pid(root) -> int | None:
    holder = WorkspaceLock(root).holder()
    return holder.pid if holder else None


def test_console_kill_9_at_random_moments(ws_with_job):
    ws, jobs, job = ws_with_job
    rng = random.Random(SEED + 3)
    config_hash = hashlib.sha256(ws.config_path.read_bytes()).hexdigest()
    record_before = {k: v for k, v in read_record(job.dir).items() if k != "last_log_lines"}
    problems, driving_kills = [], 0
    for trial in range(TRIALS):
        console = ConsoleProcess(ws.root)
        if trial % 2:
            # Every other kill lands while the console drives: once it names itself in the lock file (read,
            # not probed with flock, which would send it read-only), however slowly a loaded machine starts it.
            if not _wait(lambda: _holder_pid(ws.root) == console.pid or console.proc.poll() is not None, 60):
                problems.append(f"trial {trial}: the console did not take the lock in 60 s")
            deadline = time.monotonic() + rng.uniform(0.0, 1.0)
        else:  # the others at any moment of its start, before or after it takes the lock
            deadline = time.monotonic() + rng.uniform(0.1, 1.8)
        while time.monotonic() < deadline and console.proc.poll() is None:
            time.sleep(0.02)
        if console.proc.poll() is not None:
            problems.append(f"trial {trial}: console exited by itself ({console.proc.returncode}): "
                            f"{console.text()[-300:]}")
        children = console.descendants()
        driving = not _lock_free(ws.root)
        console.kill9()
        driving_kills += int(driving)
        if not _lock_free(ws.root):
            problems.append(f"trial {trial}: lock still held after the console died")
        alive = [pid for pid in children if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
        if alive:
            problems.append(f"trial {trial}: processes of the dead console still run: {alive}")
        info = jobs.get(job.id)
        if info.state != "running" or not is_same_process(info.pid, info.create_time):
            problems.append(f"trial {trial}: the running job was disturbed: {info.state}")
        record = {k: v for k, v in read_record(job.dir).items() if k != "last_log_lines"}
        if record != record_before:
            problems.append(f"trial {trial}: job.json changed")
        if hashlib.sha256(ws.config_path.read_bytes()).hexdigest() != config_hash:
            problems.append(f"trial {trial}: console.toml changed")
    ledger.add("kill -9 console", trials=TRIALS, faults=TRIALS, records=TRIALS, losses=len(problems))
    assert not problems, problems
    assert driving_kills >= TRIALS // 2, f"only {driving_kills} kills hit a driving console"


def test_two_consoles_one_drives_the_other_attaches_read_only(ws_with_job):
    ws, jobs, job = ws_with_job
    first = ConsoleProcess(ws.root)
    second = None
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _holder_pid(ws.root) != first.pid:
            time.sleep(0.05)  # read the holder file, never try the lock: a probe could win the race
        assert WorkspaceLock(ws.root).holder().pid == first.pid, first.text()[-500:]
        assert not _lock_free(ws.root)
        assert first.wait_for_text("driving"), first.text()[-500:]
        second = ConsoleProcess(ws.root)
        # the whole phrase: the output is read as it streams, a frame may end before the pid
        assert second.wait_for_text(f"read-only: driven by pid {first.pid}"), second.text()[-500:]
        assert WorkspaceLock(ws.root).holder().pid == first.pid, "the second console took the lock"
        first.kill9()
        assert _lock_free(ws.root), "the read-only console must not grab the lock when the driver dies"
        assert second.proc.poll() is None, "the read-only console keeps running"
        assert jobs.get(job.id).state == "running"
    finally:
        first.kill9()
        if second is not None:
            second.kill9()
    ledger.add("two consoles", trials=1, faults=1, records=0, losses=0)
