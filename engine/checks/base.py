"""Check results and stage states. A stage is green only when its checks passed when last run."""

from __future__ import annotations

import enum
import time
from dataclasses import asdict, dataclass, field
from typing import Any


class Status(str, enum.Enum):
    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"


class StageState(str, enum.Enum):
    PENDING = "pending"  # never run (or results cleared by a change)
    RUNNING = "running"  # being checked, or its job is running
    STALE = "stale"  # last checked under another config, or before a job that feeds it ended
    PASSED = "passed"  # every check passed
    WARNED = "warned"  # no failure, at least one warning: usable, not green
    FAILED = "failed"

    @property
    def ok(self) -> bool:
        return self in (StageState.PASSED, StageState.WARNED)


@dataclass(frozen=True)
class CheckResult:
    name: str
    status: Status
    evidence: str  # what was measured, in words and figures
    fix: str = ""  # on failure or warning: what the user should do
    measured_at: float = field(default_factory=time.time)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["status"] = self.status.value
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CheckResult":
        return cls(
            name=str(data["name"]),
            status=Status(data["status"]),
            evidence=str(data.get("evidence", "")),
            fix=str(data.get("fix", "")),
            measured_at=float(data.get("measured_at", 0.0)),
            seconds=float(data.get("seconds", 0.0)),
        )


def passed(name: str, evidence: str) -> CheckResult:
    return CheckResult(name, Status.PASS, evidence)


def warned(name: str, evidence: str, fix: str) -> CheckResult:
    return CheckResult(name, Status.WARN, evidence, fix)


def failed(name: str, evidence: str, fix: str) -> CheckResult:
    return CheckResult(name, Status.FAIL, evidence, fix)


def stage_state(results: list[CheckResult]) -> StageState:
    if not results:
        return StageState.PENDING
    if any(r.status is Status.FAIL for r in results):
        return StageState.FAILED
    if any(r.status is Status.WARN for r in results):
        return StageState.WARNED
    return StageState.PASSED


@dataclass(frozen=True)
class StageReport:
    stage: str
    title: str
    state: StageState
    results: tuple[CheckResult, ...] = ()
    note: str = ""  # e.g. "checks not yet available in this build"
    ran_at: float | None = None
    # What the results were computed under: ((config section, fingerprint), ...) (engine.pipeline).
    basis: tuple[tuple[str, str], ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "title": self.title,
            "state": self.state.value,
            "note": self.note,
            "ran_at": self.ran_at,
            "config": dict(self.basis) if self.basis is not None else None,
            "checks": [r.to_dict() for r in self.results],
        }
