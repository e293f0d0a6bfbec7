"""Training checkpoints: `<drafter_dir>/checkpoints/step-NNNNNNNN/state.pt`, pointers
`latest.json` and `best.json`, all written atomically. Retention: the last two periodic
checkpoints and the best one are kept; older periodic ones are superseded and removed. Besides
those, only the temp files of a save that was killed midway are ever deleted.

Integrity: beside each state.pt, `manifest.json` holds its sha256 and size, written atomically after
it (and before latest.json names the step). `load` re-hashes the file and checks every model weight
finite, and raises CheckpointError naming the file and the problem instead of handing back damaged
values (torch.load alone takes a file with 4 KiB zeroed in it and returns changed numbers). A
checkpoint without a manifest (saved by an older version) loads unsigned: `load_checked` says so.
A save refuses non-finite model weights."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import torch

from engine.io import atomic
from engine.records import all_finite, sha256_and_size, sha256_of
from engine.errors import EngineError

CKPT_DIR = "checkpoints"
LATEST = "latest.json"
BEST = "best.json"
STATE = "state.pt"
MANIFEST = "manifest.json"  # {"file": "state.pt", "sha256", "bytes", "step"} beside each state.pt
KEEP_LAST = 2
TRAIN_LOCK = ".train.lock"  # flock held by the one training writing this drafter directory


class CheckpointError(EngineError):
    """A checkpoint that must not be trained from (or saved): the message names the file and why."""


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


def nonfinite_weights(model_state: dict) -> dict[str, tuple[int, int]]:
    """{name: (non-finite values, values)} of the floating tensors in a model state dict that hold any."""
    counts = {}
    for name, tensor in model_state.items():
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and not all_finite(tensor):
            counts[name] = (int((~torch.isfinite(tensor)).sum()), tensor.numel())
    return counts


def _describe(counts: dict[str, tuple[int, int]]) -> str:
    total = sum(bad for bad, _ in counts.values())
    worst = sorted(counts.items(), key=lambda item: -item[1][0])[:3]
    return f"{total:,} non-finite model weights (" + ", ".join(f"{n} {b:,} of {v:,}" for n, (b, v) in worst) + ")"


def save(drafter_dir: Path, step: int, state: dict) -> Path:
    """state.pt, then its manifest.json (sha256), then latest.json; refuses non-finite model weights."""
    root = ckpt_root(drafter_dir)
    path = root / f"step-{step:08d}"
    counts = nonfinite_weights(state.get("model") or {})
    if counts:
        raise CheckpointError(f"checkpoint of step {step} not saved: {_describe(counts)}")
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getvalue()
    # An older manifest.json of this step stays until the new one replaces it: a save killed in
    # between leaves a state.pt that does not match it (refused), never one that reads as unsigned.
    atomic.write_bytes(path / STATE, data)
    atomic.write_json(path / MANIFEST, {"file": STATE, "sha256": sha256_of(data), "bytes": len(data), "step": step})
    atomic.write_json(root / LATEST, {"step": step, "path": path.name})
    return path


def mark_best(drafter_dir: Path, step: int, sim_al: float) -> None:
    atomic.write_json(ckpt_root(drafter_dir) / BEST, {"step": step, "path": f"step-{step:08d}", "sim_al": sim_al})


def verify(drafter_dir: Path, name: str) -> tuple[str | None, bool]:
    """(problem, signed) for checkpoint `name` by its bytes: problem None when state.pt is there and,
    if a manifest.json vouches for it, hashes to it; signed when it does."""
    directory = ckpt_root(drafter_dir) / name
    path = directory / STATE
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except FileNotFoundError:
        manifest = None
    except (OSError, ValueError) as exc:
        return f"{directory / MANIFEST} unreadable ({exc}): nothing vouches for {path}", False
    try:
        digest, size = sha256_and_size(str(path))
    except FileNotFoundError:
        return f"{path} missing", False
    except OSError as exc:
        return f"{path} unreadable ({exc})", False
    if manifest is None:
        return None, False
    if not isinstance(manifest, dict) or "sha256" not in manifest or not isinstance(manifest.get("bytes"), int):
        return f"{directory / MANIFEST} holds no sha256 and size: nothing vouches for {path}", False
    if digest != manifest["sha256"]:
        return (f"{path}: sha256 {digest[:12]}… ({size:,} bytes) is not the {str(manifest['sha256'])[:12]}… "
                f"({manifest['bytes']:,} bytes) written beside it when it was saved: the file changed "
                "since (damaged on disk or overwritten)"), False
    return None, True


def load_checked(drafter_dir: Path, name: str | None = None) -> tuple[dict, bool]:
    """(state, signed) of checkpoint `name` (default: latest.json's), verified: CheckpointError when its
    bytes differ from its manifest, it cannot be read, or a model weight is not finite;
    FileNotFoundError when there is no checkpoint at all."""
    root = ckpt_root(drafter_dir)
    name = name or (latest(drafter_dir) or {}).get("path")
    if not name:
        raise FileNotFoundError(f"no checkpoint in {root}")
    problem, signed = verify(drafter_dir, name)
    if problem:
        raise CheckpointError(problem)
    path = root / name / STATE
    try:
        with open(path, "rb") as handle:
            state = torch.load(handle, map_location="cpu", weights_only=False)
    except Exception as exc:  # a damaged zip or pickle: torch raises many types
        raise CheckpointError(f"{path} unreadable ({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        raise CheckpointError(f"{path} holds no model state")
    counts = nonfinite_weights(state["model"])
    if counts:
        raise CheckpointError(f"{path} holds {_describe(counts)}")
    return state, signed


def load(drafter_dir: Path, name: str | None = None) -> dict:
    """The verified state of checkpoint `name` (default: the latest); see load_checked."""
    return load_checked(drafter_dir, name)[0]


def candidates(drafter_dir: Path) -> list[str]:
    """Step directories holding a state.pt, newest first."""
    root = ckpt_root(drafter_dir)
    return sorted((p.name for p in root.glob("step-*") if (p / STATE).is_file()), reverse=True)


def prune(drafter_dir: Path) -> list[str]:
    """Remove periodic checkpoints superseded by the last two up to the latest, never the best or the
    latest. Ones newer than the latest (left by a run that resumed from an older checkpoint, when the
    newer one was refused as damaged) are not counted among the last two, nor removed: training replaces
    them when it reaches their step."""
    root = ckpt_root(drafter_dir)
    last = latest(drafter_dir) or {}
    keep = {(best(drafter_dir) or {}).get("path"), last.get("path")}
    steps = sorted(p.name for p in root.glob("step-*") if (p / STATE).is_file())
    if last.get("path") in steps:
        keep.update(name for name in steps if name > last["path"])
        steps = [name for name in steps if name <= last["path"]]
    keep.update(steps[-KEEP_LAST:])
    removed = []
    for name in steps:
        if name not in keep:
            shutil.rmtree(root / name)
            removed.append(name)
    return removed
