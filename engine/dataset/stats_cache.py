"""Cached dataset statistics (written by the `dataset` stage, read by `disk` for the budget).

`<ws>/state/dataset_stats.json` records which file it describes (resolved path, mtime in
ns, size) and the max_seq_len and model it was counted with. A cache whose file, length
limit or model no longer match the workspace is stale and ignored: the disk budget then
falls back to an estimate instead of trusting numbers about another file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from engine.io import atomic

STATS_FILE = "dataset_stats.json"


def file_fingerprint(path: Path | str) -> dict[str, Any]:
    """Identity of a file's current content, cheap to recompute: resolved path, mtime (ns), size."""
    resolved = Path(path).expanduser().resolve()
    st = os.stat(resolved)
    return {"path": str(resolved), "mtime_ns": st.st_mtime_ns, "size": st.st_size}


def write_stats(workspace, data: dict[str, Any]) -> Path:
    path = workspace.state_dir / STATS_FILE
    atomic.write_json(path, data)
    return path


def _matches(workspace, data: dict[str, Any]) -> bool:
    try:
        config = workspace.config
        current = file_fingerprint(workspace.path(config.dataset.path))
    except Exception:  # no config, no dataset file: nothing the cache could describe
        return False
    if data.get("dataset") != current:
        return False
    if data.get("max_seq_len") != config.dataset.max_seq_len:
        return False
    model = str(workspace.model_dir) if config.model.path else ""
    return data.get("model_path", model) == model


def load_cached_stats(workspace) -> dict[str, Any] | None:
    """The stats the `dataset` stage wrote, or None when missing, damaged or stale."""
    path = workspace.state_dir / STATS_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("total_tokens_after_truncation"), int):
        return None
    if not _matches(workspace, data):
        return None
    return data
