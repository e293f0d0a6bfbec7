"""Issue 20, cases 7 and 8: what the console says about jobs and stages must be true.

7. A failed job says why (its last error line) in `jobs list`, the toast, its pane and the stage's
   check; starting a job whose prerequisite stages are red asks first and names them; a foreign
   process on the server's port is named once and not hammered.
8. A stage whose job runs reads `running` (never `failed`), and a result computed under another
   config (or before a job that feeds it ended) reads `stale`.

Everything here is real: detached job processes on tiny workspaces, a real read-only output
directory (a read-only tmpfs as root, a mode-0555 directory otherwise), a real HTTP server owning
the port, Textual driven by Pilot with assertions on the rendered screen.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.processes import free_port
from tests.helpers.screen import screen_text, wait_until
from tests.helpers.workspaces import console_workspace, make_workspace, write_conversations
from engine.config import set_value
from engine.core import Engine
from engine.jobs.manager import JobManager
from engine.workspace import Workspace
from faults import ledger
from eagle3_console.app import ConsoleApp
from eagle3_console.confirm import ConfirmScreen
from eagle3_console.panes import PipelinePane
from engine.checks.extract import START_FIX

REPO = Path(__file__).resolve().parents[2]

WAITING_JOB = """
import sys, time
from pathlib import Path
from engine.jobs.context import JobContext
ctx = JobContext.from_env()
ctx.install_sigterm_handler()
ctx.event("started", samples=400)
ctx.progress(78, 400)
while not ctx.stop_requested and not Path(sys.argv[1]).exists():
    time.sleep(0.05)
"""


# ----------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def read_only_dir(path: Path):
    """A directory the job cannot write into; yields (path, the error text a write gets)."""
    path.mkdir(parents=True)
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield path, "Permission denied"
        finally:
            path.chmod(0o755)
        return
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot make a read-only directory here (root, and mount refused: {mounted.stderr.strip()})")
    try:
        yield path, "Read-only file system"
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def cli(ws, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eagle3_console", *args, "-w", str(ws.root)],
                          capture_output=True, text=True, timeout=120, cwd=REPO)


def record_toasts(app) -> list[str]:
    """Every toast's text as the app is asked to show it (a toast expires from the screen in seconds)."""
    seen: list[str] = []
    show = app.notify

    def notify(message, *args, **kwargs):
        seen.append(str(message))
        return show(message, *args, **kwargs)

    app.notify = notify
    return seen


def wait_for(predicate, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"{what} not reached in {timeout:.0f} s")


def row_state(pane, stage: str) -> str:
    """The state cell of a stage's row in the Pipeline pane."""
    return pane.row_text(stage).split()[2]


def stage_line(status_text: str, stage: str) -> str:
    return next(line for line in status_text.splitlines() if line.strip()[2:].startswith(f"{stage} "))


# ----------------------------------------------------------------------------- item 7: a failed job says why


async def test_failed_extraction_says_why_in_toast_pane_check_and_jobs_list(tmp_path, tiny_chat_model_dir):
    with read_only_dir(tmp_path / "ro") as (ro, cause):
        ws = make_workspace(tmp_path / "ws", tiny_chat_model_dir,
                            **{"dataset.path": "train.jsonl", "extract.output_dir": str(ro)})
        write_conversations(ws.root / "train.jsonl", 5)
        from engine.server.manager import ServerManager

        server = ServerManager(ws)  # up: without a server the job is refused sooner, for that reason
        await server.start()
        engine = Engine(Workspace(ws.root))
        app = ConsoleApp(engine)
        toasts = record_toasts(app)
        try:
            async with app.run_test(size=(110, 36)) as pilot:  # one pane at a time: full-width stage rows
                await pilot.press("4")
                await pilot.press("s")  # start asks first (estimated time, disk need): yes
                await wait_until(pilot, lambda: isinstance(app.screen, ConfirmScreen), 5, "the start question")
                await pilot.press("y")
                await wait_until(pilot, lambda: engine.jobs.list(), 20, "the extraction job")
                job = engine.jobs.list()[0]
                await wait_until(pilot, lambda: engine.jobs.get(job.id).state == "failed", 120, "the job to fail")

                # The toast names the cause, not only "job … failed".
                await wait_until(pilot, lambda: any(job.id in n and cause in n for n in toasts), 20,
                                 lambda: f"a toast with the cause (toasts: {toasts})")
                # The Extraction pane, as rendered, says why (toasts cleared: they say it too).
                app.clear_notifications()
                await pilot.pause(0.3)
                await wait_until(pilot, lambda: cause in screen_text(app), 20, "the cause on the Extraction pane")
                assert "Errno" in screen_text(app)
                assert "● failed" in screen_text(app) and "● planning" not in screen_text(app)

                # The stage is re-checked when the job ends: its first failure names the job's cause, and
                # the fix is not "run the very command that failed".
                await wait_until(pilot, lambda: any(r.name == "job" for r in engine.pipeline.report("extract").results),
                                 30, "the extract stage re-checked")
                report = engine.pipeline.report("extract")
                first = next(r for r in report.results if r.status.value == "fail")
                assert cause in first.evidence and job.id in first.evidence, first
                assert first.fix != START_FIX and cause not in first.fix and "jobs logs" in first.fix, first.fix
                await pilot.press("3")
                await pilot.pause(0.3)
                assert cause in app.query_one(PipelinePane).row_text("extract")
        finally:
            await server.stop(grace=5)

        listed = cli(ws, "jobs")
        line = next(line for line in listed.stdout.splitlines() if job.id in line)
        assert "failed" in line and cause in line and "Errno" in line, listed.stdout
        rows = json.loads(cli(ws, "jobs", "list", "--json").stdout)
        reason = next(r for r in rows if r["id"] == job.id)["reason"]
        assert cause in reason
    print(f"\n  read-only output dir: job {job.id} failed, shown as {reason!r}")
    ledger.add("failed job says why (read-only output)", trials=1, faults=1)


