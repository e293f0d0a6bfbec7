"""Corrupted data at rest: truncated and bit-flipped records (seeded choice of victims and bytes).

Training refuses them with a clear error naming the file (never a traceback, never a step
trained on a bad record); a resumed extraction detects exactly the damaged records, redoes
them, and training then runs.
"""

from __future__ import annotations

import asyncio
import random

from engine.extract.job import Extractor
from engine.extract.verify import check_run
from faults import ledger, zygote
from faults.helpers import HIDDEN, SEED, check_complete, fault_workspace, manifest_lines, plan_ids

TRAIN = {"train.draft_vocab_size": 128, "train.max_len": 64, "train.batch_size": 2, "train.ttt_steps": 2,
         "train.epochs": 1, "train.eval_fraction": 0.0, "train.save_every": 100, "train.log_every": 1}


def _corrupt(run_dir, rng, count: int) -> list[str]:
    rows, _ = manifest_lines(run_dir)
    victims = rng.sample(rows[1:], count)  # not the first: training checks that one at setup
    for i, row in enumerate(victims):
        path = run_dir / row["path"]
        data = bytearray(path.read_bytes())
        if i % 2 == 0:
            data = data[: rng.randrange(1, len(data))]  # truncated
        else:
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)  # one bit flipped
        path.write_bytes(bytes(data))
    return sorted(row["path"] for row in victims)


def test_corrupted_records_are_refused_by_training_and_redone_by_extraction(
        tiny_chat_model_dir, shared_server, tmp_path):
    rng = random.Random(SEED + 5)
    ws = fault_workspace(tmp_path / "ws", tiny_chat_model_dir, shared_server, n=12, **TRAIN)
    expected = plan_ids(ws)
    assert asyncio.run(Extractor(ws).run()) == 0
    problems = []
    victims = _corrupt(ws.hidden_dir, rng, 4)

    # Training refuses, naming a damaged file; no traceback.
    job_dir = ws.jobs_dir / "train-corrupt"
    proc = zygote.start("train", ["--workspace", str(ws.root), "--device", "cpu"], job_dir)
    proc.join(120)
    log = (job_dir / "log.txt").read_text()

    if proc.exitcode != 2 or "Traceback" in log:
        problems.append(f"training on damaged records: exit {proc.exitcode}, log {log[-1500:]}")
    if not any(v in log for v in victims) or "re-run extraction" not in log.replace("resume the extraction", "re-run extraction"):
        problems.append(f"training error does not name a damaged record and the fix: {log[-600:]}")

    # The extraction check finds exactly the damaged ones; a resume redoes them.
    found = check_run(ws.hidden_dir, HIDDEN, deep=True)
    damaged = sorted(p.split(":")[0] for p in found.problems)
    if damaged != victims:
        problems.append(f"verification found {damaged}, damaged were {victims}")
    assert asyncio.run(Extractor(ws).run()) == 0
    problems += check_complete(ws.hidden_dir, expected)

    proc = zygote.start("train", ["--workspace", str(ws.root), "--device", "cpu"], ws.jobs_dir / "train-ok")
    proc.join(120)
    if proc.exitcode != 0:
        problems.append(f"training after the repair failed: {(ws.jobs_dir / 'train-ok' / 'log.txt').read_text()[-800:]}")
    ledger.add("corrupted records", trials=1, faults=len(victims), records=len(expected) * 2, losses=len(problems))
    assert not problems, problems
