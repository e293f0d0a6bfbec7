"""The console's key scheme: ONE table, from which the bindings, the footer, `?` and the README's
key list are all derived.

Rules the table keeps (tests/test_console_keys.py checks them):
- navigation keys (vim `j`/`k`, `g`/`G`, arrows) only move; none starts or stops anything;
- `s` starts (or resumes) and `S` stops (asks first) in every pane that has something to start
  or stop: the server, the selected stage's job, extraction, training, evaluation, the selected job;
- starting a long job (extract, train, evaluate) asks first, with its estimated duration and disk need;
- a key that changes something (`mutates`) is neither shown nor accepted by a read-only console.
"""

from __future__ import annotations

from dataclasses import dataclass

from eagle3_console.tabs import TABS
from engine.registry import STAGE_PANES

# Panes, by tab id. "" in `panes` means: every pane.
EVERYWHERE: tuple[str, ...] = ()
# The checklist and every pane that follows a stage's job (engine.registry), in tab order.
JOB_PANES = tuple(tab for tab, _ in TABS if tab == "pipeline" or tab in STAGE_PANES.values())


@dataclass(frozen=True)
class Key:
    key: str  # Textual key name
    action: str  # app action ("" for keys a widget handles: navigation)
    label: str  # footer label
    help: str  # one line for `?`
    panes: tuple[str, ...] = EVERYWHERE  # where it applies (its footer shows it only there)
    mutates: bool = False  # changes jobs, the server or files: refused by a read-only console
    show: bool = True  # in the footer
    display: str = ""  # how `?` and the footer write the key ("" = the key itself)

    @property
    def shown_key(self) -> str:
        return self.display or self.key


KEYS: tuple[Key, ...] = (
    # -- everywhere
    Key("q", "quit", "Quit", "close the console — jobs keep running; open it again to re-attach"),
    Key("question_mark", "help", "Help", "this help (Esc closes)", display="?"),
    Key("t", "cycle_theme", "Theme", "next theme (saved in console.toml ui.theme)", show=False),
    Key("r", "run_selected", "Check", "run the selected stage's checks", panes=("pipeline",)),
    Key("R", "run_all", "Check all", "run every stage's checks in order", panes=("pipeline",)),
    *(Key(str(i), f"show_tab('{tab}')", label, f"show the {label} pane", show=False)
      for i, (tab, label) in enumerate(TABS, start=1)),
    # -- start / stop: the same keys in every pane
    Key("s", "start", "Start", "start or resume this pane's job (server, selected stage, extract, train, "
        "evaluate); a long job asks first with its estimated time and disk need", panes=JOB_PANES, mutates=True),
    Key("S", "stop", "Stop", "stop this pane's job or the selected job (asks first; jobs checkpoint)",
        panes=(*JOB_PANES, "jobs"), mutates=True),
    # -- pane keys
    Key("a", "apply_settings", "Apply", "restart the server so it runs with console.toml as it is now (asks "
        "first, naming what differs)", panes=("server",), mutates=True),
    Key("p", "toggle_pause", "Pause", "pause / resume extraction after the requests in flight",
        panes=("extraction",), mutates=True),
    Key("c", "next_curve", "Curve", "next training curve (loss → accuracy → acceptance length)",
        panes=("training",)),
    Key("u", "reload_evaluation", "Reload", "read the evaluation report again", panes=("evaluation",)),
    Key("d", "stacks", "Stacks", "the selected running job writes every thread's stack to its log",
        panes=("jobs",)),
    Key("slash", "search", "Filter", "filter the list in focus (stages, jobs) or search the focused log "
        "(Enter applies, Esc clears)", panes=("pipeline", "jobs"), display="/"),
    Key("n", "search_next", "Next", "next match of the search", panes=("jobs",), show=False),
    Key("N", "search_previous", "Prev", "previous match of the search", panes=("jobs",), show=False),
    Key("f", "follow", "Follow", "follow the log's end on / off", panes=("jobs",)),
)

# Navigation: handled by the focused list or detail area, never by an app action.
NAVIGATION: tuple[tuple[str, str], ...] = (
    ("j / ↓", "down (lists and detail areas; never starts anything)"),
    ("k / ↑", "up"),
    ("g / G", "top / bottom"),
    ("PgUp/PgDn", "a page up / down"),
    ("Tab", "next area: a list, then its detail (scroll it with the keys above)"),
    ("Enter", "Pipeline: run the highlighted stage's checks"),
    ("←/→", "previous / next tab (when the tab bar has focus)"),
    ("Ctrl+P", "command palette: every action by name, and all themes"),
)

BY_ACTION = {k.action: k for k in KEYS}


def key_for(action: str) -> Key | None:
    return BY_ACTION.get(action)


def bindings():
    """Textual bindings for the app, from the table."""
    from textual.binding import Binding

    return [Binding(k.key, k.action, k.label, show=k.show, key_display=k.display or None,
                    tooltip=k.help, id=f"key-{k.key}") for k in KEYS]


def nav_bindings():
    """vim keys for a list or a scrolling area (added to those widgets' own BINDINGS)."""
    from textual.binding import Binding

    return [Binding("j", "cursor_down", "Down", show=False), Binding("k", "cursor_up", "Up", show=False),
            Binding("g", "scroll_top", "Top", show=False), Binding("G", "scroll_bottom", "Bottom", show=False)]


def scroll_bindings():
    """vim keys for a scrolling detail area."""
    from textual.binding import Binding

    return [Binding("j", "scroll_down", "Down", show=False), Binding("k", "scroll_up", "Up", show=False),
            Binding("g", "scroll_home", "Top", show=False), Binding("G", "scroll_end", "Bottom", show=False)]


def help_lines(read_only: bool = False) -> list[str]:
    """The `?` screen, as markup lines, from the table (a read-only console omits what it cannot do)."""
    from eagle3_console.render import esc

    labels = dict(TABS)
    tabs = " · ".join(label for _tab, label in TABS)
    lines = ["[b]eagle3-console keys[/b]   (the mouse works too; it is never needed)", ""]
    if read_only:
        lines += ["[$warning]Read-only: keys that start, stop or pause are off in this console.[/]", ""]
    lines += [
             f"  [b]{'1-' + str(len(TABS)):<10}[/b]{tabs}"]
    for key in KEYS:
        if key.panes or key.action.startswith("show_tab") or (read_only and key.mutates):
            continue
        lines.append(f"  [b]{esc(key.shown_key):<10}[/b]{esc(key.help)}")
    lines += ["", "[b]Moving[/b]"]
    lines += [f"  [b]{esc(k):<10}[/b]{esc(text)}" for k, text in NAVIGATION]
    lines += ["", "[b]In panes[/b] (shown in the footer while the pane is active)"]
    for key in KEYS:
        if not key.panes or (read_only and key.mutates):
            continue
        where = "all job panes" if set(JOB_PANES) <= set(key.panes) else ", ".join(labels[p] for p in key.panes)
        lines.append(f"  [b]{esc(key.shown_key):<10}[/b]{esc(key.help)} [$text-muted]({esc(where)})[/]")
    lines += ["", "[b]Questions[/b]  [b]y[/b] yes   [b]n[/b] / [b]Esc[/b] no (Enter never confirms)"]
    lines += ["", "A stage turns green only when its checks pass now; its detail area",
              "shows what each check measured and how to fix a failure.",
              "The top strip sums up server, stages, the running job, disks and GPUs.",
              "The console closes by itself if its terminal goes away (SSH drop);",
              "[b]jobs keep running[/b] and the next console re-attaches."]
    return lines
