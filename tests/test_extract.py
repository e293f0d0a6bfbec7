"""The extraction job against a real local server: correct records, resume after kill -9,
disk guardrails on a real tmpfs, a server killed mid-run, corrupted records redone."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from tests.helpers.models import fine_tune_in_place
from tests.helpers.processes import lock_held_by_another_process
from tests.helpers.slots import RequestSlots
from tests.helpers.workspaces import make_workspace, write_conversations
from engine.checks.context import CheckContext
from engine.config import set_value
from engine.extract.job import COMPLETE, Extractor
from engine.extract.launch import start_extraction
from engine.extract.plan import build_plan
from engine.extract.verify import check_run
from engine.jobs.manager import JobManager
from engine.pipeline import Pipeline
from engine.records import load_record, load_token_counts, read_manifest
from engine.server.manager import ServerManager

N_SAMPLES = 10


def _ws(tmp_path, model_dir, n=N_SAMPLES, **changes):
    ws = make_workspace(tmp_path / "ws", model_dir, **{"dataset.path": "train.jsonl", "extract.concurrency": 3,
                                                         **changes})
    write_conversations(ws.root / "train.jsonl", n)
    return ws


def _wait_job(jobs, job_id, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        info = jobs.get(job_id)
        if info.state not in ("starting", "running"):
            return info
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} did not finish in {timeout}s: {jobs.tail(job_id, 20)}")


def _events(jobs, job_id):
    return jobs.events(job_id, 0)[0]


def _assert_exactly_once(ws, n=N_SAMPLES):
    entries, problems = read_manifest(ws.hidden_dir)
    lines = [json.loads(line)["id"] for line in (ws.hidden_dir / "manifest.jsonl").read_text().splitlines() if line]
    assert len(lines) == len(set(lines)) == n, (problems, len(lines))
    check = check_run(ws.hidden_dir, 64, deep=True)
    assert len(check.good) == n and not check.problems, check.problems
    on_disk = sorted(p.name for p in ws.hidden_dir.glob("records/*/*.safetensors"))
    assert on_disk == sorted(f"{i}.safetensors" for i in lines)
    assert not list(ws.hidden_dir.rglob("*.tmp")), "no temp file left behind"


@pytest.fixture
def server_ws(tiny_chat_model_dir, tmp_path):
    ws = _ws(tmp_path, tiny_chat_model_dir)
    manager = ServerManager(ws)
    asyncio.run(manager.start())
    yield ws
    asyncio.run(manager.stop(grace=5))


def test_records_match_in_process_reference_and_stage_turns_green(server_ws, tiny_chat_model_dir):
    ws = server_ws
    assert asyncio.run(Extractor(ws).run()) == 0
    plan = build_plan(ws)
    _assert_exactly_once(ws)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_chat_model_dir)).eval()
    meta = json.loads((ws.hidden_dir / "run.json").read_text())
    layers = meta["layers"]
    entries, _ = read_manifest(ws.hidden_dir)
    for sample in plan.samples:
        record = load_record(ws.hidden_dir, entries[sample.id])
        assert record["input_ids"].tolist() == sample.input_ids
        assert record["loss_mask"].tolist() == sample.loss_mask
        assert 0 < int(record["loss_mask"].sum()) < len(sample.input_ids)
        with torch.no_grad():
            out = model(torch.tensor([sample.input_ids]), output_hidden_states=True)
            final = model.model(torch.tensor([sample.input_ids])).last_hidden_state[0]  # post final norm
        aux = torch.cat([out.hidden_states[i + 1][0] for i in layers], dim=-1)
        assert record["aux_hidden_state"].dtype == torch.bfloat16
        torch.testing.assert_close(record["aux_hidden_state"].float(), aux.to(torch.bfloat16).float(), atol=0.05, rtol=0.02)
        torch.testing.assert_close(record["hidden_state"].float(), final.to(torch.bfloat16).float(), atol=0.05, rtol=0.02)
    counts = load_token_counts(ws.hidden_dir)
    expected = sum(sum(s.loss_mask) for s in plan.samples)
    assert int(counts.sum()) == expected
    assert json.loads((ws.hidden_dir / COMPLETE).read_text())["samples"] == N_SAMPLES
    assert not any(ws.spool_dir.iterdir()), "spool emptied as records commit"
    report = asyncio.run(Pipeline(CheckContext(ws)).run_stage("extract"))
    assert report.state.value == "passed", [r.to_dict() for r in report.results]


def test_the_server_keeps_its_requests_while_records_are_written(server_ws, monkeypatch):
    """Record writes are off the request path: while a record is being written (slowed down here),
    the server still has all `extract.concurrency` requests, and never more. Each worker used to
    write its record before it sent the next request, leaving the server a slot short per write."""
    ws = server_ws
    concurrency = ws.config.extract.concurrency
    slots = RequestSlots(monkeypatch, concurrency)
    monkeypatch.setattr(Extractor, "_write", slots.slow(Extractor._write))
    assert asyncio.run(Extractor(ws).run()) == 0
    assert slots.most == concurrency, slots
    # Never, had the writing worker's slot stayed empty; the last writes find no sample left to send.
    assert slots.full_during_write >= 2, slots
    _assert_exactly_once(ws)


def test_kill_9_then_resume_gives_every_sample_exactly_once(tiny_chat_model_dir, tmp_path):
    ws = _ws(tmp_path, tiny_chat_model_dir, n=24, **{"extract.concurrency": 1})
    manager = ServerManager(ws)
    asyncio.run(manager.start())
    jobs = JobManager(ws.jobs_dir)
    try:
        for kill_after in (2, 9):
            job = start_extraction(ws, jobs)
            deadline = time.time() + 60
            while time.time() < deadline:
                progress = [e for e in _events(jobs, job.id) if e["type"] == "progress"]
                if progress and progress[-1]["done"] >= kill_after:
                    break
                time.sleep(0.05)
            jobs.kill(job.id)
            assert jobs.get(job.id).state in ("stopped", "failed", "lost")
        job = start_extraction(ws, jobs)
        info = _wait_job(jobs, job.id)
        assert info.state == "succeeded", jobs.tail(job.id, 30)
        started = [e for e in _events(jobs, job.id) if e["type"] == "started"][0]
        assert started["resumed"] >= 9 and started["todo"] == 24 - started["resumed"]
        _assert_exactly_once(ws, 24)
    finally:
        asyncio.run(manager.stop(grace=5))


def test_corrupted_record_is_detected_and_redone(server_ws):
    ws = server_ws
    assert asyncio.run(Extractor(ws).run()) == 0
    entries, _ = read_manifest(ws.hidden_dir)
    victim = sorted(entries.values(), key=lambda e: e.index)[3]
    path = ws.hidden_dir / victim.path
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped bit pattern mid-tensor: same size, wrong checksum
    path.write_bytes(bytes(data))
    report = asyncio.run(Pipeline(CheckContext(ws)).run_stage("extract"))
    assert report.state.value == "failed" and "checksum" in json.dumps(report.to_dict())
    assert asyncio.run(Extractor(ws).run()) == 0
    _assert_exactly_once(ws)


def test_dead_writers_temp_files_are_swept_and_a_locked_run_is_refused(server_ws):
    """A writer killed mid-write leaves `.NAME.XXXX.tmp` beside the records (or beside
    complete.json, when killed while finishing); the next session removes both (neither was ever
    renamed into place). While another process (a real one here) holds
    the run's lock, a second extraction and a release of that run are both refused."""
    from engine.extract.guard import ExtractionRefused
    from engine.extract.job import RUN_LOCK
    from engine.release import in_use_reason

    ws = server_ws
    run_dir, run_name = ws.hidden_dir, ws.config.extract.run
    dead = run_dir / "records" / "00000" / ".c007.safetensors.hby75h61.tmp"
    dead.parent.mkdir(parents=True)
    dead.write_bytes(b"half a record")
    dead_summary = run_dir / ".complete.json.8i7ddnxq.tmp"
    dead_summary.write_bytes(b'{"samples": ')
    with lock_held_by_another_process(run_dir, RUN_LOCK) as holder_pid:
        with pytest.raises(ExtractionRefused, match=f"being extracted by pid {holder_pid}"):
            asyncio.run(Extractor(ws).run())
        assert dead.exists() and dead_summary.exists(), "temp files are left alone while another writer may own them"
        ws.save_config(set_value(ws.config, "extract.run", "other"))  # else refused as the configured run
        ws.reload()
        reason = in_use_reason(ws, run_name)
        assert reason is not None and "is writing run" in reason, reason
    assert in_use_reason(ws, run_name) is None
    ws.save_config(set_value(ws.config, "extract.run", run_name))
    ws.reload()
    events = []
    extractor = Extractor(ws)
    extractor.event = lambda kind, **data: events.append((kind, data))
    assert asyncio.run(extractor.run()) == 0
    assert ("swept_temp", {"count": 2}) in events and not dead.exists() and not dead_summary.exists()
    _assert_exactly_once(ws)


