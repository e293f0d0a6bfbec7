"""The job behind each stage that has one: how to start it, so the console and CLI share it."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

from engine.system import nccl


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


@dataclass(frozen=True)
class JobKind:
    """Everything the engine, CLI and console need to know about one kind of job."""

    name: str
    start: Callable | None  # (workspace, jobs) -> JobInfo; None: started elsewhere (regenerate by its CLI)
    stop_grace_s: float  # SIGTERM, then this long to checkpoint before SIGKILL
    prerequisites: tuple[str, ...] = ()  # stages that must be green for its work to make sense
    needs_server: bool = False  # stopping the capture server would disrupt it
    reads_records: bool = False  # reads extraction records: a release of them waits for it


# The one registry of jobs. A stage with a job has the job's name; adding one is an entry here plus
# its module. Extraction with no server waits at 0 % forever; training without a verified
# extraction has nothing to read; evaluation launches its own servers (ours must be stopped).
JOB_KINDS: dict[str, JobKind] = {kind.name: kind for kind in (
    JobKind("extract", start_extract, 60.0, ("model", "dataset", "server", "capture", "disk"),
            needs_server=True, reads_records=True),
    JobKind("train", start_train, 120.0, ("model", "extract"), reads_records=True),
    JobKind("evaluate", start_evaluate, 30.0, ("model", "train"), needs_server=True, reads_records=True),
    JobKind("regenerate", None, 30.0, needs_server=True),
)}
DEFAULT_GRACE_S = 30.0
STAGE_JOBS = tuple(name for name, kind in JOB_KINDS.items() if kind.start is not None)
STARTERS: dict[str, Callable] = {name: kind.start for name, kind in JOB_KINDS.items() if kind.start is not None}
PREREQUISITES: dict[str, tuple[str, ...]] = {name: JOB_KINDS[name].prerequisites for name in STAGE_JOBS}
STOP_GRACE_S: dict[str, float] = {name: kind.stop_grace_s for name, kind in JOB_KINDS.items()}
SERVER_USERS = frozenset(name for name, kind in JOB_KINDS.items() if kind.needs_server)
RECORD_READERS = tuple(name for name, kind in JOB_KINDS.items() if kind.reads_records)


def stop_grace(kind: str) -> float:
    return STOP_GRACE_S.get(kind, DEFAULT_GRACE_S)


# train.mode = online or hybrid: training captures its own states from the server (engine.train.online),
# so it needs the server and a passing capture probe, and the disk stage's budget (the window), not an
# extraction.
ONLINE_PREREQUISITES: dict[str, tuple[str, ...]] = {"train": ("model", "dataset", "server", "capture", "disk")}


def online_training(config) -> bool:
    return config is not None and getattr(config.train, "mode", "offline") in ("online", "hybrid")


def prerequisites(stage: str, config=None) -> tuple[str, ...]:
    """The stages `stage`'s job needs green, under `config` (console.toml; None: offline training)."""
    if online_training(config) and stage in ONLINE_PREREQUISITES:
        return ONLINE_PREREQUISITES[stage]
    return PREREQUISITES.get(stage, ())


def server_users(config=None) -> frozenset[str]:
    """Job kinds that stopping the server would disrupt: online training too, under `config`."""
    return SERVER_USERS | {"train"} if online_training(config) else SERVER_USERS


def red_prerequisites(stage: str, reports, config=None) -> list:
    """The reports (as they stand now) of `stage`'s prerequisite stages that are red (failed)."""
    by_name = {r.stage: r for r in reports}
    return [by_name[name] for name in prerequisites(stage, config)
            if name in by_name and by_name[name].state.value == "failed"]
