"""The real console (`python -m eagle3_console -w WS`) in a pseudo-terminal, for fault tests."""

from __future__ import annotations

import os
import re
import signal
import struct
import subprocess
import sys
import termios
import fcntl
import threading
import time
from pathlib import Path

import psutil

_ANSI = re.compile(rb"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[()][A-Za-z0-9]|\x1b[=>]|\x1b\][^\x07]*\x07")


class ConsoleProcess:
    """A console on `workspace` in a pty of 120x40; its screen output is drained in a thread."""

    def __init__(self, workspace: Path, extra: list[str] | None = None):
        master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "120", "LINES": "40"}
        self.proc = subprocess.Popen([sys.executable, "-m", "eagle3_console", "-w", str(workspace), *(extra or [])],
                                     stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True,
                                     start_new_session=True)
        os.close(slave)
        self._master = master
        self._output = bytearray()
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _drain(self) -> None:
        while True:
            try:
                data = os.read(self._master, 65536)
            except OSError:
                return
            if not data:
                return
            with self._lock:
                self._output += data

    def text(self) -> str:
        """Screen output so far with escape sequences removed (and spaces collapsed)."""
        with self._lock:
            raw = bytes(self._output)
        plain = _ANSI.sub(b" ", raw).decode("utf-8", errors="replace")
        return " ".join(plain.split())

    def wait_for_text(self, needle: str, timeout: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if needle in self.text():
                return True
            if self.proc.poll() is not None:
                return needle in self.text()
            time.sleep(0.05)
        return False

    def descendants(self) -> list[int]:
        try:
            return [p.pid for p in psutil.Process(self.pid).children(recursive=True)]
        except psutil.Error:
            return []

    def kill9(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
        self.proc.wait(10)
        self.close()

    def close(self) -> None:
        try:
            os.close(self._master)
        except OSError:
            pass
        self._reader.join(2)
