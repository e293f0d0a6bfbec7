"""Training checkpoints: `<drafter_dir>/checkpoints/step-NNNNNNNN/state.pt`, pointers
`latest.json` and `best.json`, all written atomically. Retention: the last two periodic
checkpoints and the best one are kept; older periodic ones are superseded and removed. Besides
those, only the temp files of a save that was killed midway are ever deleted."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import torch

from engine import atomic

CKPT_DIR = "checkpoints"
LATEST = "latest.json"
BEST = "best.json"
STATE = "state.pt"
KEEP_LAST = 2
TRAIN_LOCK = ".train.lock"  # flock held by the one training writing this drafter directory


def ckpt_root(drafter_dir: Path) -> Path:
    return Path(drafter_dir) / CKPT_DIR


def sweep_dead_temp_files(drafter_dir: Path) -> int:
    """Remove what a training killed mid-save left: temp files (a checkpoint's is as big as the
    optimizer state) and the step directories they leave empty. Nothing there was ever named by
    latest.json. Call with TRAIN_LOCK held."""
    root = Path(drafter_dir)
    removed = atomic.remove_dead_temp_files(root, [".", CKPT_DIR, f"{CKPT_DIR}/step-*", "export"])
    for step_dir in root.glob(f"{CKPT_DIR}/step-*"):
        try:
            step_dir.rmdir()  # only succeeds when empty
        except OSError:
            pass
    return removed


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def latest(drafter_dir: Path) -> dict | None:
    return _read(ckpt_root(drafter_dir) / LATEST)


def best(drafter_dir: Path) -> dict | None:
    return _read(ckpt_root(drafter_dir) / BEST)


def save(drafter_dir: Path, step: int, state: dict) -> Path:
    root = ckpt_root(drafter_dir)
    path = root / f"step-{step:08d}"
    buffer = io.BytesIO()
    torch.save(state, buffer)
    atomic.write_bytes(path / STATE, buffer.getvalue())
    atomic.write_json(root / LATEST, {"step": step, "path": path.name})
    return path


def mark_best(drafter_dir: Path, step: int, sim_al: float) -> None:
    atomic.write_json(ckpt_root(drafter_dir) / BEST, {"step": step, "path": f"step-{step:08d}", "sim_al": sim_al})


def load(drafter_dir: Path, name: str | None = None) -> dict:
    root = ckpt_root(drafter_dir)
    name = name or (latest(drafter_dir) or {}).get("path")
    if not name:
        raise FileNotFoundError(f"no checkpoint in {root}")
    with open(root / name / STATE, "rb") as handle:
        return torch.load(handle, map_location="cpu", weights_only=False)


def prune(drafter_dir: Path) -> list[str]:
    """Remove periodic checkpoints superseded by the last two, never the best or the latest."""
    root = ckpt_root(drafter_dir)
    keep = {(best(drafter_dir) or {}).get("path"), (latest(drafter_dir) or {}).get("path")}
    steps = sorted(p.name for p in root.glob("step-*") if (p / STATE).is_file())
    keep.update(steps[-KEEP_LAST:])
    removed = []
    for name in steps:
        if name not in keep:
            shutil.rmtree(root / name)
            removed.append(name)
    return removed
