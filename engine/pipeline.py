"""The pipeline: stages in order, their checks, and the last results (persisted in the workspace).

There is no way to mark a stage done by hand: its state is computed from check results only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import inspect
import json
import time
import traceback
from dataclasses import dataclass, replace
from typing import Awaitable, Callable, Iterable, Union

from engine.io import atomic
from engine.checks.base import CheckResult, StageReport, StageState, failed, passed, stage_state
from engine.checks.context import CheckContext
from engine.jobs.registry import STAGE_JOBS

CheckFn = Callable[[CheckContext], Union[list[CheckResult], Awaitable[list[CheckResult]]]]
RESULTS_FILE = "checks.json"


@dataclass(frozen=True)
class Stage:
    name: str
    title: str
    description: str
    checks: CheckFn | None  # None: not yet available in this build


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
        Stage("dataset", "Dataset", "parse, token lengths, truncation, assistant tokens", check_dataset),
        Stage("server", "Server", "process up, health, capture-safe flags, decode tok/s", check_server),
        Stage("capture", "Capture probe", "tokens sent = captured, 0 cached, shapes, finite, argmax", check_capture),
        Stage("disk", "Disk", "output dirs writable, bytes needed fit under free minus reserve", check_disk),
        Stage("extract", "Extraction", "manifest covers every sample and verifies", _extract_unless_online(check_extract)),
        Stage("train", "Training", "export signed, finite, in the layout SGLang's EAGLE-3 loader reads", check_train),
        Stage("evaluate", "Evaluation", "acceptance length and speedup measured", check_evaluate),
    ]


def _extract_unless_online(check_extract: CheckFn) -> CheckFn:
    """train.mode = online/hybrid captures during training: no extraction is needed, and the stage says so
    (with what the window holds) instead of asking for one; offline, the extraction's own checks."""

    def check(ctx: CheckContext):
        from engine.system.disk import fmt_bytes
        from engine.jobs.registry import online_training
        from engine.train.window import window_budget, window_dir

        cfg = ctx.config
        if not online_training(cfg):
            return check_extract(ctx)
        return [passed("mode", f"not needed: train.mode = {cfg.train.mode!r} captures the states from the server "
                               f"while training, into {window_dir(ctx.workspace)} (at most "
                               f"{fmt_bytes(window_budget(cfg))}, train.window_gb); set train.mode = \"offline\" "
                               "to train from extracted records")]

    return check


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

# The console.toml sections each stage's result depends on: a result computed under other values of
# these is stale (shown as such, never as current). `ui` matters to no stage.
STAGE_CONFIG: dict[str, tuple[str, ...]] = {
    "gpus": ("gpu", "model", "server"),
    "model": ("model",),
    "dataset": ("dataset", "model"),
    "server": ("server", "model"),
    "capture": ("server", "model", "extract"),
    "disk": ("dataset", "extract", "train", "evaluate", "model"),
    "extract": ("extract", "dataset", "model", "train.mode"),  # online training needs no extraction
    "train": ("train", "extract", "dataset", "model"),
    "evaluate": ("evaluate", "train", "server", "model", "dataset"),
}
# The jobs (by kind) whose work a stage's result describes: one started or ended after the check
# makes the result stale. A stage whose own job (same name) runs reads "running".
STAGE_JOB_INPUTS: dict[str, tuple[str, ...]] = {
    "server": ("server",),
    "capture": ("server",),
    "extract": ("extract",),
    "train": ("extract", "train"),
    "evaluate": ("train", "evaluate"),
}