def _mount_tmpfs(path, size):
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("tmpfs mount needs root (CI runs as root)")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount tmpfs: {proc.stderr.decode().strip()}")


def test_refuses_to_start_when_the_output_disk_is_too_small(tiny_chat_model_dir, tmp_path):
    out = tmp_path / "small"
    _mount_tmpfs(out, "64k")
    try:
        ws = _ws(tmp_path, tiny_chat_model_dir, **{"extract.output_dir": str(out)})
        manager = ServerManager(ws)  # without one the job refuses sooner, naming the server
        asyncio.run(manager.start())
        try:
            proc = subprocess.run([sys.executable, "-m", "engine.extract", "--workspace", str(ws.root)],
                                  capture_output=True, text=True, timeout=120)
        finally:
            asyncio.run(manager.stop(grace=5))
        assert proc.returncode == 2
        assert "refusing to start: needs" in proc.stdout and "free" in proc.stdout and "reserve" in proc.stdout
        assert "another disk" in proc.stdout
        assert not (out / "run1" / "manifest.jsonl").exists()
    finally:
        subprocess.run(["umount", str(out)], capture_output=True)


def test_pauses_when_disk_fills_and_resumes_when_freed(tiny_chat_model_dir, tmp_path):
    out = tmp_path / "disk"
    _mount_tmpfs(out, "24m")
    # Enough samples that the run cannot finish between the first progress event and the ballast.
    ws = _ws(tmp_path, tiny_chat_model_dir, n=200, **{"extract.output_dir": str(out), "extract.disk_reserve_gb": 0.01,
                                                       "extract.concurrency": 1})
    manager = ServerManager(ws)
    asyncio.run(manager.start())
    jobs = JobManager(ws.jobs_dir)
    ballast = out / "ballast.bin"
    try:
        job = start_extraction(ws, jobs)
        deadline = time.time() + 60
        while time.time() < deadline:
            progress = [e for e in _events(jobs, job.id) if e["type"] == "progress"]
            if progress and progress[-1]["done"] >= 2:
                break
            time.sleep(0.05)
        # Leave ~4 MiB free mid-run: under the ~10 MiB reserve (the budget check passed at start).
        free = os.statvfs(out).f_bavail * os.statvfs(out).f_frsize
        ballast.write_bytes(b"\0" * (free - 4 * 2**20))
        deadline = time.time() + 60
        while time.time() < deadline and not any(e["type"] == "paused" for e in _events(jobs, job.id)):
            time.sleep(0.1)
        paused = [e for e in _events(jobs, job.id) if e["type"] == "paused"]
        # Either the reserve check or a write that met the full disk pauses first: both are pauses.
        assert paused and ("under the reserve" in paused[0]["reason"] or "disk full" in paused[0]["reason"]), \
            jobs.tail(job.id, 20)
        time.sleep(1.0)
        assert jobs.get(job.id).state == "running", "paused, not crashed"
        done_while_paused = read_manifest(ws.hidden_dir)[0]
        ballast.unlink()
        info = _wait_job(jobs, job.id)
        assert info.state == "succeeded", jobs.tail(job.id, 30)
        assert any(e["type"] == "resumed" for e in _events(jobs, job.id))
        assert 2 <= len(done_while_paused) < 200
        _assert_exactly_once(ws, 200)
    finally:
        asyncio.run(manager.stop(grace=5))
        subprocess.run(["umount", str(out)], capture_output=True)


