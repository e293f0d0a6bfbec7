"""The help screen (`?`): every key, from the one key table (eagle3_console.keys), and what
quitting does to jobs. A read-only console's help leaves out what it cannot do."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from eagle3_console.keys import help_lines, scroll_bindings


class HelpScroll(VerticalScroll):
    BINDINGS = scroll_bindings()


class HelpScreen(ModalScreen[None]):
    """Key reference over the console."""

    BINDINGS = [
        Binding("escape", "dismiss", "Close"),
        Binding("question_mark", "dismiss", "Close", show=False),
        Binding("q", "dismiss", "Close", show=False),
    ]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > HelpScroll {
        width: 100;
        max-width: 100%;
        height: auto;
        max-height: 100%;
        border: round $primary;
        background: $surface;
        padding: 0 1;
    }
    HelpScreen Static { width: 100%; }  /* long lines wrap at 80 columns instead of being cut */
    """

    def __init__(self, read_only: bool = False) -> None:
        super().__init__()
        self.read_only = read_only

    def compose(self) -> ComposeResult:
        with HelpScroll():
            yield Static("\n".join(help_lines(self.read_only)))

    def on_mount(self) -> None:
        self.query_one(HelpScroll).focus()
