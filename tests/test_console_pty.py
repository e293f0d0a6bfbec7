"""The console in a real pseudo-terminal: a dropped SSH link (the pty's master side closing)
makes it exit by itself, releasing the workspace lock and leaving detached jobs running.

The pty is made the console's controlling terminal (as sshd does), so closing the master
sends SIGHUP; the tty watchdog covers terminals that hang up without one.
"""

from __future__ import annotations

import fcntl
import os
import select
import subprocess
import sys
import termios
import time

import pytest

from engine.jobs.manager import JobManager
from engine.workspace import WorkspaceLock
from tests.helpers.workspaces import console_workspace


def _make_controlling_tty() -> None:  # runs in the child, after setsid (start_new_session)
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def read_until(master: int, needle: bytes, timeout: float) -> bytes:
    seen = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and needle not in seen:
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                seen += os.read(master, 65536)
            except OSError:
                break
    return seen


def start_console_in_pty(ws_root, *, controlling: bool):
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, b"\x18\x00\x50\x00\x00\x00\x00\x00")  # 24 rows, 80 cols
    env = {**os.environ, "TERM": "xterm-256color", "TEXTUAL_ANIMATIONS": "none"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "eagle3_console", "-w", str(ws_root)],
        stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True,
        start_new_session=True, preexec_fn=_make_controlling_tty if controlling else None,
    )
    os.close(slave)
    return proc, master


@pytest.mark.parametrize("controlling", [True, False], ids=["sighup", "watchdog"])
def test_console_exits_when_its_terminal_goes_away(tmp_path, controlling):
    ws = console_workspace(tmp_path)
    jobs = JobManager(ws.jobs_dir)
    job = jobs.start("train", [sys.executable, "-c", "import time; time.sleep(60)"])
    proc, master = start_console_in_pty(ws.root, controlling=controlling)
    try:
        screen = read_until(master, b"Pipeline", timeout=30)
        assert b"Pipeline" in screen, screen[-2000:]
        time.sleep(0.5)
        assert proc.poll() is None, "the console should be running"
        assert not WorkspaceLock(ws.root).acquire(), "the console should hold the lock"
        os.close(master)  # the SSH link drops
        master = -1
        code = proc.wait(timeout=30)  # raises TimeoutExpired if the console keeps running
        assert code == 0, f"not a clean exit: {code}"
        probe = WorkspaceLock(ws.root)
        assert probe.acquire(), "the lock was not released"
        probe.release()
        info = jobs.get(job.id)
        assert info.state == "running", info  # the detached job was not touched
    finally:
        if master >= 0:
            os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        jobs.stop_sync(job.id, grace=5)