def test_server_killed_mid_run_is_restarted_and_the_job_completes(tiny_chat_model_dir, tmp_path):
    # Enough samples that the job is still running when the kill lands (a fast server did 30 before it).
    ws = _ws(tmp_path, tiny_chat_model_dir, n=120, **{"extract.concurrency": 1})
    manager = ServerManager(ws)
    first = asyncio.run(manager.start())
    jobs = JobManager(ws.jobs_dir)
    try:
        job = start_extraction(ws, jobs)
        deadline = time.time() + 60
        while time.time() < deadline:
            progress = [e for e in _events(jobs, job.id) if e["type"] == "progress"]
            if progress and progress[-1]["done"] >= 3:
                break
            time.sleep(0.05)
        os.kill(first.pid, signal.SIGKILL)
        info = _wait_job(jobs, job.id, timeout=180)
        assert info.state == "succeeded", jobs.tail(job.id, 30)
        kinds = [e["type"] for e in _events(jobs, job.id)]
        assert "server_down" in kinds and "server_restart" in kinds and "server_up" in kinds
        status = asyncio.run(manager.poll())
        assert status.state == "ready" and status.pid != first.pid and status.restarts == 1
        _assert_exactly_once(ws, 120)
    finally:
        asyncio.run(manager.stop(grace=5))
    assert not psutil.pid_exists(first.pid) or psutil.Process(first.pid).status() == psutil.STATUS_ZOMBIE


