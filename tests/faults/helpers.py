"""What the fault-injection tests share (fixtures are in conftest.py): the seed, a tmpfs mount,
workspaces on the shared server, and the invariants checked independently of the engine's own
verification."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.helpers.workspaces import make_workspace, write_conversations

SEED = int(os.environ.get("FAULT_SEED", "1234"))
HIDDEN = 64  # the tiny test model


@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    """Mount a fresh tmpfs of `size` at `path` (root only); skip the test if that is impossible."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount tmpfs at {path}: {proc.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


class SharedServer(tuple):
    """(port, spool, manager) plus whether the spool is a tmpfs of its own (disk-full tests)."""

    def __new__(cls, port, spool, manager, spool_is_tmpfs):
        self = super().__new__(cls, (port, spool, manager))
        self.spool_is_tmpfs = spool_is_tmpfs
        return self


def fault_workspace(root: Path, model_dir: Path, server, n: int, seed: int = 0, **changes):
    """A workspace on the shared server with `n` short conversations."""
    port, spool, _ = server
    ws = make_workspace(root, model_dir, **{"server.port": port, "extract.spool_dir": str(spool),
                                            "dataset.path": "train.jsonl", "extract.concurrency": 2,
                                            "server.restart_on_crash": False, **changes})
    write_conversations(ws.root / "train.jsonl", n, seed=seed)
    return ws


# ---- training on records extracted from the shared server (kill-training and resume tests) ----

FAULT_TRAIN = {"train.draft_vocab_size": 128, "train.max_len": 64, "train.batch_size": 2, "train.ttt_steps": 3,
               "train.log_every": 1, "train.save_every": 3, "train.eval_fraction": 0.15, "train.epochs": 3,
               "train.learning_rate": 1e-2, "train.warmup_ratio": 0.05}


def fault_train_workspace(root: Path, model_dir: Path, hidden_run: Path):
    """A workspace that trains on `hidden_run` with FAULT_TRAIN's small settings."""
    changes = {**FAULT_TRAIN, "extract.output_dir": str(hidden_run.parent), "extract.run": hidden_run.name}
    return make_workspace(root, model_dir, **changes)


def metric_rows(ws) -> list[dict]:
    """The run's metrics.jsonl rows so far (a torn last line is the resumed run's to drop)."""
    path = ws.drafter_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


# ---- invariants, checked independently of the engine's own verification ------------------

def manifest_lines(run_dir: Path) -> tuple[list[dict], list[str]]:
    """Parsed manifest lines and problems; only the very last line may be torn (a crash mid-append)."""
    path = run_dir / "manifest.jsonl"
    if not path.exists():
        return [], []
    raw = path.read_bytes()
    parts = raw.split(b"\n")
    rows, problems = [], []
    for number, line in enumerate(parts, 1):
        if not line:
            continue
        try:
            rows.append(json.loads(line))
        except ValueError:
            last = number == len(parts)  # no newline after it: torn append
            if not last:
                problems.append(f"manifest line {number} malformed in the middle of the file")
    return rows, problems


def check_at_rest(run_dir: Path) -> tuple[int, list[str]]:
    """After a crash: every manifest entry is durable (file present, size and sha256 right), no
    id twice. Returns (records checked, problems)."""
    rows, problems = manifest_lines(run_dir)
    seen: set[str] = set()
    for row in rows:
        if row["id"] in seen:
            problems.append(f"{row['id']} twice in the manifest")
        seen.add(row["id"])
        path = run_dir / row["path"]
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            problems.append(f"{row['path']} in the manifest but missing")
            continue
        if len(data) != row["bytes"] or hashlib.sha256(data).hexdigest() != row["sha256"]:
            problems.append(f"{row['path']} does not match its manifest entry")
    return len(rows), problems


def check_complete(run_dir: Path, expected_ids: list[str]) -> list[str]:
    """A finished run: every sample exactly once, checksums valid, files == manifest, no temp files."""
    count, problems = check_at_rest(run_dir)
    rows, _ = manifest_lines(run_dir)
    ids = [row["id"] for row in rows]
    if sorted(ids) != sorted(expected_ids):
        problems.append(f"manifest ids differ from the plan: missing {sorted(set(expected_ids) - set(ids))[:5]}, "
                        f"extra {sorted(set(ids) - set(expected_ids))[:5]}, {len(ids)} lines for {len(expected_ids)}")
    on_disk = sorted(str(p.relative_to(run_dir)) for p in run_dir.glob("records/*/*.safetensors"))
    if on_disk != sorted(row["path"] for row in rows):
        problems.append(f"record files {len(on_disk)} != manifest entries {len(rows)}")
    leftovers = [str(p) for p in run_dir.rglob("*.tmp")]
    if leftovers:
        problems.append(f"temp files left behind: {leftovers[:3]}")
    if not (run_dir / "complete.json").is_file():
        problems.append("complete.json missing")
    return problems


def plan_ids(ws) -> list[str]:
    from engine.extract.plan import build_plan

    return [s.id for s in build_plan(ws).samples]
