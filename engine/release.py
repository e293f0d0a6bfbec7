"""Releasing old extraction runs: the only place the console deletes hidden-state records.

Nothing is deleted automatically. A run is released only when the user asks for it by name,
and only when either a newer run is verified complete (every record re-hashed) or the user
typed the run's name to confirm. The run in use (extract.run) is never released.

Deletion is careful: the run directory must be a real directory (not a symlink) directly under
extract.output_dir holding run.json; it is first renamed to `<name>.releasing-<hex>` so a
half-deleted run never looks like a usable one, then emptied bottom-up without following any
symlink (a link is unlinked, never entered).
"""

from __future__ import annotations

import os
import re
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path

from engine.extract.layout import COMPLETE, RUN_LOCK
from engine.io.names import UnsafeNameError, check_name
from engine.records import RUN_META, RecordError, read_manifest, read_run_meta
from engine.registry import RECORD_READERS
from engine.errors import EngineError
from engine.system.disk import tree_bytes
from engine.io.jsonfile import read_json_object_or_none

RELEASING = re.compile(r"^(?P<run>.+)\.releasing-[0-9a-f]{8}$")


class ReleaseError(EngineError):
    """Why a run can't be described or released, with what to do instead."""


@dataclass(frozen=True)
class RunInfo:
    name: str
    path: Path
    records: int  # manifest entries
    bytes: int  # size of every file under the run directory (what releasing it frees)
    state: str  # "incomplete" | "complete" | "verified" | "damaged" | "releasing"
    created_at: float | None = None  # run.json created_at
    finished_at: float | None = None  # complete.json finished_at
    problems: tuple[str, ...] = field(default_factory=tuple)

    @property
    def since(self) -> float | None:
        """When this run's data was last made: finished if complete, else created."""
        return self.finished_at if self.finished_at is not None else self.created_at

    def to_dict(self) -> dict:
        return {"name": self.name, "path": str(self.path), "records": self.records, "bytes": self.bytes,
                "state": self.state, "created_at": self.created_at, "finished_at": self.finished_at,
                "problems": list(self.problems)}


# ----------------------------------------------------------------------------- describing


def output_dir_of(workspace) -> Path:
    return workspace.path(workspace.config.extract.output_dir)


def _checked_name(name: str) -> str:
    try:
        return check_name(name, "run name")
    except UnsafeNameError as exc:
        raise ReleaseError(str(exc)) from None


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _run_dir(output_dir: Path, name: str) -> Path:
    """The run's directory, refused unless it is a real directory holding run.json (or a tombstone)."""
    _checked_name(name)
    path = Path(output_dir) / name
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        runs = [r.name for r in _scan(output_dir)]
        known = f"; runs there: {', '.join(runs)}" if runs else "; there are no runs there"
        raise ReleaseError(f"no run {name!r} in {output_dir}{known}") from None
    if stat.S_ISLNK(mode):
        raise ReleaseError(f"{path} is a symlink (to {os.readlink(path)}): refusing to release through a link; "
                           "remove the link yourself if it is no longer needed")
    if not stat.S_ISDIR(mode):
        raise ReleaseError(f"{path} is a file, not an extraction run directory: nothing released")
    if RELEASING.match(name) is None and not (path / RUN_META).is_file():
        found = sorted(p.name for p in path.iterdir())[:5]
        raise ReleaseError(f"{path} has no {RUN_META}, so it is not an extraction run "
                           f"(it holds {', '.join(found) if found else 'nothing'}): nothing released")
    return path


