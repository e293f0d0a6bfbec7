"""Exceptions as the one line a log, a reply or a pane has room for."""

from __future__ import annotations


def one_line(exc: BaseException) -> str:
    """`Type: first line of the message` (just `Type` when the message is empty)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")
