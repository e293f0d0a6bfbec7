"""The pane deck: three layouts over the same seven pane widgets, chosen by terminal width.

- below 120 columns (`-narrow`): one pane at a time under a tab bar (keys 1-7);
- 120-199 (`-split`): two columns, Pipeline always on the left and the chosen pane on the right;
- 200 and more (`-wide`): every pane at once in a grid whose top row (GPUs, Server, Extraction)
  is as tall as its content and whose lower rows share the rest (Pipeline runs down the left).

Switching on resize keeps every pane's state (cursor, scroll, last sample). Textual's
TabbedContent is not used because its ContentSwitcher hides inactive panes with inline styles
and re-activates a tab whenever a pane gains focus, which fights the grid; a `Tabs` bar over
this deck gives the same keys and looks without that conflict.
"""

from __future__ import annotations

from textual.containers import Container

SPLIT_MIN_COLUMNS = 120
WIDE_MIN_COLUMNS = 200
TOP_ROW = ("gpus", "server", "extraction")


def layout_for(width: int) -> str:
    if width >= WIDE_MIN_COLUMNS:
        return "wide"
    if width >= SPLIT_MIN_COLUMNS:
        return "split"
    return "narrow"


class PaneDeck(Container):
    """Holds the panes; class `-narrow`, `-split` or `-wide` picks the layout."""

    DEFAULT_CSS = """
    PaneDeck { height: 1fr; }
    PaneDeck.-narrow > .pane { display: none; }
    PaneDeck.-narrow > .pane.-active { display: block; }
    PaneDeck.-split { layout: horizontal; }
    PaneDeck.-split > .pane { display: none; width: 1fr; }
    PaneDeck.-split > .pane.-right { display: block; }
    PaneDeck.-split > #pane-pipeline { display: block; width: 1fr; }
    PaneDeck.-wide {
        layout: grid;
        grid-size: 3 3;
        grid-columns: 1fr 1fr 1fr;
        grid-rows: auto 1fr 1fr;
    }
    PaneDeck.-wide > .pane-top { height: auto; max-height: 24; }
    PaneDeck.-wide #server-log { height: auto; max-height: 6; }
    PaneDeck.-wide #extract-scroll { height: auto; max-height: 20; }
    PaneDeck.-wide #gpu-scroll { height: auto; max-height: 22; }
    PaneDeck.-wide > #pane-pipeline { row-span: 2; }
    PaneDeck.-wide > #pane-evaluation { column-span: 2; }
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.right = "jobs"  # what the split layout shows beside Pipeline

    def set_layout(self, name: str) -> None:
        for other in ("narrow", "split", "wide"):
            self.set_class(other == name, f"-{other}")
        self._order()
        self._tell_shown()

    def set_wide(self, wide: bool) -> None:  # kept for callers of the two-layout deck
        self.set_layout("wide" if wide else "narrow")

    @property
    def layout_name(self) -> str:
        return next((n for n in ("narrow", "split", "wide") if self.has_class(f"-{n}")), "narrow")

    @property
    def wide(self) -> bool:
        """More than one pane shows at once (split or wide)."""
        return self.layout_name != "narrow"

    def activate(self, pane_id: str) -> None:
        if pane_id != "pipeline":
            self.right = pane_id
        for pane in self._panes():
            pane.set_class(pane.id == f"pane-{pane_id}", "-active")
            pane.set_class(pane.id == f"pane-{self.right}", "-right")
        self._tell_shown()

    def _order(self) -> None:
        """Grid order for the wide layout; compose order otherwise (same set of children)."""
        for pane in self._panes():
            pane.set_class(pane.id.removeprefix("pane-") in TOP_ROW, "pane-top")
        if self.layout_name == "wide":
            wanted = ["gpus", "server", "extraction", "pipeline", "training", "jobs", "evaluation"]
        elif self.layout_name == "split":  # Pipeline on the left
            wanted = ["pipeline", "gpus", "server", "extraction", "training", "evaluation", "jobs"]
        else:
            wanted = ["gpus", "server", "pipeline", "extraction", "training", "evaluation", "jobs"]
        panes = {p.id.removeprefix("pane-"): p for p in self._panes()}
        ordered = [panes[name] for name in wanted if name in panes]
        if ordered and list(self._panes()) != ordered:
            for pane in ordered[1:]:
                self.move_child(pane, after=ordered[ordered.index(pane) - 1])

    def _tell_shown(self) -> None:
        """Let panes that skipped updates while hidden catch up now that they show."""
        for pane in self._panes():
            if pane.shown:
                pane.pane_shown()

    def _panes(self) -> list:
        """The panes: the deck's own children (cheaper than a selector query over all widgets)."""
        return [child for child in self.children if child.has_class("pane")]
