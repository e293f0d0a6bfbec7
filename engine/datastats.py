"""Cached dataset statistics (written by the `dataset` stage, read by `disk` for the budget)."""

from __future__ import annotations

import json
from typing import Any

STATS_FILE = "dataset_stats.json"


def load_cached_stats(workspace) -> dict[str, Any] | None:
    path = workspace.state_dir / STATS_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("total_tokens_after_truncation"), int):
        return None
    return data
