"""Validation of names that become file or directory names (run names, request ids, job ids)."""

from __future__ import annotations

import re
from engine.errors import EngineError

_SAFE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class UnsafeNameError(EngineError, ValueError):
    pass


def check_name(name: str, what: str = "name") -> str:
    """Return `name` if it is safe as a single path component, else raise UnsafeNameError.

    Allowed: letters, digits, '.', '_', '-', starting with a letter or digit, at most 128
    characters; no '..' so nothing can climb out of its directory.
    """
    if not isinstance(name, str) or not _SAFE.match(name) or ".." in name:
        raise UnsafeNameError(
            f"invalid {what} {name!r}: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit, without '..'"
        )
    return name


def is_safe_name(name: str) -> bool:
    try:
        check_name(name)
    except UnsafeNameError:
        return False
    return True