def _section_fingerprint(section) -> str:
    value = dataclasses.asdict(section) if dataclasses.is_dataclass(section) and not isinstance(section, type) \
        else section
    text = json.dumps(value, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _config_part(config, name: str):
    """A section (`train`) or one key of it (`train.mode`)."""
    value = config
    for part in name.split("."):
        value = getattr(value, part, None)
    return value


def config_basis(stage: str, config) -> tuple[tuple[str, str], ...]:
    """((section or section.key, fingerprint), ...) of the config parts `stage` depends on."""
    return tuple((name, _section_fingerprint(_config_part(config, name)))
                 for name in STAGE_CONFIG.get(stage, ()))


def _clock(value) -> str:
    return time.strftime("%H:%M:%S", time.localtime(value)) if value else "?"


def live_report(report: StageReport, config, jobs: Iterable = ()) -> StageReport:
    """The report as it stands now: `running` while the stage's own job runs; `stale` when it was
    computed under other values of its config sections, or before a job that feeds it started or
    ended. Otherwise the report itself. `jobs`: JobInfo, newest first."""
    if report.state in (StageState.RUNNING, StageState.UNAVAILABLE):
        return report
    jobs = list(jobs)
    if report.stage in STAGE_JOBS:
        job = next((j for j in jobs if j.kind == report.stage and j.active), None)
        if job is not None:
            since = job.started_at or job.created_at
            return replace(report, state=StageState.RUNNING,
                           note=f"{job.kind} job {job.id} {job.state} since {_clock(since)}")
    if report.state is StageState.PENDING:
        return report
    why = []
    if report.ran_at is not None:
        kinds = STAGE_JOB_INPUTS.get(report.stage, ())
        for job in jobs:  # newest first: the newest job that changed things is named
            if job.kind not in kinds:
                continue
            started = job.created_at or job.started_at or 0.0
            if job.ended_at is not None and job.ended_at > report.ran_at:
                why.append(f"before {job.kind} job {job.id} {job.state} at {_clock(job.ended_at)}")
                break
            if started > report.ran_at:
                why.append(f"before {job.kind} job {job.id} started at {_clock(started)}")
                break
    if report.basis is not None and config is not None:
        current = dict(config_basis(report.stage, config))
        changed = [name for name, fingerprint in report.basis if current.get(name) != fingerprint]
        if changed:
            why.append("under other " + ", ".join(f"[{name}]" for name in changed) + " settings of console.toml")
    if why:
        return replace(report, state=StageState.STALE,
                       note=f"checked {_clock(report.ran_at)}, {' and '.join(why)}: check again")
    return report


def last_failure(report: StageReport) -> str:
    """One line for a red stage: its first failed check with evidence, else its note."""
    for result in report.results:
        if result.status.value == "fail":
            return f"{result.name}: {result.evidence}"
    return report.note or report.state.value


def job_failure_result(stage: str, jobs: Iterable) -> CheckResult | None:
    """A failed check naming why the stage's newest job failed, or None (no job, or it did not fail)."""
    if stage not in STAGE_JOBS:
        return None
    job = next((j for j in jobs if j.kind == stage), None)
    if job is None or job.state not in ("failed", "lost"):
        return None
    code = "" if job.exit_code is None else f" (exit {job.exit_code})"
    return failed("job", f"{job.reason} (the last {stage} job, {job.id}, {job.state}{code})",
                  f"remove the cause of that error first, then start the job again; "
                  f"`eagle3-console jobs logs {job.id}` shows its whole log")


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
            basis = raw.get("config")
            basis = tuple((str(k), str(v)) for k, v in basis.items()) if isinstance(basis, dict) else None
            self.reports[name] = StageReport(stage.name, stage.title, stage_state(list(results)), results,
                                             ran_at=raw.get("ran_at"), basis=basis)

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
        """The last report as recorded (see `view` for how it stands now)."""
        return self.reports[name]

    def view(self, name: str, jobs: Iterable = ()) -> StageReport:
        """The last report as it stands now: running while its job runs, stale under another
        config or before a later job (live_report). `jobs`: JobInfo, newest first."""
        from engine.config import ConfigError

        try:
            config = self.ctx.config
        except (ConfigError, OSError):  # a broken console.toml: nothing to compare with
            config = None
        return live_report(self.reports[name], config, jobs)

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
        if stage.name in STAGE_JOBS and not stage_state(results).ok:
            results = await asyncio.to_thread(self._with_job_failure, stage.name, list(results))
        seconds = time.time() - started
        from engine.config import ConfigError

        try:
            basis = config_basis(stage.name, self.ctx.config)
        except (ConfigError, OSError):  # a broken console.toml: the checks said so; no basis to record
            basis = None
        report = StageReport(stage.name, stage.title, stage_state(results), tuple(results), ran_at=time.time(),
                             note=f"checked in {seconds:.2f}s", basis=basis)
        self.reports[name] = report
        self._save()
        return report

    def _with_job_failure(self, stage: str, results: list[CheckResult]) -> list[CheckResult]:
        """A red stage whose newest job failed says why first: the job's own error line."""
        from engine.jobs.manager import JobManager

        try:
            jobs = JobManager(self.ctx.workspace.jobs_dir).list()
        except OSError:
            return results
        found = job_failure_result(stage, jobs)
        return results if found is None else [found, *results]

    async def run(self, names: list[str] | None = None) -> list[StageReport]:
        return [await self.run_stage(n) for n in (names or stage_names())]
