"""Server pane: the SGLang (or local target) server the engine owns.

State, identity (backend, pid, url, model), the capture layers in both numberings (ours and
SGLang's, a known source of silent failure), the capture-relevant flags, a throughput
sparkline, request counts and the log's last lines. Keys (app-level, shown while this pane
is active): `s` start, `S` stop (asks first).
"""

from __future__ import annotations

from collections import deque

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Sparkline, Static

from eagle3_console.fmt import finite, fmt_duration, fmt_num
from eagle3_console.messages import ServerActionFailed, ServerChanged
from eagle3_console.panes.base import Pane
from eagle3_console.render import clip, esc, set_markup
from engine.server.manager import ServerStatus

# Theme variable per server state.
STATE_COLOURS = {"ready": "$success", "starting": "$warning", "unhealthy": "$warning",
                 "crashed": "$error", "stopped": "$text-muted"}
HISTORY = 120  # throughput samples kept for the sparkline (one per poll)


def capture_text(status) -> str:
    """Capture layers in our 0-indexed numbering and SGLang's, or why there are none."""
    cap = status.capture or {}
    if not cap:
        return "[$text-muted]capture: unknown until the server answers[/]"
    if not cap.get("enabled"):
        return "[$warning]capture: off[/]"
    layers = cap.get("layers") or []
    sglang = cap.get("layers_sglang")
    if sglang is None and layers:
        from engine.capture.layers import to_sglang_numbering

        sglang = to_sglang_numbering(layers)
    ours = ",".join(str(i) for i in layers) or "?"
    theirs = ",".join(str(i) for i in sglang or []) or "?"
    return f"capture layers [b]{ours}[/b] [$text-muted](SGLang layers_to_capture {theirs})[/]"


def flags_text(flags: dict, width: int) -> str:
    """Capture-relevant server flags, compact; radix cache on is flagged as an error."""
    parts = []
    for key, value in flags.items():
        if key == "disable_radix_cache" and value is False:
            parts.append("[$error]radix cache ON[/]")
            continue
        if key == "prefill_graphs" and value == "failed":
            parts.append("[$warning]prefill graphs failed (eager)[/]")
            continue
        if key == "capture_writer" and value == "process stopped":
            parts.append("[$warning]writer process stopped (threads)[/]")
            continue
        parts.append(f"[$text-muted]{esc(key)}=[/]{esc(value)}")
    if not parts:
        return "[$text-muted]flags: —[/]"
    # Clip on whole items so markup is never cut in half.
    out: list[str] = []
    used = 6
    for part, key in zip(parts, flags):
        size = len(key) + len(str(flags[key])) + 2
        if used + size > width and out:
            out.append("[$text-muted]…[/]")
            break
        out.append(part)
        used += size
    return "flags " + " ".join(out)


def status_lines(status, width: int) -> list[str]:
    """The pane's text above the sparkline for one ServerStatus."""
    colour = STATE_COLOURS.get(status.state, "$text-muted")
    head = f"[{colour}]● [b]{esc(status.state)}[/b][/]"
    if status.backend:
        head += f" · {esc(status.backend)}"
    if status.pid:
        head += f" · pid {status.pid}"
    if status.uptime_s is not None:
        head += f" · up {fmt_duration(status.uptime_s)}"
    if status.restarts:
        head += f" · [$warning]restarts {status.restarts}[/]"
    if status.exit_code is not None:
        head += f" · exit {status.exit_code}"
    lines = [head]
    where = esc(status.url) if status.url else "[$text-muted]no url yet[/]"
    model = f" · model {esc(clip(status.model, max(10, width - len(status.url) - 10)))}" if status.model else ""
    lines.append(f"{where}{model}")
    lines.append(capture_text(status))
    lines.append(flags_text(status.flags or {}, width))
    if status.error:
        lines.append(f"[$error]{esc(clip(status.error.replace(chr(10), ' '), width * 2))}[/]")
    return lines


