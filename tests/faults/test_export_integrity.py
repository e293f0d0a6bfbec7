"""Integrity of what the train stage vouches for (issue 20, case 2), replayed as it was found.

Found: after a NaN run 344,576 of 346,045 exported weights were non-finite and `train` read
`✔ export: … match SGLang's LlamaForCausalLMEagle3 loader`; overwriting 64 KiB of a good export's
model.safetensors with 0xFF (31,220 NaN in fc.weight) kept `train` green (`check train` rc 0); a
checkpoint with 4 KiB zeroed inside state.pt loaded, resumed and "succeeded" (1,025 optimizer
values changed).

Now: the export and every checkpoint carry a sha256 sidecar written atomically after them, and
weights are checked finite when written and when read. A drafter with non-finite weights is not
exported (the job fails naming the tensor); `check train` is red for an overwritten export (hash
mismatch, the non-finite values counted per tensor) and exits non-zero; a resume refuses a damaged
checkpoint naming it, falls back to the newest intact one, and stops with a clear error (exit 2,
no traceback, nothing trained) when none is intact.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from faults import ledger

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def hidden_run(tiny_model_dir, tmp_path_factory) -> Path:
    from tests.helpers.training import make_records

    run_dir = tmp_path_factory.mktemp("hidden_integrity") / "run1"
    make_records(tiny_model_dir, run_dir, n=14)
    return run_dir


def _train_ws(root: Path, model_dir: Path, hidden_run: Path, **train):
    from tests.helpers.training import train_workspace

    return train_workspace(root, model_dir, hidden_run, **{"log_every": 1, "save_every": 100, "epochs": 1, **train})


def _cli_check_train(ws) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eagle3_console", "check", "train", "-w", str(ws.root)],
                          capture_output=True, text=True, timeout=120, cwd=REPO)


def _data_start(path: Path) -> int:
    """Where a safetensors file's tensor data begins (after the 8-byte length and the JSON header)."""
    with open(path, "rb") as handle:
        return 8 + struct.unpack("<Q", handle.read(8))[0]


def _nonfinite_per_tensor(path: Path) -> dict[str, int]:
    """Counted independently of the engine: every tensor loaded whole."""
    from safetensors.torch import load_file

    counts = {}
    for name, tensor in load_file(str(path)).items():
        if tensor.is_floating_point():
            bad = int((~torch.isfinite(tensor.float())).sum())
            if bad:
                counts[name] = bad
    return counts


def test_an_overwritten_export_turns_train_red_and_check_exits_nonzero(tiny_model_dir, hidden_run, tmp_path):
    from engine.checks.base import Status
    from engine.checks.context import CheckContext
    from engine.checks.train import check_train
    from engine.train.loop import Trainer

    torch.set_num_threads(1)
    ws = _train_ws(tmp_path / "ws", tiny_model_dir, hidden_run)
    assert Trainer(ws, device="cpu").run() == 0
    weights = ws.drafter_dir / "export" / "model.safetensors"
    good = _cli_check_train(ws)
    assert good.returncode == 0, good.stdout + good.stderr
    results = check_train(CheckContext(ws))
    assert [r.status for r in results] == [Status.PASS], results
    # The evidence claims only what was compared: our table of SGLang's layout, not its loader.
    assert "loader;" not in results[0].evidence and "test_sglang_judge" in results[0].evidence, results[0]

    # 64 KiB of 0xFF inside the tensor data, as found.
    data = bytearray(weights.read_bytes())
    offset = _data_start(weights) + 4096
    assert offset + 65536 <= len(data), (offset, len(data))
    data[offset:offset + 65536] = b"\xff" * 65536
    with open(weights, "r+b") as handle:  # in place, as dd conv=notrunc does
        handle.seek(offset)
        handle.write(bytes(data[offset:offset + 65536]))
    counts = _nonfinite_per_tensor(weights)
    assert counts, "the overwrite made no value non-finite"

    proc = _cli_check_train(ws)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "Traceback" not in out, out
    assert "model.safetensors" in out and "sha256" in out, out
    results = check_train(CheckContext(ws))
    assert results[0].status is Status.FAIL, results
    evidence = results[0].evidence
    name, count = max(counts.items(), key=lambda item: item[1])
    assert f"{count:,} non-finite" in evidence and name in evidence, (counts, evidence)
    assert "run train" in results[0].fix, results[0].fix
    ledger.add("overwritten export", trials=1, faults=1, records=sum(counts.values()),
               losses=int(results[0].status is not Status.FAIL))
    shown = proc.stdout.replace(str(ws.drafter_dir), "DRAFTER").strip()
    print(f"\n  export: 64 KiB of 0xFF at +{offset}: non-finite {counts}; check train rc {proc.returncode}:\n"
          f"  {shown}")


