"""Start the extraction as a detached job of the workspace."""

from __future__ import annotations

import sys

from engine.system import nccl


def extraction_argv(workspace, limit: int | None = None) -> list[str]:
    argv = [sys.executable, "-m", "engine.extract", "--workspace", str(workspace.root)]
    return argv + (["--limit", str(limit)] if limit else [])


def start_extraction(workspace, jobs, limit: int | None = None):
    active = jobs.active("extract")
    if active:
        return active[0]
    cfg = workspace.config
    env = nccl.build_child_env(cfg.gpu.nccl_preset, disable_nvls=cfg.gpu.disable_nvls)
    return jobs.start("extract", extraction_argv(workspace, limit), env=env, cwd=workspace.root)
