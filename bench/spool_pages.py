"""How much of a spool write is the file system handing out fresh pages? Fresh files against reused ones.

The capture writer writes each segment into a new file and the reader deletes it once read, so every
segment lands on pages the file system must allocate (and, on tmpfs, zero) first. This writes segments of
one request's size from as many threads as the writer uses, in alternating rounds: into new files (the
last round's unlinked: as the spool does today) and over the same files again (their pages kept). The
ratio says what recycling segment files could give the writer, on this machine's spool file system.

    python bench/spool_pages.py                      # /dev/shm, the e2e shape's segment (512 x 5,128 B)
    python bench/spool_pages.py --mb 33.6            # the 1b shape's (2,048 x 16,392 B)
    python bench/spool_pages.py --dir /mnt/nvme/spool --threads 8
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


def write_round(directory: Path, data: bytes, files: int, threads: int, reuse: bool) -> float:
    """GB/s of `threads` threads writing `files` files each; `reuse` overwrites last round's files in place."""
    def writer(k: int) -> None:
        for i in range(files):
            path = directory / f"t{k}-{i}"
            if reuse:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT)
                os.pwrite(fd, data, 0)
            else:
                path.unlink(missing_ok=True)
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.write(fd, data)
            os.close(fd)

    pool = [threading.Thread(target=writer, args=(k,)) for k in range(threads)]
    started = time.perf_counter()
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return threads * files * len(data) / (time.perf_counter() - started) / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir(),
                        help="the spool's file system (a temp folder is made and removed inside it)")
    parser.add_argument("--mb", type=float, default=2.63, help="one segment, in MB (default: 512 tokens x 5,128 B)")
    parser.add_argument("--threads", type=int, default=4, help="writer threads (the capture writer's default: 4)")
    parser.add_argument("--files", type=int, default=64, help="files per thread and round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per side, alternating")
    args = parser.parse_args()
    if args.mb <= 0 or args.threads < 1 or args.files < 1 or args.rounds < 1:
        parser.error("--mb, --threads, --files and --rounds must be positive")
    need = int(args.mb * 1e6) * args.threads * args.files
    free = shutil.disk_usage(args.dir).free
    if need * 1.2 > free:
        parser.error(f"{args.dir} has {free / 1e9:.1f} GB free, the files need {need / 1e9:.1f} GB: "
                     "give fewer --files or --threads, or another --dir")
    data = os.urandom(int(args.mb * 1e6))
    directory = Path(tempfile.mkdtemp(prefix="spool-pages-", dir=args.dir))
    try:
        write_round(directory, data, args.files, args.threads, reuse=False)  # warm-up, and the files to reuse
        fresh: list[float] = []
        reused: list[float] = []
        for r in range(args.rounds):
            for reuse in ((False, True) if r % 2 == 0 else (True, False)):
                (reused if reuse else fresh).append(write_round(directory, data, args.files, args.threads, reuse))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    f, u = statistics.median(fresh), statistics.median(reused)
    print(f"{args.dir}: {args.threads} threads x {args.files} files of {args.mb} MB, {args.rounds} rounds a side")
    print(f"fresh files  {f:6.2f} GB/s  (rounds {' / '.join(f'{x:.2f}' for x in fresh)})")
    print(f"reused files {u:6.2f} GB/s  (rounds {' / '.join(f'{x:.2f}' for x in reused)})")
    print(f"reused / fresh: {u / f:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
