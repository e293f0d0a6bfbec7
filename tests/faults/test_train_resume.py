"""Training resume after a crash at the two awkward moments the kill -9 trials exposed.

- Killed before the first checkpoint: the relaunch starts from step 0 and must not leave the
  dead run's metric lines beside its own (they were duplicated).
- Killed after a checkpoint: the resumed run must know the best simulated acceptance length
  reached so far, or it marks a worse later checkpoint as best (and exports it).
- Killed in the middle of a checkpoint save: the temp file (as big as the optimizer state) must
  not stay on disk for good, and two trainings must never write one drafter directory.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.helpers.processes import lock_held_by_another_process
from faults.helpers import fault_train_workspace, metric_rows


def test_relaunch_after_a_crash_before_the_first_checkpoint_has_no_duplicate_metrics(
        tiny_chat_model_dir, hidden_run, tmp_path):
    from engine.train import checkpoint as ckpt
    from engine.train.launch import build_train_argv
    from engine.train.loop import Trainer

    torch.set_num_threads(1)
    ws = fault_train_workspace(tmp_path / "ws", tiny_chat_model_dir, hidden_run)
    Trainer(ws, device="cpu", max_steps=2).run()
    # The state a kill -9 leaves just before the first checkpoint: metric lines, no checkpoint.
    shutil.rmtree(ws.drafter_dir / ckpt.CKPT_DIR)
    assert [r["step"] for r in metric_rows(ws) if r["type"] == "train"] == [1, 2]
    assert "--resume" not in build_train_argv(ws)  # the relaunch is a fresh start
    Trainer(ws, device="cpu", max_steps=4).run()
    steps = [r["step"] for r in metric_rows(ws) if r["type"] == "train"]
    assert steps == [1, 2, 3, 4], steps
    # The same through --resume (a resume with nothing to resume from).
    shutil.rmtree(ws.drafter_dir / ckpt.CKPT_DIR)
    Trainer(ws, device="cpu", resume=True, max_steps=3).run()
    steps = [r["step"] for r in metric_rows(ws) if r["type"] == "train"]
    assert steps == [1, 2, 3], steps


def test_resumed_run_remembers_the_best_acceptance_so_far(tiny_chat_model_dir, hidden_run, tmp_path):
    from engine.train import checkpoint as ckpt
    from engine.train.loop import Trainer

    torch.set_num_threads(1)
    straight = fault_train_workspace(tmp_path / "a", tiny_chat_model_dir, hidden_run)
    full = Trainer(straight, device="cpu", max_steps=3)
    full.run()
    split = fault_train_workspace(tmp_path / "b", tiny_chat_model_dir, hidden_run)
    Trainer(split, device="cpu", max_steps=3).run()
    resumed = Trainer(split, device="cpu", resume=True, max_steps=3)
    resumed.setup()
    assert resumed.step == 3
    assert resumed.best_sim_al == full.best_sim_al == ckpt.best(split.drafter_dir)["sim_al"]
    assert json.loads(json.dumps(ckpt.best(split.drafter_dir))) == ckpt.best(straight.drafter_dir)


def test_a_save_killed_midway_is_swept_and_a_trained_directory_is_locked(tiny_chat_model_dir, hidden_run, tmp_path):
    """The holder of the lock is a real second process, as a concurrent training job would be."""
    from engine.train import checkpoint as ckpt
    from engine.train.loop import Trainer, TrainError

    torch.set_num_threads(1)
    ws = fault_train_workspace(tmp_path / "ws", tiny_chat_model_dir, hidden_run)
    Trainer(ws, device="cpu", max_steps=2).run()
    # What a kill -9 during the next save leaves: a step directory holding only a temp file.
    dead_dir = ckpt.ckpt_root(ws.drafter_dir) / "step-00000009"
    dead_dir.mkdir()
    dead = dead_dir / ".state.pt.k3j2h1xx.tmp"
    dead.write_bytes(b"x" * 4096)
    with lock_held_by_another_process(ws.drafter_dir, ckpt.TRAIN_LOCK) as holder_pid:
        with pytest.raises(TrainError, match=f"being trained by pid {holder_pid}"):
            Trainer(ws, device="cpu", resume=True, max_steps=1).run()
        assert dead.exists(), "left alone while another trainer may be writing it"
    before = [r["step"] for r in metric_rows(ws) if r["type"] == "train"]
    events = []
    trainer = Trainer(ws, device="cpu", resume=True, max_steps=1)
    trainer.event = lambda kind, **data: events.append((kind, data))
    assert trainer.run() == 0
    assert ("swept_temp", {"count": 1}) in events
    assert not dead_dir.exists(), "the empty step directory goes with its temp file"
    assert [r["step"] for r in metric_rows(ws) if r["type"] == "train"] == before + [3]
    assert ckpt.latest(ws.drafter_dir)["step"] == 3
