"""Can this machine pin a shared-memory arena for CUDA, and how fast do device states land in it?

The capture writer process (engine/capture/spool_process.py) registers its POSIX shared-memory arena with
CUDA so a batch's states are copied into it asynchronously; if CUDA refuses, every copy waits on the
server's model thread. This prints the registration's return code and times one batch-sized device-to-host
copy into the arena, into a torch pinned buffer and into pageable memory (host call and landing).

    python bench/pin_probe.py                # the e2e shape's batch: 64 x 512 tokens x 5,128 B
    python bench/pin_probe.py --mb 537       # the 1b shape's 16 x 2,048-token batch
"""

from __future__ import annotations

import argparse
import resource
import time
from multiprocessing import shared_memory


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=168, help="bytes of one copy, in MB")
    parser.add_argument("--arena-mb", type=int, default=378, help="arena size in MB (the e2e shape: 9 slots)")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to probe")
        return 1
    print("RLIMIT_MEMLOCK", resource.getrlimit(resource.RLIMIT_MEMLOCK))
    size = args.mb * 1_000_000
    shm = shared_memory.SharedMemory(create=True, size=max(args.arena_mb * 1_000_000, size))
    try:
        arena = torch.frombuffer(shm.buf, dtype=torch.uint8)
        code = int(torch.cuda.cudart().cudaHostRegister(arena.data_ptr(), arena.numel(), 0))
        print(f"cudaHostRegister of the {arena.numel() / 1e6:.0f} MB arena: code {code} ({'pinned' if code == 0 else 'refused'})")
        source = torch.empty(size, dtype=torch.uint8, device="cuda")
        targets = {"shared arena": arena[:size], "torch pinned buffer": torch.empty(size, dtype=torch.uint8, pin_memory=True),
                   "pageable memory": torch.empty(size, dtype=torch.uint8)}
        for name, target in targets.items():
            for _ in range(2):  # the second pass is timed
                torch.cuda.synchronize()
                started = time.perf_counter()
                target.copy_(source, non_blocking=True)
                host = time.perf_counter() - started
                torch.cuda.synchronize()
                landed = time.perf_counter() - started
            print(f"{args.mb} MB device to {name}: host call {host * 1e3:.1f} ms, landed {landed * 1e3:.1f} ms "
                  f"({size / landed / 1e9:.1f} GB/s)")
        if code == 0:
            torch.cuda.cudart().cudaHostUnregister(arena.data_ptr())
        del arena, targets
    finally:
        shm.close()
        shm.unlink()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
