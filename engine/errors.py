"""The engine's errors: one base, and an exception as the one line a log, a reply or a pane has room for."""

from __future__ import annotations


class EngineError(Exception):
    """Base of every error the engine raises for a person to read: the message names the problem and
    the fix. Catch it where anything the engine refuses should become a clear message, not a traceback."""


def one_line(exc: BaseException) -> str:
    """`Type: first line of the message` (just `Type` when the message is empty)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")
