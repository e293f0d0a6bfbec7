"""The status strip: one line under the header, at every size, that says how everything stands.

    ● server ready sglang :30000 │ stages 6✔ 1✘ disk │ extract 42% 850/2000 ETA 12m03s │ PAUSED │ disk 1.2 TiB free
    │ GPU 8× 45% 310/1128G  (one line)

Each part has a long and a short form; the line first shortens the least important parts, then
drops them, so it never wraps: warnings (PAUSED, BELOW RESERVE, restart the server to apply) go
last. The job's ETA comes from a smoothed rate (`RateTracker`), not from the first seconds' rate.
Rendering is a pure function of `StripState` (tested without an app).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from textual.content import Content
from textual.widgets import Static

from eagle3_console.fmt import finite, fmt_duration
from eagle3_console.render import esc, set_markup

if TYPE_CHECKING:
    from engine.system.gpu import GpuSnapshot

GIB = 2**30
SERVER_COLOURS = {"ready": "$success", "starting": "$warning", "unhealthy": "$warning", "crashed": "$error",
                  "stopped": "$text-muted"}
SEP = " [$text-muted]│[/] "


class RateTracker:
    """Progress rate smoothed over time (exponential, time constant `tau_s`), and the ETA from it.

    The first samples of a job (start-up, compilation, warm caches) mislead a plain
    first-to-last rate; the smoothed rate follows the recent pace and ignores replayed history
    (events with the same timestamp).
    """

    def __init__(self, tau_s: float = 15.0) -> None:
        self.tau_s = tau_s
        self.rate: float | None = None
        self.last: tuple[float, float] | None = None  # (t, done)
        self.total: float | None = None
        self.done: float | None = None

    def update(self, done, total, t: float | None = None) -> None:
        done, total = finite(done), finite(total)
        if done is None:
            return
        t = time.time() if t is None else float(t)
        self.done, self.total = done, total if total else self.total
        if self.last is not None:
            t0, d0 = self.last
            dt, dd = t - t0, done - d0
            if dt <= 0:
                return  # same instant: keep the older point, the interval grows
            if dd < 0:  # restarted (a new run): start over
                self.rate, self.last = None, (t, done)
                return
            inst = dd / dt
            weight = 1 - math.exp(-dt / self.tau_s)
            self.rate = inst if self.rate is None else self.rate + weight * (inst - self.rate)
        self.last = (t, done)

    @property
    def eta_s(self) -> float | None:
        if not self.rate or self.total is None or self.done is None or self.rate <= 0:
            return None
        return max(0.0, (self.total - self.done) / self.rate)


@dataclass
class JobProgress:
    kind: str
    job_id: str
    done: float | None = None
    total: float | None = None
    unit: str = ""
    paused: str = ""
    eta_s: float | None = None  # the job's own estimate: used until the smoothed rate has two points
    tracker: RateTracker = field(default_factory=RateTracker)

    @property
    def fraction(self) -> float | None:
        if self.done is None or not self.total:
            return None
        return max(0.0, min(1.0, self.done / self.total))


@dataclass
class StripState:
    server_state: str = "stopped"
    server_backend: str = ""
    server_port: int | None = None
    stages: dict = field(default_factory=dict)  # stage -> state value
    running: list = field(default_factory=list)  # JobProgress of running jobs, newest first
    below_reserve: list = field(default_factory=list)  # mount labels under their reserve
    disk_free: int | None = None  # the least free space among the written filesystems (bytes)
    gpu: GpuSnapshot | None = None
    drift: list = field(default_factory=list)  # settings the running server differs from console.toml in


def _server_parts(s: StripState) -> list[str]:
    colour = SERVER_COLOURS.get(s.server_state, "$text-muted")
    port = f" :{s.server_port}" if s.server_port else ""
    backend = f" {esc(s.server_backend)}" if s.server_backend else ""
    return [f"[{colour}]●[/] server [{colour}]{esc(s.server_state)}[/]{backend}{port}",
            f"[{colour}]●[/] srv [{colour}]{esc(s.server_state)}[/]{port}",
            f"[{colour}]● {esc(s.server_state)}[/]"]


def _stage_parts(s: StripState) -> list[str]:
    if not s.stages:
        return []
    green = sum(1 for v in s.stages.values() if v == "passed")
    red = [k for k, v in s.stages.items() if v == "failed"]
    running = [k for k, v in s.stages.items() if v == "running"]
    counts = f"[$success]{green}✔[/]" + (f" [$error]{len(red)}✘[/]" if red else "")
    names = f" [$error]{esc(','.join(red))}[/]" if red else ""
    first = f" [$error]{esc(red[0])}{',…' if len(red) > 1 else ''}[/]" if red else ""
    run = f" [$primary]…{esc(running[0])}[/]" if running and not red else ""
    return [f"stages {counts}{names}{run}", f"{counts}{first}", counts]


def _job_parts(s: StripState) -> list[str]:
    if not s.running:
        return ["[$text-muted]no job running[/]", "[$text-muted]idle[/]"]
    # The job with progress to show first (a job that has not reported yet says least).
    job = sorted(s.running, key=lambda j: j.done is None)[0]
    more = f" [$text-muted]+{len(s.running) - 1}[/]" if len(s.running) > 1 else ""
    frac = job.fraction
    pct = f" {frac * 100:.0f}%" if frac is not None else ""
    count = (f" {job.done:.0f}/{job.total:.0f}" if job.done is not None and job.total else "")
    eta = job.tracker.eta_s if job.tracker.eta_s is not None else job.eta_s
    eta_text = f" ETA {fmt_duration(eta)}" if eta is not None and not job.paused else ""
    name = f"[$primary]{esc(job.kind)}[/]"
    return [f"{name}{pct}{count}{eta_text}{more}", f"{name}{pct}{eta_text}{more}", f"{name}{pct}{more}"]


def _warning_parts(s: StripState) -> list[str]:
    parts = []
    paused = next((j for j in s.running if j.paused), None)
    if paused is not None:
        parts.append("PAUSED")
    if s.below_reserve:
        parts.append("BELOW RESERVE")
    if s.drift:
        parts.append("restart server to apply")
    if not parts:
        return []
    short = [p if p != "restart server to apply" else "restart srv" for p in parts]
    return [f"[b $warning]{' · '.join(parts)}[/]", f"[b $warning]{' · '.join(short)}[/]"]


def _disk_parts(s: StripState) -> list[str]:
    if s.disk_free is None:
        return []
    from engine.system.disk import fmt_bytes

    colour = "$warning" if s.below_reserve else "$foreground"
    return [f"disk [{colour}]{fmt_bytes(s.disk_free)} free[/]", f"disk [{colour}]{fmt_bytes(s.disk_free)}[/]"]


def _gpu_parts(s: StripState) -> list[str]:
    snap = s.gpu
    if snap is None:
        return ["[$text-muted]GPU …[/]"]
    if not snap.available or not snap.gpus:
        return ["[$text-muted]GPU n/a[/]", "[$text-muted]GPU -[/]"]
    utils = [g.utilization_gpu for g in snap.gpus if g.utilization_gpu is not None]
    used = sum(g.memory_used or 0 for g in snap.gpus)
    total = sum(g.memory_total or 0 for g in snap.gpus)
    util = f"{sum(utils) / len(utils):.0f}%" if utils else "?%"
    mem = f"{used / GIB:.0f}/{total / GIB:.0f}G" if total else "?G"
    mem_pct = f"{100 * used / total:.0f}%m" if total else ""
    n = f"{len(snap.gpus)}× " if len(snap.gpus) > 1 else ""
    return [f"GPU {n}{util} {mem}", f"GPU {util} {mem_pct}".rstrip(), f"GPU {util}"]


def strip_markup(state: StripState, width: int) -> str:
    """One line of markup that fits `width` cells (0: no limit)."""
    parts = [("server", _server_parts(state)), ("stages", _stage_parts(state)), ("job", _job_parts(state)),
             ("warning", _warning_parts(state)), ("disk", _disk_parts(state)), ("gpu", _gpu_parts(state))]
    # Every part gets three forms (its shortest repeated), so level 3, and only level 3, drops it.
    parts = [(name, (forms + [forms[-1]] * 3)[:3]) for name, forms in parts if forms]
    level = {name: 0 for name, _f in parts}

    def line() -> str:
        return SEP.join(forms[min(level[name], len(forms) - 1)] for name, forms in parts
                        if level[name] < len(forms))

    def cells(markup: str) -> int:
        return Content.from_markup(markup).cell_length

    if not width:
        return line()
    # What gives way first: shorter forms of the least telling parts, then the GPU summary and the
    # red stages' names; the warnings go last of all. A level past a part's forms drops it.
    for name, lvl in SHORTEN:
        if cells(line()) <= width:
            break
        if name in level:
            level[name] = max(level[name], lvl)
    # Then give room back, most telling part first, wherever a longer form still fits.
    for name in GROW_BACK:
        while level.get(name, 0) > 0:
            level[name] -= 1
            if cells(line()) > width:
                level[name] += 1
                break
    return line()


GROW_BACK = ("warning", "job", "stages", "server", "disk", "gpu")
# (part, level) steps, applied in order until the line fits; a level equal to the number of forms drops it.
SHORTEN = (("disk", 1), ("gpu", 1), ("job", 1), ("server", 1), ("gpu", 2), ("job", 2), ("stages", 1),
           ("warning", 1), ("disk", 3), ("gpu", 3), ("stages", 2), ("server", 2), ("job", 3), ("stages", 3),
           ("server", 3), ("warning", 2))


class StatusStrip(Static):
    """The one-line summary; the app feeds `state` and calls `refresh_strip()`."""

    DEFAULT_CSS = """
    StatusStrip { height: 1; background: $panel; color: $foreground; padding: 0 1; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__("", **kwargs)
        self.state = StripState()

    def on_mount(self) -> None:
        self.refresh_strip()

    def on_resize(self) -> None:
        self.refresh_strip()

    def refresh_strip(self) -> None:
        width = self.content_region.width if self.is_mounted else 0
        set_markup(self, strip_markup(self.state, width))

    @property
    def line(self) -> str:
        """The strip as plain text (tests)."""
        return Content.from_markup(str(self.content)).plain