def test_reason_is_the_last_error_line_of_the_log(tmp_path):
    jobs = JobManager(tmp_path / "jobs")
    code = ("import sys\nprint('working', flush=True)\n"
            "try:\n    raise KeyError('x')\nexcept KeyError:\n    raise ValueError('bad value 7')\n")
    job = jobs.start("train", [sys.executable, "-c", code])
    wait_for(lambda: not jobs.get(job.id).active, 30, "the job to end")
    info = jobs.get(job.id)
    assert info.state == "failed" and info.reason == "ValueError: bad value 7", info.last_log_lines
    ok = jobs.start("train", [sys.executable, "-c", "print('fine')"], job_id="ok-job")
    wait_for(lambda: not jobs.get(ok.id).active, 30, "the job to end")
    assert jobs.get(ok.id).reason is None


# ----------------------------------------------------------------------------- item 7: red prerequisites ask first


async def test_starting_a_job_with_red_prerequisites_asks_and_names_them(tmp_path):
    ws = console_workspace(tmp_path)  # no server: the `server` stage is red once checked
    engine = Engine(ws)
    app = ConsoleApp(engine)
    async with app.run_test(size=(100, 30)) as pilot:
        await engine.run_checks(["server", "model"])
        await pilot.pause(0.2)
        assert engine.pipeline.report("server").state.value == "failed"

        app.query_one(PipelinePane).select_stage("extract")
        await pilot.press("s")
        await wait_until(pilot, lambda: isinstance(app.screen, ConfirmScreen), 5, "a confirmation")
        text = screen_text(app)
        assert "server" in text and "model" in text and "red" in text, text
        await pilot.press("n")
        await pilot.pause(0.5)
        assert engine.jobs.list() == [], "answering no starts nothing"

        await pilot.press("4")
        await pilot.press("s")
        await wait_until(pilot, lambda: isinstance(app.screen, ConfirmScreen), 5, "a confirmation for s")
        assert "server" in screen_text(app)
        await pilot.press("y")
        await wait_until(pilot, lambda: engine.jobs.list(), 20, "the job started after yes")
        job = engine.jobs.list()[0]
        assert job.kind == "extract"
        if engine.jobs.get(job.id).active:
            await engine.jobs.stop(job.id, grace=5)


# ----------------------------------------------------------------------------- item 7: a foreign server on our port