class ServerPane(Pane):
    """Live server status from ServerChanged messages; start failures from ServerActionFailed."""

    PANE_ID = "server"
    TITLE = "Server"
    DEFAULT_CSS = """
    ServerPane #server-state { height: auto; }
    ServerPane #server-failure { height: auto; color: $error; }
    ServerPane #server-rate-row { height: 3; margin-top: 1; }
    ServerPane #server-rate { width: 30; }
    ServerPane #server-spark-box { width: 1fr; height: 3; }
    ServerPane #server-spark-label { height: 1; color: $text-muted; }
    ServerPane #server-spark { width: 1fr; height: 2; }
    ServerPane #server-log-title { height: 1; margin-top: 1; color: $text-muted; }
    ServerPane #server-log { height: 1fr; color: $text-muted; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.status: ServerStatus | None = None
        self.throughput: deque[float] = deque(maxlen=HISTORY)
        self.failure: tuple[str, tuple[str, ...]] | None = None

    def compose(self) -> ComposeResult:
        yield Static(
            "[b]stopped[/b]\n[$text-muted]No server is running for this workspace. "
            "Press [b]s[/b] to start it (or run the pipeline's server stage).[/]",
            id="server-state",
        )
        yield Static("", id="server-failure")
        with Horizontal(id="server-rate-row"):
            yield Static("", id="server-rate")
            with Vertical(id="server-spark-box"):
                yield Static("", id="server-spark-label")
                yield Sparkline([], id="server-spark")
        yield Static("log", id="server-log-title")
        yield Static("", id="server-log")

    def on_mount(self) -> None:
        self._render_status()

    def on_server_changed(self, message: ServerChanged) -> None:
        status = message.status
        if status.state == "ready":
            self.throughput.append(finite(status.gen_throughput) or 0.0)  # a NaN gauge draws as 0
            self.failure = None  # a running server supersedes an older start failure
        elif self.status is not None and self.status.state == "ready":
            self.throughput.append(0.0)  # the drop is part of the story
        self.status = status
        if self.render_when_shown():  # hidden behind another tab: render when shown
            self._render_status()

    def refresh_view(self) -> None:
        self._render_status()

    def on_server_action_failed(self, message: ServerActionFailed) -> None:
        self.failure = (message.reason, message.log_tail)
        self._render_status()

    def on_resize(self) -> None:
        self._render_status()

    def _render_status(self) -> None:
        status = self.status
        width = max(30, self.content_region.width or 76)
        state = self.query_one("#server-state", Static)
        failure = self.query_one("#server-failure", Static)
        if self.failure:
            failure.display = True
            set_markup(failure, f"start failed: {esc(self.failure[0])}")
        else:
            failure.display = False
        if status is None:
            self.query_one("#server-rate-row").display = False
            self._render_log(self.failure[1] if self.failure else ())
            return
        set_markup(state, "\n".join(status_lines(status, width)))
        row = self.query_one("#server-rate-row")
        row.display = bool(self.throughput) or status.state == "ready"
        rate = "?" if status.gen_throughput is None else f"{status.gen_throughput:.1f}"
        set_markup(self.query_one("#server-rate", Static),
            f"gen [b]{rate}[/b] tok/s\nrunning {fmt_num(status.running_reqs, 0)} · queued {fmt_num(status.queued_reqs, 0)}")
        data = list(self.throughput) or [0.0]
        self.query_one("#server-spark", Sparkline).data = data
        peak = max(data)
        set_markup(self.query_one("#server-spark-label", Static),
                   f"tok/s, last {len(self.throughput)} poll{'' if len(self.throughput) == 1 else 's'}, 0-{peak:.0f}")
        tail = status.log_tail or (self.failure[1] if self.failure else ())
        self._render_log(tail)

    def _render_log(self, tail) -> None:
        log = self.query_one("#server-log", Static)
        sized_by_content = log.styles.height is not None and log.styles.height.is_auto  # the wide grid's top row
        rows = 6 if sized_by_content else max(1, log.size.height or 6)
        width = max(20, log.size.width or 76)
        lines = [esc(clip(line.rstrip(), width)) for line in list(tail)[-rows:]]
        self.query_one("#server-log-title", Static).display = bool(lines)
        set_markup(log, "\n".join(lines))

    # -- read by the app and tests
    @property
    def state(self) -> str:
        return self.status.state if self.status is not None else "stopped"