def test_run_with_other_settings_is_refused(server_ws):
    ws = server_ws
    assert asyncio.run(Extractor(ws, limit=3).run()) in (0, 3)
    ws.save_config(set_value(ws.config, "dataset.max_seq_len", 64))
    ws.reload()
    from engine.extract.guard import DiskBudgetError, ExtractionRefused

    with pytest.raises(ExtractionRefused, match="set extract.run to a new name") as info:
        asyncio.run(Extractor(ws).run())
    assert not isinstance(info.value, DiskBudgetError), "a settings mismatch is not a disk problem"


def test_a_job_refuses_to_start_when_no_server_runs_or_answers(tiny_chat_model_dir, tmp_path):
    """With the server stopped and nothing answering, extraction (and online training's capture, which
    checks the server the same way) is refused at once, naming the fix, instead of waiting for a server
    nobody starts. A crashed server is another matter: the job restarts it (test_kill_server)."""
    from engine.extract.guard import ExtractionRefused

    ws = _ws(tmp_path, tiny_chat_model_dir, n=2)
    started = time.monotonic()
    with pytest.raises(ExtractionRefused, match=r"no server answers at http://127\.0\.0\.1:\d+ and this workspace's "
                                                r"server is stopped: start it \(`eagle3-console server start`"):
        asyncio.run(Extractor(ws).run())
    assert time.monotonic() - started < 30
    assert not (ws.hidden_dir / "manifest.jsonl").exists()


def test_a_capture_written_after_its_rid_was_given_up_on_is_freed_when_the_run_ends(server_ws):
    """A writer that runs past extract.capture_wait_s writes a rid the job has already released and
    retried: at the end of the run (no request in flight) this session's strays are freed with the
    earlier sessions'; a rid of another workspace sharing the spool is left alone."""
    from engine.capture.segments import write_segment

    ws = server_ws
    extractor = Extractor(ws)
    states = (torch.arange(3), torch.zeros(3, 3 * 8, dtype=torch.bfloat16), torch.zeros(3, 8, dtype=torch.bfloat16))
    stray, foreign = f"x999-{extractor.tag}-a0", "x5-abcdef-a0"

    def event(kind, **data):
        if kind == "started":  # mid-run: the late write of a rid given up on, and another workspace's capture
            write_segment(ws.spool_dir, stray, 0, *states, [1, 2, 3])
            write_segment(ws.spool_dir, foreign, 0, *states, [1, 2, 3])

    extractor.event = event
    assert asyncio.run(extractor.run()) == 0
    assert (ws.spool_dir / foreign).is_dir(), "another workspace's capture is not ours to free"
    assert not (ws.spool_dir / stray).exists(), "this session's stray capture stays on the spool (often tmpfs)"
    _assert_exactly_once(ws)


