"""kill -9 of the extraction job at random moments, 20 seeded trials, then resume.

Each trial starts the extraction (resuming whatever the previous trial left), kills it with
SIGKILL after a random delay drawn from a seeded RNG (so the kill lands during planning,
between requests, mid-write or after the end), and checks the run at rest: every manifest
entry durable and unique. When a run completes it is checked whole and the next trials start a
new run name. At the end the last run is resumed to completion and every run is checked:
every sample exactly once, checksums valid, files == manifest, no temp file, spool empty.
"""

from __future__ import annotations

import random
import time

from engine.config import set_value
from faults import ledger, zygote
from faults.helpers import SEED, check_at_rest, check_complete, fault_workspace, plan_ids

TRIALS = 20


def _set_run(ws, name: str) -> None:
    ws.save_config(set_value(ws.config, "extract.run", name))
    ws.reload()


def test_extraction_kill_9_at_random_moments(tiny_chat_model_dir, shared_server, tmp_path):
    rng = random.Random(SEED)
    ws = fault_workspace(tmp_path / "ws", tiny_chat_model_dir, shared_server, n=16)
    expected = plan_ids(ws)
    runs, problems, checked, kills = [], [], 0, 0
    # A run without faults sets the time scale, so the kills land mid-run on any machine.
    _set_run(ws, "reference")
    started = time.monotonic()
    proc = zygote.start("extract", ["--workspace", str(ws.root)], ws.jobs_dir / "extract-reference")
    proc.join(120)
    full_s = time.monotonic() - started
    assert proc.exitcode == 0
    runs.append(ws.hidden_dir)
    run_index = 0
    _set_run(ws, f"run{run_index}")
    for trial in range(TRIALS):
        proc = zygote.start("extract", ["--workspace", str(ws.root)], ws.jobs_dir / f"extract-t{trial:02d}")
        deadline = time.monotonic() + rng.uniform(0.02, 0.5 * full_s)
        while time.monotonic() < deadline and proc.exitcode is None:
            time.sleep(0.01)
        code = zygote.kill(proc)
        kills += int(code == -9)
        count, found = check_at_rest(ws.hidden_dir)
        checked += count
        problems += [f"trial {trial}: {p}" for p in found]
        if (ws.hidden_dir / "complete.json").exists():
            problems += [f"trial {trial}: {p}" for p in check_complete(ws.hidden_dir, expected)]
            runs.append(ws.hidden_dir)
            run_index += 1
            _set_run(ws, f"run{run_index}")
    proc = zygote.start("extract", ["--workspace", str(ws.root)], ws.jobs_dir / "extract-final")
    proc.join(120)
    assert proc.exitcode == 0, (ws.jobs_dir / "extract-final" / "log.txt").read_text()[-3000:]
    runs.append(ws.hidden_dir)
    for run_dir in runs:
        problems += [f"{run_dir.name}: {p}" for p in check_complete(run_dir, expected)]
        checked += len(expected)
    leftover = sorted(p.name for p in ws.spool_dir.iterdir()) if ws.spool_dir.exists() else []
    if leftover:
        problems.append(f"spool not emptied after the runs: {len(leftover)} entries, e.g. {leftover[:3]}")
    ledger.add("kill -9 extraction", trials=TRIALS, faults=kills, records=checked, losses=len(problems))
    assert not problems, problems
    assert kills >= TRIALS // 3, f"only {kills} of {TRIALS} trials were killed mid-run (full run {full_s:.1f}s)"