def describe_run(output_dir: Path, name: str, verify: bool = False) -> RunInfo:
    """What the run holds. `verify` re-hashes every record (slow for big runs) to tell
    "verified" from "complete"; without it a finished run is "complete"."""
    path = _run_dir(output_dir, name)
    size = tree_bytes(path)
    if RELEASING.match(name):
        return RunInfo(name, path, 0, size, "releasing",
                       problems=("an earlier release was interrupted: release this name to finish it",))
    try:
        meta = read_run_meta(path)
    except RecordError as exc:
        meta, problems = {}, [str(exc)]
    else:
        problems = []
    entries, manifest_problems = read_manifest(path)
    problems += manifest_problems
    complete = read_json_object_or_none(path / COMPLETE)
    created = _number(meta.get("created_at"))
    if created is None:
        try:
            created = os.stat(path / RUN_META).st_mtime
        except OSError:
            created = None
    finished = _number(complete.get("finished_at")) if complete else None
    state = "complete" if complete is not None else "incomplete"
    if complete is not None and verify:
        problems += _verify_problems(path, complete)
        state = "damaged" if problems else "verified"
    return RunInfo(name, path, len(entries), size, state, created, finished, tuple(problems))


_VERIFIED: set[tuple] = set()  # runs this process re-hashed clean, keyed on what would change with them


def _signature(path: Path) -> tuple | None:
    """Inode, size and mtime of the manifest, complete.json and every record (stat is cheap, hashing is not)."""
    entries, _ = read_manifest(path)
    files = [path / "manifest.jsonl", path / COMPLETE] + [path / e.path for e in entries.values()]
    try:
        return (str(path),) + tuple((s.st_ino, s.st_size, s.st_mtime_ns) for s in map(os.stat, files))
    except OSError:
        return None


def _verify_problems(path: Path, complete: dict) -> list[str]:
    """Every record present and re-hashed, and as many good records as complete.json says.

    A clean result is remembered for this process only, so `data release` does not hash a
    terabyte twice (once to show it, once again before deleting)."""
    from engine.extract.verify import check_run

    signature = _signature(path)
    if signature is not None and signature in _VERIFIED:
        return []

    # Sizes and sha256 against the manifest; no tensor loading (shapes were checked when written,
    # and a matching hash means the same bytes), so no torch import and no 2x memory traffic.
    check = check_run(path, None, deep=True)
    problems = list(check.problems)
    expected = complete.get("samples")
    if not check.good:
        problems.append("no records")
    elif expected != len(check.good):
        problems.append(f"{len(check.good)} good records, complete.json says {expected}")
    if not problems and signature is not None:
        _VERIFIED.add(signature)
    return problems


def _scan(output_dir: Path) -> list[Path]:
    """Run directories (and interrupted releases) under output_dir, symlinks left out."""
    try:
        children = sorted(Path(output_dir).iterdir())
    except OSError:
        return []
    out = []
    for child in children:
        if child.is_symlink() or not child.is_dir():
            continue
        try:
            check_name(child.name)
        except UnsafeNameError:
            continue
        if (child / RUN_META).is_file() or RELEASING.match(child.name):
            out.append(child)
    return out


def list_runs(workspace, verify: bool = False) -> list[RunInfo]:
    """Every run under extract.output_dir, oldest first."""
    output_dir = output_dir_of(workspace)
    runs = []
    for child in _scan(output_dir):
        try:
            runs.append(describe_run(output_dir, child.name, verify=verify))
        except ReleaseError:
            continue  # vanished or changed while listing
    return sorted(runs, key=lambda r: (r.since is None, r.since or 0.0, r.name))


def newer_verified_run(workspace, name: str) -> RunInfo | None:
    """The newest other run finished after `name` was made, whose records all re-hash correctly."""
    output_dir = output_dir_of(workspace)
    target = describe_run(output_dir, name)
    since = target.since
    candidates: list[tuple[float, RunInfo]] = []
    for child in _scan(output_dir):
        if child.name == name or RELEASING.match(child.name):
            continue
        try:
            info = describe_run(output_dir, child.name)
        except ReleaseError:
            continue
        if info.state == "complete" and info.finished_at is not None and (since is None or info.finished_at > since):
            candidates.append((info.finished_at, info))
    for _, info in sorted(candidates, key=lambda c: c[0], reverse=True):  # hash the newest first
        try:
            checked = describe_run(output_dir, info.name, verify=True)
        except ReleaseError:
            continue
        if checked.state == "verified":
            return checked
    return None