def test_a_drafter_trained_for_other_target_weights_turns_train_red(tiny_model_dir, hidden_run, tmp_path):
    """The export names the target weights it was trained against. A fine-tune of the target at model.path
    (same shapes and tokenizer: SGLang would load the drafter beside it) turns `train` red, naming both
    weights and the fix; the same weights at another path (moved) are green."""
    import shutil

    from engine.checks.base import Status
    from engine.checks.context import CheckContext
    from engine.checks.train import check_train
    from engine.config import set_value
    from engine.model.weights_id import weights_id
    from engine.train.export import trained_for
    from engine.train.loop import Trainer
    from engine.workspace import Workspace
    from tests.helpers.models import fine_tune_in_place

    torch.set_num_threads(1)
    ws = _train_ws(tmp_path / "ws", tiny_model_dir, hidden_run)
    assert Trainer(ws, device="cpu").run() == 0
    trained = trained_for(ws.drafter_dir / "export")
    assert trained == weights_id(tiny_model_dir)

    def point_at(model: Path) -> Workspace:
        ws.save_config(set_value(ws.config, "model.path", str(model)))
        return Workspace(ws.root)

    moved = tmp_path / "moved"
    shutil.copytree(tiny_model_dir, moved)
    assert [r.status for r in check_train(CheckContext(point_at(moved)))] == [Status.PASS]
    fine_tune_in_place(moved)
    results = check_train(CheckContext(point_at(moved)))
    assert [r.status for r in results] == [Status.FAIL], results
    assert f"trained against target weights {trained}, but model.path {moved} holds weights " in \
        results[0].evidence, results[0].evidence
    assert "model.path back" in results[0].fix
    proc = _cli_check_train(ws)
    assert proc.returncode != 0 and "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert [r.status for r in check_train(CheckContext(point_at(tiny_model_dir)))] == [Status.PASS]
    ledger.add("drafter of other target weights", trials=1, faults=1)


def test_a_drafter_with_nonfinite_weights_is_never_exported(tiny_model_dir, hidden_run, tmp_path):
    """The found export: nearly every weight NaN. The trainer refuses to write it (the job fails naming the
    tensor); an export written that way by an older version is red with the count."""
    from safetensors.torch import save_file

    from engine.checks.base import Status
    from engine.checks.context import CheckContext
    from engine.checks.train import check_train
    from engine.train import checkpoint as ckpt
    from engine.train.export import CONFIG, WEIGHTS, export_config, export_tensors
    from engine.train.loop import Trainer, TrainError

    torch.set_num_threads(1)
    ws = _train_ws(tmp_path / "ws", tiny_model_dir, hidden_run)
    trainer = Trainer(ws, device="cpu")
    assert trainer.run() == 0
    export = ws.drafter_dir / "export"
    before = (export / WEIGHTS).read_bytes()
    # What a blown-up run leaves: weights NaN, and no best checkpoint to fall back to.
    with torch.no_grad():
        for param in trainer.model.trainable_parameters():
            param.fill_(float("nan"))
    (ckpt.ckpt_root(ws.drafter_dir) / ckpt.BEST).unlink()
    total = sum(p.numel() for p in trainer.model.trainable_parameters())
    with pytest.raises(TrainError) as failure:
        trainer.export()
    message = str(failure.value)
    assert "fc.weight" in message and "non-finite" in message, message
    assert (export / WEIGHTS).read_bytes() == before, "the good export was replaced"

    # An export written as the older version wrote it (no check, no sidecar): red with the count.
    tensors = export_tensors(trainer.model)
    save_file(tensors, str(export / WEIGHTS), metadata={"format": "pt"})
    (export / CONFIG).write_text(json.dumps(export_config(trainer.model.cfg)))
    for sidecar in export.glob("*.json"):
        if sidecar.name != CONFIG:
            sidecar.unlink()
    bad = sum(_nonfinite_per_tensor(export / WEIGHTS).values())
    results = check_train(CheckContext(ws))
    assert results[0].status is Status.FAIL, results
    assert f"{bad:,} non-finite" in results[0].evidence, results[0].evidence
    proc = _cli_check_train(ws)
    assert proc.returncode != 0 and "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    ledger.add("non-finite export", trials=1, faults=1, records=total, losses=0)
    print(f"\n  NaN drafter: export refused ({message[:120]}); an unchecked one: {bad:,} non-finite values, "
          f"check train rc {proc.returncode}")


