"""The installed `eagle3-console` in a real tmux session at 80x24: the tabs and the footer are
on screen, a number key switches tabs, and `q` closes it (the process exits). What a user
sees over SSH, read back with `tmux capture-pane -p`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.helpers.workspaces import console_workspace

TMUX = shutil.which("tmux") or "tmux"  # absent: every test here is skipped
pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (.ci/run installs it)")


def console_binary() -> str:
    found = Path(sys.executable).parent / "eagle3-console"
    if found.exists():
        return str(found)
    which = shutil.which("eagle3-console")
    if which is None:
        pytest.skip("eagle3-console is not installed (pip install -e .)")
    return which


def tmux(socket: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([TMUX, "-L", socket, *args], capture_output=True, text=True, timeout=10)


def capture(socket: str) -> str:
    return tmux(socket, "capture-pane", "-p", "-t", "console").stdout


def wait_for(socket: str, predicate, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    screen = ""
    while time.monotonic() < deadline:
        screen = capture(socket)
        if predicate(screen):
            return screen
        time.sleep(0.2)
    raise AssertionError(f"screen never matched; last screen:\n{screen}")


def test_installed_console_in_tmux(tmp_path):
    ws = console_workspace(tmp_path)
    socket = f"eagle3-test-{uuid.uuid4().hex[:8]}"  # a private tmux server, never the user's
    marker = tmp_path / "exited"
    command = f"{console_binary()} -w {ws.root}; echo $? > {marker}; sleep 30"
    env = {**os.environ, "TERM": "xterm-256color"}
    result = subprocess.run([TMUX, "-L", socket, "-f", "/dev/null", "new-session", "-d", "-s", "console",
                             "-x", "80", "-y", "24", command], env=env, capture_output=True, text=True, timeout=10)
    assert result.returncode == 0, result.stderr
    try:
        tmux(socket, "set-option", "-g", "escape-time", "10")
        screen = wait_for(socket, lambda s: "6 Evaluation" in s and "palette" in s)
        lines = screen.splitlines()
        assert len(lines) <= 24 and all(len(line) <= 80 for line in lines)
        for tab in ("1 GPUs", "2 Server", "3 Pipeline", "4 Extraction", "5 Training", "6 Evaluation"):
            assert tab in screen, tab
        assert "q Quit" in screen and "? Help" in screen  # the footer
        assert "╭─ Pipeline" in screen and "evaluate" in screen
        tmux(socket, "send-keys", "-t", "console", "4")
        screen = wait_for(socket, lambda s: "╭─ Extraction" in s)
        assert "s Start" in screen and "S Stop" in screen and "╭─ Pipeline" not in screen
        tmux(socket, "send-keys", "-t", "console", "q")
        deadline = time.monotonic() + 15
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert marker.exists(), f"the console did not exit; screen:\n{capture(socket)}"
        assert marker.read_text().strip() == "0"
        assert "Console closed. No jobs running." in capture(socket)
    finally:
        tmux(socket, "kill-server")
