"""Online training (train.mode = online | hybrid, engine/train/online.py): settings, the window's
accounting, the checklist, and real runs against a real local target server.

The kill test runs the trainer as a real process (`python -m engine.train`), samples the window
directory while it runs (on a tmpfs barely larger than the window when the test runs as root, so an
overflow would also fail the write), kills it with SIGKILL after a checkpoint, resumes it, and checks
the stated guarantee from the consumption ledger: the samples trained twice are exactly those
consumed after the checkpoint it resumed from.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading

import psutil
import pytest
import torch

from engine.checks.base import StageReport, StageState, failed, passed
from engine.config import ConfigError, parse_config, set_value
from engine.registry import prerequisites, red_prerequisites, server_users
from engine.train.window import Window, record_bytes, window_dir
from tests.helpers.slots import RequestSlots
from tests.helpers.online import online_workspace, run_job, stop_while_waiting_for_captures
from tests.helpers.window import WindowSampler
from tests.helpers.workspaces import make_workspace


# ---------------------------------------------------------------------------- settings and checklist

def test_mode_and_window_are_declared_and_bad_values_name_key_and_fix():
    cfg = parse_config('[train]\nmode = "online"\nwindow_gb = 0.005\n')
    assert cfg.train.mode == "online" and cfg.train.window_gb == 0.005
    assert parse_config("").train.mode == "offline"  # today's behaviour by default
    for text, key, fix in (('mode = "stream"', "train.mode", "offline, online, hybrid"),
                           ("window_gb = 0", "train.window_gb", "0.0001 to 1000000000"),
                           ('window_gb = "5"', "train.window_gb", "number")):
        with pytest.raises(ConfigError) as err:
            parse_config(f"[train]\n{text}\n")
        assert err.value.key == key and fix in str(err.value)


def _report(stage: str, ok: bool) -> StageReport:
    results = (passed("x", "ok") if ok else failed("x", "bad", "fix it"),)
    return StageReport(stage, stage, StageState.PASSED if ok else StageState.FAILED, results)


def test_prerequisites_follow_the_mode():
    offline = parse_config("")
    online = parse_config('[train]\nmode = "hybrid"\n')
    assert "extract" in prerequisites("train", offline) and "server" not in prerequisites("train", offline)
    assert set(prerequisites("train", online)) == {"model", "dataset", "server", "capture", "disk"}
    reports = [_report(s, s in ("model", "dataset", "disk")) for s in
               ("model", "dataset", "server", "capture", "disk", "extract")]
    assert {r.stage for r in red_prerequisites("train", reports, online)} == {"server", "capture"}
    assert {r.stage for r in red_prerequisites("train", reports, offline)} == {"extract"}
    assert "train" in server_users(online) and "train" not in server_users(offline)


def test_window_admits_within_budget_and_one_batch_beyond():
    win = Window(1000)
    assert win.reserve(600, slot=0, timeout=0) and win.reserve(400, slot=0, timeout=0)
    assert not win.reserve(1, slot=1, timeout=0.05)  # full: the next batch's record waits
    freed = threading.Timer(0.1, win.release, args=(600, 0))
    freed.start()
    assert win.reserve(500, slot=1, timeout=5)  # admitted once the trainer released a record
    assert win.used == 900 and win.peak == 1000
    win.release(400, 0)
    assert win.reserve(2000, slot=1, timeout=0)  # only its own batch held: one batch may exceed the window
    assert not win.reserve(10, slot=2, timeout=0)
    win.keep(500, 1)  # kept for good: counted, no longer held by its batch
    win.release(2000, 1)
    assert win.used == 500 and win.kept == 500
    assert record_bytes(10, 64) == 10 * (2 * 4 * 64 + 16) + 1024


# ---------------------------------------------------------------------------- real runs

@pytest.fixture
def online_ws(request, tiny_chat_model_dir, tmp_path):
    """A workspace in online mode whose window lives on a small disk (256k unless parametrized), with a
    real local server running."""
    with online_workspace(tiny_chat_model_dir, tmp_path, getattr(request, "param", "256k")) as made:
        yield made


def test_window_disk_use_counts_files_and_rides_out_a_job_deleting_under_it(tmp_path):
    """tree_bytes (the disk check's window figure) while a job deletes records and whole directories: it
    never raises (the window's own Path.rglob walk raised FileNotFoundError from a directory gone mid-walk:
    thousands of times in two seconds here), and at rest it counts exactly what is there, a link as a link
    (not what it points to)."""
    import shutil
    import time

    from engine.system.disk import tree_bytes

    root = tmp_path / "window"
    (root / "rank0" / "shard").mkdir(parents=True)
    (root / "rank0" / "a.rec").write_bytes(b"x" * 1000)
    (root / "rank0" / "shard" / "b.rec").write_bytes(b"y" * 234)
    (root / "run.json").write_text("{}")
    (root / "link.rec").symlink_to(root / "rank0" / "a.rec")
    assert tree_bytes(root) == 1000 + 234 + 2 + os.lstat(root / "link.rec").st_size

    churn_root = tmp_path / "churn"
    churn_root.mkdir()
    stop, errors, looks = threading.Event(), [], [0]

    def churn() -> None:
        i = 0
        while not stop.is_set():
            deep = churn_root / f"run{i % 8}" / "shard" / "deep"
            deep.mkdir(parents=True, exist_ok=True)
            (deep / "rec.bin").write_bytes(b"z" * 1000)
            shutil.rmtree(churn_root / f"run{(i + 4) % 8}", ignore_errors=True)
            i += 1

    deleter = threading.Thread(target=churn, daemon=True)
    deleter.start()
    deadline = time.monotonic() + 1.5
    try:
        while time.monotonic() < deadline:
            try:
                assert 0 <= tree_bytes(churn_root) <= 8 * 1000
            except OSError as exc:
                errors.append(exc)
            looks[0] += 1
    finally:
        stop.set()
        deleter.join()
    assert not errors, f"{len(errors)} of {looks[0]} looks raised, e.g. {errors[0]!r}"
    assert looks[0] > 10


@pytest.mark.parametrize("online_ws", ["640k"], indirect=True)
def test_hybrid_keeps_what_fits_stops_cleanly_and_reuses_its_kept_records(online_ws):
    from engine.jobs.manager import JobManager
    from engine.records import read_manifest
    from engine.train.online import LEDGER
    from engine.train.window import window_budget, window_dir

    ws, _ = online_ws
    config = set_value(set_value(ws.config, "train.mode", "hybrid"), "train.window_gb", 0.0005)
    ws.save_config(config)
    ws.reload()
    budget, root = window_budget(ws.config), window_dir(ws)
    jobs = JobManager(ws.jobs_dir)
    first: list[dict] = []
    with WindowSampler(root) as sampler:
        info = run_job(ws, jobs, first, until=lambda ev: any(e.get("type") == "checkpoint" for e in ev))
        stopped = jobs.stop_sync(info.id, grace=60)  # SIGTERM: checkpoint at the next step, then exit
        assert stopped.state == "stopped" and stopped.exit_code == 0, jobs.tail(info.id, 20)
        events, _ = jobs.events(info.id, 0)
        assert any(e.get("type") == "stopped" for e in events), events[-5:]
        plan = next(e for e in events if e.get("type") == "started")
        assert plan["mode"] == "hybrid" and plan["keep_budget"] > 0
        second: list[dict] = []
        info = run_job(ws, jobs, second)
        assert info.state == "succeeded", "\n".join(jobs.tail(info.id, 60))
    kept, _ = read_manifest(root / "kept")
    from engine.train.data import is_eval

    fraction = ws.config.train.eval_fraction
    kept_train = {i for i in kept if not is_eval(i, fraction)}
    assert kept_train, "hybrid kept no training sample"
    resumed_plan = next(e for e in second if e.get("type") == "started")
    assert resumed_plan["window_kept"] > 0  # the second run found the first run's kept records
    streamed = {json.loads(line)["id"] for line in (ws.drafter_dir / LEDGER).read_text().splitlines()}
    assert not streamed & kept_train  # a kept sample is captured once and read from disk by every epoch
    assert 0 < sampler.peak <= budget
    # The producer's threads are metered: CPU per wall second on the progress lines, the total at the end.
    window_lines = [e for e in second if e.get("type") == "progress" and "window_budget" in e]
    assert window_lines and all(e["producer_cpu"] >= 0 for e in window_lines)
    # The epoch position never names an epoch past the configured ones; the last step ends the last epoch.
    epochs = ws.config.train.epochs
    positions = [(e["done"], e["epoch"], e["epoch_step"], e["steps_per_epoch"]) for e in window_lines]
    assert all(1 <= epoch <= epochs and 0 <= index <= per for _, epoch, index, per in positions), positions
    assert [(epoch, index) for done, epoch, index, per in positions if done == window_lines[-1]["total"]] == \
        [(epochs, positions[-1][3])], positions[-3:]
    end = [e for e in second if e.get("type") == "window" and "window_peak" in e][-1]
    assert end["producer_cpu_s"] >= 0 and end["capture_cpu_s"] > 0, end
    from engine.model.weights_id import weights_id
    from engine.train.export import trained_for

    assert trained_for(ws.drafter_dir / "export") == weights_id(ws.model_dir)  # what check train compares


@pytest.mark.parametrize("online_ws", ["64m"], indirect=True)
def test_the_capture_process_keeps_the_servers_requests_while_records_are_written(online_ws, monkeypatch, tmp_path):
    """The capture process writes a record after its request has given the slot back, as the extraction
    job does: while a record is being written (slowed down here) the server still has all
    `extract.concurrency` requests, and never more. It used to write inside the slot, which cost online
    training ~40 % of the capture rate on the H200 (RESULTS, run 12). The process's own loop
    (engine.train.capture_process.Capturer) runs here in a thread, so that the slow write applies."""
    from multiprocessing import Pipe

    from engine.extract.job import Extractor
    from engine.extract.plan import build_plan
    from engine.model.target import workspace_plan
    from engine.records import load_record
    from engine.train.capture_process import CaptureSpec, Capturer, Order

    ws, _ = online_ws
    concurrency = ws.config.extract.concurrency
    slots = RequestSlots(monkeypatch, concurrency)
    monkeypatch.setattr(Extractor, "write_capture", slots.slow(Extractor.write_capture))
    samples, hidden = build_plan(ws).samples[:12], workspace_plan(ws).hidden_size
    stream, kept = tmp_path / "stream", tmp_path / "kept"
    stream.mkdir()
    ours, theirs = Pipe(duplex=True)
    spec = CaptureSpec(root=str(ws.root), rank=0, hidden_size=hidden, window_dir=str(tmp_path), stream_dir=str(stream),
                       kept_dir=str(kept), job_dir=None, workers=2 * concurrency, parent_pid=0)
    loop = threading.Thread(target=lambda: asyncio.run(Capturer(spec, theirs).run()), daemon=True)
    loop.start()
    assert ours.poll(60) and ours.recv() == ("ready",)
    for seq, sample in enumerate(samples, 1):
        ours.send(("capture", Order(seq, sample, keep=False)))
    ours.send(("end",))
    answers = []
    while ours.poll(60):
        answers.append(ours.recv())
        if answers[-1][0] in ("ended", "failed"):
            break
    loop.join(30)
    assert answers[-1][0] == "ended" and not loop.is_alive(), answers[-1]
    stored = {seq: entry for kind, seq, entry in answers[:-1]}
    assert sorted(stored) == list(range(1, 13))
    for seq, sample in enumerate(samples, 1):  # every record whole, and the one its order named
        record = load_record(stream, stored[seq], verify=True)
        assert record["input_ids"].tolist() == sample.input_ids and record["hidden_state"].shape == (len(sample.input_ids), hidden)
    assert slots.writes == len(samples), slots
    assert slots.most == concurrency, slots
    # Never, had a writing worker kept its slot; the last writes find nothing left to send.
    assert slots.full_during_write >= 2, slots


@pytest.mark.parametrize("online_ws", ["64m"], indirect=True)
def test_online_captures_run_in_a_process_of_their_own(online_ws):
    """The trainer's process only orders captures and files the answers; the requests and the records
    cost the capture process's CPU, not the training loop's (whose GIL they would share). With fp8 aux
    states (extract.aux_format) the window reserves fp8 sizes and the trainer reads bf16."""
    from engine.model.target import workspace_plan
    from engine.train.online import OnlineData

    ws, _ = online_ws
    # room for every record: no window waits
    ws.save_config(set_value(set_value(ws.config, "train.window_gb", 0.05), "extract.aux_format", "fp8"))
    ws.reload()
    data = OnlineData(ws, workspace_plan(ws), max_len=64, eval_fraction=0.0, batch_size=2)
    steps = 6
    order = data.train_entries
    batches = {step: [order[(2 * step + i) % len(order)] for i in range(2)] for step in range(steps)}
    data.start(lambda step: batches[step], 0, steps)
    capture_pid = None
    try:
        for step in range(steps):
            for entry in batches[step]:
                record = data.load(entry)
                assert record["hidden_state"].shape[0] == entry.tokens
                assert record["aux_hidden_state"].dtype == torch.bfloat16
                if capture_pid is None:
                    # A job's stop is SIGTERM to its process group: the trainer checkpoints at its next step
                    # and the batch it waits for must still come, so the capture process lets it pass.
                    capture_pid = data.capture_pid
                    assert capture_pid is not None
                    os.kill(capture_pid, signal.SIGTERM)
    finally:
        end = data.close()
    assert capture_pid is not None and capture_pid != os.getpid()
    assert not psutil.pid_exists(capture_pid) or psutil.Process(capture_pid).status() == psutil.STATUS_ZOMBIE
    assert end["captured"] == 2 * steps
    assert end["capture_cpu_s"] > 0.05, end  # a process's CPU: its imports alone take more
    assert end["producer_cpu_s"] < end["capture_cpu_s"], end
    assert not (window_dir(ws) / "stream").exists()  # emptied by close()


def test_a_checkpoint_resumes_only_in_its_mode_family(tiny_chat_model_dir, tmp_path):
    from engine.train.loop import Trainer, TrainError

    ws = make_workspace(tmp_path / "ws", tiny_chat_model_dir, **{"train.mode": "online"})
    trainer = Trainer(ws, device="cpu")
    trainer._check_data_mode({"mode": "hybrid", "epoch": 0, "next_index": 0})  # same samples, same order
    for data in ({"mode": "offline"}, None):  # None: saved before train.mode existed, i.e. offline
        with pytest.raises(TrainError, match="set train.mode back to 'offline'"):
            trainer._check_data_mode(data)
    ws.save_config(set_value(ws.config, "train.mode", "offline"))
    ws.reload()
    with pytest.raises(TrainError, match="train.run"):
        Trainer(ws, device="cpu")._check_data_mode({"mode": "online"})


def test_a_stop_while_the_trainer_waits_for_captures_checkpoints_at_once(online_ws):
    """The server stops under a running online job (stopped, not crashed: nobody restarts it), so the
    trainer waits for captures that will not come. `jobs stop` (SIGTERM) must still stop it cleanly and
    at once — checkpoint at the step it waited at, exit 0 — not after the grace's SIGKILL (it did)."""
    from engine.jobs.manager import JobManager

    ws, _ = online_ws
    jobs = JobManager(ws.jobs_dir)
    events: list[dict] = []
    info = run_job(ws, jobs, events, until=lambda ev: any(e.get("type") == "progress" and e["done"] >= 2 for e in ev))
    assert info.active, "\n".join(jobs.tail(info.id, 40))
    _, took = stop_while_waiting_for_captures(ws, jobs, info.id)
    assert took < 40, f"the stop took {took:.1f} s"  # the grace is 60 s: a SIGKILL would take longer


@pytest.mark.parametrize("online_ws", ["64m"], indirect=True)
def test_a_capture_process_killed_fails_the_batch_that_waits_naming_it(online_ws):
    """kill -9 of the capture process alone: the trainer's next wait for a record ends in an error that
    says what ended and how (the job then fails and resumes from its checkpoint, as after any crash)."""
    from engine.model.target import workspace_plan
    from engine.train.data import TrainDataError
    from engine.train.online import OnlineData

    ws, _ = online_ws
    ws.save_config(set_value(ws.config, "train.window_gb", 0.0002))  # a few records: captures stay ahead
    ws.reload()
    data = OnlineData(ws, workspace_plan(ws), max_len=64, eval_fraction=0.0, batch_size=2)
    order = data.train_entries
    batches = {step: [order[(2 * step + i) % len(order)] for i in range(2)] for step in range(20)}
    data.start(lambda step: batches[step], 0, 20)
    try:
        data.load(batches[0][0])
        pid = data.capture_pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(TrainDataError, match=r"the capture process ended \(killed by signal 9\)"):
            for step in range(20):
                for entry in batches[step][1 if step == 0 else 0:]:
                    data.load(entry)
    finally:
        data.close()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


@pytest.mark.parametrize("online_ws", ["64m"], indirect=True)
@pytest.mark.parametrize("outcome", ["succeeded", "failed"])
def test_a_full_disk_as_the_window_closes_keeps_the_runs_own_outcome(online_ws, monkeypatch, capfd, outcome):
    """The window's close writes its note (data.json); a full disk there raised OSError out of the
    trainer's cleanup, replacing its return 0, or its own error and fix."""
    import errno

    from engine.io import atomic
    from engine.train.data import TrainDataError
    from engine.train.loop import Trainer
    from engine.train.online import DATA_NOTE

    ws, _ = online_ws
    real_write_json, notes = atomic.write_json, []

    def full_for_the_closing_note(path, *args, **kwargs):
        if path.name == DATA_NOTE:
            notes.append(path)
            if len(notes) > 1:  # the first is the plan, written as the window opens
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_write_json(path, *args, **kwargs)

    monkeypatch.setattr(atomic, "write_json", full_for_the_closing_note)
    trainer = Trainer(ws, device="cpu", max_steps=2)
    if outcome == "failed":
        def first_batch_is_damaged(*args, **kwargs):
            raise TrainDataError("records/0001 sha256 mismatch: resume the extraction")

        monkeypatch.setattr(trainer, "train_step", first_batch_is_damaged)
        with pytest.raises(TrainDataError, match="resume the extraction"):
            trainer.run()
    else:
        assert trainer.run() == 0
    assert len(notes) == 2 and "online window closed without its note: [Errno 28]" in capfd.readouterr().err
    assert "window_peak" not in json.loads((ws.drafter_dir / DATA_NOTE).read_text())  # the plan stays


def test_kept_records_of_other_weights_are_dropped_and_said(tiny_chat_model_dir, tmp_path, capfd):
    """Kept records (hybrid) of an earlier session whose target was fine-tuned in place since: they hold the
    old model's states, so they are dropped (they can be captured again) and the log says how many and why;
    the same weights keep them, also moved to another path."""
    import shutil

    from engine.model.target import workspace_plan
    from engine.model.weights_id import weights_id
    from engine.records import RecordEntry, read_manifest, read_run_meta
    from engine.train.online import OnlineData
    from engine.workspace import Workspace
    from tests.helpers.online import ONLINE_TRAIN
    from tests.helpers.workspaces import write_conversations
    from tests.helpers.models import fine_tune_in_place

    model = tmp_path / "target"
    shutil.copytree(tiny_chat_model_dir, model)
    ws = make_workspace(tmp_path / "ws", model, **{**ONLINE_TRAIN, "train.mode": "hybrid",
                                                    "dataset.path": "train.jsonl"})
    write_conversations(ws.root / "train.jsonl", 12)

    def open_window() -> OnlineData:
        fresh = Workspace(ws.root)
        return OnlineData(fresh, workspace_plan(fresh), 64, 0.15, 2)

    first = open_window()
    kept, held = first.kept_dir, first.own_eval[0]
    assert read_run_meta(kept)["model_weights"] == weights_id(model)
    record = kept / "records" / "000" / "s.safetensors"
    record.parent.mkdir(parents=True)
    record.write_bytes(b"old states")
    entry = RecordEntry(held.id, held.index, "records/000/s.safetensors", 4, 2, 10, "0" * 64)
    (kept / "manifest.jsonl").write_text(entry.to_json() + "\n")
    assert len(read_manifest(kept)[0]) == 1
    capfd.readouterr()
    assert open_window().kept and "dropped" not in capfd.readouterr().err  # same weights, same dataset: kept
    moved = tmp_path / "moved"
    shutil.move(model, moved)
    ws.save_config(set_value(Workspace(ws.root).config, "model.path", str(moved)))
    assert open_window().kept and "dropped" not in capfd.readouterr().err  # the same weights elsewhere: kept
    model = moved
    fine_tune_in_place(model)
    open_window()
    said = capfd.readouterr().err
    assert f"note: {kept}: 1 kept record(s) of an earlier session dropped (model_weights changed)" in said, said
    assert read_run_meta(kept)["model_weights"] == weights_id(model) and not record.exists()
