"""The help screen (`?`): every key, and what quitting does to jobs."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

HELP_TEXT = """\
[b]eagle3-console keys[/b]   (mouse works too; it is never needed)

  [b]1-6[/b]     GPUs · Server · Pipeline · Extraction · Training · Evaluation
  [b]←/→[/b]     previous / next tab (when the tab bar has focus)
  [b]Tab[/b]     next focusable area (scroll a pane with ↑/↓ PgUp/PgDn)
  [b]t[/b]       next theme (saved in console.toml ui.theme)
  [b]Ctrl+P[/b]  command palette: every action by name, and all themes
  [b]?[/b]       this help (Esc closes)
  [b]q[/b]       close the console — [b]jobs keep running[/b];
          open the console again to re-attach

[b]Pipeline[/b] (3)
  [b]↑/↓[/b]     move through the stages
  [b]Enter[/b]   run the checks of the highlighted stage
  [b]r[/b] / [b]R[/b]   run the selected stage's checks / all checks in order
  [b]j[/b]       start the stage's job: server start, extract, train, evaluate

[b]Server[/b] (2)       [b]s[/b] start   [b]S[/b] stop (asks first)
[b]Extraction[/b] (4)   [b]x[/b] start/resume   [b]p[/b] pause/resume   [b]X[/b] stop (asks)
[b]Training[/b] (5)     [b]T[/b] start/resume   [b]K[/b] stop (asks)   [b]c[/b] next curve
[b]Evaluation[/b] (6)   [b]l[/b] read the report again
[b]Questions[/b]        [b]y[/b] yes   [b]n[/b] / [b]Esc[/b] no (Enter never confirms)

A stage turns green only when its checks pass now; the detail area
shows what each check measured and how to fix a failure.
Pane keys show in the footer while their pane is active.
On terminals of 160 columns or more, all six panes show at once.
The console closes by itself if its terminal goes away (SSH drop);
jobs keep running and the next console re-attaches."""


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
