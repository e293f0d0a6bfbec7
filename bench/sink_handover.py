"""CPU time the local server's model thread spends handing one captured batch to the writer process:
the sink's packed hand-over (`CaptureSink._to_process` -> `submit_packed`) against a piece a request
(`submit`, what the sink did before), side by side in one run. States are narrow by default so that
the copies into shared memory cost little and the per-batch Python shows; on a GPU those copies are
asynchronous and the Python is what the thread that launches the model pays.

    python bench/sink_handover.py                        # the e2e shape's batch: 64 x 512 tokens
    python bench/sink_handover.py --rows 16 --tokens 2048   # the 1b shape's batch
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.localserver.capture_sink import CaptureConfig, CaptureSink  # noqa: E402


class Completion(SimpleNamespace):
    def finish_capture(self, error: str | None = None) -> None:
        self.error = error
        self.answered.set()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=8)
    parser.add_argument("--batches", type=int, default=30)

    parser.add_argument("--spool", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    args = parser.parse_args()

    spool = Path(tempfile.mkdtemp(prefix="sinkbench-", dir=args.spool))
    sink = CaptureSink()
    sink.config, sink.mode = CaptureConfig([1, 2, 3], spool), "process"
    sink._start_process(args.hidden * 2, 8192)
    if sink._process is None:
        print(f"the writer process did not start: {sink.note}")
        return 1
    writer = sink._process
    rows, width = list(range(args.rows)), args.tokens
    host_ids = torch.randint(0, 32000, (args.rows, width))
    results: dict[str, list[float]] = {}
    try:
        for padded in (False, True):
            lengths = [width - (row % 7 if padded else 0) for row in rows]  # padded: most rows end early
            shape = "some rows shorter" if padded else "full rows"
            for number in range(args.batches):
                aux = torch.randn(args.rows, width, 3 * args.hidden).bfloat16()
                final = torch.randn(args.rows, width, args.hidden).bfloat16()
                for way in ("per request (submit)", "packed (the sink now)"):
                    batch = [Completion(request=SimpleNamespace(rid=f"b{padded:d}-{number}-{way[0]}-{row}"),
                                        capture_queued=False, answered=threading.Event()) for row in rows]
                    start = time.thread_time()
                    if way.startswith("packed"):
                        assert sink._to_process(batch, rows, lengths, host_ids, aux, final)
                    else:
                        pieces = [(batch[row].request.rid, 0, host_ids[row, :lengths[row]], aux[row, :lengths[row]],
                                   final[row, :lengths[row]]) for row in rows]
                        writer.submit(pieces, lambda errors, batch=batch: [c.finish_capture(e)
                                                                           for c, e in zip(batch, errors)])
                    results.setdefault(f"{shape:17s} {way}", []).append(1e3 * (time.thread_time() - start))
                    # The child writes the batch before the next hand-over is timed: on a small box its
                    # writing would otherwise share the cores with the thread being timed.
                    for completion in batch:
                        if not completion.answered.wait(60):
                            raise RuntimeError("the writer process did not answer within 60 s")
                    assert all(completion.error is None for completion in batch)
                shutil.rmtree(spool, ignore_errors=True)
    finally:
        writer.close()
        shutil.rmtree(spool, ignore_errors=True)
    print(f"batch of {args.rows} x {args.tokens} tokens, states {args.hidden} wide; CPU ms of the calling thread "
          f"per batch (median of {args.batches - 5}, first 5 dropped)")
    for name, times in results.items():
        print(f"  {name:45s} {statistics.median(times[5:]):7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
