"""The engine owning a real local server process: start, stages `server` and `capture`,
crash detection and restart, fail-fast start errors, stop leaving nothing behind."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers.processes import writer_child_pid
from tests.helpers.workspaces import make_workspace, write_conversations
from engine.checks.context import CheckContext
from engine.pipeline import Pipeline
from engine.server.manager import ServerManager, ServerStartError

@pytest.fixture(scope="module")
def chat_model_dir(tiny_chat_model_dir):
    return tiny_chat_model_dir


def make_ws(tmp_path, model_dir, **changes):
    return make_workspace(tmp_path / "ws", model_dir, **changes)


@pytest.fixture(scope="module")
def running(chat_model_dir, tmp_path_factory):
    ws = make_ws(tmp_path_factory.mktemp("srv"), chat_model_dir)
    manager = ServerManager(ws)
    status = asyncio.run(manager.start())
    yield ws, manager, status
    asyncio.run(manager.stop(grace=5))


def test_start_reports_ready_with_capture_flags(running):
    ws, manager, status = running
    assert status.state == "ready"
    assert status.url.startswith("http://127.0.0.1:")
    assert status.capture["enabled"] is True
    assert status.flags["disable_radix_cache"] is True
    assert status.flags["prefill_graphs"] == "off"  # CPU: no CUDA graphs, as the local server says
    assert psutil.pid_exists(status.pid)
    record = manager.record()
    assert record["desired"] == "running" and record["job_id"] == status.job_id


def test_server_and_capture_stages_pass_for_real(running):
    ws, manager, _ = running
    pipeline = Pipeline(CheckContext(ws))
    server = asyncio.run(pipeline.run_stage("server"))
    assert server.state.value == "passed", [r.to_dict() for r in server.results]
    assert "tok/s" in {r.name: r for r in server.results}["decode"].evidence
    capture = asyncio.run(pipeline.run_stage("capture"))
    assert capture.state.value == "passed", [r.to_dict() for r in capture.results]
    evidence = {r.name: r.evidence for r in capture.results}
    assert "cached_tokens = 0" in evidence["cached"]
    assert "= server's next token" in evidence["argmax"]
    # the probe released its spool
    spool = ws.spool_dir
    assert not any(spool.iterdir()) if spool.exists() else True


def test_capture_stage_beside_a_foreign_file_says_so_instead_of_crashing(running, monkeypatch):
    """A file not ours lands in the probe's spool folder: reading the capture refuses it (the stage is red
    with why), release keeps it and the check says where, instead of "check crashed" (release's error
    used to replace the verdict)."""
    import engine.capture.segments as segments

    ws, _, _ = running
    real_open, folders = segments.open_capture, []

    def open_beside_a_foreign_file(spool, rid, *args, **kwargs):
        (Path(spool) / rid).mkdir(parents=True, exist_ok=True)
        (Path(spool) / rid / "notes.txt").write_text("an operator's file")
        folders.append(Path(spool) / rid)
        return real_open(spool, rid, *args, **kwargs)

    monkeypatch.setattr(segments, "open_capture", open_beside_a_foreign_file)
    capture = asyncio.run(Pipeline(CheckContext(ws)).run_stage("capture"))
    results = {r.name: r for r in capture.results}
    assert capture.state.value == "failed" and "crashed" not in str([r.to_dict() for r in capture.results])
    assert "notes.txt" in results["spool"].evidence and results["spool"].status.value == "warn", results
    assert str(folders[0]) in results["spool"].fix
    assert (folders[0] / "notes.txt").read_text() == "an operator's file"
    assert [p.name for p in folders[0].iterdir()] == ["notes.txt"]  # the capture itself was released
    (folders[0] / "notes.txt").unlink()
    folders[0].rmdir()


def test_second_start_reuses_the_running_server(running):
    ws, manager, status = running
    again = asyncio.run(manager.start())
    assert again.job_id == status.job_id


def test_capture_stage_fails_when_server_runs_without_capture(chat_model_dir, tmp_path):
    # The probe waits extract.capture_wait_s for segments that may come after the answer (SGLang); none come here.
    ws = make_ws(tmp_path, chat_model_dir, **{"extract.capture_wait_s": 1.0})
    manager = ServerManager(ws)
    asyncio.run(manager.start(capture=False))
    try:
        pipeline = Pipeline(CheckContext(ws))
        server = asyncio.run(pipeline.run_stage("server"))
        flags = {r.name: r for r in server.results}["flags"]
        assert flags.status.value == "fail" and "capture is not enabled" in flags.evidence
        capture = asyncio.run(pipeline.run_stage("capture"))
        assert capture.state.value == "failed"
        assert "no usable capture" in capture.results[-1].evidence
        assert "after waiting 1 s for the server's capture writer" in capture.results[-1].evidence
    finally:
        asyncio.run(manager.stop(grace=5))


def test_capture_stage_fails_at_once_when_the_writer_loses_a_capture_after_the_answer(chat_model_dir, tmp_path,
                                                                                     monkeypatch):
    """The server's writer process stopped: the probe is answered (its states are in the child's hands) and
    waits for the segments; the child killed once the answer is back: the stage fails then, with the reason
    and what to do, not after extract.capture_wait_s."""
    from engine.client import ServerClient

    ws = make_ws(tmp_path, chat_model_dir, **{"extract.capture_wait_s": 120.0})
    manager = ServerManager(ws)
    asyncio.run(manager.start())
    try:
        child = writer_child_pid(asyncio.run(_server_info(manager))["capture"]["writer"])
        os.kill(child, signal.SIGSTOP)
        real_generate, answered = ServerClient.generate, []

        async def kill_the_writer_once_answered(self, *args, **kwargs):
            result = await real_generate(self, *args, **kwargs)
            answered.append(time.monotonic())
            os.kill(child, signal.SIGKILL)  # after the answer, never before: else threads write the probe
            return result

        monkeypatch.setattr(ServerClient, "generate", kill_the_writer_once_answered)
        capture = asyncio.run(Pipeline(CheckContext(ws)).run_stage("capture"))
        assert len(answered) == 1 and time.monotonic() - answered[0] < 60
        assert capture.state.value == "failed"
        tokens = {r.name: r for r in capture.results}["tokens"]
        assert "failed in the server's writer" in tokens.evidence and "exited (code -9)" in tokens.evidence
        assert "failed after answering" in tokens.fix
    finally:
        asyncio.run(manager.stop(grace=5))


async def _server_info(manager) -> dict:
    client = manager.client()
    try:
        return await client.server_info()
    finally:
        await client.aclose()


def test_kill_9_is_detected_as_crash_and_restarted(chat_model_dir, tmp_path):
    ws = make_ws(tmp_path, chat_model_dir)
    manager = ServerManager(ws)
    first = asyncio.run(manager.start())
    try:
        os.kill(first.pid, signal.SIGKILL)
        deadline = time.time() + 15
        status = asyncio.run(manager.poll())
        while status.state != "crashed" and time.time() < deadline:
            time.sleep(0.2)
            status = asyncio.run(manager.poll())
        assert status.state == "crashed"
        assert status.exit_code == -9
        restarted = asyncio.run(manager.ensure_running())
        assert restarted.state == "ready" and restarted.pid != first.pid
        assert restarted.restarts == 1
    finally:
        asyncio.run(manager.stop(grace=5))
    stopped = asyncio.run(manager.poll())
    assert stopped.state == "stopped"


def _watch_until(manager: ServerManager, predicate, timeout: float = 60.0) -> list:
    """Run the console's watcher (crash detection and restart) until a status satisfies `predicate`."""
    seen: list = []

    async def watch() -> None:
        task = asyncio.create_task(manager.watch(seen.append, interval=0.2))
        deadline = time.monotonic() + timeout
        try:
            while not any(predicate(s) for s in seen) and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(watch())
    assert any(predicate(s) for s in seen), [(s.state, s.error) for s in seen[-5:]]
    return seen


