"""What every pane shares: a titled border and a class the layout switches on."""

from __future__ import annotations

from textual.containers import Vertical


class Pane(Vertical):
    """A bordered pane; `PANE_ID` is its tab id, `TITLE` its tab and border title."""

    PANE_ID = ""
    TITLE = ""
    DEFAULT_CSS = """
    Pane {
        border: round $primary 80%;  /* >= 3:1 on the background in every shipped theme */
        border-title-color: $text-muted;
        padding: 0 1;
        height: 1fr;
        &:focus-within {
            border: round $accent;
            border-title-color: $text;
            border-title-style: bold;
        }
    }
    """

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id or f"pane-{self.PANE_ID}", classes=f"pane {classes or ''}".strip())
        self.border_title = self.TITLE
        self._stale = False  # an update arrived while hidden: render when shown

    @property
    def shown(self) -> bool:
        """Whether the deck shows this pane now (all panes when wide, the active one when narrow).

        Read from the deck's classes rather than computed styles, which lag a class change by a
        refresh; the deck calls `pane_shown` as soon as it shows a pane.
        """
        deck = self.parent
        if deck is None:
            return True
        if deck.has_class("-narrow"):
            return self.has_class("-active")
        if deck.has_class("-split"):
            return self.id == "pane-pipeline" or self.has_class("-right")
        return True

    def render_when_shown(self) -> bool:
        """True if the pane is shown (render now); else remember to render on `pane_shown`.

        Panes fed at 1 Hz (GPUs, server) skip re-rendering while another tab is in front.
        """
        if self.shown:
            self._stale = False
            return True
        self._stale = True
        return False

    def pane_shown(self) -> None:
        """Called by the deck when this pane comes into view; renders what was skipped."""
        if self._stale and self.is_mounted:
            self._stale = False
            self.refresh_view()

    def refresh_view(self) -> None:
        """Render the pane from its current data (panes that skip hidden updates override it)."""
