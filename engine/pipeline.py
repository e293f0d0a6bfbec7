"""The pipeline: runs the stages' checks (the stages themselves: engine.registry) and keeps the last
results, persisted in the workspace; a result's staleness from the config and jobs it depends on.

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
from dataclasses import replace
from typing import Iterable

from engine.io import atomic
from engine.checks.base import CheckResult, StageReport, StageState, failed, stage_state
from engine.checks.context import CheckContext
from engine.registry import STAGE_JOBS, STAGES, Stage, get_stage, stage_names

RESULTS_FILE = "checks.json"


def stages() -> tuple[Stage, ...]:
    return STAGES


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
                 for name in get_stage(stage).depends_on) if stage in stage_names() else ()


def _clock(value) -> str:
    return time.strftime("%H:%M:%S", time.localtime(value)) if value else "?"


def live_report(report: StageReport, config, jobs: Iterable = ()) -> StageReport:
    """The report as it stands now: `running` while the stage's own job runs; `stale` when it was
    computed under other values of its config sections, or before a job that feeds it started or
    ended. Otherwise the report itself. `jobs`: JobInfo, newest first."""
    if report.state is StageState.RUNNING:
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
        kinds = get_stage(report.stage).fed_by if report.stage in stage_names() else ()
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
        checks = stage.checks
        self.reports[name] = StageReport(stage.name, stage.title, StageState.RUNNING, self.reports[name].results)
        started = time.time()
        try:
            if inspect.iscoroutinefunction(checks):
                results = await checks(self.ctx)
            else:
                # Checks may load tokenizers or touch disks: never on the event loop.
                results = await asyncio.to_thread(checks, self.ctx)
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