FOREIGN_SERVER = """
import http.server, sys
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        sys.stderr.write("REQ " + self.path + "\\n"); sys.stderr.flush()
        body = b"<html>not sglang</html>"
        self.send_response(404); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


def test_client_backs_off_a_foreign_server_and_names_its_owner_once(tmp_path, caplog):
    from engine.client import ServerClient

    port = free_port()
    log = tmp_path / "foreign.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", FOREIGN_SERVER, str(port)], stderr=err)
    try:
        import httpx

        wait_for(lambda: _answers(httpx, port), 20, "the foreign server")
        before = log.read_text().count("REQ /health_generate")
        url = f"http://127.0.0.1:{port}"
        errors: list[str] = []

        async def poller() -> None:  # as the extraction's "wait for the server" loop does, per worker
            client = ServerClient(url, timeout=5)
            try:
                deadline = time.monotonic() + 6.0
                while time.monotonic() < deadline:
                    try:
                        await client.health_generate()
                    except Exception as exc:
                        errors.append(str(exc))
                        await asyncio.sleep(0.3)
            finally:
                await client.aclose()

        async def main() -> None:
            await asyncio.gather(*(poller() for _ in range(4)))

        with caplog.at_level(logging.WARNING):
            asyncio.run(main())
        requests = log.read_text().count("REQ /health_generate") - before
        print(f"\n  foreign server: {requests} /health_generate requests in 6 s from 4 pollers")
        assert requests <= 10, f"{requests} requests in 6 s: the client hammers a foreign server"
        assert errors and f"pid {proc.pid}" in errors[-1] and "python" in errors[-1], errors[-1]
        named = [r.getMessage() for r in caplog.records if f"pid {proc.pid}" in r.getMessage()]
        assert len(named) == 1, named
        assert f"port {port}" in named[0]
        ledger.add("foreign server on the port (4 pollers, 6 s)", trials=1, faults=1)

        # The console and `status` of a workspace whose server.port it holds name it too, once.
        ws = console_workspace(tmp_path / "console", **{"server.port": port})
        assert f"held by pid {proc.pid}" in cli(ws, "status").stdout
        asyncio.run(_console_names_the_owner_once(ws, proc.pid))
    finally:
        proc.kill()
        proc.wait()


async def _console_names_the_owner_once(ws, pid: int) -> None:
    app = ConsoleApp(Engine(ws))
    toasts = record_toasts(app)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_until(pilot, lambda: any(f"pid {pid}" in t for t in toasts), 15,
                         lambda: f"a toast naming the port's owner ({toasts})")
        await pilot.pause(3.0)  # the server watcher polls every second: no second toast
        named = [t for t in toasts if f"pid {pid}" in t]
        assert len(named) == 1 and "server.port" in named[0], named


def _answers(httpx, port: int) -> bool:
    try:
        httpx.get(f"http://127.0.0.1:{port}/ping", timeout=1)
        return True
    except httpx.HTTPError:
        return False


# ----------------------------------------------------------------------------- item 8: running and stale


async def test_running_jobs_show_running_in_status_and_pipeline_rows(tmp_path):
    ws = console_workspace(tmp_path)
    first = Engine(ws)
    await first.run_checks(["extract", "train"])  # no run yet: both red, and recorded
    await first.close()
    assert "failed" in stage_line(cli(ws, "status").stdout, "extract")

    go = tmp_path / "go"
    jobs = JobManager(ws.jobs_dir)
    extract = jobs.start("extract", [sys.executable, "-c", WAITING_JOB, str(go)])
    train = jobs.start("train", [sys.executable, "-c", WAITING_JOB, str(go)])
    try:
        wait_for(lambda: jobs.get(extract.id).state == "running" and jobs.get(train.id).state == "running")
        text = cli(ws, "status").stdout
        for stage, job in (("extract", extract), ("train", train)):
            line = stage_line(text, stage)
            assert "running" in line and "failed" not in line and job.id in line, text

        engine = Engine(Workspace(ws.root))
        app = ConsoleApp(engine)
        async with app.run_test(size=(100, 30)) as pilot:
            await pilot.pause(0.3)
            pane = app.query_one(PipelinePane)
            for stage, job in (("extract", extract), ("train", train)):
                row = pane.row_text(stage)
                assert row_state(pane, stage) == "running" and "failed" not in row and job.id in row, row
            assert "✘" not in "\n".join(line for line in screen_text(app).splitlines()
                                        if " extract " in line or " train " in line)
            # The job ends: the row stops saying running (re-checked: red again, nothing was made).
            go.touch()
            await wait_until(pilot, lambda: row_state(pane, "extract") != "running", 20, "the extract row updated")
            assert row_state(pane, "extract") == "failed"
        print(f"\n  running jobs: status and the Pipeline rows say running for {extract.id}, {train.id}")
        ledger.add("stage rows while their jobs run", trials=2, faults=2)
    finally:
        go.touch()
        for job in (extract, train):
            if jobs.get(job.id).active:
                jobs.stop_sync(job.id, grace=5)


async def test_results_under_another_config_or_before_a_job_read_stale(tmp_path):
    ws = console_workspace(tmp_path)
    engine = Engine(ws)
    await engine.run_checks(["model", "evaluate"])
    await engine.close()
    assert "failed" in stage_line(cli(ws, "status").stdout, "model")

    # The model path changes: the recorded `model` result describes another model.
    other = tmp_path / "other-model"
    other.mkdir()
    ws.save_config(set_value(ws.config, "model.path", str(other)))
    text = cli(ws, "status").stdout
    line = stage_line(text, "model")
    assert "stale" in line and "failed" not in line and "[model]" in line, text
    assert "stale" not in stage_line(text, "gpus")

    # A train job ends after the evaluate check: "no drafter export" may no longer be true.
    jobs = JobManager(ws.jobs_dir)
    train = jobs.start("train", [sys.executable, "-c", "print('exported')"])
    wait_for(lambda: not jobs.get(train.id).active, 30, "the train job to end")
    text = cli(ws, "status").stdout
    line = stage_line(text, "evaluate")
    assert "stale" in line and train.id in line, text

    engine = Engine(Workspace(ws.root))
    app = ConsoleApp(engine)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.pause(0.3)
        pane = app.query_one(PipelinePane)
        assert row_state(pane, "model") == "stale" and row_state(pane, "evaluate") == "stale"
        # A re-check under the current config is current again.
        await engine.run_checks(["model"])
        await pilot.pause(0.2)
        assert row_state(pane, "model") == "failed"

    # Back to the config the result was computed under: not stale.
    ws = Workspace(ws.root)
    ws.save_config(set_value(ws.config, "model.path", str(tmp_path / "model")))
    engine = Engine(Workspace(ws.root), drive=False)
    try:
        assert engine.reports()[1].state.value == "stale"  # the last check ran under other-model
    finally:
        await engine.close()
    print(f"\n  stale results: model after a model.path change, evaluate after train job {train.id}")
    ledger.add("stale stage results (config, later job)", trials=3, faults=3)
