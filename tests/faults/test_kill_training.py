"""kill -9 of the training job at random moments, 20 seeded trials, each followed by a resume.

A reference run trains straight through in-process. The same configuration is then trained by
job processes that are SIGKILLed after a random delay (seeded), each trial resuming the last.
After each kill: the latest checkpoint loads, and every metrics line written so far equals the
reference's line for that step. At the end the run is resumed to completion: metrics equal the
reference step for step, exactly once each; the best checkpoint and the export match.
"""

from __future__ import annotations

import json
import random
import time

import torch

from engine.config import set_value
from faults import ledger, zygote
from faults.helpers import SEED, fault_train_workspace, metric_rows

TRIALS = 20
COMPARED = ("loss", "acc", "sim_al", "lr", "grad_norm")


def _same(row: dict, ref: dict) -> bool:
    return all(json.dumps(row.get(k)) == json.dumps(ref.get(k)) for k in COMPARED if k in ref)


def test_training_kill_9_resumes_with_identical_metrics(tiny_chat_model_dir, hidden_run, tmp_path):
    from engine.train import checkpoint as ckpt
    from engine.train.loop import Trainer

    torch.set_num_threads(1)
    ref_ws = fault_train_workspace(tmp_path / "ref", tiny_chat_model_dir, hidden_run)
    started = time.monotonic()
    ref = Trainer(ref_ws, device="cpu")
    assert ref.run() == 0
    full_s = time.monotonic() - started
    reference = {(r["type"], r["step"]): r for r in metric_rows(ref_ws)}
    ref_best = ckpt.best(ref_ws.drafter_dir)

    ws = fault_train_workspace(tmp_path / "kill", tiny_chat_model_dir, hidden_run)
    rng = random.Random(SEED + 1)
    problems, kills, checked, runs = [], 0, 0, 0

    def finished_run_problems() -> list[str]:
        rows = metric_rows(ws)
        keys = [(r["type"], r["step"]) for r in rows]
        found = []
        if len(keys) != len(set(keys)):
            found.append(f"metrics lines repeated after resumes: {len(keys) - len(set(keys))} duplicates")
        if set(keys) != set(reference):
            found.append(f"metrics steps differ: missing {sorted(set(reference) - set(keys))[:5]}, "
                         f"extra {sorted(set(keys) - set(reference))[:5]}")
        found += [f"{r['type']} step {r['step']} differs" for r in rows
                  if (r["type"], r["step"]) in reference and not _same(r, reference[(r["type"], r["step"])])]
        best = ckpt.best(ws.drafter_dir)
        if (best or {}).get("step") != (ref_best or {}).get("step"):
            found.append(f"best checkpoint {best} differs from the reference {ref_best}")
        if not (ws.drafter_dir / "export" / "model.safetensors").is_file():
            found.append("no export after completion")
        return [f"{ws.config.train.run}: {p}" for p in found]

    for trial in range(TRIALS):
        job_dir = ws.jobs_dir / f"train-t{trial:02d}"
        proc = zygote.start("train", ["--workspace", str(ws.root), "--resume", "--device", "cpu"], job_dir)
        deadline = time.monotonic() + rng.uniform(0.02, 0.1 + full_s * 0.5)
        while time.monotonic() < deadline and proc.exitcode is None:
            time.sleep(0.005)
        code = zygote.kill(proc)
        kills += int(code == -9)
        if code not in (-9, 0):
            problems.append(f"trial {trial}: exit {code}: {(job_dir / 'log.txt').read_text()[-800:]}")
        latest = ckpt.latest(ws.drafter_dir)
        if latest:
            try:
                state = ckpt.load(ws.drafter_dir)
                checked += 1
                if state["step"] != latest["step"]:
                    problems.append(f"trial {trial}: latest.json says step {latest['step']}, state {state['step']}")
            except Exception as exc:  # noqa: BLE001 - any failure to load is a finding
                problems.append(f"trial {trial}: latest checkpoint unloadable: {exc}")
        for row in metric_rows(ws):
            checked += 1
            ref_row = reference.get((row["type"], row["step"]))
            if ref_row is None or not _same(row, ref_row):
                problems.append(f"trial {trial}: {row['type']} step {row['step']} differs from the reference")
        if code == 0:  # finished before the kill: check it whole, train a new run next
            problems += finished_run_problems()
            runs += 1
            ws.save_config(set_value(ws.config, "train.run", f"run{runs}"))
            ws.reload()
    proc = zygote.start("train", ["--workspace", str(ws.root), "--resume", "--device", "cpu"],
                        ws.jobs_dir / "train-final")
    proc.join(120)
    assert proc.exitcode == 0, (ws.jobs_dir / "train-final" / "log.txt").read_text()[-3000:]
    problems += finished_run_problems()
    checked += len(metric_rows(ws))
    ledger.add("kill -9 training", trials=TRIALS, faults=kills, records=checked, losses=len(problems))
    assert not problems, problems[:10]
    assert kills >= TRIALS // 3, f"only {kills} of {TRIALS} trials were killed mid-run (full run {full_s:.1f}s)"
