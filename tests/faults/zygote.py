"""Job processes forked from a warm zygote, so a kill -9 trial costs milliseconds, not seconds.

The real job entry points (`engine.extract.job.main`, `engine.train.job.main`) run in a fresh
process forked from a multiprocessing forkserver that has already imported torch,
transformers and the engine. The process reports to a job folder through EAGLE3_JOB_DIR exactly
as under the job manager; what it skips is the ~4 s of imports a `python -m` start costs, which
would put 20 trials per target far beyond the CI budget. The forkserver runs no torch op
before forking, so the children start with clean thread pools.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from pathlib import Path

PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "torch.nn.parallel", "torch.optim", "transformers",
           "transformers.models.llama", "tokenizers", "safetensors.torch", "httpx", "engine.extract.job",
           "engine.extract.plan", "engine.dataset", "engine.capture.segments", "engine.client",
           "engine.server.manager", "engine.checks.model", "engine.model.lmhead", "engine.train.job", "engine.train.loop",
           "engine.train.model", "engine.train.loss", "engine.train.attention", "engine.train.export",
           "engine.jobs.context", "faults.zygote"]
ENTRIES = {"extract": "engine.extract.job", "train": "engine.train.job"}

_ctx = None


def context():
    global _ctx
    if _ctx is None:
        _ctx = multiprocessing.get_context("forkserver")
        _ctx.set_forkserver_preload(PRELOAD)
    return _ctx


def _run(entry: str, argv: list[str], job_dir: str) -> None:
    import importlib

    from engine.jobs.context import JOB_DIR_ENV, LOG_FILE

    os.environ[JOB_DIR_ENV] = job_dir
    log = os.open(os.path.join(job_dir, LOG_FILE), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    code = 1
    try:
        import torch

        torch.set_num_threads(1)  # two cores shared by the suite: spinning thread pools only slow it down
        code = importlib.import_module(ENTRIES[entry]).main(argv)
    except BaseException:  # noqa: BLE001 - a traceback is what a `python -m` job would print
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
    finally:
        os._exit(int(code or 0))


def start(entry: str, argv: list[str], job_dir: Path):
    """Start `entry` (extract | train) with `argv`, reporting to `job_dir`; returns the Process."""
    job_dir.mkdir(parents=True, exist_ok=True)
    proc = context().Process(target=_run, args=(entry, list(argv), str(job_dir)), daemon=False)
    proc.start()
    return proc


def kill(proc) -> int | None:
    """SIGKILL (if still running) and reap; returns the exit code (negative: killed by signal)."""
    if proc.exitcode is None:
        proc.kill()
    proc.join(30)
    return proc.exitcode
