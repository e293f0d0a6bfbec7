"""GPU pane: one compact row per GPU, the processes on them attributed to this workspace's server,
trainer and evaluation (eagle3_console.gpuprocs), then the interconnect and the NCCL environment."""

from __future__ import annotations

import time
from collections import deque

from textual import work
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.message import Message
from textual.widgets import Static

from eagle3_console.fmt import finite
from eagle3_console.keys import scroll_bindings
from eagle3_console.gpuprocs import GpuProcessRow, attribute, process_lines, psutil_parent
from eagle3_console.messages import GpuChanged, JobsChanged
from eagle3_console.panes.base import Pane
from eagle3_console.render import bar, clip, esc, level_colour, set_markup
from engine.system.gpu import GpuSnapshot

GIB = 2**30


def _mem_text(used: int | None, total: int | None) -> str:
    if used is None or total is None:
        return "?/?"
    return f"{used / GIB:.1f}/{total / GIB:.0f}G"


def _pct(value: int | float | None) -> str:
    return "  ? " if value is None else f"{value:>3.0f}%"


SPARK_CHARS = "▁▂▃▄▅▆▇█"
HISTORY = 60  # utilisation samples kept per GPU (one per sample, 1 Hz by default)


def spark_text(values, width: int) -> str:
    """The last `width` percentages as a one-line sparkline (0..100 scale), padded on the left."""
    recent = list(values)[-width:]
    cells = "".join(SPARK_CHARS[min(7, max(0, round(v * 7 / 100)))] if finite(v) is not None else " "
                    for v in recent)
    return cells.rjust(width)


