"""Segments an earlier server left in a spool nobody reads any more.

Extraction requests carry rids `x<index>-<tag>-a<attempt>`; every extraction session appends its
tag to `<run>/spool_sessions.txt`. When the spool moves (`extract.spool_dir` changed, server
restarted), captures of this workspace's sessions that the old server wrote and nobody released
stay in the old spool for good (often tmpfs: memory). `sweep(workspace, spool)` removes them.

Only this workspace's sessions are touched (a spool may be shared by several workspaces), and
never the session of an extraction that runs now: a run whose lock (`.extract.lock`) a live
process holds keeps its newest session's segments.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

RID = re.compile(r"^x\d+-([0-9a-f]{6})-a\d+$")
HISTORY = 8  # spools of earlier servers the record remembers


@dataclass(frozen=True)
class Swept:
    folders: int = 0
    files: int = 0
    bytes: int = 0

    def __add__(self, other: Swept) -> Swept:
        return Swept(self.folders + other.folders, self.files + other.files, self.bytes + other.bytes)


def session_tags(run_dir: Path) -> list[str]:
    from engine.extract.layout import SPOOL_SESSIONS

    try:
        return (Path(run_dir) / SPOOL_SESSIONS).read_text(encoding="utf-8").split()
    except OSError:
        return []


def run_is_live(run_dir: Path) -> bool:
    """A live process holds the run's extraction lock."""
    from engine.extract.layout import RUN_LOCK
    from engine.workspace import WorkspaceLock

    if not (Path(run_dir) / RUN_LOCK).exists():
        return False
    return WorkspaceLock(Path(run_dir), RUN_LOCK).held_elsewhere()


def dead_tags(workspace) -> set[str]:
    """Session tags of this workspace's extraction runs that no live extraction owns."""
    output = workspace.path(workspace.config.extract.output_dir)
    tags: set[str] = set()
    live: set[str] = set()
    try:
        runs = [p for p in output.iterdir() if p.is_dir()]
    except OSError:
        return set()
    for run in runs:
        found = session_tags(run)
        if not found:
            continue
        tags.update(found)
        if run_is_live(run):
            live.add(found[-1])  # the running session's tag (appended when it started)
    return tags - live


def sweep(spool: Path | str, tags: set[str]) -> Swept:
    """Release every rid folder in `spool` of the sessions `tags`; what was removed."""
    from engine.capture.segments import SegmentError, release

    spool = Path(spool)
    total = Swept()
    if not tags or not spool.is_dir():
        return total
    try:
        entries = list(spool.iterdir())
    except OSError:
        return total
    for entry in entries:
        match = RID.match(entry.name)
        if not match or match.group(1) not in tags or entry.is_symlink() or not entry.is_dir():
            continue
        try:
            size = sum(f.stat().st_size for f in entry.iterdir() if f.is_file())
            files = release(spool, entry.name)
        except (SegmentError, OSError):
            continue  # not ours after all, or vanishing: leave it
        total = total + Swept(1, files, size)
    return total


def sweep_earlier_spools(workspace, spools, keep: Path | str | None = None) -> Swept:
    """Sweep this workspace's dead sessions from `spools` (earlier servers' spools), except `keep`."""
    keep_path = str(Path(keep).resolve()) if keep else None
    targets = []
    for spool in spools or ():
        if not spool:
            continue
        resolved = str(Path(spool).resolve())
        if resolved != keep_path and resolved not in targets:
            targets.append(resolved)
    if not targets:
        return Swept()
    tags = dead_tags(workspace)
    total = Swept()
    for spool in targets:
        total = total + sweep(Path(spool), tags)
    return total
