"""Whole-number settings read from the environment. A bad value is refused with a ValueError naming the
variable and the fix, never replaced by the default: the operator set it for a reason."""

from __future__ import annotations

import os


def whole_number_from_env(name: str, default: int, high: int, what: str, unset: str, low: int = 1) -> int:
    """`name` if set (a whole number from `low` to `high`), else `default`. `what` names the kind of number
    ("a whole number of MiB"), `unset` what leaving it unset gives ("4,096 MiB")."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if raw.isdigit() and low <= int(raw) <= high:
        return int(raw)
    raise ValueError(f"{name}={raw!r} is not {what} from {low:,} to {high:,}: give one in that range, or unset it "
                     f"for {unset}")
