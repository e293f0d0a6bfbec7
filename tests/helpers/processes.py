"""Real processes for tests: ports, the local target server, a second lock holder."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def local_server_argv(model_dir: Path, port: int, *extra: str, device: str = "cpu",
                      dtype: str = "float32") -> list[str]:
    """The local target server's command line on 127.0.0.1 (for tests that start it as a process)."""
    return [sys.executable, "-m", "engine.localserver", "--model-path", str(model_dir), "--host", "127.0.0.1",
            "--port", str(port), "--device", device, "--dtype", dtype, *extra]


def wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout: float = 120.0) -> None:
    """Wait for a started server process to answer /health; fail with its log if it dies or stalls."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}: {log.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"server not healthy within {timeout:.0f} s: {log.read_text()}")
        time.sleep(0.2)


def writer_child_pid(description: str) -> int:
    """The capture writer child's pid from /server_info's capture.writer ("process (pid N[; ...])");
    AssertionError if the server writes on threads."""
    assert description.startswith("process (pid "), description
    return int(description.removeprefix("process (pid ").split(")")[0].split(";")[0])


def stop_process(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM a test's server process, SIGKILL it if it has not exited after `grace` seconds."""
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def lock_held_by_another_process(directory: Path, name: str) -> Iterator[int]:
    """A real second process holding the flock `directory/name` (as a concurrent job would);
    yields its pid and kills it on exit."""
    code = ("import sys, time; from pathlib import Path; from engine.workspace import WorkspaceLock; "
            "lock = WorkspaceLock(Path(sys.argv[1]), sys.argv[2]); assert lock.acquire(); "
            "print('held', flush=True); time.sleep(120)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(directory), name], stdout=subprocess.PIPE, text=True,
                              cwd=REPO)
    assert holder.stdout is not None
    try:
        assert holder.stdout.readline().strip() == "held"
        yield holder.pid
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