def test_a_spool_folder_release_cannot_empty_keeps_the_record_and_the_foreign_file(server_ws, monkeypatch, capfd):
    """Something not ours lands in a rid's spool folder: reading that capture refuses it (a retry, under
    a new rid) and release keeps the file and its folder. That refusal must not crash the job (it
    did: release's error replaced the retry): every record lands once, the file is kept, and the
    job's log names the folder left in place."""
    import engine.capture.segments as segments

    ws = server_ws
    real_open, dropped = segments.open_capture, []

    def open_beside_a_foreign_file(spool, rid, *args, **kwargs):
        if not dropped:
            folder = Path(spool) / rid
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "notes.txt").write_text("an operator's file")
            dropped.append(folder)
        return real_open(spool, rid, *args, **kwargs)

    monkeypatch.setattr(segments, "open_capture", open_beside_a_foreign_file)
    extractor, events = Extractor(ws), []
    extractor.event = lambda kind, **data: events.append((kind, data))
    assert asyncio.run(extractor.run()) == 0
    retries = [data for kind, data in events if kind == "retry"]
    assert len(retries) == 1 and "notes.txt" in retries[0]["reason"], retries
    _assert_exactly_once(ws)
    assert (dropped[0] / "notes.txt").read_text() == "an operator's file"
    assert f"capture spool of {dropped[0].name} left in place" in capfd.readouterr().err


@pytest.mark.parametrize("reply", ["cached tokens", "refused", "resent after an outage"])
def test_a_refused_capture_beside_a_foreign_file_is_a_retry_not_a_crash(tmp_path, tiny_chat_model_dir, capfd, reply):
    """The three ways `request` gives a rid up release its spool folder first. A folder holding a file not
    ours used to raise out of them (SegmentError in place of SampleFailed) and end the extraction."""
    from types import SimpleNamespace

    from engine.capture.segments import write_segment
    from engine.client import ServerReplyError
    from engine.extract.job import SampleFailed

    ws = _ws(tmp_path, tiny_chat_model_dir)
    extractor = Extractor(ws)
    sample = build_plan(ws).samples[0]
    rid = f"x{sample.index}-{extractor.tag}-a0"
    n = len(sample.input_ids)

    class ServerStandIn:  # what the server's side leaves in the spool, then its answer
        async def generate(self, **request):
            assert request["rid"] == rid
            write_segment(ws.spool_dir, rid, 0, torch.tensor(sample.input_ids), torch.zeros(n, 3 * 64),
                          torch.zeros(n, 64), [1, 2, 3])
            (ws.spool_dir / rid / ".nfs0000000000000042").write_text("an NFS client's file")
            if reply == "refused":
                raise ServerReplyError("rid already in flight", status=409)
            cached = 2 if reply == "cached tokens" else 0
            return SimpleNamespace(meta={"cached_tokens": cached, "prompt_tokens": n})

    if reply == "resent after an outage":
        extractor._sent.add(rid)
        (ws.spool_dir / rid).mkdir(parents=True)
        (ws.spool_dir / rid / "notes.txt").write_text("an operator's file")
        assert asyncio.run(extractor.request(ServerStandIn(), sample, 0)) == rid
        assert (ws.spool_dir / rid / "notes.txt").exists()
    else:
        with pytest.raises(SampleFailed):
            asyncio.run(extractor.request(ServerStandIn(), sample, 0))
        assert (ws.spool_dir / rid / ".nfs0000000000000042").exists()
        assert not list((ws.spool_dir / rid).glob("*.safetensors"))
    assert f"capture spool of {rid} left in place" in capfd.readouterr().err


def test_a_limited_extraction_never_cuts_finished_records_out_of_the_run(server_ws):
    """`--limit 3` on a finished run of 10: the resume repair keeps only planned records, so it would rewrite
    the manifest with 3 and call the run complete. Refused instead, naming the fix; the run is untouched."""
    from engine.extract.guard import ExtractionRefused

    ws = server_ws
    assert asyncio.run(Extractor(ws).run()) == 0
    manifest = (ws.hidden_dir / "manifest.jsonl").read_bytes()
    with pytest.raises(ExtractionRefused, match=r"holds 7 finished record\(s\) beyond --limit 3.*new name"):
        asyncio.run(Extractor(ws, limit=3).run())
    assert (ws.hidden_dir / "manifest.jsonl").read_bytes() == manifest
    _assert_exactly_once(ws)
    ws.save_config(set_value(ws.config, "extract.run", "smoke"))  # a limited run of its own is fine
    ws.reload()
    assert asyncio.run(Extractor(ws, limit=3).run()) == 0
    _assert_exactly_once(ws, n=3)