def test_a_restart_that_fails_says_why_even_when_the_record_cannot_be_written(chat_model_dir, tmp_path):
    """kill -9, and the watcher's restart fails (model.path now names no model): the console hears
    'restart failed' with the reason and the record says stopped, so it does not try again. With the disk
    under the server record full as well, the same reason comes first and the failed write is named; it
    used to replace the reason ('poll failed: [Errno 28] No space left on device')."""
    from engine.config import set_value
    from tests.helpers.online import small_disk

    for disk_full in (False, True):
        ws = make_workspace(tmp_path / f"ws-{disk_full}", chat_model_dir)
        with small_disk(ws.state_dir, "1m") as mounted:
            if disk_full and not mounted:
                pytest.skip("the full-disk case needs a tmpfs (root)")
            manager = ServerManager(ws)
            first = asyncio.run(manager.start())
            filler = ws.state_dir / "filler"
            try:
                ws.save_config(set_value(ws.config, "model.path", str(tmp_path / "gone")))
                if disk_full:
                    with open(filler, "wb", buffering=0) as handle:
                        try:
                            while True:
                                handle.write(b"\0" * 65536)
                        except OSError:
                            pass
                os.kill(first.pid, signal.SIGKILL)
                seen = _watch_until(manager, lambda s: "restart failed" in (s.error or ""))
                failed = next(s for s in seen if "restart failed" in (s.error or ""))
                assert failed.state == "crashed" and "gone/config.json missing" in failed.error, failed.error
                if disk_full:
                    assert failed.error.index("restart failed") == 0 and "could not be written" in failed.error
                    assert "No space left" in failed.error, failed.error
                else:
                    assert manager.record()["desired"] == "stopped"
                    assert asyncio.run(manager.poll()).state == "stopped"
            finally:
                filler.unlink(missing_ok=True)  # room for the stop's record
                asyncio.run(manager.stop(grace=5))


