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

import pytest

from engine.config import ConfigError, parse_config, set_value
from tests.helpers.online import follow, start_training, stop_while_waiting_for_captures, two_rank_workspace
from tests.helpers.window import WindowSampler
from tests.helpers.workspaces import make_workspace


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

def test_two_ranks_in_hybrid_mode_each_keep_their_own_samples_within_their_share(tiny_chat_model_dir, tmp_path):
    """Hybrid on two torchrun ranks: each rank keeps (in `rank<r>/kept/`, with a manifest) training samples of
    its own batches, never streams a sample it kept, and never holds more than its half of the window."""
    from engine.records import read_manifest, verify_record
    from engine.train.data import is_eval
    from engine.train.online import LEDGER
    from engine.train.window import window_budget, window_dir

    hybrid = {"train.mode": "hybrid", "train.window_gb": 0.001, "train.epochs": 4}
    with two_rank_workspace(tiny_chat_model_dir, tmp_path, **hybrid) as (ws, jobs):
        budget, root = window_budget(ws.config), window_dir(ws)
        events: list[dict] = []
        with WindowSampler(root) as sampler:
            info = follow(jobs, start_training(ws, jobs).id, events)
        assert info.state == "succeeded", "\n".join(jobs.tail(info.id, 60))

    started = next(e for e in events if e.get("type") == "started")
    assert started["mode"] == "hybrid" and started["world"] == 2 and started["keep_budget"] > 0
    lines = [json.loads(line) for line in (ws.drafter_dir / LEDGER).read_text().splitlines()]
    fraction = ws.config.train.eval_fraction
    kept_by: dict[int, set[str]] = {}
    for rank in (0, 1):
        kept_dir = root / f"rank{rank}" / "kept"
        kept, _ = read_manifest(kept_dir)
        kept_by[rank] = {i for i in kept if not is_eval(i, fraction)}
        assert kept_by[rank], f"rank {rank} kept no training sample"
        assert all(verify_record(kept_dir, entry) is None for entry in kept.values())  # durable, hashed
        streamed = {l["id"] for l in lines if l["rank"] == rank and "kept_by" not in l}
        assert streamed and not streamed & kept_by[rank]  # kept once, read from disk by every later epoch
        assert 0 < sampler.rank_peak[f"rank{rank}"] <= budget // 2
    # A sample one rank kept is read from that rank's kept/ when the epoch's order hands it to the other.
    shared = [l for l in lines if "kept_by" in l]
    assert shared, "no rank read a record another rank kept"
    assert all(l["id"] in kept_by[int(l["kept_by"][4:])] and l["kept_by"] != f"rank{l['rank']}" for l in shared)
    assert 0 < sampler.peak <= budget and sampler.samples > 50
    assert (ws.drafter_dir / "export" / "config.json").is_file()
    print(f"2 ranks, hybrid: kept {[len(read_manifest(root / f'rank{r}' / 'kept')[0]) for r in (0, 1)]} records, "
          f"{len(shared)} reads of the other rank's; "
          f"window peak {sampler.peak:,} of {budget:,} bytes (per rank {dict(sampler.rank_peak)})")


def test_two_ranks_waiting_for_captures_stop_together_at_once(tiny_chat_model_dir, tmp_path):
    """The server stops under a running two-rank online job, so both ranks wait for captures that will not
    come. `jobs stop` must stop both at the same step with a checkpoint and exit 0, at once — not after
    the grace's SIGKILL (a rank waiting for its batch never reached the step's stop vote)."""
    with two_rank_workspace(tiny_chat_model_dir, tmp_path, **{"train.epochs": 20}) as (ws, jobs):
        events: list[dict] = []
        job = start_training(ws, jobs)
        follow(jobs, job.id, events, until=lambda ev: any(e.get("type") == "progress" and e["done"] >= 2 for e in ev))
        assert jobs.get(job.id).active, "\n".join(jobs.tail(job.id, 40))
        progressed = max(e["done"] for e in events if e.get("type") == "progress")
        step, took = stop_while_waiting_for_captures(ws, jobs, job.id)
    assert took < 40, f"the stop took {took:.1f} s"  # the grace is 60 s: a SIGKILL would take longer
    assert step >= progressed
    print(f"2 ranks waiting for captures: stopped at step {step} in {took:.1f} s, exit 0, checkpoint at {step}")
