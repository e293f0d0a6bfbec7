"""What writing capture segments costs the *other* threads of the process that writes them.

    python bench/spool_gil.py [--gb-s 1.0] [--seconds 4] [--writers 4] [--rows 8 --tokens 512 --hidden 640]

A stand-in for the server's model thread (a loop of small torch calls, each a kernel launch's worth
of Python and GIL) runs in this process while batches of segments (the e2e target's shape by
default: 8 rows x 512 tokens, three 640-wide layers + the final state, bf16) are written at a fixed
rate, side by side in one run:

  alone     nothing written: the stand-in's own calls/s
  threads   `write_segment` on --writers threads in this process (the server's default writers)
  packed    engine.capture.spool_process.SpoolWriterProcess (EAGLE3_CAPTURE_WRITER=process): the batch
            handed over packed with its segment table (`submit_packed`, the path of the local server and
            of SGLang's hook), one copy + one message a slot here, the files written by a child process

and prints the stand-in's calls/s under each as a ratio of `alone`, with the GB/s actually written.
The spool is freed by a separate cleaner process (as the extraction job frees it in the server's
case), so freeing costs this process nothing in either mode. No GPU: the states come from host
memory; on the GPU box the server's copies from the device add the same work to both modes.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import queue
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LAYERS = [1, 2, 3]


def _cleaner(spool: str, stop) -> None:
    """Free written segments from another process (the extraction job's part in the server's case)."""
    from engine.capture.segments import release

    while not stop.is_set():
        for name in os.listdir(spool):
            # Only published segments (each rid here has one, at start 0): a rid whose file is still
            # being written is left for the next pass.
            if os.path.exists(os.path.join(spool, name, f"{0:010d}.safetensors")):
                try:
                    release(spool, name)
                except Exception:
                    pass
        time.sleep(0.005)


def launcher_calls_per_s(seconds: float) -> float:
    """The model thread's stand-in: small torch calls as fast as the GIL lets it make them."""
    import torch

    x = torch.ones(8)
    count, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        x.add_(1)
        count += 1
    return count / seconds


class Feed:
    """Batches at a fixed rate from a feeder thread, through `mode`; counts bytes written."""

    def __init__(self, mode: str, spool: Path, args) -> None:
        import torch

        self.mode, self.spool, self.args = mode, spool, args
        rows, tokens, hidden = args.rows, args.tokens, args.hidden
        self.ids = torch.arange(rows * tokens).view(rows, tokens)
        self.aux = torch.randn(rows, tokens, 3 * hidden).to(torch.bfloat16)
        self.final = torch.randn(rows, tokens, hidden).to(torch.bfloat16)
        self.batch_bytes = sum(t.numel() * t.element_size() for t in (self.ids, self.aux, self.final))
        self.written = 0
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.serial = 0
        self.threads: list[threading.Thread] = []
        self.writer = None
        self.rows: queue.Queue = queue.Queue(maxsize=4 * rows)

    def _done(self, nbytes: int) -> None:
        with self.lock:
            self.written += nbytes

    def start(self) -> None:
        from engine.capture.spool_process import SpoolWriterProcess

        if self.mode == "threads":
            self.threads += [threading.Thread(target=self._write_rows, daemon=True) for _ in range(self.args.writers)]
        elif self.mode == "packed":
            self.writer = SpoolWriterProcess(self.spool, LAYERS, slot_bytes=self.batch_bytes + 4096, slots=3,
                                             threads=self.args.writers)
            self.writer.start()
        if self.mode != "alone":
            self.threads.append(threading.Thread(target=self._feed, daemon=True))
        for thread in self.threads:
            thread.start()

    def close(self) -> None:
        self.stop.set()
        for _ in range(self.args.writers):
            self.rows.put(None)
        for thread in self.threads:
            thread.join(30)
        if self.writer is not None:
            self.writer.close()

    def _write_rows(self) -> None:
        from engine.capture.segments import write_segment

        while (item := self.rows.get()) is not None:
            rid, i = item
            write_segment(self.spool, rid, 0, self.ids[i], self.aux[i], self.final[i], LAYERS)
            self._done(self.batch_bytes // self.args.rows)

    def _feed(self) -> None:
        interval = self.batch_bytes / (self.args.gb_s * 1e9)
        due = time.perf_counter()
        while not self.stop.is_set():
            self.serial += 1
            rids = [f"b{self.serial}-{i}" for i in range(self.args.rows)]
            if self.mode == "threads":
                for i, rid in enumerate(rids):
                    self.rows.put((rid, i))
            else:
                self.writer.submit_packed([(rid, 0, self.args.tokens) for rid in rids], self.ids.view(-1),
                                          self.aux.view(-1, self.aux.shape[-1]), self.final.view(-1, self.final.shape[-1]),
                                          lambda errors: self._done(self.batch_bytes if not any(errors) else 0))
            due += interval
            pause = due - time.perf_counter()
            if pause > 0:
                time.sleep(pause)
            else:
                due = time.perf_counter()  # behind: do not try to catch up in a burst


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gb-s", type=float, default=1.0, help="rate the feeder offers (GB/s)")
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--writers", type=int, default=4)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=640)
    parser.add_argument("--repeats", type=int, default=2, help="alternating passes over the modes")
    parser.add_argument("--spool", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    args = parser.parse_args()
    if args.gb_s <= 0 or args.seconds <= 0 or min(args.writers, args.rows, args.tokens, args.hidden) < 1:
        parser.error("--gb-s and --seconds must be > 0; --writers, --rows, --tokens, --hidden >= 1")
    import torch

    torch.set_num_threads(1)
    spool = Path(tempfile.mkdtemp(prefix="spoolgil-", dir=args.spool))
    context = multiprocessing.get_context("spawn")
    stop = context.Event()
    cleaner = context.Process(target=_cleaner, args=(str(spool), stop), daemon=True)
    cleaner.start()
    figures: dict[str, list[tuple[float, float]]] = {"alone": [], "threads": [], "packed": []}
    try:
        for _ in range(args.repeats):
            for mode in figures:
                feed = Feed(mode, spool, args)
                feed.start()
                time.sleep(0.5)  # past the start
                before, started = feed.written, time.perf_counter()
                calls = launcher_calls_per_s(args.seconds)
                gb_s = (feed.written - before) / (time.perf_counter() - started) / 1e9
                feed.close()
                figures[mode].append((calls, gb_s))
    finally:
        stop.set()
        cleaner.join(10)
        shutil.rmtree(spool, ignore_errors=True)
    alone = max(c for c, _ in figures["alone"])
    print(f"machine: {os.cpu_count()} cores; offered {args.gb_s} GB/s in batches of {args.rows} x {args.tokens} "
          f"tokens, hidden {args.hidden}, bf16, {args.writers} writer threads, {args.repeats} passes")
    print(f"alone: {alone:,.0f} launcher calls/s")
    for mode in ("threads", "packed"):
        for calls, gb_s in figures[mode]:
            print(f"{mode:8s} launcher at {calls / alone:.3f} of alone while writing {gb_s:.2f} GB/s")
    kept = {mode: statistics.median(c for c, _ in figures[mode]) / alone for mode in ("threads", "packed")}
    print(f"launcher kept (median of {args.repeats}): threads {kept['threads']:.3f}, writer process (packed) "
          f"{kept['packed']:.3f} (process / threads {kept['packed'] / kept['threads']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
