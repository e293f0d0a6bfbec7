"""Verify an extraction run's manifest against its files; compact the manifest on resume."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from engine.io import atomic
from engine.records import MANIFEST, RecordEntry, read_manifest, verify_record

DEEP_LIMIT_BYTES = 20 * 2**30  # above this, hash only the most recent records on resume


@dataclass
class RunCheck:
    good: dict[str, RecordEntry] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)  # redone records and manifest damage
    checked: int = 0
    deep_checked: int = 0

    @property
    def bytes(self) -> int:
        return sum(e.bytes for e in self.good.values())

    @property
    def tokens(self) -> int:
        return sum(e.tokens for e in self.good.values())


def check_run(run_dir: Path, hidden_size: int | None = None, deep: bool | None = None, recent: int = 200) -> RunCheck:
    """Every manifest entry whose file is present, complete and (where hashed) uncorrupted.
    `deep` None: hash everything up to DEEP_LIMIT_BYTES, else only the `recent` newest; records
    not hashed are checked by size alone."""
    entries, problems = read_manifest(run_dir)
    result = RunCheck(problems=list(problems))
    total = sum(e.bytes for e in entries.values())
    deep_all = deep if deep is not None else total <= DEEP_LIMIT_BYTES
    ordered = sorted(entries.values(), key=lambda e: e.index)
    recent_ids = {e.id for e in ordered[-recent:]} if recent > 0 else set()
    for entry in ordered:
        hashed = deep_all or entry.id in recent_ids
        reason = verify_record(run_dir, entry, hidden_size if hashed else None, deep=hashed)
        result.checked += 1
        result.deep_checked += int(hashed)
        if reason is None:
            result.good[entry.id] = entry
        else:
            result.problems.append(reason)
    return result


def rewrite_manifest(run_dir: Path, entries: list[RecordEntry]) -> None:
    """Atomically replace the manifest with exactly these entries (each id once, in index order)."""
    text = "".join(e.to_json() + "\n" for e in sorted(entries, key=lambda e: e.index))
    atomic.write_text(Path(run_dir) / MANIFEST, text)


def write_bad(run_dir: Path, bad: dict[str, str]) -> None:
    text = "".join(json.dumps({"id": k, "reason": v}) + "\n" for k, v in sorted(bad.items()))
    atomic.write_text(Path(run_dir) / "bad.jsonl", text)
