"""The live panes (Server, Extraction, Training) driven with Pilot on a real engine and workspace.

Server: statuses are built by hand and published through the engine's own `_emit` path, with
the engine's server watcher cancelled so it does not overwrite them. This is deterministic data
for rendering only; the real server path (start, poll, crash, restart) is covered by
tests/test_server_manager.py. Stopping goes through the real engine (it writes the server
record and polls), and a failed start is real too (the configured port is held by a socket).

Extraction and training: real detached jobs started by engine.jobs.manager.JobManager run tiny scripts
that report through engine.jobs.context.JobContext exactly like the real jobs (same event names and
keys), and the engine streams their events.jsonl to the panes. Training metrics are real
metrics.jsonl lines in the drafter folder, in engine.train.loop's format.

Screenshots land in /tmp/live_*.svg (80x24 and 160x50) for a human to look at.
"""

from __future__ import annotations

import json
import re
import socket
import sys
import textwrap
import time
from typing import Any

import pytest
from textual.content import Content
from textual.widgets import Static
from textual_plotext import PlotextPlot

from engine.core import Engine
from engine.system.disk import usage_for
from engine.events import ServerUpdated
from engine.server.manager import ServerStatus
from engine.workspace import Workspace
from eagle3_console.app import ConsoleApp
from eagle3_console.confirm import ConfirmScreen
from eagle3_console.panes import ExtractionPane, ServerPane, TrainingPane
from tests.helpers.screen import screen_lines, screen_text, wait_until
from tests.helpers.workspaces import console_workspace


# ----------------------------------------------------------------------------- helpers


def plain(widget: Static) -> str:
    return Content.from_markup(str(widget.content)).plain


def notifications(app) -> list[str]:
    return [n.message for n in app._notifications]


def assert_fits_80(app) -> None:
    for line in screen_lines(app):
        assert len(line.rstrip()) <= 80, line


def cancel_server_watcher(engine: Engine) -> None:
    for task in engine._tasks:
        if task.get_name() == "server-watcher":
            task.cancel()


@pytest.fixture
def ws(tmp_path) -> Workspace:
    return console_workspace(tmp_path)


def ready_status(throughput: float, **changes) -> ServerStatus:
    fields: dict[str, Any] = dict(
        state="ready", backend="local", url="http://127.0.0.1:30123", job_id="server-x", pid=4242, uptime_s=125.0,
        model="/models/tiny-llama", capture={"enabled": True, "layers": [1, 1, 0], "layers_sglang": [2, 2, 1]},
        flags={"disable_radix_cache": True, "enable_metrics": True, "chunked_prefill_size": -1},
        gen_throughput=throughput, running_reqs=2.0, queued_reqs=1.0,
        log_tail=("INFO: server started", "INFO: 127.0.0.1 POST /generate 200"),
    )
    fields.update(changes)
    return ServerStatus(**fields)


# ----------------------------------------------------------------------------- server


async def test_server_pane_shows_status_and_stop_asks_first(ws):
    engine = Engine(ws)
    app = ConsoleApp(engine)
    sleeper = None
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        cancel_server_watcher(engine)
        await pilot.press("2")
        for rate in (80.0, 120.5, 99.0, 123.4):
            engine._emit(ServerUpdated(status=ready_status(rate)))
            await pilot.pause()
        pane = app.query_one(ServerPane)
        await wait_until(pilot, lambda: pane.state == "ready" and len(pane.throughput) == 4)
        text = screen_text(app)
        assert "● ready · local · pid 4242 · up 2m05s" in text
        assert "http://127.0.0.1:30123 · model /models/tiny-llama" in text
        assert "capture layers 1,1,0 (SGLang layers_to_capture 2,2,1)" in text
        assert "gen 123.4 tok/s" in text and "running 2 · queued 1" in text
        assert "POST /generate 200" in text  # log tail
        footer = screen_lines(app)[-1]
        assert "s Start" in footer and "S Stop" in footer
        assert "Extract" not in footer  # other panes' keys stay out of an 80-column footer
        assert_fits_80(app)
        app.save_screenshot("/tmp/live_server_80x24.svg")

        # Stop asks; `n` keeps the server (state and record untouched).
        await pilot.press("S")
        await pilot.pause()
        assert isinstance(app.screen, ConfirmScreen)
        assert "Stop the server?" in screen_text(app)
        await pilot.press("n")
        await pilot.pause()
        assert not isinstance(app.screen, ConfirmScreen)
        assert pane.state == "ready" and engine.server.record().get("desired") is None

        # With a job that uses the server running, the question names it.
        sleeper = engine.jobs.start("extract", [sys.executable, "-c", "import time; time.sleep(30)"])
        await wait_until(pilot, lambda: any(j.id == sleeper.id for j in engine.server_users()))
        await pilot.press("S")
        await pilot.pause()
        text = screen_text(app)
        assert "Running jobs use this server: extract" in text and sleeper.id in text
        assert "s Start" not in screen_lines(app)[-1]  # no pane keys behind the question
        await pilot.press("s")
        await pilot.pause()
        assert isinstance(app.screen, ConfirmScreen) and not notifications(app)
        app.save_screenshot("/tmp/live_server_confirm_80x24.svg")
        await pilot.press("escape")
        await pilot.pause()
        assert pane.state == "ready"

        # `y` stops through the real engine: the record says stopped, the pane follows.
        await pilot.press("S")
        await pilot.pause()
        await pilot.press("y")
        await wait_until(pilot, lambda: pane.state == "stopped")
        assert engine.server.record().get("desired") == "stopped"
        await pilot.resize_terminal(160, 50)
        await pilot.pause()
        app.save_screenshot("/tmp/live_server_160x50.svg")
    engine.jobs.stop_sync(sleeper.id, grace=5)


