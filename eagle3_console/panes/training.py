"""Training pane: loss curves of the drafter run. Empty until a run exists."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.widgets import Static

from eagle3_console.panes.base import Pane


class TrainingPane(Pane):
    """Training progress and curves; for now only the empty state."""

    PANE_ID = "training"
    TITLE = "Training"
    DEFAULT_CSS = """
    TrainingPane #training-state { height: auto; }
    """

    def compose(self) -> ComposeResult:
        yield Static(
            "[b]no training run yet[/b]\n[$text-muted]Curves appear here once the train stage starts a run.[/]",
            id="training-state",
        )
