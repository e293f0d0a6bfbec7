"""The command line of the training job: torchrun with DDP on several GPUs, plain python otherwise."""

from __future__ import annotations

import sys

from engine.system.gpusets import visible_devices_env
from engine.train import checkpoint as ckpt


def build_train_argv(workspace, resume: bool | None = None) -> list[str]:
    """`resume=None` resumes when the drafter run already has a checkpoint (a stopped job continues)."""
    if resume is None:
        resume = ckpt.latest(workspace.drafter_dir) is not None
    tail = ["-m", "engine.train", "--workspace", str(workspace.root)] + (["--resume"] if resume else [])
    gpus = int(workspace.config.train.num_gpus)
    if gpus > 1:
        # torchrun, run by engine.train.torchrun: a stop is the ranks' to answer (checkpoint, exit 0)
        return [sys.executable, "-m", "engine.train.torchrun", "--standalone", "--nproc-per-node", str(gpus)] + tail
    return [sys.executable] + tail


def train_env(workspace) -> dict[str, str]:
    """What the training job's environment adds for train.gpus: CUDA_VISIBLE_DEVICES (numbered as
    nvidia-smi does), so torchrun's ranks (LOCAL_RANK 0..num_gpus-1) land on those GPUs and never on the
    server's. {} when train.gpus is [] (every visible GPU, today's behaviour). Merge it over the job's env."""
    return visible_devices_env(workspace.config.train.gpus)