async def test_server_start_failure_shows_reason_in_pane_and_notification(tmp_path):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        ws = console_workspace(tmp_path, **{"server.port": port})
        engine = Engine(ws)
        app = ConsoleApp(engine)
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.pause()
            cancel_server_watcher(engine)
            await pilot.press("2")
            await pilot.press("s")
            pane = app.query_one(ServerPane)
            await wait_until(pilot, lambda: pane.failure is not None)
            assert f"port {port} on 127.0.0.1 is in use" in pane.failure[0]
            assert any("is in use" in n for n in notifications(app))
            assert f"start failed: port {port}" in screen_text(app)
    finally:
        holder.close()


# ----------------------------------------------------------------------------- extraction

# Reports like engine.extract.job: started, progress (same keys), bad_sample, paused, finished.
EXTRACT_SCRIPT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from engine.jobs.context import JobContext

    ctx = JobContext.from_env()
    mount, free = sys.argv[1], int(sys.argv[2])
    def progress(done, paused=""):
        ctx.progress(done, 10, tokens=done * 1000, total_tokens=10000, tokens_per_s=250.0 * done,
                     mb_per_s=1.5 * done, eta_s=(10 - done) * 4, bytes=done * 1000 * 528, bad=1 if done > 1 else 0,
                     paused=paused, output_free=free, output_mount=mount, spool_free=free)
    def wait_for(name):
        while not (ctx.job_dir / name).exists():
            time.sleep(0.05)
    ctx.event("planning", dataset="data.jsonl")
    ctx.event("started", samples=10, todo=10, resumed=0, verified=0, hashed=0,
              budget="needs 5.0 MiB of 1.0 TiB free", truncated=2, bad_lines=0)
    for done in (1, 2, 3):
        progress(done)
    ctx.event("bad_sample", id="s7", reason="cached_tokens=3: the radix cache must be off")
    wait_for("go")
    ctx.event("paused", reason="output disk below reserve: 1.0 GiB free, reserve 2.0 GiB")
    progress(3, paused="output disk below reserve: 1.0 GiB free, reserve 2.0 GiB")
    wait_for("go2")
    ctx.event("resumed")
    progress(10)
    ctx.event("finished", samples=9, bad=1, tokens=10000, bytes=5280000, fingerprint="f", finished_at=time.time())
