"""The job behind each stage that has one: how to start it, so the console and CLI share it."""

from __future__ import annotations

import sys
from typing import Callable

from engine import nccl


def _env(workspace) -> dict[str, str]:
    cfg = workspace.config
    return nccl.build_child_env(cfg.gpu.nccl_preset, disable_nvls=cfg.gpu.disable_nvls)


def start_extract(workspace, jobs):
    from engine.extract.launch import start_extraction

    return start_extraction(workspace, jobs)


def start_train(workspace, jobs):
    from engine.train.launch import build_train_argv

    active = jobs.active("train")
    if active:
        return active[0]
    return jobs.start("train", build_train_argv(workspace), env=_env(workspace), cwd=workspace.root)


def start_evaluate(workspace, jobs):
    active = jobs.active("evaluate")
    if active:
        return active[0]
    argv = [sys.executable, "-m", "engine.evaluate", "--workspace", str(workspace.root)]
    return jobs.start("evaluate", argv, env=_env(workspace), cwd=workspace.root)


STARTERS: dict[str, Callable] = {"extract": start_extract, "train": start_train, "evaluate": start_evaluate}

# The stages each job needs green before it can do its work: extraction with no server waits at
# 0 % forever, training without a verified extraction has nothing to read.
PREREQUISITES: dict[str, tuple[str, ...]] = {
    "extract": ("model", "dataset", "server", "capture", "disk"),
    "train": ("model", "extract"),
    "evaluate": ("model", "train"),  # it launches its own servers (the capture server must be down)
}


def red_prerequisites(stage: str, reports) -> list:
    """The reports (as they stand now) of `stage`'s prerequisite stages that are red (failed)."""
    by_name = {r.stage: r for r in reports}
    return [by_name[name] for name in PREREQUISITES.get(stage, ())
            if name in by_name and by_name[name].state.value == "failed"]
