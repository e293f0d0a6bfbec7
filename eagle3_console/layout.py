"""The pane deck: one tab at a time on narrow terminals, all six in a grid on wide ones.

Both layouts use the same six pane widgets, so switching on resize keeps every pane's
state (cursor, scroll, last sample). Textual's TabbedContent is not used because its
ContentSwitcher hides inactive panes with inline styles and re-activates a tab whenever a
pane gains focus, which fights an all-panes-visible grid; a `Tabs` bar over this deck gives
the same keys and looks without that conflict.
"""

from __future__ import annotations

from textual.containers import Container

WIDE_MIN_COLUMNS = 160


class PaneDeck(Container):
    """Holds the panes. Class `-narrow`: only the `-active` pane shows; `-wide`: a 3×2 grid.

    Wide order (compose order): GPUs, Server, Pipeline / Extraction, Training, Evaluation.
    """

    DEFAULT_CSS = """
    PaneDeck { height: 1fr; }
    PaneDeck.-narrow > .pane { display: none; }
    PaneDeck.-narrow > .pane.-active { display: block; }
    PaneDeck.-wide {
        layout: grid;
        grid-size: 3 2;
        grid-columns: 1fr 1fr 1fr;
        grid-rows: 1fr 1fr;
    }
    """

    def set_wide(self, wide: bool) -> None:
        self.set_class(wide, "-wide")
        self.set_class(not wide, "-narrow")
        self._tell_shown()

    @property
    def wide(self) -> bool:
        return self.has_class("-wide")

    def activate(self, pane_id: str) -> None:
        for pane in self._panes():
            pane.set_class(pane.id == f"pane-{pane_id}", "-active")
        self._tell_shown()

    def _tell_shown(self) -> None:
        """Let panes that skipped updates while hidden catch up now that they show."""
        for pane in self._panes():
            if pane.shown:
                pane.pane_shown()

    def _panes(self) -> list:
        """The panes: the deck's own children (cheaper than a selector query over all widgets)."""
        return [child for child in self.children if child.has_class("pane")]
