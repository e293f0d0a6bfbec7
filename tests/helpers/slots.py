"""Is the server kept busy while records are written? Counts the requests at the server
(`ServerClient.generate`) and wraps a record writer so that each write first waits (a slow disk, up to a
second) to see whether every request slot is taken meanwhile."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable


class RequestSlots:
    def __init__(self, monkeypatch: Any, concurrency: int):
        from engine.client import ServerClient

        self.concurrency = concurrency
        self.in_flight = self.most = self.full_during_write = self.writes = 0
        self._lock = threading.Lock()
        real_generate = ServerClient.generate

        async def counted_generate(client, *args, **kwargs):
            self.in_flight += 1
            self.most = max(self.most, self.in_flight)
            try:
                return await real_generate(client, *args, **kwargs)
            finally:
                self.in_flight -= 1

        monkeypatch.setattr(ServerClient, "generate", counted_generate)

    def slow(self, real_write: Callable[..., Any]) -> Callable[..., Any]:
        """`real_write`, after waiting up to a second for every slot to be at the server."""
        def write(*args, **kwargs):
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline:
                if self.in_flight == self.concurrency:
                    with self._lock:
                        self.full_during_write += 1
                    break
                time.sleep(0.005)
            with self._lock:
                self.writes += 1
            return real_write(*args, **kwargs)

        return write

    def __repr__(self) -> str:
        return (f"RequestSlots(most={self.most}, full_during_write={self.full_during_write}, writes={self.writes}, "
                f"concurrency={self.concurrency})")
