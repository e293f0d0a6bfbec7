"""The top line: workspace path, who drives it, and how many jobs run."""

from __future__ import annotations

from pathlib import Path

from textual.widgets import Static

from eagle3_console.render import esc, set_markup


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

    def on_mount(self) -> None:
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
        """One line when it fits, else the mode and jobs go on a second line (never split mid-phrase)."""
        width = self.content_region.width if self.is_mounted else 0
        path, mode, jobs = self._parts(width)
        one_line = f"eagle3-console {path} · {mode} · {jobs}"
        sep = " · " if not width or len(one_line) <= width else "\n"
        if plain:
            return f"eagle3-console {path}{sep}{mode} · {jobs}"
        mode_colour = "$warning" if self.read_only_by else "$success"
        return (f"[b]eagle3-console[/b] {esc(path)}{sep}[{mode_colour}]{esc(mode)}[/]"
                f" · [$text-muted]{jobs}[/]")

    def _render_line(self) -> None:
        set_markup(self, self.render_line_markup())
