"""kill -9 in online training (train.mode = online): of the trainer on one rank, of the target server
mid-epoch, and of torchrun with two ranks. Each resumes from its checkpoint, retrains exactly the samples
consumed after it (from the consumption ledger), and the window never exceeds its budget (sampled every
few milliseconds; on a tmpfs barely larger than the window when the suite runs as root). Everything runs
against a real local target server (tiny Llama on CPU) on 127.0.0.1."""

from __future__ import annotations

import json
import os
import signal
import time

import psutil
import pytest

from engine.config import set_value
from faults import ledger
from tests.helpers.online import (
    follow,
    online_workspace,
    run_job,
    run_job_until_end,
    start_training,
    two_rank_workspace,
)
from tests.helpers.window import WindowSampler, past_a_checkpoint, window_bytes


@pytest.fixture
def online_ws(tiny_chat_model_dir, tmp_path):
    with online_workspace(tiny_chat_model_dir, tmp_path) as made:
        yield made


def test_online_training_killed_resumes_and_retrains_only_what_followed_the_checkpoint(online_ws):
    from engine.checks.context import CheckContext
    from engine.checks.disk import check_disk
    from engine.checks.train import check_train
    from engine.jobs.manager import JobManager
    from engine.pipeline import get_stage
    from engine.train.online import LEDGER
    from engine.train.window import window_budget, window_dir

    ws, mounted = online_ws
    budget = window_budget(ws.config)
    root = window_dir(ws)
    jobs = JobManager(ws.jobs_dir)

    first: list[dict] = []
    with WindowSampler(root) as sampler:
        info = run_job(ws, jobs, first, until=past_a_checkpoint)
        assert info.active, f"the run ended before a checkpoint and two more steps: {first[-5:]}"
        killed_after = [e["done"] for e in first if e.get("type") == "progress"][-1]
        capturing = [p for p in psutil.Process(info.pid).children() if "engine.train.capture_process" in p.cmdline()]
        assert len(capturing) == 1, "the captures run in a process of the trainer's own"
        os.kill(info.pid, signal.SIGKILL)  # the trainer itself, at once
        _, alive = psutil.wait_procs(capturing, timeout=20)
        assert not alive, "the capture process outlived its trainer"
        while jobs.get(info.id).active:
            time.sleep(0.05)
        started = next(e for e in first if e.get("type") == "started")
        assert started["mode"] == "online" and started["window_budget"] == budget
        assert started["offline_bytes"] > budget  # the point: the run does not fit the window
        live = [e for e in first if e.get("type") == "progress"][-1]
        assert live["window_budget"] == budget and 0 <= live["window_bytes"] <= budget
        assert live["capture_tokens_per_s"] >= 0 and live["train_tokens_per_s"] >= 0 and live["epoch"] >= 1

        second: list[dict] = []
        info = run_job(ws, jobs, second)
        assert info.state == "succeeded", "\n".join(jobs.tail(info.id, 60))
    resumed = next(e for e in second if e.get("type") == "resumed")
    c = resumed["step"]
    total = resumed_total = next(e for e in second if e.get("type") == "started")["total_steps"]
    steps_per_epoch = total // ws.config.train.epochs
    assert (resumed["epoch"], resumed["next_index"]) == (c // steps_per_epoch, (c % steps_per_epoch) * 2)

    lines = [json.loads(line) for line in (ws.drafter_dir / LEDGER).read_text().splitlines()]
    pids = list(dict.fromkeys(line["pid"] for line in lines))
    assert len(pids) == 2
    before = [(l["step"], l["id"]) for l in lines if l["pid"] == pids[0]]
    after = [(l["step"], l["id"]) for l in lines if l["pid"] == pids[1]]
    twice = set(before) & set(after)
    stated = {pair for pair in before if pair[0] >= c}
    broken = (len(twice ^ stated) + len(set(range(c, resumed_total)) ^ {step for step, _ in after})
              + len(after) - len(set(after)) + int(sampler.peak > budget))
    ledger.add("kill -9 online training", trials=1, faults=1, records=len(before) + len(after), losses=broken)
    # The guarantee: exactly what the killed run consumed at or after the checkpoint's step is trained again.
    assert twice == stated
    assert twice and all(step >= c for step, _ in twice)
    assert {step for step, _ in after} == set(range(c, resumed_total))  # every later step, once
    assert {step for step, _ in before} >= set(range(c))  # every earlier step was consumed before the kill
    assert len(after) == len(set(after))
    print(f"killed after step {killed_after}, resumed from {c}: {len(twice)} samples trained twice "
          f"(steps {min(s for s, _ in twice)}-{max(s for s, _ in twice)}), window peak {sampler.peak:,} of "
          f"{budget:,} bytes over {sampler.samples} samples{' on a 256k tmpfs' if mounted else ''}")

    assert sampler.samples > 50 and 0 < sampler.peak <= budget
    assert not (root / "stream").exists() or window_bytes(root / "stream") == 0  # emptied at the end
    ends = [e for e in second if e.get("type") == "window" and "window_peak" in e]
    assert ends and ends[-1]["window_peak"] <= budget and ends[-1]["captured"] > 0
    assert (ws.drafter_dir / "export" / "config.json").is_file()

    ctx = CheckContext(ws)
    train = check_train(ctx)
    assert train[0].status.value == "pass" and "trained online" in train[0].evidence, train[0].evidence
    disk = {r.name: r for r in check_disk(ctx)}
    assert disk["budget"].status.value == "pass" and "never exceed the window" in disk["budget"].evidence
    extract = get_stage("extract").checks(ctx)
    assert extract[0].status.value == "pass" and extract[0].evidence.startswith("not needed")
    ws.save_config(set_value(ws.config, "train.mode", "offline"))
    ws.reload()
    assert get_stage("extract").checks(CheckContext(ws))[0].status.value == "fail"


def test_online_training_rides_out_a_server_killed_mid_epoch(online_ws):
    """kill -9 of the target server while the trainer waits on captures: the capture path's outage
    handling restarts the server the engine owns, and training finishes within its window."""
    from engine.jobs.manager import JobManager
    from engine.server.manager import ServerManager
    from engine.train.online import LEDGER
    from engine.train.window import window_budget, window_dir

    ws, _ = online_ws
    budget, root = window_budget(ws.config), window_dir(ws)
    jobs, manager = JobManager(ws.jobs_dir), ServerManager(ws)
    server = manager.job()
    assert server is not None and server.pid
    events: list[dict] = []
    with WindowSampler(root) as sampler:
        info = run_job(ws, jobs, events, until=lambda ev: any(e.get("type") == "progress" and e["done"] >= 3
                                                               for e in ev))
        os.kill(server.pid, signal.SIGKILL)
        info = run_job_until_end(jobs, info.id, events)
    consumed = len((ws.drafter_dir / LEDGER).read_text().splitlines())
    ledger.add("kill -9 server during online training", trials=1, faults=1, records=consumed,
               losses=int(info.state != "succeeded") + int(sampler.peak > budget))
    assert info.state == "succeeded", "\n".join(jobs.tail(info.id, 60))
    kinds = [e.get("type") for e in events]
    assert "server_down" in kinds and "server_restart" in kinds and "server_up" in kinds, kinds
    # every request in flight met the outage; it is said once (it was once per capture worker)
    assert kinds.count("server_down") == kinds.count("server_up") == kinds.count("server_restart") == 1, kinds
    restarted = manager.job()
    assert restarted is not None and restarted.pid != server.pid
    assert (ws.drafter_dir / "export" / "config.json").is_file() and 0 < sampler.peak <= budget


def test_two_ranks_train_disjoint_shards_within_the_window_and_resume_after_kill(tiny_chat_model_dir, tmp_path):
    from engine.train.online import LEDGER
    from engine.train.window import window_budget, window_dir

    with two_rank_workspace(tiny_chat_model_dir, tmp_path) as (ws, jobs):
        budget, root = window_budget(ws.config), window_dir(ws)
        first: list[dict] = []
        with WindowSampler(root) as sampler:
            info = start_training(ws, jobs)
            torchrun = psutil.Process(info.pid)
            info = follow(jobs, info.id, first, until=past_a_checkpoint)
            assert info.active, f"the run ended before a checkpoint and two more steps: {jobs.tail(info.id, 20)}"
            ranks = torchrun.children(recursive=True)
            assert len(ranks) >= 2
            torchrun.send_signal(signal.SIGKILL)  # kill -9 of the job: its ranks (own sessions) die with it
            _, alive = psutil.wait_procs(ranks, timeout=20)
            assert not alive, f"ranks left running after torchrun was killed: {alive}"
            while jobs.get(info.id).active:
                time.sleep(0.05)
            started = next(e for e in first if e.get("type") == "started")
            assert started["world"] == 2 and started["window_budget"] == budget
            second: list[dict] = []
            info = follow(jobs, start_training(ws, jobs).id, second)
            # the whole log: torchrun's own traceback alone fills the last 30 lines, the rank's error is above
            assert info.state == "succeeded", "\n".join(jobs.tail(info.id, 300))

    resumed = next(e for e in second if e.get("type") == "resumed")
    c, total = resumed["step"], next(e for e in second if e.get("type") == "started")["total_steps"]
    steps_per_epoch = total // ws.config.train.epochs
    assert resumed["next_index"] == (c % steps_per_epoch) * 2  # batch 1 x 2 ranks per step

    lines = [json.loads(line) for line in (ws.drafter_dir / LEDGER).read_text().splitlines()]
    pids = list(dict.fromkeys(line["pid"] for line in lines))
    assert len(pids) == 4  # two ranks, two sessions
    session = {pid: 0 if pid in pids[:2] else 1 for pid in pids}  # the killed run ended before the second began
    before = [(l["rank"], l["step"], l["id"]) for l in lines if session[l["pid"]] == 0]
    after = [(l["rank"], l["step"], l["id"]) for l in lines if session[l["pid"]] == 1]
    assert {r for r, _, _ in before} == {r for r, _, _ in after} == {0, 1}

    # Disjoint shards covering each epoch, over what the weights kept: the killed run's steps before the
    # checkpoint, then the resumed run's.
    trained = [(r, s, i) for r, s, i in before if s < c] + after
    train_count = started["train"]
    for epoch in range(ws.config.train.epochs):
        steps = range(epoch * steps_per_epoch, (epoch + 1) * steps_per_epoch)
        shard = {r: [i for rr, s, i in trained if rr == r and s in steps] for r in (0, 1)}
        assert len(shard[0]) == len(shard[1]) == steps_per_epoch, shard
        assert not set(shard[0]) & set(shard[1])
        assert len(set(shard[0]) | set(shard[1])) == 2 * steps_per_epoch > train_count - 2  # all but the remainder

    twice = {(s, i) for _, s, i in before} & {(s, i) for _, s, i in after}
    stated = {(s, i) for _, s, i in before if s >= c}
    broken = (len(twice ^ stated) + len(set(range(c, total)) ^ {s for _, s, _ in after}) + len(after) - len(set(after))
              + int(sampler.peak > budget) + sum(peak > budget // 2 for peak in sampler.rank_peak.values()))
    ledger.add("kill -9 online training, 2 ranks", trials=1, faults=1, records=len(before) + len(after), losses=broken)
    # The guarantee, on both ranks: exactly what the killed run consumed at or after the checkpoint's step.
    assert twice == stated and twice
    assert {s for _, s, _ in after} == set(range(c, total))
    assert len(after) == len(set(after)) == 2 * (total - c)

    ends = [e for e in second if e.get("type") == "window" and "window_peak" in e]
    assert ends and 0 < ends[-1]["window_peak"] <= budget  # the ranks' peaks summed
    assert sampler.samples > 50 and 0 < sampler.peak <= budget
    assert set(sampler.rank_peak) == {"rank0", "rank1"} and max(sampler.rank_peak.values()) <= budget // 2
    assert (ws.drafter_dir / "export" / "config.json").is_file()
    print(f"2 ranks: resumed from step {c} of {total}; {len(twice)} samples trained twice; window peak "
          f"{sampler.peak:,} of {budget:,} bytes (per rank {dict(sampler.rank_peak)}) over {sampler.samples} samples")


def test_a_full_disk_under_the_window_fails_the_job_naming_the_disk_and_the_fix(tiny_chat_model_dir, tmp_path):
    """train.window_gb larger than the disk it lives on (a 256k tmpfs, 2 MB window): the write that finds the
    disk full fails the job with the window's directory and what to change, not a bare OSError; the
    checkpoints it wrote stay (a restart resumes from them)."""
    from engine.jobs.manager import JobManager

    with online_workspace(tiny_chat_model_dir, tmp_path) as (ws, mounted):
        if not mounted:
            pytest.skip("needs a small tmpfs under the window (run as root)")
        ws.save_config(set_value(ws.config, "train.window_gb", 0.002))
        ws.reload()
        jobs = JobManager(ws.jobs_dir)
        events: list[dict] = []
        info = run_job(ws, jobs, events)
    said = " ".join([*(str(e.get("message") or e.get("reason") or "") for e in events), *jobs.tail(info.id, 40)])
    named = "disk full while writing the online window" in said and "train.window_gb" in said
    ledger.add("disk full under the online window", trials=1, faults=1, losses=int(info.state != "failed" or not named))
    assert info.state == "failed", "\n".join(jobs.tail(info.id, 60))
    assert named, said[-3000:]
    assert "resumes from its checkpoint" in said
