"""`eagle3-console status`: the console's facts as text and JSON for scripts — server, jobs
with their progress, and the evaluation summary — from a real workspace and a real job."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from engine.jobs import JobManager
from tests.test_console import make_workspace
from tests.test_console_scenes import write_report

JOB = """
import time
from engine.jobctx import JobContext
ctx = JobContext.from_env()
ctx.event("started", samples=40)
ctx.progress(10, 40, eta_s=30, tokens_per_s=100.0)
ctx.event("paused", reason="output disk below reserve")
time.sleep(60)
"""


def start_paused_job(ws):
    """A real extraction-kind job that reports progress 10/40 and then "paused"; waits for that event."""
    jobs = JobManager(ws.jobs_dir)
    job = jobs.start("extract", [sys.executable, "-c", JOB])
    deadline = time.monotonic() + 20
    events = job.dir / "events.jsonl"
    while time.monotonic() < deadline and not (events.exists() and b"paused" in events.read_bytes()):
        time.sleep(0.1)
    return jobs, job


def status(ws, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eagle3_console", "status", "-w", str(ws.root), *extra],
                          capture_output=True, text=True, timeout=60)


def test_status_reports_server_job_progress_and_evaluation(tmp_path):
    ws = make_workspace(tmp_path)
    result = status(ws)
    assert result.returncode == 0, result.stderr
    assert "server: stopped" in result.stdout
    assert "evaluation: none (no evaluation report at" in result.stdout

    jobs, job = start_paused_job(ws)
    try:
        write_report(ws.eval_dir, 0.82)
        text = status(ws).stdout
        line = next(line for line in text.splitlines() if line.strip().startswith(job.id))
        assert "extract" in line and "running" in line and "10/40 (25%)" in line
        assert "PAUSED: output disk below reserve" in line
        assert "evaluation: acceptance length 2.69 · SLOWER: 0.82×" in text
        data = json.loads(status(ws, "--json").stdout)
        entry = next(j for j in data["jobs"] if j["id"] == job.id)
        assert entry["progress"]["done"] == 10 and entry["progress"]["percent"] == 25.0
        assert data["evaluation"]["available"] and data["evaluation"]["slower"] is True
        assert data["server"]["state"] == "stopped"
    finally:
        jobs.stop_sync(job.id, grace=5)
