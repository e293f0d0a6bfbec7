"""Small text renderers shared by the panes: bars and levels, as Textual content markup.

Colours are theme variables ($success, $warning, ...) so every theme, light ones included,
colours them correctly.
"""

from __future__ import annotations

import math

from textual.markup import escape

from engine.jobs.manager import JobState

_EIGHTHS = " ▏▎▍▌▋▊▉"


def bar(fraction: float | None, width: int, colour: str = "$primary") -> str:
    """A `width`-cell bar in eighth-block resolution; unknown values (None, NaN, inf) render as a muted track."""
    width = max(1, width)
    if fraction is None or not math.isfinite(fraction):
        return f"[$text-muted]{'╌' * width}[/]"
    fraction = min(1.0, max(0.0, fraction))
    eighths = round(fraction * width * 8)
    if fraction > 0 and eighths == 0:
        eighths = 1  # anything above zero shows at least a sliver
    full, rest = divmod(eighths, 8)
    filled = "█" * full + (_EIGHTHS[rest] if rest else "")
    track = "·" * (width - len(filled))
    return f"[{colour}]{filled}[/][$text-muted]{track}[/]"


def level_colour(percent: float | None, warn: float, error: float) -> str:
    """$success below `warn`, $warning below `error`, else $error; muted when unknown (None, NaN, inf)."""
    if percent is None or not math.isfinite(percent):
        return "$text-muted"
    if percent >= error:
        return "$error"
    if percent >= warn:
        return "$warning"
    return "$success"


def clip(text: str, width: int) -> str:
    """`text` cut to `width` cells with an ellipsis (plain text; escape afterwards)."""
    if width <= 0:
        return ""
    return text if len(text) <= width else text[: max(0, width - 1)] + "…"


def esc(text: object) -> str:
    """Escape user or engine text for markup (paths may contain brackets)."""
    return escape(str(text))


def set_markup(widget, markup: str) -> bool:
    """`widget.update(markup)` only when the text differs; True if it changed.

    Each update re-parses the markup and re-runs layout; most polls (1 Hz) bring the same
    text again (a stopped server, no NVML, the same disk figures), and skipping those is most
    of what keeps the idle console cheap.
    """
    if widget.content == markup:
        return False
    widget.update(markup)
    return True


# A job state's theme colour (a theme variable name without `$`), the same in every pane.
# A stage's state and a check's status as one glyph (the checklist pane and the CLI's `status`).
STAGE_GLYPHS = {"passed": "✔", "warned": "!", "failed": "✘", "pending": "·", "running": "…", "stale": "?"}
STATUS_GLYPHS = {"pass": "✔", "warn": "!", "fail": "✘"}

JOB_STATE_COLOURS = {JobState.RUNNING: "success", JobState.STARTING: "warning", JobState.SUCCEEDED: "success",
                     JobState.FAILED: "error", JobState.LOST: "error", JobState.STOPPED: "warning"}


def job_state_colour(state: str) -> str:
    """`$variable` for markup; muted for a state with no colour (unknown)."""
    return "$" + JOB_STATE_COLOURS.get(state, "text-muted")  # type: ignore[call-overload]  # str enum: a str key finds it
