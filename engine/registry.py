"""The one stage/job registry: every stage in order — what checks it, which console.toml parts and which
jobs its result depends on, the console pane that follows it — and every kind of job: how it starts,
how long it gets to stop, what it needs green, whether it uses the server or reads the records.

Adding a stage is one `Stage(...)` line here plus its module (the check, and the job's starter if it has
one). The pipeline, the runner behind `run`, `stop` and `jobs`, the console's checklist, keys and panes,
the release of records and the disk check all read this table; nothing else lists stages or job kinds.
Checks and starters are named as "module:function" and imported on first use, so this module imports
nothing of the engine and anything may import it.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from functools import cache
from typing import Any, Callable


@cache
def _resolve(ref: str) -> Callable[..., Any]:
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class JobKind:
    """Everything the engine, CLI and console need to know about one kind of job."""

    name: str
    start: str | None  # "module:function" (workspace, jobs) -> JobInfo; None: started elsewhere (its CLI)
    stop_grace_s: float  # SIGTERM, then this long to checkpoint before SIGKILL
    prerequisites: tuple[str, ...] = ()  # stages that must be green for its work to make sense
    online_prerequisites: tuple[str, ...] | None = None  # instead, under train.mode online/hybrid
    needs_server: bool = False  # stopping the capture server would disrupt it
    needs_server_online: bool = False  # ... under train.mode online/hybrid
    reads_records: bool = False  # reads extraction records: a release of them waits for it

    @property
    def starter(self) -> Callable[..., Any] | None:
        return None if self.start is None else _resolve(self.start)


@dataclass(frozen=True)
class Stage:
    name: str
    title: str
    description: str
    check: str  # "module:function" (CheckContext) -> list[CheckResult], sync or async
    depends_on: tuple[str, ...]  # console.toml sections (or section.key): a result under other values is stale
    fed_by: tuple[str, ...] = ()  # job kinds whose start or end makes an earlier result stale
    job: JobKind | None = None  # the stage's own job (same name as the stage)
    pane: str | None = None  # the console pane that follows its job, besides the checklist

    @property
    def checks(self) -> Callable[..., Any]:
        return _resolve(self.check)


# Extraction with no server waits at 0 % forever; training without a verified extraction has nothing
# to read (online, it captures its own states: it needs the server, the capture probe and the disk's
# window budget instead); evaluation launches its own servers (ours must be stopped).
STAGES: tuple[Stage, ...] = (
    Stage("gpus", "GPUs & NCCL", "NVML, GPUs visible, compute capability, free memory, NCCL preset",
          "engine.checks.gpus:check_gpus", ("gpu", "model", "server")),
    Stage("model", "Target model", "config.json, shapes, capture layers, tokenizer + chat template",
          "engine.checks.model:check_model", ("model",)),
    Stage("dataset", "Dataset", "parse, token lengths, truncation, assistant tokens",
          "engine.checks.dataset:check_dataset", ("dataset", "model")),
    Stage("server", "Server", "process up, health, capture-safe flags, decode tok/s",
          "engine.checks.server:check_server", ("server", "model"), fed_by=("server",), pane="server"),
    Stage("capture", "Capture probe", "tokens sent = captured, 0 cached, shapes, finite, argmax",
          "engine.checks.capture:check_capture", ("server", "model", "extract"), fed_by=("server",)),
    Stage("disk", "Disk", "output dirs writable, bytes needed fit under free minus reserve",
          "engine.checks.disk:check_disk", ("dataset", "extract", "train", "evaluate", "model")),
    Stage("extract", "Extraction", "manifest covers every sample and verifies",
          "engine.checks.extract:check_extract_stage", ("extract", "dataset", "model", "train.mode"),
          fed_by=("extract",), pane="extraction",
          job=JobKind("extract", "engine.extract.launch:start_extraction", 60.0,
                      ("model", "dataset", "server", "capture", "disk"), needs_server=True, reads_records=True)),
    Stage("train", "Training", "export signed, finite, in the layout SGLang's EAGLE-3 loader reads",
          "engine.checks.train:check_train", ("train", "extract", "dataset", "model"),
          fed_by=("extract", "train"), pane="training",
          job=JobKind("train", "engine.registry:start_train", 120.0, ("model", "extract"),
                      online_prerequisites=("model", "dataset", "server", "capture", "disk"),
                      needs_server_online=True, reads_records=True)),
    Stage("evaluate", "Evaluation", "acceptance length and speedup measured",
          "engine.checks.evaluate:check_evaluate", ("evaluate", "train", "server", "model", "dataset"),
          fed_by=("train", "evaluate"), pane="evaluation",
          job=JobKind("evaluate", "engine.registry:start_evaluate", 30.0, ("model", "train"),
                      needs_server=True, reads_records=True)),
)
# Jobs no stage starts: `data regenerate` runs one through its own CLI.
OTHER_JOBS: tuple[JobKind, ...] = (JobKind("regenerate", None, 30.0, needs_server=True),)


def _child_env(workspace) -> dict[str, str]:
    from engine.system import nccl

    cfg = workspace.config
    return nccl.build_child_env(cfg.gpu.nccl_preset, disable_nvls=cfg.gpu.disable_nvls)


def start_train(workspace, jobs):
    from engine.train.launch import build_train_argv, train_env

    active = jobs.active("train")
    if active:
        return active[0]
    env = {**_child_env(workspace), **train_env(workspace)}  # train.gpus: the trainer's own GPUs
    return jobs.start("train", build_train_argv(workspace), env=env, cwd=workspace.root)


def start_evaluate(workspace, jobs):
    active = jobs.active("evaluate")
    if active:
        return active[0]
    argv = [sys.executable, "-m", "engine.evaluate", "--workspace", str(workspace.root)]
    return jobs.start("evaluate", argv, env=_child_env(workspace), cwd=workspace.root)


# ---------------------------------------------------------------- views of the table
JOB_KINDS: dict[str, JobKind] = {kind.name: kind for kind in
                                 (*(s.job for s in STAGES if s.job is not None), *OTHER_JOBS)}
STAGE_JOBS = tuple(s.name for s in STAGES if s.job is not None)  # stages with a job of their own
DEFAULT_GRACE_S = 30.0
STOP_GRACE_S: dict[str, float] = {name: kind.stop_grace_s for name, kind in JOB_KINDS.items()}
RECORD_READERS = tuple(name for name, kind in JOB_KINDS.items() if kind.reads_records)
STAGE_PANES: dict[str, str] = {s.name: s.pane for s in STAGES if s.pane is not None}


def stage_names() -> list[str]:
    return [s.name for s in STAGES]


def get_stage(name: str) -> Stage:
    for stage in STAGES:
        if stage.name == name:
            return stage
    import difflib

    close = difflib.get_close_matches(name, stage_names(), n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    raise KeyError(f"unknown stage '{name}'{hint} Stages: {', '.join(stage_names())}")


def stages_fed_by(kind: str) -> tuple[str, ...]:
    """The stages whose results describe what a `kind` job (or the server) does: rechecked when it changes."""
    return tuple(s.name for s in STAGES if kind in s.fed_by)


def starter(stage: str) -> Callable[..., Any] | None:
    kind = JOB_KINDS.get(stage)
    return None if kind is None else kind.starter


def online_training(config) -> bool:
    return config is not None and getattr(config.train, "mode", "offline") in ("online", "hybrid")


def prerequisites(stage: str, config=None) -> tuple[str, ...]:
    """The stages `stage`'s job needs green, under `config` (console.toml; None: offline training)."""
    kind = JOB_KINDS.get(stage)
    if kind is None:
        return ()
    if online_training(config) and kind.online_prerequisites is not None:
        return kind.online_prerequisites
    return kind.prerequisites


def server_users(config=None) -> frozenset[str]:
    """Job kinds that stopping the server would disrupt, under `config` (online training is one)."""
    online = online_training(config)
    return frozenset(name for name, kind in JOB_KINDS.items()
                     if kind.needs_server or (online and kind.needs_server_online))


def stop_grace(kind: str) -> float:
    return STOP_GRACE_S.get(kind, DEFAULT_GRACE_S)


def red_prerequisites(stage: str, reports, config=None) -> list:
    """The reports (as they stand now) of `stage`'s prerequisite stages that are red (failed)."""
    by_name = {r.stage: r for r in reports}
    return [by_name[name] for name in prerequisites(stage, config)
            if name in by_name and by_name[name].state.value == "failed"]
