"""What reading an fp8 record costs the trainer's loader against a bf16 one (engine.records.load_record:
read, sha256, parse, and for fp8 the dequantization to bf16), side by side in one run.

    python bench/records_fp8.py [--tokens 4096] [--hidden 4096] [--reps 5] [--dir /dev/shm]

The trainer's batch loader is one thread (engine.train.data.BatchPrefetcher); on the H200 a 4,096-token
step of the Llama-3.1-8B drafter takes ~156 ms (bench/RESULTS.md), so a load near that would make the
loader, not the GPU, set the pace.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from engine.records import load_record, write_record


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dir", default="/dev/shm")
    args = parser.parse_args()
    t, h = args.tokens, args.hidden
    g = torch.Generator().manual_seed(0)
    aux = torch.cat([torch.randn(t, h, generator=g) * s for s in (0.05, 1.0, 40.0)], dim=1).to(torch.bfloat16)
    final = torch.randn(t, h, generator=g).to(torch.bfloat16)
    ids, mask = torch.arange(t), torch.ones(t, dtype=torch.int64)
    times: dict[str, list[float]] = {"bf16": [], "fp8": []}
    cpu: dict[str, float] = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        entries = {}
        for fmt in times:
            started = time.perf_counter()
            entries[fmt] = write_record(Path(root) / fmt, 0, "s", ids, mask, aux, final, aux_format=fmt)
            print(f"write {fmt}: {(time.perf_counter() - started) * 1e3:.1f} ms, {entries[fmt].bytes:,} bytes")
        for fmt in times:
            load_record(Path(root) / fmt, entries[fmt])  # warm: page cache, torch kernels
        c0 = {fmt: 0.0 for fmt in times}
        for _ in range(args.reps):
            for fmt in times:  # interleaved: both sides meet the same machine state
                wall, proc = time.perf_counter(), time.process_time()
                load_record(Path(root) / fmt, entries[fmt])
                times[fmt].append(time.perf_counter() - wall)
                c0[fmt] += time.process_time() - proc
        cpu = {fmt: c0[fmt] / args.reps for fmt in times}
    med = {fmt: statistics.median(v) * 1e3 for fmt, v in times.items()}
    print(f"record: {t} tokens, H = {h}; torch threads {torch.get_num_threads()}")
    for fmt in times:
        print(f"load_record {fmt}: median {med[fmt]:.1f} ms wall, {cpu[fmt] * 1e3:.1f} ms CPU "
              f"(over {args.reps}: {', '.join(f'{x * 1e3:.1f}' for x in times[fmt])})")
    print(f"fp8 / bf16: {med['fp8'] / med['bf16']:.2f}x wall, {cpu['fp8'] / cpu['bf16']:.2f}x CPU")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
