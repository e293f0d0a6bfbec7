"""Watching an online-training window from outside: its bytes on disk now, and a sampler thread that keeps
the peak (in all and per rank directory) while a run goes on."""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict
from pathlib import Path

META = {"spool_sessions.txt", "manifest.jsonl", "run.json"}  # the window's small bookkeeping files


def window_bytes(root: Path) -> int:
    """Bytes of captured records (and their temp files) under `root` now; os.walk skips what vanishes."""
    total = 0
    for folder, _, names in os.walk(root):
        for name in names:
            if name not in META:
                try:
                    total += os.stat(os.path.join(folder, name)).st_size
                except OSError:
                    continue  # deleted while we looked
    return total


class WindowSampler:
    """The window's bytes every few milliseconds on a thread: `peak` over the whole window, `rank_peak`
    per `rank<r>/` directory (several trainer ranks), `samples` how many looks were taken."""

    def __init__(self, root: Path):
        self.root, self.peak, self.samples = root, 0, 0
        self.rank_peak: dict[str, int] = defaultdict(int)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.root.exists():
                for rank in self.root.glob("rank*"):
                    self.rank_peak[rank.name] = max(self.rank_peak[rank.name], window_bytes(rank))
                self.peak, self.samples = max(self.peak, window_bytes(self.root)), self.samples + 1
            time.sleep(0.005)

    def __enter__(self) -> "WindowSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def past_a_checkpoint(events: list[dict]) -> bool:
    """A training job's events show a checkpoint and two more steps: a kill now loses steps past it."""
    saved = [e["step"] for e in events if e.get("type") == "checkpoint"]
    done = [e["done"] for e in events if e.get("type") == "progress"]
    return bool(saved and done and done[-1] >= saved[-1] + 2)