def test_stop_leaves_no_process_behind(chat_model_dir, tmp_path):
    ws = make_ws(tmp_path, chat_model_dir)
    manager = ServerManager(ws)
    status = asyncio.run(manager.start())
    pid = status.pid
    stopped = asyncio.run(manager.stop(grace=5))
    assert stopped.state == "stopped"
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_bad_model_path_fails_fast_with_reason(tmp_path):
    ws = make_ws(tmp_path, tmp_path / "no-such-model")
    started = time.monotonic()
    with pytest.raises(ServerStartError) as info:
        asyncio.run(ServerManager(ws).start())
    assert time.monotonic() - started < 20
    assert "no-such-model/config.json missing" in str(info.value) and "model.path" in str(info.value)


def test_busy_port_fails_before_starting(chat_model_dir, tmp_path):
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        ws = make_ws(tmp_path, chat_model_dir, **{"server.port": port})
        with pytest.raises(ServerStartError, match=f"port {port} on 127.0.0.1 is in use"):
            asyncio.run(ServerManager(ws).start())
        assert ServerManager(ws).job() is None  # nothing was started


def test_server_command_prints_argv_without_the_key(chat_model_dir, tmp_path):
    import subprocess
    import sys

    ws = make_ws(tmp_path, chat_model_dir, **{"server.api_key": "sekret-123"})
    out = subprocess.run([sys.executable, "-m", "eagle3_console", "server", "command", "-w", str(ws.root)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "engine.localserver" in out.stdout and "--capture-layers" in out.stdout
    assert "sekret-123" not in out.stdout
    assert "NCCL_NVLS_ENABLE=0" in out.stdout


async def test_console_engine_rechecks_stages_when_the_server_or_a_stage_job_changes(chat_model_dir, tmp_path):
    """A started or stopped server makes the last `server`/`capture` results describe a server that
    is gone, and a stage job that ends changes its stage's data: the driving engine checks them
    again by itself (real checks, a real server, a real extraction job)."""
    from engine.core import Engine

    ws = make_ws(tmp_path, chat_model_dir, **{"dataset.path": "train.jsonl"})
    write_conversations(ws.root / "train.jsonl", 6)
    engine = Engine(ws)
    await engine.start()

    async def states_become(want: dict[str, str], timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = {name: engine.pipeline.report(name).state.value for name in want}
            if got == want:
                return
            await asyncio.sleep(0.2)
        raise AssertionError(f"stages are {got}, expected {want}")

    try:
        assert engine.pipeline.report("server").state.value == "pending"
        await engine.start_server()
        await states_become({"server": "passed", "capture": "passed"})
        probe = {r.name: r for r in engine.pipeline.report("capture").results}
        assert probe["argmax"].status.value == "pass"
        # A stage job that ends has its stage checked again: extraction done -> `extract` green.
        await engine.run_checks(["extract"])
        assert engine.pipeline.report("extract").state.value == "failed"
        await engine.start_stage_job("extract")
        await states_become({"extract": "passed"}, timeout=120)
        await engine.stop_server()
        await states_become({"server": "failed", "capture": "failed"})
        assert "stopped" in engine.pipeline.report("server").results[0].evidence
    finally:
        await engine.close()
        await ServerManager(ws).stop(grace=5)
    # The stopped server is still "stopped"; a read-only console seeing it come up runs nothing.
    from engine.server.manager import ServerStatus

    holder = Engine(ws)  # drives (holds the lock), so the next one is attached read-only
    reader = Engine(ws)
    try:
        assert reader.read_only
        reader._on_server(ServerStatus(state="stopped"))
        reader._on_server(ServerStatus(state="ready"))
        assert reader._recheck_task is None, "checks persist reports: only the driving console runs them"
    finally:
        await reader.close()
        await holder.close()
