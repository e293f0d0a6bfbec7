"""NCCL all-reduce check across the local GPUs with the configured NCCL preset.

Runs `torchrun --standalone --nproc-per-node N -m engine.sglang.allreduce` in its own process
group with the preset's environment; each worker all-reduces a buffer a few times and rank 0
prints one JSON line with the bus bandwidth (nccl-tests' definition: 2(n-1)/n x bytes / time).
A hang (seen with P2P over PCIe on RTX PRO 6000) becomes a timeout naming the preset.
`backend="gloo", device="cpu"` runs the same code without GPUs (used by the tests).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

RESULT_PREFIX = "ALLREDUCE_RESULT "
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


@dataclass(frozen=True)
class AllReduceResult:
    ok: bool
    nproc: int
    preset: str
    bus_gbps: float | None = None
    seconds: float = 0.0
    error: str = ""
    log_tail: tuple[str, ...] = ()


def run_allreduce_check(nproc: int, env: dict[str, str], preset: str, timeout: float = 120.0,
                        size_mb: float = 64.0, iters: int = 10, backend: str = "nccl",
                        device: str = "cuda") -> AllReduceResult:
    """Spawn the workers and wait; never raises for a failing or hanging collective."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "engine.sglang.allreduce", "--size-mb", str(size_mb), "--iters", str(iters),
            "--backend", backend, "--device", device]
    child_env = dict(env)
    child_env["PYTHONPATH"] = _PACKAGE_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    started = time.monotonic()
    proc = subprocess.Popen(argv, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # own process group: a hang is killed as a whole
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, _ = proc.communicate()
        return AllReduceResult(False, nproc, preset, seconds=time.monotonic() - started,
                               error=f"all-reduce over {nproc} GPUs hung for {timeout:.0f}s with NCCL preset "
                                     f"'{preset}'", log_tail=tuple(out.splitlines()[-10:]))
    lines = out.splitlines()
    for line in lines:
        if line.startswith(RESULT_PREFIX):
            data = json.loads(line[len(RESULT_PREFIX):])
            return AllReduceResult(True, nproc, preset, bus_gbps=data["bus_gbps"],
                                   seconds=time.monotonic() - started, log_tail=tuple(lines[-5:]))
    return AllReduceResult(False, nproc, preset, seconds=time.monotonic() - started,
                           error=f"all-reduce workers exited with code {proc.returncode} under NCCL preset '{preset}'",
                           log_tail=tuple(lines[-10:]))


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the group we created for this child only
    except (ProcessLookupError, PermissionError):
        proc.kill()


def _worker(size_mb: float, iters: int, backend: str, device: str) -> None:
    import torch
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "cuda":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend=backend)
    world = dist.get_world_size()
    numel = max(1, int(size_mb * 2**20 / 4))
    data = torch.ones(numel, dtype=torch.float32, device=device if device == "cpu" else f"cuda:{local_rank}")

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    dist.all_reduce(data)  # warm up: the first call builds the communicator
    sync()
    started = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(data)
    sync()
    elapsed = (time.perf_counter() - started) / iters
    expected = float(world) ** (iters + 1)
    if not torch.allclose(data[:1].cpu(), torch.tensor([expected])):
        raise SystemExit(f"all-reduce gave {data[0].item()}, expected {expected}")
    if dist.get_rank() == 0:
        bus = 2 * (world - 1) / world * numel * 4 / elapsed / 1e9
        print(RESULT_PREFIX + json.dumps({"bus_gbps": round(bus, 2), "world": world}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="one all-reduce benchmark worker (run under torchrun)")
    parser.add_argument("--size-mb", type=float, default=64.0)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--backend", default="nccl", choices=["nccl", "gloo"])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = parser.parse_args()
    _worker(args.size_mb, args.iters, args.backend, args.device)
