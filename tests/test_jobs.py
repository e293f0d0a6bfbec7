"""Job manager tests with real detached processes (small `python -c` scripts)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Callable

import psutil
import pytest

from engine.io.atomic import write_json
from engine.jobs.context import JobContext, read_record
from engine.jobs.manager import LOST_NOTE, JobError, JobManager
from engine.io.names import UnsafeNameError
from engine.system.procinfo import is_same_process, process_create_time, process_start_ticks

PY = sys.executable


def wait_for(predicate: Callable[[], object], timeout: float = 10.0, what: str = "condition") -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.03)
    raise AssertionError(f"timed out waiting for {what}")


def script(body: str) -> list[str]:
    return [PY, "-c", textwrap.dedent(body)]


def kill_leftovers(jobs_dir: Path) -> None:
    """SIGKILL every process group a test's jobs left behind (verified by create time)."""
    for record_path in jobs_dir.glob("*/job.json"):
        try:
            record = json.loads(record_path.read_text())
        except (OSError, ValueError):
            continue
        for pid_key, ctime_key in (("supervisor_pid", "supervisor_create_time"), ("pid", "create_time")):
            pid = record.get(pid_key)
            if is_same_process(pid, record.get(ctime_key)):
                try:
                    os.killpg(os.getpgid(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
                wait_for(lambda: not is_same_process(pid, record.get(ctime_key)), 5.0, "leftover to die")


@pytest.fixture(autouse=True)
def any_event_kind(monkeypatch):
    """These tests exercise the manager's reading of any line a job writes (made-up kinds and fields
    included), not the event contract: its strict mode is off for the jobs they start."""
    monkeypatch.delenv("EAGLE3_STRICT_JOB_EVENTS", raising=False)


@pytest.fixture
def jobs_dir(tmp_path: Path):
    path = tmp_path / "jobs"
    yield path
    kill_leftovers(path)


@pytest.fixture
def manager(jobs_dir: Path):
    mgr = JobManager(jobs_dir)
    yield mgr
    kill_leftovers(jobs_dir)
    for proc in mgr._spawned.values():  # reap our supervisors: no zombies left
        proc.wait(timeout=5)


def wait_final(mgr: JobManager, job_id: str, timeout: float = 10.0):
    return wait_for(lambda: (lambda i: i if not i.active else None)(mgr.get(job_id)), timeout, "job to end")


def wait_log(mgr: JobManager, job_id: str, text: str, timeout: float = 10.0) -> None:
    wait_for(lambda: any(text in line for line in mgr.tail(job_id)), timeout, f"{text!r} in the log")


SLEEPER = script("""
    import time
    print("ready", flush=True)
    time.sleep(60)
""")


# ---- procinfo -----------------------------------------------------------------------


def test_process_identity_of_self_and_of_a_gone_pid():
    me = os.getpid()
    ctime = process_create_time(me)
    assert ctime == pytest.approx(psutil.Process(me).create_time(), abs=0.01)
    assert is_same_process(me, ctime)
    assert is_same_process(me, ctime, process_start_ticks(me))
    assert not is_same_process(me, ctime - 5.0), "a different create time is a different process"
    assert not is_same_process(me, ctime, process_start_ticks(me) + 1000)
    assert not is_same_process(me, None)
    proc = subprocess.Popen([PY, "-c", "pass"])
    proc.wait()
    assert process_create_time(proc.pid) is None


def test_zombie_counts_as_not_alive():
    proc = subprocess.Popen([PY, "-c", "pass"])
    ctime = psutil.Process(proc.pid).create_time()
    try:
        wait_for(lambda: psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE, 10.0, "zombie")
        assert not is_same_process(proc.pid, ctime)
    finally:
        proc.wait()


# ---- start / re-attach / events -------------------------------------------------------


def test_start_records_running_and_fresh_manager_reattaches(manager: JobManager, jobs_dir: Path, tmp_path: Path):
    info = manager.start("server", SLEEPER, cwd=tmp_path)
    assert info.state == "running"
    assert info.id.startswith("server-")
    record = read_record(info.dir)
    assert record["state"] == "running"
    assert is_same_process(record["pid"], record["create_time"])
    assert is_same_process(record["supervisor_pid"], record["supervisor_create_time"])
    assert record["pgid"] == record["supervisor_pid"] != os.getpgid(0), "job runs in its own group"
    assert os.getsid(record["pid"]) == record["supervisor_pid"], "job runs in its own session"
    assert record["cwd"] == str(tmp_path.resolve()) and record["argv"] == SLEEPER

    fresh = JobManager(jobs_dir)
    again = fresh.get(info.id)
    assert again.state == "running" and again.pid == info.pid
    assert [j.id for j in fresh.active("server")] == [info.id]
    assert fresh.active("train") == []
    wait_log(fresh, info.id, "ready")


def test_events_are_read_incrementally_and_partial_lines_wait(manager: JobManager, tmp_path: Path):
    info = manager.start("extract", script("""
        import pathlib, time
        from engine.jobs.context import JobContext
        ctx = JobContext.from_env()
        ctx.event("hello", n=1)
        while not pathlib.Path("go").exists():
            time.sleep(0.02)
        ctx.progress(1, 2)
        ctx.progress(2, 2, phase="done")
    """), cwd=tmp_path, job_id="extract-1")
    first = wait_for(lambda: manager.events("extract-1")[0], 10.0, "first event")
    assert [(e["type"], e["n"]) for e in first] == [("hello", 1)]
    assert isinstance(first[0]["t"], float)
    _, offset = manager.events("extract-1")
    assert manager.events("extract-1", offset) == ([], offset)

    (tmp_path / "go").touch()
    final = wait_final(manager, info.id)
    assert final.state == "succeeded" and final.exit_code == 0
    rest, offset = manager.events("extract-1", offset)
    assert [(e["type"], e["done"], e["total"]) for e in rest] == [("progress", 1, 2), ("progress", 2, 2)]
    assert rest[1]["phase"] == "done"

    events_path = info.dir / "events.jsonl"
    with open(events_path, "ab") as handle:  # a writer caught mid-line
        handle.write(b'{"t": 1.0, "type": "par')
    assert manager.events("extract-1", offset) == ([], offset)
    with open(events_path, "ab") as handle:
        handle.write(b'tial"}\n')
    done, end = manager.events("extract-1", offset)
    assert [e["type"] for e in done] == ["partial"] and end == events_path.stat().st_size


def test_exit_3_is_failed_with_its_last_output(manager: JobManager):
    info = manager.start("train", script("""
        import sys
        for i in range(30):
            print(f"step {i}")
        print("boom: out of memory", file=sys.stderr)
        sys.exit(3)
    """))
    final = wait_final(manager, info.id)
    assert final.state == "failed" and final.exit_code == 3
    assert len(final.last_log_lines) == 20
    assert final.last_log_lines[-1] == "boom: out of memory"
    assert final.last_log_lines[-2] == "step 29"
    assert manager.tail(info.id, 2) == ["step 29", "boom: out of memory"]


def test_success_and_list_newest_first(manager: JobManager):
    first = manager.start("eval", script("print('one')"), job_id="eval-a")
    wait_final(manager, first.id)
    second = manager.start("eval", script("print('two')"), job_id="eval-b")
    final = wait_final(manager, second.id)
    assert final.state == "succeeded" and final.last_log_lines == ("two",)
    assert [j.id for j in manager.list()] == ["eval-b", "eval-a"]
    assert manager.active() == []


def test_env_is_layered_over_the_current_environment(manager: JobManager):
    info = manager.start("eval", script("""
        import os
        print(os.environ["EAGLE3_TEST_VALUE"], os.environ["EAGLE3_JOB_DIR"], "PATH" in os.environ)
    """), env={"EAGLE3_TEST_VALUE": "layered"})
    final = wait_final(manager, info.id)
    assert final.last_log_lines == (f"layered {info.dir} True",)


# ---- ending badly ---------------------------------------------------------------------


def test_child_killed_by_sigkill_is_failed_minus_9(manager: JobManager):
    info = manager.start("server", SLEEPER)
    wait_log(manager, info.id, "ready")
    os.kill(info.pid, signal.SIGKILL)
    final = wait_final(manager, info.id)
    assert final.state == "failed" and final.exit_code == -9
    assert final.last_log_lines == ("ready",)


def test_supervisor_and_child_killed_is_lost_for_a_fresh_manager(manager: JobManager, jobs_dir: Path):
    info = manager.start("server", SLEEPER)
    os.kill(info.supervisor_pid, signal.SIGKILL)
    os.kill(info.pid, signal.SIGKILL)
    wait_for(lambda: not is_same_process(info.pid, info.create_time), 5.0, "child gone")
    wait_for(lambda: not is_same_process(info.supervisor_pid, info.supervisor_create_time), 5.0, "supervisor gone")

    fresh = JobManager(jobs_dir)
    lost = fresh.get(info.id)
    assert lost.state == "lost" and lost.note == LOST_NOTE and lost.exit_code is None
    assert read_record(info.dir)["state"] == "lost", "the verdict is recorded for other readers"
    assert fresh.active() == []
    assert fresh.stop_sync(info.id).state == "lost"


def test_orphaned_child_still_counts_as_running_and_can_be_stopped(manager: JobManager, jobs_dir: Path):
    info = manager.start("server", SLEEPER)
    os.kill(info.supervisor_pid, signal.SIGKILL)
    wait_for(lambda: not is_same_process(info.supervisor_pid, info.supervisor_create_time), 5.0, "supervisor gone")
    fresh = JobManager(jobs_dir)
    assert fresh.get(info.id).state == "running"
    final = fresh.stop_sync(info.id, grace=3.0)
    assert final.state == "stopped" and not is_same_process(info.pid, info.create_time)


def test_reused_pid_with_wrong_create_time_is_not_running(manager: JobManager, jobs_dir: Path):
    """A record whose pid now belongs to a live, unrelated process (this test process)."""
    job_dir = jobs_dir / "server-old"
    me = os.getpid()
    write_json(job_dir / "job.json", {
        "id": "server-old", "kind": "server", "argv": ["x"], "state": "running", "created_at": 1.0,
        "pid": me, "create_time": process_create_time(me) - 3600, "pgid": os.getpgid(0),
        "supervisor_pid": me, "supervisor_create_time": process_create_time(me) - 3600,
    })
    info = manager.get("server-old")
    assert info.state == "lost"
    assert manager.active() == []
    # Stopping it must not signal the unrelated process (we would not survive SIGTERM).
    assert manager.stop_sync("server-old", grace=0.2).state == "lost"


# ---- stopping -------------------------------------------------------------------------


async def test_stop_sigterm_default_is_stopped_minus_15(manager: JobManager):
    info = manager.start("server", SLEEPER)
    wait_log(manager, info.id, "ready")
    final = await manager.stop(info.id, grace=5.0)
    assert final.state == "stopped" and final.exit_code == -15
    assert final.last_log_lines == ("ready",)
    assert not is_same_process(info.pid, info.create_time)
    assert not is_same_process(info.supervisor_pid, info.supervisor_create_time)


def test_graceful_stop_checkpoints_once_and_keeps_its_exit_code(manager: JobManager):
    info = manager.start("train", script("""
        import signal, sys, time
        from engine.jobs.context import JobContext
        ctx = JobContext.from_env()
        ctx.install_sigterm_handler()
        handler, count = signal.getsignal(signal.SIGTERM), [0]
        def counting(signum, frame):
            count[0] += 1
            handler(signum, frame)
        signal.signal(signal.SIGTERM, counting)
        print("ready", flush=True)
        while not ctx.stop_requested:
            time.sleep(0.02)
        time.sleep(0.3)  # a duplicate SIGTERM would arrive in this window
        print(f"checkpoint saved, sigterms={count[0]}", flush=True)
        sys.exit(0)
    """))
    wait_log(manager, info.id, "ready")
    final = manager.stop_sync(info.id, grace=5.0)
    assert final.state == "stopped" and final.exit_code == 0
    assert final.last_log_lines[-1] == "checkpoint saved, sigterms=1"


def test_job_ignoring_sigterm_is_killed_after_grace(manager: JobManager):
    info = manager.start("train", script("""
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ready", flush=True)
        time.sleep(60)
    """))
    wait_log(manager, info.id, "ready")
    started = time.monotonic()
    final = manager.stop_sync(info.id, grace=0.5)
    elapsed = time.monotonic() - started
    assert 0.5 <= elapsed < 10.0  # killed after the grace, not after the job's 60 s
    assert final.state == "stopped" and final.exit_code == -9
    assert final.last_log_lines == ("ready",)
    assert not is_same_process(info.pid, info.create_time)
    assert not is_same_process(info.supervisor_pid, info.supervisor_create_time)


def test_kill_takes_down_the_whole_group(manager: JobManager):
    info = manager.start("server", script("""
        import subprocess, sys, time
        grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        print(f"grandchild {grandchild.pid}", flush=True)
        time.sleep(60)
    """))
    wait_log(manager, info.id, "grandchild")
    line = next(l for l in manager.tail(info.id) if l.startswith("grandchild"))
    grandchild = int(line.split()[1])
    grandchild_ctime = process_create_time(grandchild)
    final = manager.kill(info.id)
    assert final.state == "stopped" and final.exit_code == -9
    wait_for(lambda: not is_same_process(grandchild, grandchild_ctime), 5.0, "grandchild gone")


# ---- detachment and input checks ------------------------------------------------------


def test_job_survives_its_starting_process_exiting(jobs_dir: Path):
    starter = subprocess.run(
        [PY, "-c", textwrap.dedent(f"""
            import sys
            from pathlib import Path
            from engine.jobs.manager import JobManager
            info = JobManager(Path({str(jobs_dir)!r})).start("server", {SLEEPER!r}, job_id="server-detached")
            print(info.pid, info.state)
        """)],
        capture_output=True, text=True, timeout=30, check=True,
    )
    pid_text, state = starter.stdout.split()
    assert state == "running"
    time.sleep(0.3)  # give a wrongly attached job time to die with its parent
    mgr = JobManager(jobs_dir)
    info = mgr.get("server-detached")
    assert info.state == "running" and info.pid == int(pid_text)
    assert is_same_process(info.pid, info.create_time)
    assert mgr.stop_sync(info.id, grace=5.0).state == "stopped"


def test_bad_requests_get_clear_errors(manager: JobManager, tmp_path: Path):
    with pytest.raises(UnsafeNameError):
        manager.start("server", SLEEPER, job_id="../escape")
    with pytest.raises(JobError, match="not on PATH"):
        manager.start("server", ["no-such-program-eagle3"])
    with pytest.raises(JobError, match="does not exist"):
        manager.start("server", SLEEPER, cwd=tmp_path / "missing")
    with pytest.raises(JobError, match="no job"):
        manager.get("server-unknown")
    manager.start("eval", script("pass"), job_id="eval-dup")
    with pytest.raises(JobError, match="already exists"):
        manager.start("eval", script("pass"), job_id="eval-dup")
    with pytest.raises(RuntimeError, match="JobManager.start"):
        JobContext.from_env({})
    with pytest.raises(ValueError, match="reserved"):
        JobContext(tmp_path).event("x", type="y")


def test_sigusr1_writes_the_stacks_of_a_running_job_to_its_log_and_it_goes_on(manager: JobManager):
    info = manager.start("extract", script("""
        import time
        from engine.jobs.context import JobContext

        ctx = JobContext.from_env()
        def stuck_in_here():
            for i in range(400):
                time.sleep(0.05)
        print("ready", flush=True)
        stuck_in_here()
        ctx.event("finished")
    """), cwd=Path(__file__).resolve().parents[1])
    wait_log(manager, info.id, "ready")
    os.kill(manager.get(info.id).pid, signal.SIGUSR1)
    wait_log(manager, info.id, "in stuck_in_here")
    assert manager.get(info.id).state == "running", "a stack dump does not stop the job"
    manager.kill(info.id)


def test_dump_stacks_signals_torchruns_ranks_never_torchrun(manager: JobManager, tmp_path: Path):
    """A stand-in launcher named `torchrun` (a real process, as torchrun is a Python script) with one
    rank: SIGUSR1 would kill torchrun, so the rank gets it and dumps its stacks."""
    launcher = tmp_path / "torchrun"
    launcher.write_text(textwrap.dedent(f"""
        import subprocess, sys, time
        rank = subprocess.Popen([{PY!r}, "-c", "import time; from engine.jobs.context import JobContext; "
                                 "JobContext.from_env(); print('rank ready', flush=True); time.sleep(60)"])
        print("launcher pid", flush=True)
        rank.wait()
    """))
    info = manager.start("train", [PY, str(launcher)], cwd=Path(__file__).resolve().parents[1])
    wait_log(manager, info.id, "rank ready")
    launcher_pid = manager.get(info.id).pid
    rank_pid = psutil.Process(launcher_pid).children()[0].pid
    assert manager.dump_stacks(info.id) == [rank_pid]
    wait_log(manager, info.id, "Current thread")
    time.sleep(0.3)
    assert psutil.pid_exists(launcher_pid) and psutil.Process(launcher_pid).status() != psutil.STATUS_ZOMBIE
    assert manager.get(info.id).state == "running"
    manager.kill(info.id)


@pytest.mark.parametrize(("argv", "code", "said"), [
    (["engine.extract"], 2, "extraction: error: "), (["engine.train"], 2, "training: error: "),
    (["engine.evaluate"], 2, "evaluation: error: "),
    (["engine.dataset", "regenerate", "--out", "out.jsonl"], 1, "error: "),  # its own convention: stderr, 1
])
def test_a_job_whose_error_event_cannot_be_written_still_says_why(tmp_path, argv, code, said):
    """A job ending on a bad config while its events file cannot take a line (a full disk; here the name is
    a folder): its exit code with the reason in its log, never a traceback from the failed event in its
    place. With a writable events file the same reason is the job's last event, an error."""
    from engine.workspace import init_workspace

    ws = init_workspace(tmp_path / "ws")
    config = (ws.root / "console.toml").read_text()
    (ws.root / "console.toml").write_text(config.replace("max_retries = ", "max_retries = -3 #"))
    for events_writable in (False, True):
        job_dir = tmp_path / f"job-{events_writable}"
        job_dir.mkdir()
        if not events_writable:
            (job_dir / "events.jsonl").mkdir()
        proc = subprocess.run([sys.executable, "-m", *argv, "--workspace", str(ws.root)], capture_output=True,
                              text=True, timeout=120, cwd=tmp_path, env={**os.environ, "EAGLE3_JOB_DIR": str(job_dir)})
        log = proc.stdout + proc.stderr
        assert proc.returncode == code, log
        assert said in log and "extract.max_retries" in log, log
        assert "Traceback" not in proc.stderr, proc.stderr
        if events_writable:
            events = [json.loads(line) for line in (job_dir / "events.jsonl").read_text().splitlines()]
            assert events[-1]["type"] == "error" and "extract.max_retries" in events[-1]["message"], events
    assert not (tmp_path / "out.jsonl").exists()
