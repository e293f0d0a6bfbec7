"""The command line of the training job: torchrun with DDP on several GPUs, plain python otherwise."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from engine.train import checkpoint as ckpt


def build_train_argv(workspace, resume: bool | None = None) -> list[str]:
    """`resume=None` resumes when the drafter run already has a checkpoint (a stopped job continues)."""
    if resume is None:
        resume = ckpt.latest(workspace.drafter_dir) is not None
    tail = ["-m", "engine.train", "--workspace", str(workspace.root)] + (["--resume"] if resume else [])
    gpus = int(workspace.config.train.num_gpus)
    if gpus > 1:
        torchrun = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
        return [torchrun, "--standalone", "--nproc-per-node", str(gpus)] + tail
    return [sys.executable] + tail
