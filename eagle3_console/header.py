"""The top line: workspace path and who drives it; messages (what Textual shows as toasts) replace
it for a few seconds, so a message never covers a pane. Jobs, server and stages are on the strip."""

from __future__ import annotations

from pathlib import Path

from textual.timer import Timer
from textual.widgets import Static

from eagle3_console.render import clip, esc, set_markup


def short_path(path: Path) -> str:
    """`path` with the home directory shown as ~ (keeps the header on one line more often)."""
    try:
        return "~/" + str(path.relative_to(Path.home()))
    except ValueError:
        return str(path)


class ConsoleHeader(Static):
    """Workspace, driver/read-only state and running-job count."""

    DEFAULT_CSS = """
    ConsoleHeader {
        height: auto;
        background: $panel;
        color: $foreground;
        padding: 0 1;
    }
    """

    def __init__(self, workspace: Path, read_only_by: str | None, **kwargs) -> None:
        super().__init__("", **kwargs)
        self.workspace = workspace
        self.read_only_by = read_only_by  # None: this console drives the workspace
        self.running_jobs = 0
        self.message: tuple[str, str] | None = None
        self._message_timer: Timer | None = None

    MESSAGE_COLOURS = {"information": "$primary", "warning": "$warning", "error": "$error"}

    def on_mount(self) -> None:
        self._render_line()

    def show_message(self, text: str, severity: str = "information", timeout: float = 5.0) -> None:
        """Show `text` (its first line) in the severity's colour for `timeout` seconds."""
        first = str(text).strip().splitlines()[0] if str(text).strip() else ""
        self.message = (first, severity)
        if self._message_timer is not None:
            self._message_timer.stop()
        self._message_timer = self.set_timer(timeout, self.clear_message)
        self._render_line()

    def clear_message(self) -> None:
        self.message = None
        self._message_timer = None
        self._render_line()

    def set_running_jobs(self, count: int) -> None:
        if count != self.running_jobs:
            self.running_jobs = count
            self._render_line()

    def on_resize(self) -> None:
        self._render_line()

    @property
    def line(self) -> str:
        """The header as plain words (no markup)."""
        return self.render_line_markup(plain=True)

    def _parts(self, width: int) -> tuple[str, str, str]:
        mode = ("read-only: driven by " + self.read_only_by) if self.read_only_by else "driving"
        jobs = f"{self.running_jobs} job(s) running" if self.running_jobs else "no jobs running"
        path = short_path(self.workspace)
        room = width - len("eagle3-console ")
        if width > 0 and len(path) > room:  # keep the end of the path: it names the workspace
            path = "…" + path[-max(1, room - 1):]
        return path, mode, jobs

    def render_line_markup(self, plain: bool = False) -> str:
        """One line when it fits, else the mode goes on a second line (never split mid-phrase)."""
        width = self.content_region.width if self.is_mounted else 0
        if self.message is not None:
            text, severity = self.message
            text = clip(text, width) if width else text
            return text if plain else f"[b {self.MESSAGE_COLOURS.get(severity, '$primary')}]{esc(text)}[/]"
        path, mode, _jobs = self._parts(width)
        one_line = f"eagle3-console {path} · {mode}"
        sep = " · " if not width or len(one_line) <= width else "\n"
        if plain:
            return f"eagle3-console {path}{sep}{mode}"
        mode_colour = "$warning" if self.read_only_by else "$success"
        return f"[b]eagle3-console[/b] {esc(path)}{sep}[{mode_colour}]{esc(mode)}[/]"

    def _render_line(self) -> None:
        set_markup(self, self.render_line_markup())
