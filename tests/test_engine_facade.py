"""The Engine facade the CLI stands on: `run_stages` (typed progress from check -> start the server
or job -> follow -> check again, on a real tiny model, server and extraction), its refusal of a
job whose prerequisite stage is red, `stop_job` with each kind's grace from the job registry, and
the `status()` snapshot."""

from __future__ import annotations

import asyncio
import os
import sys
import time

import pytest

from tests.helpers.workspaces import make_workspace, write_conversations
from eagle3_console.cli import RunPrinter
from engine import runner
from engine.core import Engine, ReadOnlyError
from engine.jobs.manager import JobManager
from engine.server.manager import ServerManager
from engine.registry import STOP_GRACE_S
from engine.workspace import init_workspace

N_CONVERSATIONS = 6


def _kinds(items) -> list[str]:
    """Item type names, runs of the followed job's events shortened to one."""
    out: list[str] = []
    for item in items:
        name = type(item).__name__
        if name in ("JobProgress", "JobEventRead") and out and out[-1] == "job events":
            continue
        out.append("job events" if name in ("JobProgress", "JobEventRead") else name)
    return out


async def _collect(engine: Engine, names: list[str], **kw) -> list:
    return [item async for item in engine.run_stages(names, **kw)]


def test_run_stages_starts_the_server_and_follows_the_extraction(tiny_chat_model_dir, tmp_path, capsys):
    ws = make_workspace(tmp_path / "ws", tiny_chat_model_dir, **{"dataset.path": "train.jsonl"})
    write_conversations(ws.root / "train.jsonl", N_CONVERSATIONS)

    async def run() -> list:
        engine = Engine(ws)
        try:
            return await _collect(engine, ["model", "server", "extract"])
        finally:
            await engine.close()

    try:
        items = asyncio.run(run())
    finally:
        asyncio.run(ServerManager(ws).stop(grace=5))
    assert _kinds(items) == [
        "Checking", "StageResult",  # model: green at first look
        "Checking", "StartingServer", "Checking", "StageResult",  # server: started, then checked again
        "Checking", "JobStarted", "job events", "JobEnded", "Checking", "StageResult",  # extract: its job
    ], _kinds(items)
    assert [i.stage for i in items if isinstance(i, runner.Checking)] == ["model", "server", "server", "extract",
                                                                          "extract"]
    results = {i.report.stage: i.report.state.value for i in items if isinstance(i, runner.StageResult)}
    assert results == {"model": "passed", "server": "passed", "extract": "passed"}, results
    started = next(i for i in items if isinstance(i, runner.JobStarted))
    ended = next(i for i in items if isinstance(i, runner.JobEnded))
    assert started.stage == "extract" and ended.job.id == started.job.id and ended.job.state == "succeeded"
    progress = [i.event for i in items if isinstance(i, runner.JobProgress)]
    assert progress and progress[-1].done == progress[-1].total == N_CONVERSATIONS  # typed (engine.jobs.events)
    kinds = [i.kind for i in items if isinstance(i, runner.JobEventRead)]
    assert "started" in kinds and "finished" in kinds, kinds
    assert all(i.job_id == started.job.id for i in items if isinstance(i, (runner.JobProgress, runner.JobEventRead)))

    # How `eagle3-console run` prints the same items.
    printer = RunPrinter()
    codes = [printer.show(item) for item in items]
    out = capsys.readouterr().out
    assert codes == [0] * len(items)
    lines = out.splitlines()
    order = ["✔ model", "starting the server…", "✔ server", f"extract: job {started.job.id} (detached",
             f"job {started.job.id} succeeded (exit 0)", "✔ extract"]
    at = [next(n for n, line in enumerate(lines) if line.startswith(want)) for want in order]
    assert at == sorted(at), out
    assert f"{N_CONVERSATIONS}/{N_CONVERSATIONS}" in out and "\r" in out  # the bar, redrawn in place
    assert f'  [started] {{"samples": {N_CONVERSATIONS}, ' in out, out  # other events: fields as written


