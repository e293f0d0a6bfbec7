"""Online-training runs for tests: the settings of a small run, a small disk for the window, the training
job started as the train stage starts it and followed through its events, and a workspace in online mode
with a real local target server running."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import time
from pathlib import Path

from tests.helpers.workspaces import make_workspace, write_conversations

ONLINE_TRAIN = {"train.draft_vocab_size": 128, "train.max_len": 64, "train.batch_size": 2, "train.ttt_steps": 3,
         "train.log_every": 1, "train.save_every": 4, "train.eval_fraction": 0.15, "train.epochs": 3,
         "train.learning_rate": 1e-2, "extract.concurrency": 2, "train.mode": "online", "train.window_gb": 0.0002}


TWO_RANK_TRAIN = {"train.draft_vocab_size": 128, "train.max_len": 64, "train.batch_size": 1, "train.ttt_steps": 2,
         "train.log_every": 1, "train.save_every": 3, "train.eval_fraction": 0.15, "train.epochs": 2,
         "train.learning_rate": 1e-2, "extract.concurrency": 2, "train.mode": "online", "train.window_gb": 0.0002,
         "train.num_gpus": 2}


@contextlib.contextmanager
def small_disk(path: Path, size: str):
    """A tmpfs of `size` at `path` when we may mount one (root), else a plain directory; yields whether mounted."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)], capture_output=True).returncode == 0
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def run_job(ws, jobs, sink: list[dict], until=None, timeout: float = 300.0):
    """Start the train stage's job (as the console does) and collect its events until it ends, or until
    `until(events)` is true (then it is left running and returned)."""
    from engine.registry import start_train

    job = start_train(ws, jobs)
    offset, deadline = 0, time.monotonic() + timeout
    while time.monotonic() < deadline:
        events, offset = jobs.events(job.id, offset)
        sink.extend(events)
        info = jobs.get(job.id)
        if until is not None and until(sink) and info.pid:
            return info
        if not info.active:
            events, offset = jobs.events(job.id, offset)
            sink.extend(events)
            return info
        time.sleep(0.01)
    raise AssertionError(f"training job {job.id} still running after {timeout:.0f}s: {jobs.tail(job.id, 20)}")


def run_job_until_end(jobs, job_id: str, sink: list[dict], timeout: float = 300.0):
    """Wait for a job `run_job` left running; `sink` ends up holding all its events."""
    deadline = time.monotonic() + timeout
    while jobs.get(job_id).active and time.monotonic() < deadline:
        time.sleep(0.05)
    sink[:] = jobs.events(job_id, 0)[0]
    return jobs.get(job_id)


def start_training(ws, jobs):
    """The training job as the train stage starts it (engine.registry.start_train: torchrun's argv, the
    NCCL env and train_env)."""
    from engine.registry import start_train

    return start_train(ws, jobs)


def follow(jobs, job_id: str, sink: list[dict], until=None, timeout: float = 120.0):
    offset, deadline = 0, time.monotonic() + timeout
    while time.monotonic() < deadline:
        events, offset = jobs.events(job_id, offset)
        sink.extend(events)
        info = jobs.get(job_id)
        if until is not None and until(sink):
            return info
        if not info.active:
            sink.extend(jobs.events(job_id, offset)[0])
            return info
        time.sleep(0.01)
    raise AssertionError(f"training job {job_id} still running after {timeout:.0f}s: {jobs.tail(job_id, 20)}")


@contextlib.contextmanager
def online_workspace(tiny_chat_model_dir: Path, tmp_path: Path, disk_size: str = "256k"):
    """A workspace in online mode whose window lives on a small disk (256k unless parametrized), with a
    real local server running."""
    from engine.server.manager import ServerManager

    disk = tmp_path / "disk"
    with small_disk(disk, disk_size) as mounted:
        ws = make_workspace(tmp_path / "ws", tiny_chat_model_dir, **{**ONLINE_TRAIN, "dataset.path": "train.jsonl",
                                                                     "extract.output_dir": str(disk)})
        write_conversations(ws.root / "train.jsonl", 20)
        manager = ServerManager(ws)
        asyncio.run(manager.start())
        try:
            yield ws, mounted
        finally:
            asyncio.run(manager.stop(grace=5))


@contextlib.contextmanager
def two_rank_workspace(tiny_chat_model_dir: Path, tmp_path: Path, **changes):
    """A workspace of TWO_RANK_TRAIN (plus `changes`) over 16 conversations, its window under tmp_path/disk,
    with a real local server running; yields (workspace, JobManager)."""
    from engine.jobs.manager import JobManager
    from engine.server.manager import ServerManager

    ws = make_workspace(tmp_path / "ws", tiny_chat_model_dir,
                        **{**TWO_RANK_TRAIN, **changes, "dataset.path": "train.jsonl",
                           "extract.output_dir": str(tmp_path / "disk")})
    write_conversations(ws.root / "train.jsonl", 16)
    manager = ServerManager(ws)
    asyncio.run(manager.start())
    try:
        yield ws, JobManager(ws.jobs_dir)
    finally:
        asyncio.run(manager.stop(grace=5))


def stop_while_waiting_for_captures(ws, jobs, job_id: str, grace: float = 60.0) -> tuple[int, float]:
    """Stop the server under a running online job (stopped, not crashed: nobody restarts it), let the window
    drain so the trainer waits for captures that will not come, then `jobs stop` it. Checks that it
    stopped cleanly (exit 0) with a checkpoint at the step it stopped at; returns (that step, seconds the
    stop took)."""
    from engine.server.manager import ServerManager
    from engine.train import checkpoint as ckpt

    asyncio.run(ServerManager(ws).stop(grace=5))
    follow(jobs, job_id, [], until=lambda ev: any(e.get("type") == "server_down" for e in ev), timeout=60)
    time.sleep(3)  # the window drains: the trainer now waits for a capture
    started = time.monotonic()
    stopped = jobs.stop_sync(job_id, grace=grace)
    took = time.monotonic() - started
    assert stopped.state == "stopped" and stopped.exit_code == 0, "\n".join(jobs.tail(job_id, 60))
    step = next(e for e in jobs.events(job_id, 0)[0] if e.get("type") == "stopped")["step"]
    assert (ckpt.latest(ws.drafter_dir) or {}).get("step") == step
    return step, took
