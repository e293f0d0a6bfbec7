"""What every pane shares: a titled border and a class the layout switches on."""

from __future__ import annotations

from textual.containers import Vertical


class Pane(Vertical):
    """A bordered pane; `PANE_ID` is its tab id, `TITLE` its tab and border title."""

    PANE_ID = ""
    TITLE = ""
    DEFAULT_CSS = """
    Pane {
        border: round $primary 40%;
        border-title-color: $text-muted;
        padding: 0 1;
        height: 1fr;
        &:focus-within {
            border: round $primary;
            border-title-color: $text;
        }
    }
    """

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id or f"pane-{self.PANE_ID}", classes=f"pane {classes or ''}".strip())
        self.border_title = self.TITLE