def test_a_capture_lost_to_a_full_spool_pauses_the_sample_and_spends_no_retry(server_ws, monkeypatch):
    """The server answered, then found the spool full (its `.nospace` mark, put here the first time each
    of two samples is read): the job pauses and captures those samples again under the same attempt,
    so even with no retry allowed nothing is bad and every record is there once."""
    import engine.capture.segments as segments

    ws = server_ws
    ws.save_config(set_value(ws.config, "extract.max_retries", 0))
    ws.reload()
    real_open, lost = segments.open_capture, set()

    def open_after_a_full_spool(spool, rid, *args, **kwargs):
        sample = rid.split("-")[0]
        if sample in ("x0", "x1") and sample not in lost:
            lost.add(sample)
            segments.mark_failed(spool, rid, 0, "", no_space=True)
        return real_open(spool, rid, *args, **kwargs)

    monkeypatch.setattr(segments, "open_capture", open_after_a_full_spool)
    extractor, events = Extractor(ws), []
    extractor.event = lambda kind, **data: events.append((kind, data))
    assert asyncio.run(extractor.run()) == 0
    paused = [data["reason"] for kind, data in events if kind == "paused"]
    assert len(paused) == 2 and all("spool full while capturing" in r and "was full when the server wrote it" in r
                                    for r in paused), paused
    assert not [kind for kind, _ in events if kind in ("retry", "bad_sample")]
    _assert_exactly_once(ws)


def test_records_of_other_weights_are_not_resumed_vouched_for_or_trained_on(tiny_chat_model_dir, tmp_path):
    """A fine-tune of the target (same architecture and tokenizer: every shape agrees) saved over model.path
    after a run began: resuming would mix two models in one run, the stage would vouch for the records and
    training would fit a drafter to a model nobody serves. Each refuses, naming both weights and the fix.
    The same weights at another path (a moved model) are the same model: accepted."""
    import shutil

    from engine.extract.guard import ExtractionRefused
    from engine.train.loop import Trainer, TrainError

    model = tmp_path / "target"
    shutil.copytree(tiny_chat_model_dir, model)
    ws = _ws(tmp_path, model)
    manager = ServerManager(ws)
    asyncio.run(manager.start())
    try:
        assert asyncio.run(Extractor(ws, limit=3).run()) == 0
        captured_from = json.loads((ws.hidden_dir / "run.json").read_text())["model_weights"]
        assert isinstance(captured_from, str) and len(captured_from) == 16
        assert asyncio.run(Pipeline(CheckContext(ws)).run_stage("extract")).results[0].status.value == "pass"
        original = tmp_path / "original"
        shutil.copytree(model, original)
        fine_tune_in_place(model)
        asyncio.run(manager.stop(grace=5))  # the server loads the fine-tune (a running one would be drift)
        manager = ServerManager(ws.__class__(ws.root))
        asyncio.run(manager.start())
        manifest = (ws.hidden_dir / "manifest.jsonl").read_bytes()
        ws = ws.__class__(ws.root)
        with pytest.raises(ExtractionRefused, match=rf"captured from weights {captured_from}, but the files at "
                                                    rf"model.path {model} now hold weights [0-9a-f]{{16}} \(replaced "
                                                    r"since\).*mix two models"):
            asyncio.run(Extractor(ws).run())
        assert (ws.hidden_dir / "manifest.jsonl").read_bytes() == manifest
        run_row = asyncio.run(Pipeline(CheckContext(ws)).run_stage("extract")).results[0]
        assert run_row.name == "run" and run_row.status.value == "fail", run_row
        assert f"captured from weights {captured_from}" in run_row.evidence and "model.path back" in run_row.fix
        with pytest.raises(TrainError, match=rf"captured from weights {captured_from}.*set extract.run to a new"):
            Trainer(ws, max_steps=1).run()
        assert not (ws.drafter_dir / "metrics.jsonl").exists()

        # the original weights, moved: the same model (the server is restarted on them: it checks the path)
        asyncio.run(manager.stop(grace=5))
        ws.save_config(set_value(ws.config, "model.path", str(original)))
        ws.reload()
        manager = ServerManager(ws)
        asyncio.run(manager.start())
        assert asyncio.run(Extractor(ws).run()) == 0
        _assert_exactly_once(ws)
        assert asyncio.run(Pipeline(CheckContext(ws)).run_stage("extract")).state.value == "passed"
    finally:
        asyncio.run(manager.stop(grace=5))
