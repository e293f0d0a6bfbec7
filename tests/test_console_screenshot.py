"""`eagle3-console screenshot`: headless SVGs of the console as it stands, taken read-only
(the way the GPU benchmark photographs a live run) — real subprocess, real workspace, real job."""

from __future__ import annotations

import html
import subprocess
import sys

from engine.workspace import Workspace
from tests.helpers.jobs import start_paused_job
from tests.helpers.workspaces import console_workspace


def screenshot(ws, out, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eagle3_console", "screenshot", "-w", str(ws.root), str(out), *extra],
                          capture_output=True, text=True, timeout=120)


def svg_text(path) -> str:
    return html.unescape(path.read_text(encoding="utf-8")).replace("\xa0", " ")


def test_screenshot_shows_a_running_job_and_never_takes_the_lock(tmp_path):
    ws = console_workspace(tmp_path)
    jobs, job = start_paused_job(ws)
    try:
        result = screenshot(ws, tmp_path / "shots", "--tabs", "extraction,pipeline", "--size", "80x24",
                            "--settle", "1")
        assert result.returncode == 0, result.stderr
        shots = sorted((tmp_path / "shots").glob("*.svg"))
        assert [p.name for p in shots] == ["extraction-80x24.svg", "pipeline-80x24.svg"]
        extraction = svg_text(shots[0])
        assert job.id[:12] in extraction and "10/40" in extraction  # the live job, with its progress
        assert "paused" in extraction.lower()
        assert "read-only: driven by nobody" in extraction  # attached, and says so
        # It attached read-only: a console started afterwards can still drive the workspace.
        assert Workspace(ws.root).lock.acquire()
    finally:
        jobs.stop_sync(job.id, grace=5)


def test_screenshot_rejects_bad_arguments_with_the_fix(tmp_path):
    ws = console_workspace(tmp_path)
    bad_tab = screenshot(ws, tmp_path / "s", "--tabs", "gpu")
    assert bad_tab.returncode == 2
    assert "unknown tab gpu: choose from gpus, server" in bad_tab.stderr
    bad_size = screenshot(ws, tmp_path / "s", "--size", "80by24")
    assert bad_size.returncode == 2 and "is not COLSxROWS, e.g. 160x50" in bad_size.stderr
    tiny = screenshot(ws, tmp_path / "s", "--size", "20x5")
    assert tiny.returncode == 2 and "out of range" in tiny.stderr
    assert not (tmp_path / "s").exists()  # nothing written on a refusal
