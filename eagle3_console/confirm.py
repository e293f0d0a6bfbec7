"""A yes/no confirmation modal for actions that stop things (server, jobs).

Keyboard first: `y` confirms, `n` or Escape cancels. Enter is deliberately not "yes", so a
stray Enter never stops a server. The screen's result is True only for an explicit yes.
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Static

from eagle3_console.render import esc


class ConfirmScreen(ModalScreen[bool]):
    """Ask before a disruptive action. `warning` (optional) is shown prominently in $error."""

    BINDINGS = [
        Binding("y", "answer(True)", "Yes", id="confirm-yes"),
        Binding("n", "answer(False)", "No", id="confirm-no"),
        Binding("escape", "answer(False)", "Cancel", show=False),
    ]
    DEFAULT_CSS = """
    ConfirmScreen { align: center middle; }
    ConfirmScreen > Vertical {
        width: 70;
        max-width: 100%;
        height: auto;
        max-height: 100%;
        border: thick $warning;
        background: $surface;
        padding: 0 1;
    }
    ConfirmScreen #confirm-title { text-style: bold; }
    ConfirmScreen #confirm-warning { color: $error; text-style: bold; margin-top: 1; }
    ConfirmScreen #confirm-body { margin-top: 1; }
    ConfirmScreen #confirm-keys { margin-top: 1; color: $text-muted; }
    """

    def __init__(self, title: str, body: str = "", warning: str = "") -> None:
        super().__init__()
        self.title_text = title
        self.body = body
        self.warning = warning

    def compose(self) -> ComposeResult:
        with Vertical(id="confirm-box"):
            yield Static(esc(self.title_text), id="confirm-title")
            if self.warning:
                yield Static(esc(self.warning), id="confirm-warning")
            if self.body:
                yield Static(esc(self.body), id="confirm-body")
            yield Static("[b]y[/b] yes    [b]n[/b] / [b]Esc[/b] no", id="confirm-keys")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(bool(yes))
