"""What a Textual app shows, as text, and waiting for it under Pilot."""

from __future__ import annotations

import html
import re
import time
from typing import Any, Callable


def screen_lines(app: Any) -> list[str]:
    """The screen as plain text lines, rebuilt from the SVG screenshot (what a user sees)."""
    svg = app.export_screenshot()
    rows: dict[float, list[tuple[float, str]]] = {}
    for x, y, text in re.findall(r'<text [^>]*x="([\d.]+)" y="([\d.]+)"[^>]*>([^<]*)</text>', svg):
        rows.setdefault(float(y), []).append((float(x), html.unescape(text).replace("\xa0", " ")))
    lines = []
    for y in sorted(rows):
        line = ""
        for x, text in sorted(rows[y]):
            col = round(x / 12.2)
            line = line.ljust(col) + text
        lines.append(line)
    return lines


def screen_text(app: Any) -> str:
    return "\n".join(screen_lines(app))


async def wait_until(pilot: Any, predicate: Callable[[], Any], timeout: float = 10.0,
                     what: str | Callable[[], str] = "condition") -> None:
    """Let the app run until `predicate()` is true; fail naming `what` (a callable is asked at
    the failure, to show the state then) after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        await pilot.pause(0.05)
    assert predicate(), f"{what() if callable(what) else what} not reached in {timeout:.0f} s"