def _zero_4k(path: Path) -> int:
    data = path.read_bytes()
    offset = (len(data) // 2) & ~4095
    with open(path, "r+b") as handle:
        handle.seek(offset)
        handle.write(b"\0" * 4096)
    return offset


def _changed_values(pristine: dict, damaged: dict) -> int:
    """Values that differ between two checkpoint states (model and optimizer tensors)."""
    changed = 0

    def walk(a, b):
        nonlocal changed
        if isinstance(a, torch.Tensor):
            changed += int((a != b).sum()) if a.shape == b.shape else a.numel()
        elif isinstance(a, dict):
            for key in a:
                walk(a[key], b[key])
        elif isinstance(a, (list, tuple)):
            for x, y in zip(a, b):
                walk(x, y)

    walk(pristine["model"], damaged["model"])
    walk(pristine["optim"]["state"], damaged["optim"]["state"])
    return changed


def test_a_damaged_checkpoint_is_refused_on_resume(tiny_model_dir, hidden_run, tmp_path):
    from engine.train import checkpoint as ckpt
    from engine.train.launch import build_train_argv

    torch.set_num_threads(1)
    ws = _train_ws(tmp_path / "ws", tiny_model_dir, hidden_run, save_every=2, epochs=4)
    from engine.train.loop import Trainer

    Trainer(ws, device="cpu", max_steps=6).run()
    latest = ckpt.latest(ws.drafter_dir)
    assert latest["step"] == 6
    state_path = ckpt.ckpt_root(ws.drafter_dir) / latest["path"] / ckpt.STATE
    pristine = torch.load(state_path, map_location="cpu", weights_only=False)
    offset = _zero_4k(state_path)
    # What the damage is: torch.load alone takes it (no error) with values silently changed.
    damaged = torch.load(state_path, map_location="cpu", weights_only=False)
    changed = _changed_values(pristine, damaged)
    assert changed > 0, "the zeroed block changed no value"

    rows_before = (ws.drafter_dir / "metrics.jsonl").read_text()
    argv = build_train_argv(ws)
    assert "--resume" in argv
    proc = subprocess.run(argv + ["--max-steps", "1", "--device", "cpu"], capture_output=True, text=True,
                          timeout=300, cwd=ws.root)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    rejected = [e for e in events if e["type"] == "checkpoint_rejected"]
    assert rejected and latest["path"] in rejected[0]["message"] and "sha256" in rejected[0]["message"], events
    resumed = [e for e in events if e["type"] == "resumed"]
    assert resumed and resumed[0]["step"] == 4, events  # the newest intact checkpoint, not the damaged one
    assert ckpt.latest(ws.drafter_dir)["step"] == 5

    # Every checkpoint damaged: the resume stops, names them and the choices; nothing is trained.
    for step_dir in ckpt.ckpt_root(ws.drafter_dir).glob("step-*"):
        _zero_4k(step_dir / ckpt.STATE)
    rows_before = (ws.drafter_dir / "metrics.jsonl").read_text()
    proc = subprocess.run(argv + ["--max-steps", "1", "--device", "cpu"], capture_output=True, text=True,
                          timeout=300, cwd=ws.root)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in out, out
    assert "training: error:" in proc.stdout and "sha256" in proc.stdout and "train.run" in proc.stdout, out
    assert (ws.drafter_dir / "metrics.jsonl").read_text() == rows_before, "metrics changed by a refused resume"
    ledger.add("damaged checkpoint", trials=2, faults=1 + len(list(ckpt.ckpt_root(ws.drafter_dir).glob("step-*"))),
               records=changed, losses=0)
    print(f"\n  checkpoint: 4 KiB zeroed at +{offset} of {latest['path']}/state.pt changed {changed:,} values; "
          f"resume fell back to step {resumed[0]['step']}; all damaged: exit {proc.returncode}")
