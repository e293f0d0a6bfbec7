"""Which GPU memory is whose: NVML's per-GPU process list attributed to this workspace's jobs.

A process on a GPU is ours when it is a job's own process or one of its descendants (SGLang's TP
workers under the server, torchrun's ranks under the trainer); anything else is someone else's.
Pure functions over a GPU snapshot, the job list and a `parent_of(pid)` lookup, so tests inject
all three; `psutil_parent` is the real lookup (reads /proc: call it off the UI thread).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable

if TYPE_CHECKING:
    from engine.system.gpu import GpuSnapshot
    from engine.jobs.manager import JobInfo

ROLES = {"server": ("server", "server worker (TP)"), "train": ("trainer", "trainer rank"),
         "evaluate": ("evaluation", "evaluation worker"), "extract": ("extraction", "extraction worker")}
MAX_DEPTH = 8  # parents walked up from a GPU process (a launcher, a rank, a compile worker)


@dataclass(frozen=True)
class GpuProcessRow:
    pid: int
    name: str
    gpus: tuple[int, ...]
    memory: int | None  # bytes over those GPUs (None where the driver does not say)
    util: float | None  # mean utilisation of those GPUs (NVML gives no per-process figure here)
    role: str  # "server", "trainer rank", ... or "other"
    job_id: str = ""

    @property
    def ours(self) -> bool:
        return bool(self.job_id)


def psutil_parent(pid: int) -> int | None:
    try:
        import psutil

        return psutil.Process(pid).ppid() or None
    except Exception:  # gone, not ours to see, no psutil
        return None


def owner(pid: int, jobs: Iterable[JobInfo], parent_of: Callable[[int], int | None]) -> tuple[JobInfo | None, bool]:
    """(the job `pid` belongs to, whether it is the job's own process) or (None, False)."""
    by_pid: dict[int, JobInfo] = {}
    for job in jobs:
        if job.pid:
            by_pid.setdefault(job.pid, job)
        if job.supervisor_pid:
            by_pid.setdefault(job.supervisor_pid, job)
    current: int | None = pid
    depth = 0
    while current and depth <= MAX_DEPTH:
        found = by_pid.get(current)
        if found is not None:
            return found, current == pid and current == found.pid
        current, depth = parent_of(current), depth + 1
    return None, False


def attribute(snapshot: GpuSnapshot | None, jobs: Iterable[JobInfo],
              parent_of: Callable[[int], int | None] = psutil_parent) -> list[GpuProcessRow]:
    """One row per process on any GPU, ours first (by role), then others by memory."""
    if snapshot is None or not snapshot.available:
        return []
    jobs = [j for j in jobs if j.state in ("starting", "running")]
    seen: dict[int, dict] = {}
    for gpu in snapshot.gpus:
        for proc in gpu.processes:
            row = seen.setdefault(proc.pid, {"name": proc.name, "gpus": [], "memory": None, "utils": []})
            row["gpus"].append(gpu.index)
            if proc.used_memory is not None:
                row["memory"] = (row["memory"] or 0) + proc.used_memory
            if gpu.utilization_gpu is not None:
                row["utils"].append(gpu.utilization_gpu)
    rows = []
    for pid, row in seen.items():
        job, main = owner(pid, jobs, parent_of)
        if job is not None:
            names = ROLES.get(job.kind, (job.kind, f"{job.kind} worker"))
            role, job_id = names[0 if main else 1], job.id
        else:
            role, job_id = "other", ""
        util = sum(row["utils"]) / len(row["utils"]) if row["utils"] else None
        rows.append(GpuProcessRow(pid, row["name"], tuple(row["gpus"]), row["memory"], util, role, job_id))
    rows.sort(key=lambda r: (not r.ours, r.role if r.ours else "", -(r.memory or 0), r.pid))
    return rows


def process_lines(rows: list[GpuProcessRow], width: int) -> list[str]:
    """Markup lines: our processes in $success, others muted; memory and the GPUs' utilisation."""
    from eagle3_console.render import clip, esc

    if not rows:
        return ["[$text-muted]no processes on the GPUs[/]"]
    gib = 2**30
    name_w = width - 51  # the fixed columns take 51 cells; the name gets the rest, or is left out
    head = f"{'pid':>7} {'role':<18} {'gpus':<7} {'memory':>8} {'util':>5}" + ("  name" if name_w >= 6 else "")
    lines = [f"[$text-muted]{head}[/]"]
    for r in rows:
        gpus = ",".join(str(g) for g in r.gpus)
        mem = "?" if r.memory is None else f"{r.memory / gib:.1f}G"
        util = "?" if r.util is None else f"{r.util:.0f}%"
        colour = "$success" if r.ours else "$text-muted"
        lines.append(f"{r.pid:>7} [{colour}]{esc(clip(r.role, 18)):<18}[/] {esc(clip(gpus, 7)):<7} {mem:>8} "
                     f"{util:>5}" + (f"  {esc(clip(r.name, name_w))}" if name_w >= 6 else ""))
    ours = sum(r.memory or 0 for r in rows if r.ours)
    others = sum(r.memory or 0 for r in rows if not r.ours)
    lines.append(f"[$text-muted]ours {ours / gib:.1f}G · others {others / gib:.1f}G "
                 "(util: of the GPUs the process is on)[/]")
    return lines
