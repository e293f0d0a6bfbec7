"""What `Engine.status()` returns: one typed snapshot of a workspace (stages, jobs, evaluation,
server, GPUs, disks), as `eagle3-console status` prints it and its --json writes it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.checks.base import StageReport
from engine.system.disk import DiskUsage
from engine.system.gpu import GpuSnapshot
from engine.jobs.manager import JobInfo
from engine.server.manager import ServerStatus
from engine.workspace import LockHolder

SERVER_DOWN = ("stopped", "crashed")  # states in which another process may hold the server's port


@dataclass(frozen=True)
class EvaluationSummary:
    """The overall figures of eval/<run>/report.json, or why there are none (`reason`)."""

    available: bool
    reason: str = ""
    path: str | None = None
    backend: str | None = None
    prompts: int | None = None
    acceptance_length: float | None = None
    speedup: Any = None  # the report's own speedup figures, as written
    slower: bool = False
    verdict: str = ""
    drafter_sha256: str | None = None

    def to_dict(self) -> dict[str, Any]:
        if not self.available:
            return {"available": False, "reason": self.reason}
        return {"available": True, "path": self.path, "backend": self.backend, "prompts": self.prompts,
                "acceptance_length": self.acceptance_length, "speedup": self.speedup, "slower": self.slower,
                "verdict": self.verdict, "drafter_sha256": self.drafter_sha256}


def evaluation_summary(eval_dir: Path) -> EvaluationSummary:
    from engine.evaluate.report import ReportError, is_slower, read_report, verdict

    try:
        report = read_report(eval_dir)
    except ReportError as exc:
        return EvaluationSummary(available=False, reason=str(exc))
    overall = report.get("overall") or {}
    return EvaluationSummary(
        available=True, path=str(eval_dir / "report.json"), backend=report.get("backend"),
        prompts=overall.get("prompts"), acceptance_length=overall.get("acceptance_length"),
        speedup=overall.get("speedup"), slower=is_slower(report), verdict=verdict(report),
        drafter_sha256=(report.get("drafter") or {}).get("sha256"))


def job_row(job: JobInfo) -> dict[str, Any]:
    return {"id": job.id, "kind": job.kind, "state": job.state, "pid": job.pid, "exit_code": job.exit_code,
            "started_at": job.started_at, "ended_at": job.ended_at, "reason": job.reason}


def disk_row(usage: DiskUsage) -> dict[str, Any]:
    return {"label": usage.label, "path": usage.path, "mount": usage.mount, "total": usage.total,
            "used": usage.used, "free": usage.free, "reserve": usage.reserve, "below_reserve": usage.below_reserve}


@dataclass(frozen=True)
class EngineStatus:
    workspace: Path
    driver: LockHolder | None  # the console that drives the workspace; None when none does
    stages: tuple[StageReport, ...]  # as they stand now (engine.pipeline.live_report)
    jobs: tuple[JobInfo, ...]  # newest first
    evaluation: EvaluationSummary
    server: ServerStatus
    port_owner: str | None  # who listens on server.port while ours is down (checks would talk to it)
    gpus: GpuSnapshot
    disks: tuple[DiskUsage, ...]

    def to_dict(self) -> dict[str, Any]:
        server = self.server.to_dict()
        if self.server.state in SERVER_DOWN:
            server["port_owner"] = self.port_owner
        return {
            "workspace": str(self.workspace),
            "driver": self.driver.describe() if self.driver else None,
            "stages": [r.to_dict() for r in self.stages],
            "jobs": [job_row(j) for j in self.jobs],
            "evaluation": self.evaluation.to_dict(),
            "server": server,
            "gpus": self.gpus.to_dict(),
            "disk": [disk_row(d) for d in self.disks],
        }
