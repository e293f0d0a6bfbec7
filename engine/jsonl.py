"""Reading append-only JSONL files (events, metrics) incrementally while they are written."""

from __future__ import annotations

import json
from typing import Any


def complete_objects(data: bytes) -> tuple[list[dict[str, Any]], int]:
    """JSON objects on the complete lines of `data`, and how many bytes those lines use.

    A last line without its newline is still being written: it is left for the next read.
    A complete line that is not a JSON object is skipped (it stays in the file).
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
