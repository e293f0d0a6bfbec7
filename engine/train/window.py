"""The disk budget of online training: bytes of captured records on disk at once.

The producer reserves a record's bytes before it captures it, in the order the trainer will consume
the records, and the trainer releases them once it has read (and deleted) the record. A reservation is
admitted when it fits under the budget, or when every reservation still held belongs to its own batch:
a batch larger than the whole window still trains, alone (the "plus one batch" of `train.window_gb`).
Records kept across epochs (hybrid mode, the held-out set) hold their bytes for good.

Sizes are reserved from the token count before the record exists (`record_bytes`), never less than
what is written, so the bytes on disk never exceed what is reserved."""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path

from engine.system.disk import records_bytes
from engine.errors import EngineError

GB = 10**9  # window_gb is in decimal gigabytes: 0.005 is 5,000,000 bytes
CAPTURE_RATE_TAIL_BYTES = 256 * 1024  # the end of a job's events.jsonl: its last few hundred lines


class WindowClosed(EngineError):
    """The window was closed while a reservation waited (training stopped or failed)."""


def window_dir(workspace) -> Path:
    """`<extract.output_dir>/window/<train.run>/`: stream/ (records ahead of the trainer), kept/ (kept for good)."""
    cfg = workspace.config
    return Path(workspace.path(cfg.extract.output_dir)) / "window" / cfg.train.run


def rank_window_dir(workspace, rank: int, world: int) -> Path:
    """One trainer rank's window: the window directory itself on one rank, `rank<r>/` in it on several."""
    root = window_dir(workspace)
    return root if world == 1 else root / f"rank{rank}"


def drop_other_layouts(root: Path, world: int) -> None:
    """Remove what a run with another rank count left in the window (its bytes would count on the disk
    but in no rank's budget): `rank<k>/` for k >= world, and the one-rank stream/ and kept/ on several."""
    import shutil

    if not root.is_dir():
        return
    for path in root.iterdir():
        rank = path.name[4:] if path.name.startswith("rank") else ""
        stale = (rank.isdigit() and (world == 1 or int(rank) >= world)) if rank else (world > 1 and path.name in ("stream", "kept"))
        if stale and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)


def window_budget(config) -> int:
    return int(config.train.window_gb * GB)


def last_capture_rate(workspace) -> float | None:
    """Tokens/s of capture last measured in this workspace: an online training job's producer rate, else an
    extraction's rate (the newest job that reported one); None before any."""
    from engine.jobs.context import EVENTS_FILE
    from engine.jobs.events import Progress
    from engine.jobs.manager import JobManager
    from engine.watchers import last_events

    for job in JobManager(workspace.jobs_dir).list():  # newest first
        if job.kind not in ("extract", "train"):
            continue
        key = "capture_tokens_per_s" if job.kind == "train" else "tokens_per_s"
        for event in reversed(last_events(job.dir / EVENTS_FILE, CAPTURE_RATE_TAIL_BYTES)):
            value = getattr(event, key) if isinstance(event, Progress) else None
            if value is not None and 0 < value < float("inf"):  # NaN compares false
                return float(value)
    return None


def record_bytes(tokens: int, hidden_size: int, aux_format: str = "bf16") -> int:
    """Upper bound of the bytes of one record of `tokens` tokens (engine.records' layout)."""
    return records_bytes(tokens, 1, hidden_size, aux_format)


class Window:
    """Thread-safe byte accounting of the window; `reserve` blocks until the bytes are admitted."""

    def __init__(self, budget: int):
        self.budget = int(budget)
        self.used = 0  # reserved and not released: records being captured, waiting, being read, kept
        self.kept = 0  # of which kept for good
        self.peak = 0
        self._held: Counter[int] = Counter()  # reservations per batch (slot), not yet released or kept
        self._cond = threading.Condition()
        self.closed = False

    def _admits(self, nbytes: int, slot: int) -> bool:
        if self.used + nbytes <= self.budget:
            return True
        return all(held == slot for held, count in self._held.items() if count > 0)

    def reserve(self, nbytes: int, slot: int, timeout: float | None = None) -> bool:
        """Take `nbytes` for a record of batch `slot`; False when `timeout` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._admits(nbytes, slot):
                if self.closed:
                    raise WindowClosed("the online training window was closed")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left if left is not None else 1.0)
            if self.closed:
                raise WindowClosed("the online training window was closed")
            self.used += nbytes
            self._held[slot] += 1
            self.peak = max(self.peak, self.used)
            return True

    def keep(self, nbytes: int, slot: int) -> None:
        """The record reserved (`nbytes`) for `slot` stays for good: its bytes stay counted."""
        with self._cond:
            self._held[slot] -= 1
            self.kept += nbytes
            self._cond.notify_all()

    def add_kept(self, nbytes: int) -> None:
        """Bytes of a record already on disk and kept (found at start)."""
        with self._cond:
            self.used += nbytes
            self.kept += nbytes
            self.peak = max(self.peak, self.used)

    def release(self, nbytes: int, slot: int | None) -> None:
        """The record is gone from disk (trained and deleted, or dropped)."""
        with self._cond:
            self.used -= nbytes
            if slot is None:
                self.kept -= nbytes
            else:
                self._held[slot] -= 1
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()
