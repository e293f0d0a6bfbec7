"""GPU sets (server.gpus, train.gpus) and online training on several trainer ranks (issue 25).

The run test starts the training job as the console does (engine.train.launch: torchrun
--nproc-per-node 2, here on the CPU with gloo) against a real local target server, samples the window
while it runs, kills torchrun and both ranks with SIGKILL after a checkpoint, resumes, and reads the
consumption ledger: the ranks trained disjoint shards covering each epoch, the window (all ranks
together) never exceeded its budget, and what was trained twice is exactly what any rank consumed
at or after the checkpoint's step.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import psutil
import pytest

from engine.config import ConfigError, parse_config, set_value
from tests.helpers.window import WindowSampler, past_a_checkpoint
from tests.helpers.workspaces import make_workspace, write_conversations


def test_gpu_sets_reach_the_server_and_the_training_job(tiny_chat_model_dir, tmp_path):
    from engine.server.local import build_local_spec
    from engine.sglang.launch import build_sglang_spec
    from engine.train.launch import build_train_argv, train_env

    ws = make_workspace(tmp_path / "ws", tiny_chat_model_dir)
    assert train_env(ws) == {} and "CUDA_VISIBLE_DEVICES" not in build_local_spec(ws, capture=False).env_set
    for key, value in (("train.num_gpus", 2), ("train.gpus", [3, 1]), ("server.gpus", [2])):
        ws.save_config(set_value(ws.config, key, value))
        ws.reload()
    assert train_env(ws) == {"CUDA_VISIBLE_DEVICES": "3,1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    from engine.jobs.manager import JobManager
    from engine.registry import start_train

    jobs, handed = JobManager(ws.jobs_dir), {}
    real_start = jobs.start

    def recording_start(kind, argv, env=None, cwd=None):  # the real start, its env noted on the way
        handed.update(env or {})
        return real_start(kind, argv, env=env, cwd=cwd)

    jobs.start = recording_start  # type: ignore[method-assign]
    job = start_train(ws, jobs)  # the train stage's starter, as the console and `run train` call it
    asyncio.run(jobs.stop(job.id, grace=5))
    assert handed["CUDA_VISIBLE_DEVICES"] == "3,1" and "NCCL_NVLS_ENABLE" in handed
    assert "--nproc-per-node" in build_train_argv(ws, resume=False)
    assert build_local_spec(ws, capture=False).env["CUDA_VISIBLE_DEVICES"] == "2"
    config = set_value(ws.config, "model.backend", "sglang")
    with pytest.raises(ConfigError, match="server.gpus: lists 1 GPU"):  # tp 2 on the one GPU listed
        set_value(config, "model.tp_size", 2)
    for key, value in (("server.gpus", []), ("model.tp_size", 2), ("server.gpus", [0, 2])):
        config = set_value(config, key, value)
    ws.save_config(config)
    ws.reload()
    spec = build_sglang_spec(ws, capture=False, version="0.5.23", compute_capability=(9, 0))
    assert spec.env["CUDA_VISIBLE_DEVICES"] == "0,2" and spec.env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert any("server.gpus" in note for note in spec.notes)


def test_gpus_stage_shows_the_split_and_warns_when_online_training_would_share_several():
    from engine.checks.gpus import _split_check

    split = parse_config('[model]\nbackend = "sglang"\ntp_size = 2\n[server]\ngpus = [0, 1]\n'
                   '[train]\nmode = "online"\nnum_gpus = 2\ngpus = [2, 3]\n')
    result = _split_check(split, [0, 1, 2, 3])
    assert result.status.value == "pass" and result.evidence == "server GPU 0,1 · trainer GPU 2,3"
    missing = _split_check(split, [0, 1])
    assert missing.status.value == "fail" and "[2, 3] not visible" in missing.evidence and "nvidia-smi" in missing.fix
    shared = _split_check(parse_config('[train]\nmode = "online"\nnum_gpus = 2\n'), [0, 1])
    assert shared.status.value == "warn" and "same GPUs" in shared.evidence and "train.gpus" in shared.fix
    one = _split_check(parse_config('[train]\nmode = "online"\n'), [0])  # one GPU, shared: the H200 has room
    assert one.status.value == "pass" and one.evidence == "server every visible GPU · trainer every visible GPU"


def test_a_window_left_by_another_rank_count_is_removed(tmp_path):
    """Its bytes would sit on the disk in no rank's budget."""
    from engine.train.window import drop_other_layouts

    root = tmp_path / "window"
    for name in ("rank0", "rank1", "rank2", "stream", "kept"):
        (root / name).mkdir(parents=True)
        (root / name / "r.safetensors").write_bytes(b"x" * 10)
    drop_other_layouts(root, 2)
    assert sorted(p.name for p in root.iterdir()) == ["rank0", "rank1"]
    (root / "kept").mkdir()
    drop_other_layouts(root, 1)
    assert sorted(p.name for p in root.iterdir()) == ["kept"]


# ---------------------------------------------------------------------------- two trainer ranks

TRAIN = {"train.draft_vocab_size": 128, "train.max_len": 64, "train.batch_size": 1, "train.ttt_steps": 2,
         "train.log_every": 1, "train.save_every": 3, "train.eval_fraction": 0.15, "train.epochs": 2,
         "train.learning_rate": 1e-2, "extract.concurrency": 2, "train.mode": "online", "train.window_gb": 0.0002,
         "train.num_gpus": 2}


