"""Run the local target server with its model thread's prefill timed from inside (CUDA only).

    python bench/runner_probe.py OUT -- -m engine.localserver --port ...

Wraps `ModelRunner._forward` and `CaptureSink.queue_rows` before the server starts. For every prefill
forward it records, split by whether the batch was captured: host milliseconds (how long the
model thread's Python took to launch it), GPU milliseconds (CUDA events around it on the compute
stream, read later so nothing waits for them), the caching allocator's device allocations,
frees and retries during the call, and the pinned host allocator's allocations. `queue_rows`
gets host ms and the same allocator counts. OUT (JSON) is rewritten every two seconds.

Tells apart: the GPU doing more work under capture (GPU ms up), the host blocking in the launch
path (host ms up, GPU ms equal), and the allocator going back to cudaMalloc (device allocs > 0).
"""

from __future__ import annotations

import json
import os
import runpy
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

COUNTERS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")


def _device_counts(torch) -> dict:
    stats = torch.cuda.memory_stats()
    return {name: int(stats.get(name, 0)) for name in COUNTERS}


def _host_allocs(torch) -> int:
    try:
        return int(torch.cuda.host_memory_stats().get("num_host_alloc", 0))
    except (AttributeError, RuntimeError):
        return -1


class Probe:
    def __init__(self, out: str):
        self.out = out
        self.lock = threading.Lock()
        self.rows: list[dict] = []  # one per timed call; GPU ms filled in at dump time

    def record(self, row: dict) -> None:
        with self.lock:
            self.rows.append(row)

    def summary(self) -> dict:
        with self.lock:
            rows = list(self.rows)
        groups: dict = {}
        for row in rows:
            events = row.pop("_events", None)
            if events is not None:
                if not events[1].query():
                    row["_events"] = events  # not finished yet: next dump
                    continue
                row["gpu_ms"] = events[0].elapsed_time(events[1])
            groups.setdefault(row["kind"], []).append(row)
        report = {}
        for kind, items in groups.items():
            entry = {"calls": len(items), "host_ms_median": round(statistics.median(r["host_ms"] for r in items), 3),
                     "host_ms_total": round(sum(r["host_ms"] for r in items), 1)}
            gpu = [r["gpu_ms"] for r in items if "gpu_ms" in r]
            if gpu:
                entry["gpu_ms_median"] = round(statistics.median(gpu), 3)
                entry["gpu_ms_total"] = round(sum(gpu), 1)
            for name in (*COUNTERS, "num_host_alloc"):
                entry[name] = sum(r.get(name, 0) for r in items)
            entry["tokens"] = sum(r.get("tokens", 0) for r in items)
            report[kind] = entry
        return report

    def dump_forever(self) -> None:
        while True:
            time.sleep(2.0)
            report = self.summary()
            tmp = self.out + ".tmp"
            with open(tmp, "w") as handle:
                json.dump(report, handle, indent=1)
            os.replace(tmp, self.out)


def install(probe: Probe) -> None:
    import torch

    from engine.localserver.capture_sink import CaptureSink
    from engine.localserver.model_runner import ModelRunner

    forward, queue_rows = ModelRunner._forward, CaptureSink.queue_rows

    def timed(kind_of, call):
        def wrapper(self, *args, **kwargs):
            if getattr(self, "device", None) == "cpu" or not torch.cuda.is_available():
                return call(self, *args, **kwargs)
            kind = kind_of(self, *args)
            before, host_before = _device_counts(torch), _host_allocs(torch)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            result = call(self, *args, **kwargs)
            host_ms = (time.perf_counter() - t0) * 1e3
            end.record()
            after, host_after = _device_counts(torch), _host_allocs(torch)
            row = {"kind": kind, "host_ms": host_ms, "_events": (start, end),
                   "num_host_alloc": max(0, host_after - host_before)}
            row.update({name: after[name] - before[name] for name in COUNTERS})
            if kind.startswith("prefill"):
                row["tokens"] = int(args[0].numel())
            probe.record(row)
            return result
        return wrapper

    def forward_kind(self, input_ids, *rest):
        if input_ids.shape[1] == 1:
            return "decode_step"
        return "prefill_captured" if self.hooks.active else "prefill_plain"

    ModelRunner._forward = timed(forward_kind, forward)
    CaptureSink.queue_rows = timed(lambda self, *a: "queue_captures", queue_rows)


def main() -> None:
    args = sys.argv[1:]
    split = args.index("--")
    own, target = args[:split], args[split + 1:]
    if len(own) != 1 or target[:1] != ["-m"]:
        raise SystemExit("usage: runner_probe.py OUT -- -m MODULE ARGS...")
    probe = Probe(own[0])
    install(probe)
    threading.Thread(target=probe.dump_forever, name="runner-probe", daemon=True).start()
    sys.argv = [target[1], *target[2:]]
    runpy.run_module(target[1], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