def gpu_rows(snapshot, width: int, history: dict[int, "deque"] | None = None) -> list[str]:
    """Markup lines for the GPU table at `width` cells, one row per GPU.

    Columns drop by priority as the pane narrows: power and clock below 70 cells, the memory
    bar below 60 (memory stays as text); the utilisation sparkline shows when `history` is given.
    """
    history = history or {}
    show_extra = width >= 70
    mem_bar = width >= 60
    spark_w = (8 if width >= 60 else 6) if history else 0
    name_w = 12 if width >= 90 else 8
    fixed = 3 + name_w + 1 + 5 + 11 + 1 + 4 + (14 if show_extra else 0) + (spark_w + 1 if spark_w else 0)
    bars = 2 if mem_bar else 1
    bar_w = max(4, (width - fixed - bars) // bars)
    head = f"{'#':>2} {'name':<{name_w}} {'util':<{bar_w + 5}}"
    head += f"{'memory':<{bar_w + 12 if mem_bar else 12}}{'temp':>4}"
    if show_extra:
        head += f" {'power':>5} {'clock':>7}"
    if spark_w:
        head += f" {'trend':<{spark_w}}"
    lines = [f"[$text-muted]{head}[/]"]
    for gpu in snapshot.gpus:
        mem_pct = None
        if gpu.memory_used is not None and gpu.memory_total:
            mem_pct = 100.0 * gpu.memory_used / gpu.memory_total
        util = gpu.utilization_gpu
        temp = gpu.temperature_c
        temp_text = f"[{level_colour(temp, 75, 85)}]{'?' if temp is None else temp:>2}°C[/]"
        mem_colour = level_colour(mem_pct, 80, 95)
        row = (f"{gpu.index:>2} {esc(clip(gpu.name.replace('NVIDIA ', ''), name_w)):<{name_w}} "
               f"{bar(None if util is None else util / 100, bar_w)}{_pct(util)} ")
        if mem_bar:
            row += f"{bar(None if mem_pct is None else mem_pct / 100, bar_w, mem_colour)}"
        row += f"[{mem_colour if not mem_bar else '$foreground'}]{_mem_text(gpu.memory_used, gpu.memory_total):>11}[/]"
        row += f" {temp_text:>4}"
        if show_extra:
            power = "   ?W" if gpu.power_w is None else f"{gpu.power_w:>4.0f}W"
            clock = "     ? " if gpu.sm_clock_mhz is None else f"{gpu.sm_clock_mhz:>4}MHz"
            row += f" {power} {clock:>7}"
        if spark_w:
            row += f" [$accent]{spark_text(history.get(gpu.index, ()), spark_w)}[/]"
        lines.append(row)
    return lines


def nccl_lines(preset: str, disable_nvls: bool, suggested: str | None) -> list[str]:
    """The preset and the NCCL variables a child process would get."""
    from engine.system.nccl import build_child_env, effective_nccl_vars

    try:
        env = effective_nccl_vars(build_child_env(preset, disable_nvls=disable_nvls))
    except ValueError as exc:
        return [f"[$error]NCCL preset: {esc(exc)}[/]", "[$text-muted]fix: set gpu.nccl_preset in console.toml[/]"]
    hint = ""
    if suggested and suggested != preset:
        hint = f"  [$warning](suggested for these GPUs: {esc(suggested)})[/]"
    lines = [f"NCCL preset [b]{esc(preset)}[/b]{hint}"]
    if env:
        lines.append("  " + "  ".join(f"[$text-muted]{esc(k)}=[/]{esc(v)}" for k, v in env.items()))
    else:
        lines.append("  [$text-muted]no NCCL variables set[/]")
    return lines


class GpuScroll(VerticalScroll):
    BINDINGS = scroll_bindings()
    # The GPU and process rows never wrap (a wrapped row would change the height, hence the scrollbar,
    # hence the width the rows are cut to, and a frame could keep the wrapped height): a line longer
    # than the width ends in an ellipsis.
    DEFAULT_CSS = ("GpuScroll { height: 1fr; } GpuScroll:focus { background-tint: $foreground 5%; } "
                   "GpuScroll > #gpu-table, GpuScroll > #gpu-procs { text-wrap: nowrap; text-overflow: ellipsis; }")


class GpuProcessesRead(Message, bubble=False):
    def __init__(self, rows: list, seq: int) -> None:
        super().__init__()
        self.rows = rows
        self.seq = seq  # an older read that finishes late is dropped


PROCESS_REFRESH_S = 2.0  # attribution walks /proc: not on every 1 Hz sample


class GpuPane(Pane):
    """GPUs (NVML), interconnect and NCCL settings; shows why when NVML is unavailable."""

    PANE_ID = "gpus"
    TITLE = "GPUs & NCCL"
    DEFAULT_CSS = """
    GpuPane #gpu-table { height: auto; }
    GpuPane #gpu-status { height: auto; margin-bottom: 1; }
    GpuPane #gpu-procs { height: auto; margin-bottom: 1; }
    GpuPane #gpu-nccl { height: auto; }
    """

    def __init__(self, nccl_preset: str = "none", disable_nvls: bool = True, **kwargs) -> None:
        super().__init__(**kwargs)
        self.nccl_preset = nccl_preset
        self.disable_nvls = disable_nvls
        self.snapshot: GpuSnapshot | None = None
        self.history: dict[int, deque] = {}  # GPU index -> recent utilisation percentages
        self._nccl_cache: tuple | None = None
        self.jobs: tuple = ()
        self.process_rows: list[GpuProcessRow] | None = None  # None: not attributed yet
        self.parent_of = psutil_parent  # pid -> parent pid (tests inject one)
        self._procs_read_at = 0.0
        self._procs_seq = 0

    def compose(self) -> ComposeResult:
        with GpuScroll(id="gpu-scroll"):  # 8 GPUs and their processes overflow 80x24: Tab, then j/k
            yield Static("[$text-muted]sampling GPUs…[/]", id="gpu-status")
            yield Static("", id="gpu-table")
            yield Static("", id="gpu-procs")
            yield Static("", id="gpu-nccl")

    def on_mount(self) -> None:
        self._render_snapshot()

    def record_sample(self, snapshot) -> None:
        """Add a sample to the per-GPU history. Called for every sample (the app does it as each
        arrives), since GpuChanged messages are coalesced and would drop history points."""
        if snapshot is not None and snapshot.available:
            for gpu in snapshot.gpus:
                self.history.setdefault(gpu.index, deque(maxlen=HISTORY)).append(gpu.utilization_gpu)

    def on_gpu_changed(self, message: GpuChanged) -> None:
        self.snapshot = message.snapshot
        if time.monotonic() - self._procs_read_at >= PROCESS_REFRESH_S:
            self.read_processes()
        if self.render_when_shown():  # hidden behind another tab: render when shown
            self._render_snapshot()

    def on_jobs_changed(self, message: JobsChanged) -> None:
        self.jobs = tuple(message.jobs)
        self.read_processes()

    def read_processes(self) -> None:
        """Attribute the GPU processes to our jobs in a worker (it reads /proc)."""
        if self.snapshot is None or not self.snapshot.available:
            return
        self._procs_read_at = time.monotonic()
        self._procs_seq += 1
        self._attribute(self.snapshot, self.jobs, self._procs_seq)

    @work(thread=True, group="gpu-procs", exit_on_error=False)
    def _attribute(self, snapshot, jobs, seq: int) -> None:
        self.post_message(GpuProcessesRead(attribute(snapshot, jobs, self.parent_of), seq))

    def on_gpu_processes_read(self, message: GpuProcessesRead) -> None:
        if message.seq != self._procs_seq:
            return  # a newer read (a newer job list) is on its way
        self.process_rows = message.rows
        if self.render_when_shown():
            self._render_snapshot()

    def on_resize(self) -> None:
        self._render_snapshot()

    def refresh_view(self) -> None:
        self._render_snapshot()

    def _nccl_lines(self, suggested: str | None) -> list[str]:
        """nccl_lines, cached: the preset and environment do not change while the console runs."""
        key = (self.nccl_preset, self.disable_nvls, suggested)
        if self._nccl_cache is None or self._nccl_cache[0] != key:
            self._nccl_cache = (key, nccl_lines(*key))
        return list(self._nccl_cache[1])

    def _text_width(self) -> int:
        """The cells a line gets: the scroll's content width (less its scrollbar when it shows one), so
        rows are cut to fit rather than wrapped by the Static."""
        width = self.query_one(GpuScroll).scrollable_content_region.width or self.content_region.width
        return max(40, width or 78)

    def _render_snapshot(self) -> None:
        snap = self.snapshot
        status = self.query_one("#gpu-status", Static)
        table = self.query_one("#gpu-table", Static)
        suggested = None
        if snap is None:
            set_markup(status, "[$text-muted]sampling GPUs…[/]")
            table.display = False
        elif not snap.available:
            set_markup(status, f"[$warning]{esc(snap.reason)}[/]\n"
                          "[$text-muted]GPU rows appear here once NVML answers (driver loaded, GPUs visible).[/]")
            table.display = False
        else:
            from engine.system.nccl import suggest_preset

            first = snap.gpus[0]
            suggested = suggest_preset(first.compute_capability, snap.interconnect)
            cuda = f" · CUDA {esc(snap.cuda_driver_version)}" if snap.cuda_driver_version else ""
            set_markup(status, f"{len(snap.gpus)} × {esc(first.architecture)} · interconnect [b]{esc(snap.interconnect)}[/b]"
                          f" · driver {esc(snap.driver_version or '?')}{cuda}")
            table.display = True
            width = self._text_width()
            set_markup(table, "\n".join(gpu_rows(snap, width, self.history)))
        procs = self.query_one("#gpu-procs", Static)
        rows = self.process_rows if snap is not None and snap.available else None
        procs.display = rows is not None
        if rows is not None:
            width = self._text_width()
            set_markup(procs, "\n".join(process_lines(rows, width)))
        lines = self._nccl_lines(suggested)
        if snap is not None and not snap.available:
            lines.insert(0, "interconnect [$text-muted]unknown (no NVML)[/]")
        set_markup(self.query_one("#gpu-nccl", Static), "\n".join(lines))