def start_training(ws, jobs):
    """The training job as the train stage starts it (engine.registry.start_train: torchrun's argv, the
    NCCL env and train_env)."""
    from engine.registry import start_train

    return start_train(ws, jobs)


def follow(jobs, job_id: str, sink: list[dict], until=None, timeout: float = 120.0):
    offset, deadline = 0, time.monotonic() + timeout
    while time.monotonic() < deadline:
        events, offset = jobs.events(job_id, offset)
        sink.extend(events)
        info = jobs.get(job_id)
        if until is not None and until(sink):
            return info
        if not info.active:
            sink.extend(jobs.events(job_id, offset)[0])
            return info
        time.sleep(0.01)
    raise AssertionError(f"training job {job_id} still running after {timeout:.0f}s: {jobs.tail(job_id, 20)}")


def test_two_ranks_train_disjoint_shards_within_the_window_and_resume_after_kill(tiny_chat_model_dir, tmp_path):
    from engine.jobs.manager import JobManager
    from engine.server.manager import ServerManager
    from engine.train.online import LEDGER
    from engine.train.window import window_budget, window_dir

    ws = make_workspace(tmp_path / "ws", tiny_chat_model_dir, **{**TRAIN, "dataset.path": "train.jsonl",
                                                                 "extract.output_dir": str(tmp_path / "disk")})
    write_conversations(ws.root / "train.jsonl", 16)
    budget, root = window_budget(ws.config), window_dir(ws)
    jobs, manager = JobManager(ws.jobs_dir), ServerManager(ws)
    asyncio.run(manager.start())
    try:
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
            assert info.state == "succeeded", jobs.tail(info.id, 30)
    finally:
        asyncio.run(manager.stop(grace=5))

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
    # The guarantee, on both ranks: exactly what the killed run consumed at or after the checkpoint's step.
    assert twice == {(s, i) for _, s, i in before if s >= c} and twice
    assert {s for _, s, _ in after} == set(range(c, total))
    assert len(after) == len(set(after)) == 2 * (total - c)

    ends = [e for e in second if e.get("type") == "window" and "window_peak" in e]
    assert ends and 0 < ends[-1]["window_peak"] <= budget  # the ranks' peaks summed
    assert sampler.samples > 50 and 0 < sampler.peak <= budget
    assert set(sampler.rank_peak) == {"rank0", "rank1"} and max(sampler.rank_peak.values()) <= budget // 2
    assert (ws.drafter_dir / "export" / "config.json").is_file()
    print(f"2 ranks: resumed from step {c} of {total}; {len(twice)} samples trained twice; window peak "
          f"{sampler.peak:,} of {budget:,} bytes (per rank {dict(sampler.rank_peak)}) over {sampler.samples} samples")


def test_two_ranks_in_hybrid_mode_each_keep_their_own_samples_within_their_share(tiny_chat_model_dir, tmp_path):
    """Hybrid on two torchrun ranks: each rank keeps (in `rank<r>/kept/`, with a manifest) training samples of
    its own batches, never streams a sample it kept, and never holds more than its half of the window."""
    from engine.jobs.manager import JobManager
    from engine.records import read_manifest, verify_record
    from engine.server.manager import ServerManager
    from engine.train.data import is_eval
    from engine.train.online import LEDGER
    from engine.train.window import window_budget, window_dir

    ws = make_workspace(tmp_path / "ws", tiny_chat_model_dir,
                        **{**TRAIN, "train.mode": "hybrid", "train.window_gb": 0.001, "dataset.path": "train.jsonl",
                           "extract.output_dir": str(tmp_path / "disk")})
    write_conversations(ws.root / "train.jsonl", 16)
    budget, root = window_budget(ws.config), window_dir(ws)
    jobs, manager = JobManager(ws.jobs_dir), ServerManager(ws)
    asyncio.run(manager.start())
    try:
        events: list[dict] = []
        with WindowSampler(root) as sampler:
            info = follow(jobs, start_training(ws, jobs).id, events)
        assert info.state == "succeeded", jobs.tail(info.id, 30)
    finally:
        asyncio.run(manager.stop(grace=5))

    started = next(e for e in events if e.get("type") == "started")
    assert started["mode"] == "hybrid" and started["world"] == 2 and started["keep_budget"] > 0
    lines = [json.loads(line) for line in (ws.drafter_dir / LEDGER).read_text().splitlines()]
    fraction = ws.config.train.eval_fraction
    for rank in (0, 1):
        kept_dir = root / f"rank{rank}" / "kept"
        kept, _ = read_manifest(kept_dir)
        kept_train = {i for i in kept if not is_eval(i, fraction)}
        assert kept_train, f"rank {rank} kept no training sample"
        assert all(verify_record(kept_dir, entry) is None for entry in kept.values())  # durable, hashed
        streamed = {l["id"] for l in lines if l["rank"] == rank}
        assert streamed and not streamed & kept_train  # kept once, read from disk by every later epoch
        assert 0 < sampler.rank_peak[f"rank{rank}"] <= budget // 2
    assert 0 < sampler.peak <= budget and sampler.samples > 50
    assert (ws.drafter_dir / "export" / "config.json").is_file()
    print(f"2 ranks, hybrid: kept {[len(read_manifest(root / f'rank{r}' / 'kept')[0]) for r in (0, 1)]} records; "
          f"window peak {sampler.peak:,} of {budget:,} bytes (per rank {dict(sampler.rank_peak)})")
