"""Number formats shared by the live panes: durations, counts, rates (plain text)."""

from __future__ import annotations

import math


def finite(value) -> float | None:
    """`value` as a finite float, else None (missing, not a number, NaN or inf: nothing to compute with)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def fmt_duration(seconds: float | int | None) -> str:
    """61 -> "1m01s", 3720 -> "1h02m", 200000 -> "2d07h"; None, NaN, inf -> "?"."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def fmt_count(n: float | int | None) -> str:
    """1234 -> "1.2k", 12_345_678 -> "12.3M"; None -> "?"; NaN -> "NaN", inf -> "inf"."""
    if n is None:
        return "?"
    n = float(n)
    if not math.isfinite(n):
        return "NaN" if math.isnan(n) else "inf" if n > 0 else "-inf"
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}" if n == int(n) else f"{n:.1f}"


def fmt_num(value, digits: int = 2) -> str:
    """A float with `digits` decimals ("nan", "inf" for those), or "?" when missing or not a number."""
    try:
        return f"{float(value):.{digits}f}"
    except (TypeError, ValueError):
        return "?"
