"""The pipeline: stages in order, their checks, and the last results (persisted in the workspace).

There is no way to mark a stage done by hand: its state is computed from check results only.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
import traceback
from dataclasses import dataclass
from typing import Awaitable, Callable, Union

from engine import atomic
from engine.checks.base import CheckResult, StageReport, StageState, failed, stage_state
from engine.checks.context import CheckContext

CheckFn = Callable[[CheckContext], Union[list[CheckResult], Awaitable[list[CheckResult]]]]
RESULTS_FILE = "checks.json"


@dataclass(frozen=True)
class Stage:
    name: str
    title: str
    description: str
    checks: CheckFn | None  # None: not yet available in this build
    has_job: bool = False


def _stages() -> list[Stage]:
    from engine.checks.disk import check_disk
    from engine.checks.gpus import check_gpus
    from engine.checks.capture import check_capture
    from engine.checks.dataset import check_dataset
    from engine.checks.evaluate import check_evaluate
    from engine.checks.extract import check_extract
    from engine.checks.model import check_model
    from engine.checks.server import check_server
    from engine.checks.train import check_train

    return [
        Stage("gpus", "GPUs & NCCL", "NVML, GPUs visible, compute capability, free memory, NCCL preset", check_gpus),
        Stage("model", "Target model", "config.json, shapes, capture layers, tokenizer + chat template", check_model),
        Stage("dataset", "Dataset", "parse, token lengths, truncation, assistant tokens", check_dataset,
              has_job=True),
        Stage("server", "Server", "process up, health, capture-safe flags, decode tok/s", check_server,
              has_job=True),
        Stage("capture", "Capture probe", "tokens sent = captured, 0 cached, shapes, finite, argmax", check_capture),
        Stage("disk", "Disk", "output dirs writable, bytes needed fit under free minus reserve", check_disk),
        Stage("extract", "Extraction", "manifest covers every sample and verifies", check_extract,
              has_job=True),
        Stage("train", "Training", "export loads with SGLang's expected weights", check_train,
              has_job=True),
        Stage("evaluate", "Evaluation", "acceptance length and speedup measured", check_evaluate,
              has_job=True),
    ]


STAGES: list[Stage] = []


def stages() -> list[Stage]:
    if not STAGES:
        STAGES.extend(_stages())
    return STAGES


def stage_names() -> list[str]:
    return [s.name for s in stages()]


def get_stage(name: str) -> Stage:
    for stage in stages():
        if stage.name == name:
            return stage
    import difflib

    close = difflib.get_close_matches(name, stage_names(), n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    raise KeyError(f"unknown stage '{name}'{hint} Stages: {', '.join(stage_names())}")


NOT_AVAILABLE = "checks not yet available in this build"


class Pipeline:
    """Runs stage checks and keeps the last report of every stage."""

    def __init__(self, ctx: CheckContext, persist: bool = True):
        self.ctx = ctx
        self.persist = persist
        self.reports: dict[str, StageReport] = {}
        self._load()

    @property
    def _path(self):
        return self.ctx.workspace.state_dir / RESULTS_FILE

    def _load(self) -> None:
        for stage in stages():
            self.reports[stage.name] = self._empty(stage)
        try:
            data = json.loads(self._path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return
        for name, raw in data.items() if isinstance(data, dict) else []:
            try:
                stage = get_stage(name)
                results = tuple(CheckResult.from_dict(r) for r in raw.get("checks", []))
            except (KeyError, ValueError, TypeError):
                continue  # an old or damaged entry: the stage shows as not run
            if stage.checks is None:
                continue
            self.reports[name] = StageReport(stage.name, stage.title, stage_state(list(results)), results,
                                             ran_at=raw.get("ran_at"))

    def _save(self) -> None:
        if not self.persist:
            return
        data = {name: r.to_dict() for name, r in self.reports.items() if r.ran_at is not None}
        try:
            atomic.write_json(self._path, data)
        except OSError:
            pass  # a read-only attach or a full disk must not break checking

    @staticmethod
    def _empty(stage: Stage) -> StageReport:
        if stage.checks is None:
            return StageReport(stage.name, stage.title, StageState.UNAVAILABLE, note=NOT_AVAILABLE)
        return StageReport(stage.name, stage.title, StageState.PENDING, note="not run yet")

    def report(self, name: str) -> StageReport:
        return self.reports[name]

    async def run_stage(self, name: str) -> StageReport:
        stage = get_stage(name)
        if stage.checks is None:
            report = self._empty(stage)
            self.reports[name] = report
            return report
        self.reports[name] = StageReport(stage.name, stage.title, StageState.RUNNING, self.reports[name].results)
        started = time.time()
        try:
            if inspect.iscoroutinefunction(stage.checks):
                results = await stage.checks(self.ctx)
            else:
                # Checks may load tokenizers or touch disks: never on the event loop.
                results = await asyncio.to_thread(stage.checks, self.ctx)
        except Exception as exc:  # a bug in a check must show as a failure, not kill the console
            tb = traceback.format_exception_only(type(exc), exc)[-1].strip()
            results = [failed("internal", f"check crashed: {tb}", "report this as a bug; the log has the traceback")]
        seconds = time.time() - started
        report = StageReport(stage.name, stage.title, stage_state(results), tuple(results), ran_at=time.time(),
                             note=f"checked in {seconds:.2f}s")
        self.reports[name] = report
        self._save()
        return report

    async def run(self, names: list[str] | None = None) -> list[StageReport]:
        return [await self.run_stage(n) for n in (names or stage_names())]