""")


async def test_extraction_pane_follows_a_real_job(ws):
    engine = Engine(ws)
    app = ConsoleApp(engine)
    out = usage_for("output", str(ws.hidden_dir))
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("4")
        pane = app.query_one(ExtractionPane)
        job = engine.jobs.start("extract", [sys.executable, "-c", EXTRACT_SCRIPT, out.mount, str(out.free)])
        await wait_until(pilot, lambda: pane.view.done == 3 and pane.running_job_id == job.id)
        await wait_until(pilot, lambda: pane.usages)
        await pilot.pause(0.1)
        text = screen_text(app)
        assert "samples 3/10 · tokens 3.0k/10.0k · ETA 28s · bad 1" in text
        assert "tok/s 750" in text and "MB/s  4.5" in text
        assert "2 sample(s) truncated" in text
        assert "bad: s7: cached_tokens=3" in text
        gauges = plain(app.query_one("#disk-gauges", Static))
        # Projection: 528 bytes/token so far × 7000 tokens to go, on top of what is used now.
        assert "at completion ▓ used" in gauges and "clear of the reserve" in gauges
        footer = screen_lines(app)[-1]
        for key, label in (("s", "Start"), ("p", "Pause"), ("S", "Stop")):
            assert f"{key} {label}" in footer
        assert_fits_80(app)

        # `p` writes the pause flag into the job folder, `p` again removes it.
        flag = job.dir / "pause.requested"
        await pilot.press("p")
        await wait_until(pilot, flag.exists)
        await pilot.press("p")
        await wait_until(pilot, lambda: not flag.exists())

        # The job pauses on its own (disk): shown prominently, and notified.
        (job.dir / "go").touch()
        await wait_until(pilot, lambda: pane.view.phase == "paused")
        await wait_until(pilot, lambda: any("extract paused" in n for n in notifications(app)))
        await pilot.pause(0.1)
        assert "PAUSED: output disk below reserve" in screen_text(app)
        app.save_screenshot("/tmp/live_extraction_80x24.svg")
        await pilot.resize_terminal(160, 50)
        await pilot.pause(0.2)
        app.save_screenshot("/tmp/live_extraction_160x50.svg")

        (job.dir / "go2").touch()
        await wait_until(pilot, lambda: pane.view.phase == "finished")
        await wait_until(pilot, lambda: any("extraction finished: 9 samples, bad 1" in n for n in notifications(app)))
        assert "finished: 9 samples" in screen_text(app)
        assert "PAUSED" not in screen_text(app)


# ----------------------------------------------------------------------------- training


def train_line(step: int, t: float) -> dict:
    acc = [max(0.05, 0.2 + step / 100 - 0.08 * k) for k in range(7)]
    sim, run = 1.0, 1.0
    for a in acc:
        run *= a
        sim += run
    return {"type": "train", "step": step, "epoch": step / 50, "t": t, "lr": 3e-4, "grad_norm": 0.9,
            "tokens_per_s": 12345.0, "loss": 6.0 - step / 20, "loss_pos": [5.0] * 7, "kl_pos": [1.0] * 7,
            "acc": acc, "accept": acc, "sim_al": sim, "positions": 512}


async def test_training_pane_plots_metrics_and_stop_asks(ws):
    drafter = ws.drafter_dir
    drafter.mkdir(parents=True, exist_ok=True)
    t0 = time.time() - 100
    lines = [json.dumps(train_line(step, t0 + step)) for step in range(10, 60, 10)]
    eval_line = {"type": "eval", "step": 50, "t": t0 + 50, "loss": 4.1, "acc": [0.5] * 7, "sim_al": 1.9}
    torn = json.dumps(train_line(60, t0 + 60))
    (drafter / "metrics.jsonl").write_text("\n".join(lines + [json.dumps(eval_line)]) + "\n" + torn[:25])

    engine = Engine(ws)
    app = ConsoleApp(engine)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("5")
        pane = app.query_one(TrainingPane)
        await wait_until(pilot, lambda: pane.view.step == 50)
        assert len(pane.plot_data("loss")["train"][0]) == 5  # the torn line waits
        best = max(train_line(s, 0)["sim_al"] for s in range(10, 60, 10))
        await pilot.pause(0.1)
        text = screen_text(app)
        assert f"best AL {best:.2f} @ step 50" in text
        assert "no checkpoint yet" in text and "eval 4.100" in text
        assert re.search(r"[\u2801-\u28ff]", text), "no braille curve drawn"
        assert "loss: ⣿ train  • eval  (c: next curve)" in text  # the legend, above the plot
        assert "step" in text  # the x axis is labelled
        assert "s Start" in screen_lines(app)[-1] and "S Stop" in screen_lines(app)[-1]
        assert_fits_80(app)

        # The torn line completes; a checkpoint and a best marker appear.
        with open(drafter / "metrics.jsonl", "a") as handle:
            handle.write(torn[25:] + "\n")
        (drafter / "checkpoints").mkdir()
        (drafter / "checkpoints" / "latest.json").write_text(json.dumps({"step": 60, "path": "step-00000060"}))
        (drafter / "checkpoints" / "best.json").write_text(json.dumps({"step": 60, "path": "step-00000060",
                                                                       "sim_al": 2.75}))
        await wait_until(pilot, lambda: pane.view.step == 60 and pane.latest_ckpt is not None)
        await pilot.pause(0.1)
        assert pane.best_acceptance_length == 2.75
        assert "best AL 2.75 @ step 60 · checkpoint step 60" in screen_text(app)
        await pilot.press("c")
        await pilot.pause(0.1)
        assert "accuracy per position" in screen_text(app)
        assert set(pane.plot_data("acc")) == {"pos 0", "pos 1", "pos 3", "pos 6"}
        app.save_screenshot("/tmp/live_training_80x24.svg")

        # Stopping a running training job asks, saying it checkpoints on SIGTERM.
        job = engine.jobs.start("train", [sys.executable, "-c", "import time; time.sleep(30)"])
        await wait_until(pilot, lambda: pane.running_job_id == job.id)
        await pilot.press("S")
        await pilot.pause()
        assert isinstance(app.screen, ConfirmScreen)
        assert "checkpoints on SIGTERM" in screen_text(app) and "step 60" in screen_text(app)
        await pilot.press("n")
        await pilot.pause()
        assert engine.jobs.get(job.id).state == "running"
        await pilot.press("S")
        await pilot.pause()
        await pilot.press("y")
        await wait_until(pilot, lambda: engine.jobs.get(job.id).state not in ("starting", "running"))
        await pilot.resize_terminal(160, 50)
        await pilot.pause(0.2)
        assert isinstance(app.query_one("#plot-acc"), PlotextPlot)
        app.save_screenshot("/tmp/live_training_160x50.svg")


async def test_stop_training_warns_when_no_checkpoint_exists(ws):
    engine = Engine(ws)
    app = ConsoleApp(engine)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("5")
        pane = app.query_one(TrainingPane)
        await pilot.press("S")
        await wait_until(pilot, lambda: any("no training is running" in n for n in notifications(app)))
        job = engine.jobs.start("train", [sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            await wait_until(pilot, lambda: pane.running_job_id == job.id)
            await pilot.press("S")
            await pilot.pause()
            assert "No checkpoint has been written yet" in screen_text(app)
            await pilot.press("n")
        finally:
            engine.jobs.stop_sync(job.id, grace=5)


async def test_training_pane_shows_online_rates_and_window(ws):
    """An online run's progress (from a real job writing through the job context) shows its epoch,
    both rates with the slower side named, and the window's fill against its budget."""
    drafter = ws.drafter_dir
    drafter.mkdir(parents=True, exist_ok=True)
    (drafter / "metrics.jsonl").write_text(json.dumps(train_line(10, time.time())) + "\n")
    script = textwrap.dedent("""
        import time
        from engine.jobs.context import JobContext
        ctx = JobContext.from_env()
        ctx.progress(10, 40, unit="steps", mode="online", epoch=1, epoch_step=3, steps_per_epoch=20,
                     capture_tokens_per_s=900.0, train_tokens_per_s=4200.0, window_bytes=4_700_000,
                     window_budget=5_000_000, window_peak=4_900_000, capture_cpu=0.63)
        while not (ctx.job_dir / "go").exists():  # the test has read the first line off the screen
            time.sleep(0.05)
        # One pace (what is captured is trained) with the window full: the producer waits for room.
        ctx.progress(12, 40, unit="steps", mode="online", epoch=1, epoch_step=5, steps_per_epoch=20,
                     capture_tokens_per_s=4150.0, train_tokens_per_s=4200.0, window_bytes=4_900_000,
                     window_budget=5_000_000, window_peak=4_950_000, producer_cpu=0.42)
        time.sleep(30)
    """)
    engine = Engine(ws)
    app = ConsoleApp(engine)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("5")
        job = engine.jobs.start("train", [sys.executable, "-c", script])
        pane = app.query_one(TrainingPane)
        await wait_until(pilot, lambda: pane.online is not None, timeout=30)
        await pilot.pause(0.1)
        region = pane.content_region  # the pane's own columns: its lines wrap at its width
        rows = screen_lines(app)[region.y:region.bottom]
        text = " ".join(" ".join(row[region.x:region.right].split()) for row in rows)
        assert "online · epoch 1 step 3/20" in text, text
        assert "capture 900 vs trainer 4.2k tok/s (capture sets the pace) · capture process 0.6 CPU" in text, text
        assert "window 4.5 MiB of 4.8 MiB (peak 4.7 MiB)" in text, text

        def pane_text() -> str:
            rows = screen_lines(app)[region.y:region.bottom]
            return " ".join(" ".join(row[region.x:region.right].split()) for row in rows)

        (job.dir / "go").touch()
        await wait_until(pilot, lambda: "step 5/20" in pane_text(), timeout=30)
        assert "capture 4.2k vs trainer 4.2k tok/s (trainer sets the pace)" in pane_text(), pane_text()
        await engine.jobs.stop(job.id, grace=1)
