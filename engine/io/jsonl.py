"""Append-only JSONL files (events, metrics): one strict JSON object a line, read incrementally
while they are written."""

from __future__ import annotations

import json
import math
from typing import Any

# How a non-finite float is written: a string that float() reads back ("NaN", "Infinity",
# "-Infinity" are Python's spellings), so a line stays strict JSON and still says what the value was.
NONFINITE_TEXT = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


def finite_or_text(value: Any) -> Any:
    """`value` with every non-finite float (nested in dicts, lists and tuples) replaced by its text."""
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return NONFINITE_TEXT["nan" if math.isnan(value) else "inf" if value > 0 else "-inf"]
    if isinstance(value, dict):
        return {key: finite_or_text(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_text(item) for item in value]
    return value


def dumps_line(record: dict[str, Any], default=None) -> str:
    """One compact line of strict JSON (never bare NaN/Infinity, which JSON parsers reject)."""
    return json.dumps(finite_or_text(record), separators=(",", ":"), allow_nan=False, default=default)


def complete_objects(data: bytes) -> tuple[list[dict[str, Any]], int]:
    """JSON objects on the complete lines of `data`, and how many bytes those lines use.

    A last line without its newline is still being written: it is left for the next read.
    A complete line that is not a JSON object is skipped (it stays in the file). Bare
    NaN/Infinity (written by versions before dumps_line) are still read, as floats.
    """
    complete = data[: data.rfind(b"\n") + 1]
    objects: list[dict[str, Any]] = []
    for line in complete.splitlines():
        try:
            item = json.loads(line)
        except ValueError:
            continue
        if isinstance(item, dict):
            objects.append(item)
    return objects, len(complete)