def test_run_stages_stops_at_a_red_prerequisite_with_its_fix(tmp_path, tiny_chat_model_dir):
    ws = make_workspace(tmp_path / "ws", tiny_chat_model_dir, **{"model.path": str(tmp_path / "no-such-model")})

    async def run() -> tuple[list, list, list]:
        engine = Engine(ws)
        try:
            await engine.run_checks(["model"])
            refused = await _collect(engine, ["extract"])
            stopped = await _collect(engine, ["model", "extract"])
            forced = await _collect(engine, ["extract"], force=True)
            return refused, stopped, forced
        finally:
            await engine.close()

    jobs = JobManager(ws.jobs_dir)
    refused, stopped, forced = asyncio.run(run())
    try:
        assert _kinds(refused) == ["Checking", "PrerequisitesRed"]
        message = refused[-1].message
        assert message.startswith("not starting extract: its prerequisite stage(s) are red: model (")
        assert "no-such-model" in message, message  # the model check's own evidence and fix
        assert "eagle3-console check model" in message and "--force" in message
        assert _kinds(stopped) == ["Checking", "Checking", "StageResult", "StageNotGreen"]
        assert stopped[-1].stage == "model" and stopped[-1].report.state.value == "failed"
        assert isinstance(forced[-1], runner.StageNotGreen) and any(isinstance(i, runner.JobStarted) for i in forced)
        assert [j.kind for j in jobs.list()] == ["extract"], "only --force started a job"
    finally:
        for job in jobs.list():
            if job.active:
                jobs.kill(job.id)

    async def attached() -> None:
        driver, reader = Engine(ws), Engine(ws)
        try:
            assert reader.read_only
            with pytest.raises(ReadOnlyError, match="cannot run stages"):
                await _collect(reader, ["model"])
        finally:
            await reader.close()
            await driver.close()

    asyncio.run(attached())


# Ignores SIGTERM, so only the SIGKILL after the grace ends it.
STUBBORN_JOB = """
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
time.sleep(600)
"""


def test_stop_job_waits_each_kinds_grace_from_the_registry(tmp_path, monkeypatch):
    """Engine.stop_job without a grace takes the job kind's from engine.registry (no literal in the
    caller): with extract's set short and train's longer, only the train job outlives its SIGTERM that
    long. An explicit grace still wins."""
    monkeypatch.setitem(STOP_GRACE_S, "extract", 0.5)
    monkeypatch.setitem(STOP_GRACE_S, "train", 4.0)
    ws = init_workspace(tmp_path / "ws")
    jobs = JobManager(ws.jobs_dir)
    started = {kind: jobs.start(kind, [sys.executable, "-c", STUBBORN_JOB]) for kind in ("extract", "train",
                                                                                         "evaluate")}
    try:
        deadline = time.monotonic() + 30
        while not all("ready" in jobs.tail(j.id, 5) for j in started.values()):
            assert time.monotonic() < deadline, "the jobs did not start"
            time.sleep(0.1)

        async def stop(engine: Engine, kind: str, grace: float | None = None) -> tuple[float, object]:
            t0 = time.monotonic()
            final = await engine.stop_job(started[kind].id, grace=grace)
            return time.monotonic() - t0, final

        async def run():
            engine = Engine(ws)
            try:
                return await asyncio.gather(stop(engine, "extract"), stop(engine, "train"),
                                            stop(engine, "evaluate", grace=0.2))
            finally:
                await engine.close()

        (t_extract, extract), (t_train, train), (t_evaluate, evaluate) = asyncio.run(run())
        for final in (extract, train, evaluate):
            assert final.state == "stopped" and final.exit_code == -9, final  # SIGKILLed after the grace
        assert t_extract < 3.0, t_extract
        assert t_train >= 4.0, t_train
        assert t_evaluate < 3.0, t_evaluate
    finally:
        for job in started.values():
            if jobs.get(job.id).active:
                jobs.kill(job.id)


def test_status_is_a_typed_snapshot_naming_the_driver(tmp_path):
    ws = init_workspace(tmp_path / "ws")

    async def snapshots():
        alone = Engine(ws, drive=False)
        try:
            first = await alone.status()
        finally:
            await alone.close()
        driver, watcher = Engine(ws), Engine(ws, drive=False)
        try:
            return first, await watcher.status(), await driver.status()
        finally:
            await watcher.close()
            await driver.close()

    first, watched, own = asyncio.run(snapshots())
    assert first.driver is None and first.workspace == ws.root
    assert [r.stage for r in first.stages][:3] == ["gpus", "model", "dataset"]
    assert first.server.state == "stopped" and first.jobs == () and not first.evaluation.available
    assert watched.driver is not None and watched.driver.pid == os.getpid()
    assert own.driver is not None and own.driver.pid == os.getpid()
    data = first.to_dict()
    assert list(data) == ["workspace", "driver", "stages", "jobs", "evaluation", "server", "gpus", "disk"]
    assert "port_owner" in data["server"] and data["evaluation"]["available"] is False
    assert data["evaluation"]["reason"] == first.evaluation.reason != ""
