"""`eagle3-console jobs`: list, logs and a clean stop of a real detached job, headless, plus the
refusals (no id, an unsafe or unknown id, a console driving the workspace)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

from tests.helpers.processes import lock_held_by_another_process
from tests.helpers.workspaces import console_workspace
from engine.jobs.manager import JobManager
from engine.workspace import LOCK_NAME

GRACEFUL_JOB = """
import time
from engine.jobs.context import JobContext
ctx = JobContext.from_env()
ctx.install_sigterm_handler()
ctx.event("started", samples=40)
ctx.progress(12, 40, tokens_per_s=50.0)
print("working on sample 12", flush=True)
while not ctx.stop_requested:
    time.sleep(0.05)
print("checkpoint written at sample 12", flush=True)
ctx.event("stopped", done=12)
"""


def jobs_cli(ws, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eagle3_console", "jobs", "-w", str(ws.root), *args],
                          capture_output=True, text=True, timeout=120)


def _wait_for(predicate, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_jobs_list_logs_and_a_clean_stop(tmp_path):
    ws = console_workspace(tmp_path)
    assert "no jobs in" in jobs_cli(ws).stdout
    for argv in (["-w", str(ws.root), "jobs"], ["-w", str(ws.root), "status"]):  # -w before the command
        before = subprocess.run([sys.executable, "-m", "eagle3_console", *argv], capture_output=True, text=True,
                                timeout=120, cwd=tmp_path)
        assert before.returncode == 0 and str(ws.root) in before.stdout, (argv, before.stderr)
    jobs = JobManager(ws.jobs_dir)
    job = jobs.start("extract", [sys.executable, "-c", GRACEFUL_JOB])
    try:
        _wait_for(lambda: "working on sample 12" in "\n".join(jobs.tail(job.id, 5)), "the job to start working")
        listed = jobs_cli(ws)
        line = next(line for line in listed.stdout.splitlines() if job.id in line)
        assert "extract" in line and "running" in line and "12/40 (30%)" in line, listed.stdout
        rows = json.loads(jobs_cli(ws, "list", "--json").stdout)
        assert [r["id"] for r in rows] == [job.id] and rows[0]["progress"]["done"] == 12
        assert jobs_cli(ws, "logs", job.id, "-n", "1").stdout.strip() == "working on sample 12"
        stacks = jobs_cli(ws, "stacks", job.id)
        assert stacks.returncode == 0 and f"# stacks of job {job.id}" in stacks.stdout, stacks.stderr
        assert 'File "<string>"' in stacks.stdout and "in <module>" in stacks.stdout, stacks.stdout
        assert jobs.get(job.id).state == "running"

        with lock_held_by_another_process(ws.root, LOCK_NAME) as console_pid:
            refused = jobs_cli(ws, "stop", job.id)
            assert refused.returncode == 2 and f"pid {console_pid}" in refused.stderr
            assert "from that console" in refused.stderr
        assert jobs.get(job.id).state == "running", "a refused stop leaves the job alone"

        stopped = jobs_cli(ws, "stop", job.id, "--grace", "20")
        assert stopped.returncode == 0, stopped.stderr
        assert f"job {job.id}: stopped" in stopped.stdout
        final = jobs.get(job.id)
        assert final.state == "stopped" and final.exit_code == 0, "SIGTERM let it checkpoint and exit on its own"
        assert "checkpoint written at sample 12" in jobs.tail(job.id, 5)
        again = jobs_cli(ws, "stop", job.id)
        assert again.returncode == 0 and "nothing to stop" in again.stdout
        ended = jobs_cli(ws, "stacks", job.id)
        assert ended.returncode == 2 and "not running" in ended.stderr
    finally:
        if jobs.get(job.id).active:
            jobs.kill(job.id)


def test_jobs_bad_requests_get_clear_errors(tmp_path):
    ws = console_workspace(tmp_path)
    no_id = jobs_cli(ws, "stop")
    assert no_id.returncode == 2 and "required: ID" in no_id.stderr and "jobs stop" in no_id.stderr
    unknown = jobs_cli(ws, "logs", "extract-nosuch")
    assert unknown.returncode == 2 and "no job 'extract-nosuch'" in unknown.stderr
    unsafe = jobs_cli(ws, "stop", "../../etc")
    assert unsafe.returncode == 2 and "job id" in unsafe.stderr and "Traceback" not in unsafe.stderr
    assert not (ws.root.parent / "etc").exists()
    damaged = ws.jobs_dir / "extract-damaged"
    damaged.mkdir(parents=True)
    (damaged / "job.json").write_text("{ half a record")
    broken = jobs_cli(ws, "logs", "extract-damaged")
    assert broken.returncode == 2 and "extract-damaged" in broken.stderr and "Traceback" not in broken.stderr
    # A broken console.toml must not keep anyone from listing or stopping jobs.
    ws.config_path.write_text(ws.config_path.read_text() + "\n[extract\nconcurrency = oops\n")
    listed = jobs_cli(ws, "list")
    assert listed.returncode == 0 and "Traceback" not in listed.stderr, listed.stderr


def test_stopping_the_server_job_goes_through_the_server_manager(tiny_chat_model_dir, tmp_path):
    """Else the server record still says "running" and a console's restart policy would take the
    stop for a crash and start it again."""
    import asyncio

    from tests.helpers.workspaces import make_workspace
    from engine.server.manager import ServerManager

    ws = make_workspace(tmp_path / "ws", tiny_chat_model_dir)
    manager = ServerManager(ws)
    status = asyncio.run(manager.start())
    try:
        assert status.state == "ready"
        stopped = jobs_cli(ws, "stop", status.job_id, "--grace", "10")
        assert stopped.returncode == 0, stopped.stderr
        after = asyncio.run(manager.poll())
        assert after.state == "stopped", after
        assert manager.record().get("desired") == "stopped"
    finally:
        asyncio.run(manager.stop(grace=5))


def test_check_shows_a_running_job_and_run_refuses_red_prerequisites(tmp_path):
    """Headless, as in the console: a stage whose job runs reads running (not failed), and
    `run extract` does not start a job while a prerequisite stage is red; --force does."""
    ws = console_workspace(tmp_path, **{"model.path": str(tmp_path / "no-such-model")})
    cli = [sys.executable, "-m", "eagle3_console"]
    jobs = JobManager(ws.jobs_dir)
    job = jobs.start("extract", [sys.executable, "-c", GRACEFUL_JOB])
    try:
        _wait_for(lambda: jobs.get(job.id).state == "running", "the job to run")
        checked = subprocess.run([*cli, "check", "extract", "-w", str(ws.root)], capture_output=True, text=True,
                                 timeout=120)
        assert "extract   running" in checked.stdout and job.id in checked.stdout, checked.stdout
        assert "failed" not in checked.stdout.splitlines()[0]
    finally:
        asyncio.run(jobs.stop(job.id, grace=10))

    assert subprocess.run([*cli, "check", "model", "-w", str(ws.root)], capture_output=True, timeout=120).returncode
    refused = subprocess.run([*cli, "run", "extract", "-w", str(ws.root)], capture_output=True, text=True,
                             timeout=120)
    assert refused.returncode != 0 and "not starting extract" in refused.stderr and "model (" in refused.stderr
    assert "no-such-model" in refused.stderr and "--force" in refused.stderr and "Traceback" not in refused.stderr
    assert [j.id for j in jobs.list() if j.kind == "extract"] == [job.id]  # nothing new was started


def test_progress_lines_take_non_finite_numbers():
    """A diverged job's events carry NaN/Infinity (as numbers from older files, as text now)."""
    from eagle3_console.cliprint import progress_line
    from engine.jobs.events import parse_event

    def line_of(**fields) -> str:
        return progress_line(parse_event({"type": "progress", **fields}))

    for eta in (float("nan"), float("inf"), "NaN", "Infinity", None):
        line = line_of(done=3, total=8, eta_s=eta, tokens_per_s=10.0)
        assert "3/8" in line and "ETA" not in line
    assert "ETA 12s" in line_of(done=3, total=8, eta_s=12.4)


def test_run_prints_other_events_as_written():
    """`run` prints a followed job's other events from the typed contract: the fields as the job wrote them
    (a non-finite number as its text, an unknown kind whole), an evaluation's table alone."""
    from eagle3_console.cliprint import event_line
    from engine.jobs.events import parse_event

    paused = parse_event({"t": 1.0, "type": "paused", "reason": "output disk below reserve"})
    assert event_line(paused) == '  [paused] {"reason": "output disk below reserve"}'
    nonfinite = parse_event({"type": "nonfinite", "step": 4, "loss": "NaN", "grad_norm": "Infinity", "note": 1})
    assert event_line(nonfinite) == '  [nonfinite] {"step": 4, "loss": "NaN", "grad_norm": "Infinity", "note": 1}'
    assert event_line(parse_event({"type": "shiny", "x": [1, 2]})) == '  [shiny] {"x": [1, 2]}'
    assert event_line(parse_event({"type": "finished", "table": "a | b", "speedup": 1.5})) == "a | b"
    assert event_line(parse_event({"type": "finished", "samples": 6})) == '  [finished] {"samples": 6}'
    assert event_line(parse_event({"type": "metrics", "step": 1})) is None
