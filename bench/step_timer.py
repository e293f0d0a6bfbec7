"""Where the extraction job's time goes: wall time summed per step, across the job's threads.

`install()` wraps the functions the job calls for each record (the server round trip, reading the
spool back, the finite check, the record's serialisation, its hash, fsyncs, the manifest append)
with timers, in this process only; `report(records, wall_s)` gives each step's total thread-seconds,
milliseconds per record and its share of the job's wall time (above 1.0 when threads overlap).
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

    wrapper._step_timer = True
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

    import safetensors.torch

    import engine.atomic
    import engine.capture.segments as segments
    import engine.client as client
    import engine.extract.job as job
    import engine.records as records

    client.ServerClient.generate = _timed_async("server round trip (generate)", client.ServerClient.generate)
    segments.assemble = _timed("spool read + assemble", segments.assemble)
    segments.release = _timed("spool release (delete segments)", segments.release)
    job.all_finite = _timed("finite check", job.all_finite)
    job.write_record = _timed("record write total", job.write_record)
    job.append_manifest = _timed("manifest append (fsync)", job.append_manifest)
    safetensors.torch.save_file = _timed("  serialise + write temp file", safetensors.torch.save_file)
    records._sha256_file = _timed("  sha256 (re-read)", records._sha256_file)
    engine.atomic.os.fsync = _timed("  fsync (all)", os.fsync)


def report(records: int, wall_s: float) -> dict[str, dict[str, float]]:
    with _lock:
        return {name: {"thread_s": round(total, 3), "calls": _counts[name],
                       "ms_per_record": round(1000 * total / max(records, 1), 2),
                       "share_of_wall": round(total / wall_s, 3) if wall_s else 0.0}
                for name, total in sorted(_totals.items(), key=lambda item: -item[1])}
