"""The help screen (`?`): every key, and what quitting does to jobs."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

HELP_TEXT = """\
[b]eagle3-console keys[/b]

  [b]1-5[/b]     GPUs · Server · Pipeline · Extraction · Training
  [b]←/→[/b]     previous / next tab (when the tab bar has focus)
  [b]↑/↓[/b]     move through the pipeline's stages
  [b]Enter[/b]   re-run the checks of the highlighted stage
  [b]r[/b]       run the checks of the selected stage
  [b]R[/b]       run all checks, in pipeline order
  [b]t[/b]       next theme (saved in console.toml ui.theme)
  [b]Ctrl+P[/b]  command palette: every action by name, and all themes
  [b]q[/b]       close the console — [b]jobs keep running[/b];
          open the console again to re-attach
  [b]?[/b]       this help (Esc closes)

A stage turns green only when its checks pass now; the detail area
shows what each check measured and how to fix a failure.
On terminals of 160 columns or more, all five panes show at once."""


class HelpScreen(ModalScreen[None]):
    """Key reference over the console."""

    BINDINGS = [
        Binding("escape", "dismiss", "Close"),
        Binding("question_mark", "dismiss", "Close", show=False),
        Binding("q", "dismiss", "Close", show=False),
    ]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll {
        width: auto;
        max-width: 100%;
        height: auto;
        max-height: 100%;
        border: round $primary;
        background: $surface;
        padding: 0 1;
    }
    HelpScreen Static { width: auto; }
    """

    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield Static(HELP_TEXT)