# ----------------------------------------------------------------------------- releasing


def in_use_reason(workspace, name: str) -> str | None:
    """Why `name` must not be released now, or None."""
    cfg = workspace.config
    if name == cfg.extract.run:
        return (f"run {name!r} is the configured run (extract.run in {workspace.config_path}): extraction, "
                "training and evaluation use it. Set extract.run to another run first")
    from engine.workspace import WorkspaceLock

    run_lock = WorkspaceLock(output_dir_of(workspace) / name, RUN_LOCK)
    if run_lock.held_elsewhere():
        return (f"an extraction ({run_lock.holder_text('another process')}) is writing run {name!r}: "
                "stop it first, then release")
    from engine.jobs.manager import JobManager

    jobs = JobManager(workspace.jobs_dir)
    try:
        changed = os.stat(workspace.config_path).st_mtime
    except OSError:
        changed = float("inf")
    for kind in RECORD_READERS:
        for job in jobs.active(kind):
            started = job.started_at or job.created_at or 0.0
            if changed >= started:
                # The job read extract.run before the config last changed: it may use any run.
                return (f"{kind} job {job.id} is running and {workspace.config_path.name} changed since it "
                        f"started, so the run it reads can't be told. Wait for it to end (or stop it), then release")
    return None


def _remove_tree(root: Path) -> int:
    """Delete everything under `root` and `root` itself; links are unlinked, never followed."""
    freed = 0
    for dirpath, dirnames, filenames in os.walk(root, topdown=False, followlinks=False):
        for entry in filenames:
            path = os.path.join(dirpath, entry)
            st = os.lstat(path)
            os.unlink(path)
            freed += st.st_size
        for entry in dirnames:
            path = os.path.join(dirpath, entry)
            if os.path.islink(path):  # a link to a directory: remove the link only
                freed += os.lstat(path).st_size
                os.unlink(path)
            else:
                os.rmdir(path)
    os.rmdir(root)
    return freed


def release_run(workspace, name: str, *, confirmed_name: str | None, newer_ok: bool) -> int:
    """Delete run `name`; the bytes freed.

    Allowed when `confirmed_name == name` (the user typed it), or when `newer_ok` (the user
    accepted deleting because a newer run is verified) and such a run exists now.
    """
    output_dir = output_dir_of(workspace)
    path = _run_dir(output_dir, name)
    reason = in_use_reason(workspace, name)
    if reason:
        raise ReleaseError(f"not released: {reason}")
    if confirmed_name is not None and confirmed_name != name:
        raise ReleaseError(f"not released: the confirmation {confirmed_name!r} does not match the run name {name!r}")
    if confirmed_name is None:
        if not newer_ok:
            raise ReleaseError(f"not released: confirm by typing the run name {name!r}, "
                               "or release it once a newer run is verified complete")
        if RELEASING.match(name) is None and newer_verified_run(workspace, name) is None:
            raise ReleaseError(f"not released: no newer run is verified complete; confirm by typing the run "
                               f"name {name!r} to release it anyway")
    if RELEASING.match(name):
        tomb = path
    else:
        tomb = output_dir / f"{name}.releasing-{secrets.token_hex(4)}"
        os.rename(path, tomb)  # atomic, same directory: no half-deleted run keeps a usable name
    st = os.lstat(tomb)
    if not stat.S_ISDIR(st.st_mode):  # replaced under us between the check and the rename
        raise ReleaseError(f"{tomb} is not a directory any more: nothing deleted")
    try:
        return _remove_tree(tomb)
    except OSError as exc:
        raise ReleaseError(f"release of {name!r} stopped at {exc.filename}: {exc.strerror}. What is left is in "
                           f"{tomb}; fix the problem and run `eagle3-console data release {tomb.name}`") from None
