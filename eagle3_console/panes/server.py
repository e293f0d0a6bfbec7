"""Server pane: the SGLang (or local target) server. Empty until the server stage exists."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.widgets import Static

from eagle3_console.panes.base import Pane


class ServerPane(Pane):
    """Server process, health and throughput; for now only the stopped state."""

    PANE_ID = "server"
    TITLE = "Server"
    DEFAULT_CSS = """
    ServerPane #server-state { height: auto; }
    """

    def compose(self) -> ComposeResult:
        yield Static(
            "[b]stopped[/b]\n[$text-muted]No server is running for this workspace. "
            "It is started by the pipeline's server stage.[/]",
            id="server-state",
        )
