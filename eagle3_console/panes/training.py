"""Training pane: live curves of the drafter run, its speed, checkpoints and best result.

The training job appends one JSON line per log step to `<drafter_dir>/metrics.jsonl`
(engine.train.loop): `type` train|eval, `step`, `t`, `loss`, `loss_pos` [per TTT position],
`acc` [per position], `accept`, `sim_al` (simulated acceptance length), and on train lines
`lr`, `grad_norm`, `tokens_per_s`; a run that failed ends with a `failed` line (`reason`,
`message`, e.g. non-finite loss), shown in red. The engine follows the file (engine.watchers) and
sends the lines added (a line still being written waits) and the checkpoint pointers; a replaced
file (a resumed run trims it atomically) comes again from the start with `reset`. The pane reads
no file. Missing keys are shown as "?". Non-finite
values (logged as "NaN"/"Infinity", or bare NaN/Infinity by older runs) are shown as nan/inf and
never plotted: a curve with no finite point says so instead of drawing.

Keys (app-level, shown while this pane is active): `s` start/resume, `S` stop (asks first),
`c` next curve when only one fits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from textual.app import ComposeResult
from textual.color import Color
from textual.containers import Horizontal
from textual.widgets import Static

from eagle3_console.fmt import finite, fmt_count, fmt_duration, fmt_num
from eagle3_console.messages import JobEventsArrived, JobsChanged, TrainingMetricsArrived
from eagle3_console.panes.base import Pane
from eagle3_console.render import esc, job_state_colour, set_markup
from eagle3_console.strip import RateTracker
from engine.system.disk import fmt_bytes
from engine.jobs.events import Error, Finished, Progress, Started, Stopped
from engine.jobs.manager import ACTIVE_STATES

CURVES = ("loss", "acc", "al")
CURVE_TITLES = {"loss": "loss", "acc": "accuracy per position", "al": "simulated acceptance length"}
CURVE_YLABELS = {"loss": "loss", "acc": "accuracy", "al": "accept. length"}
# One marker per series, so lines differ without colour (and on a monochrome terminal); the legend
# is in the title line, above the plot, never over a curve.
MARKERS = ("braille", "•", "x", "+")
MARKER_GLYPHS = {"braille": "⣿", "•": "•", "x": "x", "+": "+"}
SHOWN_POSITIONS = (0, 1, 3, 6)  # a few TTT positions; all of them would be unreadable
MAX_POINTS = 400  # plotted points per line (older ones are thinned, not dropped from memory)
ALL_CURVES_MIN_WIDTH = 120
ONLINE_MODES = ("online", "hybrid")


@dataclass
class Series:
    steps: list[float] = field(default_factory=list)
    values: list[float] = field(default_factory=list)

    def add(self, step: float, value) -> None:
        number = finite(value)
        if number is not None:
            self.steps.append(step)
            self.values.append(number)

    def thinned(self) -> tuple[list[float], list[float]]:
        stride = max(1, len(self.steps) // MAX_POINTS)
        xs, ys = self.steps[::stride], self.values[::stride]
        if self.steps and xs[-1] != self.steps[-1]:  # always show the newest point
            xs, ys = xs + [self.steps[-1]], ys + [self.values[-1]]
        return xs, ys


@dataclass
class TrainingView:
    """Curves and figures folded from metrics lines and the train job's events."""

    loss: Series = field(default_factory=Series)
    eval_loss: Series = field(default_factory=Series)
    acc: dict[int, Series] = field(default_factory=dict)
    sim_al: Series = field(default_factory=Series)
    eval_sim_al: Series = field(default_factory=Series)
    last_train: dict = field(default_factory=dict)
    last_eval: dict = field(default_factory=dict)
    rate_points: list[tuple[float, float]] = field(default_factory=list)  # (t, step) of train lines
    # Steps per second smoothed over time (the status strip's RateTracker): the first lines of a run
    # (compilation, warm-up) no longer set the ETA for the whole run.
    tracker: RateTracker = field(default_factory=RateTracker)
    best_al: float | None = None
    best_step: int | None = None
    total_steps: int | None = None
    failure: dict = field(default_factory=dict)  # the `failed` line a run that failed ends with

    def add(self, record: dict) -> None:
        step = finite(record.get("step"))
        if step is None:
            return
        kind = record.get("type", "train")
        if kind == "failed":
            self.failure = record
            return
        al = finite(record.get("sim_al"))
        if kind == "eval":
            self.last_eval = record
            self.eval_loss.add(step, record.get("loss"))
            self.eval_sim_al.add(step, al)
        else:
            self.last_train = record
            self.loss.add(step, record.get("loss"))
            self.sim_al.add(step, al)
            acc = record.get("acc")
            if isinstance(acc, list):
                for pos, value in enumerate(acc):
                    self.acc.setdefault(pos, Series()).add(step, value)
            t = finite(record.get("t"))
            if t is not None:
                self.rate_points = (self.rate_points + [(t, step)])[-20:]
                self.tracker.update(step, None, t)
        if al is not None and (self.best_al is None or al > self.best_al):
            self.best_al, self.best_step = al, int(step)

    @property
    def step(self) -> int | None:
        found = [finite(r.get("step")) for r in (self.last_train, self.last_eval) if r]
        steps = [s for s in found if s is not None]
        return int(max(steps)) if steps else None

    @property
    def steps_per_s(self) -> float | None:
        if self.tracker.rate:
            return self.tracker.rate
        if len(self.rate_points) < 2:
            return None
        (t0, s0), (t1, s1) = self.rate_points[0], self.rate_points[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 and s1 > s0 else None

    @property
    def eta_s(self) -> float | None:
        rate, step = self.steps_per_s, self.step
        if not rate or step is None or not self.total_steps:
            return None
        return max(0.0, (self.total_steps - step) / rate)


class TrainingPane(Pane):
    """Training curves (textual-plotext) and figures, from the metrics lines the engine sends."""

    PANE_ID = "training"
    TITLE = "Training"
    DEFAULT_CSS = """
    TrainingPane #training-state { height: auto; }
    TrainingPane #training-figures { height: auto; }
    TrainingPane #training-plots { height: 1fr; min-height: 6; }
    TrainingPane #training-plots .curve { width: 1fr; height: 1fr; display: none; }
    TrainingPane #training-plots .curve.-shown { display: block; }
    TrainingPane.-all-curves #training-plots .curve { display: block; }
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.view = TrainingView()
        self.latest_ckpt: dict[str, Any] | None = None
        self.best_ckpt: dict[str, Any] | None = None
        self.job_id = ""
        self.job_state = ""
        self.job_note = ""
        self.curve = "loss"
        self._plots_mounted = False
        self.online: Progress | None = None  # the newest progress of an online/hybrid run

    def compose(self) -> ComposeResult:
        yield Static(
            "[b]no training run yet[/b]\n[$text-muted]Curves appear here once training runs; "
            "press [b]s[/b] to start (or resume) it.[/]",
            id="training-state",
        )
        yield Static("", id="training-figures")
        # The plots (plotext) are mounted with the first metrics: importing plotext slows start-up
        # noticeably, and most consoles open before training has begun.
        yield Horizontal(id="training-plots")

    def on_mount(self) -> None:
        self.query_one("#training-plots").display = False
        self.app.theme_changed_signal.subscribe(self, lambda _theme: self._render_plots())

    # -- messages
    def on_training_metrics_arrived(self, message: TrainingMetricsArrived) -> None:
        if message.reset:
            total = self.view.total_steps
            self.view = TrainingView(total_steps=total)
        for record in message.records:
            self.view.add(record)
        self.latest_ckpt, self.best_ckpt = message.latest, message.best
        self._render_all()

    def on_jobs_changed(self, message: JobsChanged) -> None:
        newest = next((j for j in message.jobs if j.kind == "train"), None)
        if newest is not None and (newest.id, newest.state) != (self.job_id, self.job_state):
            self.job_id, self.job_state = newest.id, newest.state
            self._render_state()

    def on_job_events_arrived(self, message: JobEventsArrived) -> None:
        if message.kind != "train":
            return
        for event in message.events:
            total = event.total_steps if isinstance(event, Started) else \
                event.total if isinstance(event, Progress) else None
            if total is not None and math.isfinite(total) and total > 0:
                self.view.total_steps = int(total)
            if isinstance(event, Progress) and event.mode in ONLINE_MODES:
                self.online = event
            elif isinstance(event, Started):
                self.online = None
            if isinstance(event, Error):
                self.job_note = f"error: {event.message or ''}"
            elif isinstance(event, Finished):
                self.job_note = f"finished: exported to {event.export or '?'}"
            elif isinstance(event, Stopped):
                step = '?' if event.step is None else event.step
                self.job_note = f"stopped at step {step}; s resumes from the checkpoint"
            elif isinstance(event, Started):
                self.job_note = ""
        self._render_all()

    def on_resize(self) -> None:
        wide = (self.content_region.width or 0) >= ALL_CURVES_MIN_WIDTH
        self.set_class(wide, "-all-curves")
        self._render_plots()

    # -- read by the app's actions and by tests
    @property
    def running_job_id(self) -> str | None:
        return self.job_id if self.job_id and self.job_state in ACTIVE_STATES else None

    def cycle_curve(self) -> None:
        self.curve = CURVES[(CURVES.index(self.curve) + 1) % len(CURVES)]
        for name in CURVES:
            for plot in self.query(f"#plot-{name}"):
                plot.set_class(name == self.curve, "-shown")
        self._render_plots()

    def plot_data(self, name: str) -> dict[str, tuple[list[float], list[float]]]:
        """The lines a curve shows: label -> (steps, values)."""
        v = self.view
        if name == "loss":
            lines = {"train": v.loss, "eval": v.eval_loss}
        elif name == "acc":
            lines = {f"pos {p}": v.acc[p] for p in SHOWN_POSITIONS if p in v.acc}
        else:
            lines = {"train": v.sim_al, "eval": v.eval_sim_al}
        return {label: s.thinned() for label, s in lines.items() if s.steps}

    # -- rendering
    def _render_all(self) -> None:
        self._render_state()
        self._render_plots()

    def _render_state(self) -> None:
        v = self.view
        state = self.query_one("#training-state", Static)
        has_data = v.step is not None
        self.query_one("#training-plots").display = has_data
        if has_data and not self._plots_mounted:
            self._mount_plots()
        job = ""
        if self.job_id:
            colour = job_state_colour(self.job_state)
            job = f"[{colour}]● [b]{esc(self.job_state)}[/b][/] · job {esc(self.job_id)}"
        if not has_data:
            if job:
                set_markup(state, f"{job}\n[$text-muted]waiting for the first metrics line…[/]")
            return
        step = f"step [b]{v.step}[/b]" + (f"/{v.total_steps}" if v.total_steps else "")
        rate = v.steps_per_s
        lines = [" · ".join(p for p in (job, step, f"{fmt_num(rate)} step/s" if rate else "",
                                         f"ETA {fmt_duration(v.eta_s)}" if v.eta_s is not None else "") if p)]
        failure = str(v.failure.get("message") or f"failed at step {v.failure.get('step')}") if v.failure else ""
        if failure:
            lines.append(f"[$error]✘ {esc(failure)}[/]")
        if self.online is not None:
            lines.append(online_line(self.online))
        if self.job_note and self.job_note != f"error: {failure}":
            lines.append(f"[$text-muted]{esc(self.job_note)}[/]")
        set_markup(state, "\n".join(lines))
        set_markup(self.query_one("#training-figures", Static), "\n".join(self._figure_lines()))

    def _figure_lines(self) -> list[str]:
        v = self.view
        tr, ev = v.last_train, v.last_eval
        acc: list[Any] = tr["acc"] if isinstance(tr.get("acc"), list) else []
        acc_text = " ".join(f"{fmt_num(a)}" for a in acc[:7]) or "?"
        loss = f"loss [b]{fmt_num(tr.get('loss'), 3)}[/b]" + (f" (eval {fmt_num(ev.get('loss'), 3)})" if ev else "")
        al = f"sim AL [b]{fmt_num(tr.get('sim_al'))}[/b]" + (f" (eval {fmt_num(ev.get('sim_al'))})" if ev else "")
        lines = [f"{loss} · {al}", f"acc/pos {acc_text}"]
        lines.append(f"lr {_sci(tr.get('lr'))} · grad {fmt_num(tr.get('grad_norm'))} · "
                     f"{fmt_count(finite(tr.get('tokens_per_s')))} tok/s")
        best_al = self.best_ckpt.get("sim_al") if self.best_ckpt else v.best_al
        best_step = self.best_ckpt.get("step") if self.best_ckpt else v.best_step
        best = f"best AL [b][$success]{fmt_num(best_al)}[/][/b] @ step {best_step}" if best_al is not None else ""
        ckpt = (f"checkpoint step {self.latest_ckpt.get('step', '?')}" if self.latest_ckpt
                else "[$warning]no checkpoint yet[/]")
        lines.append(" · ".join(p for p in (best, ckpt) if p))
        return lines

    def _mount_plots(self) -> None:
        from textual_plotext import PlotextPlot

        self._plots_mounted = True
        plots = [PlotextPlot(id=f"plot-{name}", classes="curve" + (" -shown" if name == self.curve else ""))
                 for name in CURVES]
        self.query_one("#training-plots").mount_all(plots)
        self.call_after_refresh(self._render_plots)

    def _render_plots(self) -> None:
        if self.view.step is None or not self._plots_mounted or not self.query("#plot-loss"):
            return
        from textual_plotext import PlotextPlot

        palette = self._palette()
        wide = self.has_class("-all-curves")
        for name in CURVES:
            widget = self.query_one(f"#plot-{name}", PlotextPlot)
            if not wide and name != self.curve:
                continue
            plt = widget.plt
            plt.clear_data()
            plt.clear_figure()
            lines = self.plot_data(name)  # finite points only: plotext fails on NaN/inf
            legend = "  ".join(f"{MARKER_GLYPHS[MARKERS[i % len(MARKERS)]]} {label.replace('pos ', 'p')}"
                               for i, label in enumerate(lines))
            title = (CURVE_TITLES[name] + (f": {legend}" if legend else " (no finite values)")
                     + ("" if wide else "  (c: next curve)"))
            plt.title(title)
            plt.xlabel("step")
            plt.ylabel(CURVE_YLABELS[name])
            for i, (_label, (xs, ys)) in enumerate(lines.items()):
                plt.plot(xs, ys, color=palette[i % len(palette)], marker=MARKERS[i % len(MARKERS)])
            widget.refresh()

    def _palette(self) -> list[tuple[int, int, int]]:
        """Line colours from the current theme, so light and dark themes both read well."""
        colours = []
        for name in ("primary", "accent", "success", "warning", "error", "secondary"):
            value = self.app.theme_variables.get(name)
            if value:
                try:
                    colours.append(Color.parse(value).rgb)
                except Exception:  # a theme variable that is not a colour: skip it
                    continue
        return colours or [(128, 128, 128)]

    @property
    def best_acceptance_length(self) -> float | None:
        if self.best_ckpt and finite(self.best_ckpt.get("sim_al")) is not None:
            return float(self.best_ckpt["sim_al"])
        return self.view.best_al


# A window this full is full: the producer is waiting for room (records are whole, so a window seldom
# shows fuller than one record short of its budget). One threshold for its colour and for the pace.
FULL_WINDOW = 0.8


def online_line(p: Progress) -> str:
    """Where an online/hybrid run stands: its epoch, which side is slower, how full the window is."""
    epoch = f"{p.mode} · epoch {p.epoch if p.epoch is not None else '?'}"
    if p.epoch_step is not None:
        epoch += f" step {p.epoch_step}" + (f"/{p.steps_per_epoch}" if p.steps_per_epoch else "")
    capture, train = finite(p.capture_tokens_per_s), finite(p.train_tokens_per_s)
    rates = f"capture {fmt_count(capture)} vs trainer {fmt_count(train)} tok/s"
    if capture and train:
        rates += f" ([$warning]{pace_setter(p, capture, train)}[/] sets the pace)"
    cpu = finite(p.capture_cpu)
    if cpu is not None:  # the capture process's CPU: where the capture's client-side work goes
        rates += f" · capture process {cpu:.1f} CPU"
    window = ""
    if p.window_budget:
        used = p.window_bytes or 0
        colour = "$warning" if used >= FULL_WINDOW * p.window_budget else "$text"
        window = f"window [{colour}]{fmt_bytes(used)}[/] of {fmt_bytes(p.window_budget)}"
        if p.window_peak:
            window += f" (peak {fmt_bytes(p.window_peak)})"
    return " · ".join(part for part in (epoch, rates, window) if part)


def pace_setter(p: Progress, capture: float, train: float) -> str:
    """The side that limits an online run. Rates apart by more than a tenth say it; at one pace (the
    steady state: what is captured is what is trained) the window does: full, the producer is waiting
    for room, so the trainer sets the pace; not full, the trainer is waiting for captures."""
    if abs(capture - train) > 0.1 * max(capture, train) or not p.window_budget:
        return "capture" if capture < train else "trainer"
    return "trainer" if (p.window_bytes or 0) >= FULL_WINDOW * p.window_budget else "capture"


def _sci(value) -> str:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return "?"
    return f"{number:.1e}" if math.isfinite(number) else str(number)  # nan, inf
