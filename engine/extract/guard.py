"""Disk guardrails: refuse a run that cannot fit, pause (never crash) when a disk nears its reserve."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.system.disk import fmt_bytes, usage_for
from engine.errors import EngineError


class ExtractionRefused(EngineError):
    """The extraction will not start; the message names the cause and the options."""


class DiskBudgetError(ExtractionRefused):
    """The run does not fit on the output disk above its reserve."""


@dataclass(frozen=True)
class Budget:
    needed: int
    free: int
    reserve: int
    mount: str

    @property
    def fits(self) -> bool:
        return self.needed <= self.free - self.reserve

    def message(self) -> str:
        return (f"needs {fmt_bytes(self.needed)}, free {fmt_bytes(self.free)}, reserve {fmt_bytes(self.reserve)} "
                f"on {self.mount}")


def budget(output_dir: Path, needed: int, reserve: int) -> Budget:
    usage = usage_for("output", str(output_dir), reserve)
    return Budget(needed, usage.free, reserve, usage.mount)


def require_fit(output_dir: Path, needed: int, reserve: int) -> Budget:
    plan = budget(output_dir, needed, reserve)
    if not plan.fits:
        raise DiskBudgetError(f"refusing to start: {plan.message()}. Options: fewer samples, a shorter "
                              "dataset.max_seq_len, or extract.output_dir on another disk")
    return plan


def low_space(paths: dict[str, tuple[Path, int]]) -> str | None:
    """A reason to pause if any labelled path is under its reserve, else None."""
    for label, (path, reserve) in paths.items():
        usage = usage_for(label, str(path), reserve)
        if usage.free < reserve:
            return f"{label} disk {usage.mount}: {fmt_bytes(usage.free)} free, under the reserve {fmt_bytes(reserve)}"
    return None
