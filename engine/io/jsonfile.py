"""Reading one JSON document that must be an object (job records, reports), with one clear error."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json_object(path: Path, error: type[Exception], what: str, fix: str = "") -> dict[str, Any]:
    """The object in `path`, or `error`: "no <what> at <path>", "<what> <path> is unreadable
    (...)", "<what> <path> is not a JSON object" — each followed by `fix` (e.g. "; rerun X")."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise error(f"no {what} at {path}") from None
    except (OSError, ValueError) as exc:
        raise error(f"{what} {path} is unreadable ({exc}){fix}") from None
    if not isinstance(data, dict):
        raise error(f"{what} {path} is not a JSON object{fix}")
    return data


def read_json_object_or_none(path: Path) -> dict[str, Any] | None:
    """The object in `path`, or None when it is missing, unreadable or not an object (optional markers)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
