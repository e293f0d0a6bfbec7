"""`eagle3-console status`: the console's facts as text and JSON for scripts — server, jobs
with their progress, and the evaluation summary — from a real workspace and a real job."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers.jobs import start_paused_job
from tests.helpers.scenes import write_report
from tests.helpers.workspaces import console_workspace


def status(ws, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eagle3_console", "status", "-w", str(ws.root), *extra],
                          capture_output=True, text=True, timeout=60)


def test_status_reports_server_job_progress_and_evaluation(tmp_path):
    ws = console_workspace(tmp_path)
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
