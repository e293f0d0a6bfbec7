"""Where the extraction job's time goes: wall time summed per step, across the job's threads.

`install()` wraps the functions the job calls for each record (the server round trip, opening the
spool's segments, the record's streamed write with its finite checks, page-cache writes and fsyncs,
the manifest's group commits) with timers, in this process only; what a record write spends beyond
its timed parts is reading the spool and hashing, which cannot be wrapped. `report(records, wall_s)`
gives each step's total thread-seconds, milliseconds per record and its share of the job's wall
time (above 1.0 when threads overlap).
"""

from __future__ import annotations

import functools
import threading
import time
from collections import defaultdict

_totals: dict[str, float] = defaultdict(float)
_counts: dict[str, int] = defaultdict(int)
_lock = threading.Lock()


def _timed(name: str, fn):
    if getattr(fn, "_step_timer", False):
        return fn

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            with _lock:
                _totals[name] += time.perf_counter() - start
                _counts[name] += 1

    setattr(wrapper, "_step_timer", True)
    return wrapper


def _timed_async(name: str, fn):
    @functools.wraps(fn)
    async def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return await fn(*args, **kwargs)
        finally:
            with _lock:
                _totals[name] += time.perf_counter() - start
                _counts[name] += 1

    return wrapper


def install() -> None:
    import os

    import engine.capture.segments as segments
    import engine.client as client
    import engine.extract.commit as commit
    import engine.extract.job as job
    import engine.records as records

    setattr(client.ServerClient, "generate",
            _timed_async("server round trip (generate)", client.ServerClient.generate))
    segments.open_capture = _timed("spool open + check headers and ids", segments.open_capture)
    segments.release = _timed("spool release (delete segments)", segments.release)
    job.write_record_stream = _timed("record write total", job.write_record_stream)
    records._bf16_finite = _timed("  finite check (per 4 MiB chunk)", records._bf16_finite)
    records.write_all = _timed("  write into the page cache", records.write_all)
    # os.fsync is looked up at each call, so this times every fsync of the process (records, dirs, manifest).
    os.fsync = _timed("  fsync (all)", os.fsync)
    setattr(job.Extractor, "_finish",
            _timed("finish (final check, token counts, complete.json)", job.Extractor._finish))
    commit.append_manifest_entries = _timed("manifest group commit (dir + manifest fsync)",
                                            commit.append_manifest_entries)


def snapshot() -> dict[str, tuple[float, int]]:
    """Each step's (seconds, calls) so far."""
    with _lock:
        return {name: (total, _counts[name]) for name, total in _totals.items()}


def report(records: int, wall_s: float, taken: dict[str, tuple[float, int]] | None = None) -> dict[str, dict[str, float]]:
    """Per step: thread-seconds, calls, ms per record, share of `wall_s`; of `taken` (a snapshot) if given."""
    steps = taken if taken is not None else snapshot()
    return {name: {"thread_s": round(total, 3), "calls": calls,
                   "ms_per_record": round(1000 * total / max(records, 1), 2),
                   "share_of_wall": round(total / wall_s, 3) if wall_s else 0.0}
            for name, (total, calls) in sorted(steps.items(), key=lambda item: -item[1][0])}
