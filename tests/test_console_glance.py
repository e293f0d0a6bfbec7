"""Issue 21: everything at a glance (the status strip), one key scheme, jobs and logs in the UI,
detail areas scrolled by keys. Pilot sessions on a real workspace and engine; assertions read the
VISIBLE screen (conftest.screen_text, rebuilt from the rendered frame), not widget content.
"""

from __future__ import annotations

import sys
import time

from tests.helpers.screen import screen_lines, screen_text, wait_until
from tests.helpers.workspaces import console_workspace

from engine.checks.base import CheckResult, StageReport, StageState, Status
from engine.core import Engine
from engine.events import DiskUpdated, GpuUpdated, JobEvents, JobsUpdated, ServerUpdated, StageUpdated
from engine.pipeline import stages
from eagle3_console.app import ConsoleApp
from eagle3_console.confirm import ConfirmScreen
from eagle3_console.keys import KEYS, NAVIGATION, help_lines
from eagle3_console.panes import JobsPane, PipelinePane
from eagle3_console.strip import JobProgress, RateTracker, StatusStrip, StripState, strip_markup
from textual.content import Content
from tests.helpers.scenes import T0, disks, extract_events, gpu_snapshot, job, server_status


def plain(markup: str) -> str:
    return Content.from_markup(markup).plain


# ----------------------------------------------------------------------------- the strip, pure


def test_rate_tracker_smooths_and_ignores_replayed_history():
    tracker = RateTracker()
    for done in range(0, 50, 10):  # history replayed at attach: all at one instant
        tracker.update(done, 1000, t=100.0)
    assert tracker.eta_s is None
    tracker.update(40, 1000, t=100.0)
    # A slow start (compilation) then a steady 10/s: the estimate follows the recent pace.
    tracker.update(41, 1000, t=130.0)
    for i in range(1, 31):
        tracker.update(41 + 10 * i, 1000, t=130.0 + i)
    plain_rate = (341 - 40) / (160 - 100)  # what a first-to-last rate says: 5/s, ETA twice too long
    assert tracker.rate > 1.5 * plain_rate
    assert 50 < tracker.eta_s < 110  # 659 left at ~10/s (smoothing lags a little)
    tracker.update(5, 1000, t=200.0)  # a new run: starts over
    assert tracker.rate is None


def test_strip_fits_every_width_and_keeps_warnings_last_to_go():
    progress = JobProgress("extract", "extract-1", done=850, total=2000, paused="output disk below reserve")
    state = StripState(server_state="ready", server_backend="sglang", server_port=30000,
                       stages={"gpus": "passed", "model": "passed", "disk": "failed", "train": "failed"},
                       running=[progress], below_reserve=["hidden"], gpu=gpu_snapshot(), drift=["server.port"])
    wide = plain(strip_markup(state, 0))
    for part in ("server ready sglang :30000", "stages 2✔ 2✘ disk,train", "extract 42% 850/2000",
                 "PAUSED · BELOW RESERVE · restart server to apply", "GPU 8×"):
        assert part in wide, (part, wide)
    for width in (200, 120, 100, 80, 60, 40):
        line = plain(strip_markup(state, width))
        assert len(line) <= width, (width, line)
        assert "PAUSED" in line, (width, line)  # the warning is the last part to go
        if width >= 80:
            assert "2✘" in line and "extract 42%" in line, (width, line)
        if width >= 100:
            assert "GPU" in line and "disk" in line, (width, line)
    assert "restart" in plain(strip_markup(state, 80))
    idle = plain(strip_markup(StripState(), 80))
    assert "server stopped" in idle and "no job running" in idle


# ----------------------------------------------------------------------------- the strip, live


async def test_strip_shows_server_stages_job_warnings_and_gpus_at_80x24(tmp_path):
    ws = console_workspace(tmp_path)
    engine = Engine(ws)

    async def no_pollers() -> None:
        return None

    engine.start = no_pollers
    app = ConsoleApp(engine)
    async with app.run_test(size=(80, 24)) as pilot:
        emit = engine._emit
        emit(GpuUpdated(gpu_snapshot()))
        emit(DiskUpdated(disks(full=True)))
        emit(ServerUpdated(server_status("ready")))
        emit(StageUpdated(StageReport("disk", "Disk", StageState.FAILED,
                                      (CheckResult("space", Status.FAIL, "too small", fix="free space"),))))
        emit(JobsUpdated((job("extract-20260101-0001", "extract", "running"),)))
        emit(JobEvents("extract-20260101-0001", "extract", extract_events("paused")))
        await pilot.pause(0.3)
        top = [line for line in screen_lines(app) if line.strip()][:4]
        strip = next(line for line in top if "●" in line)
        assert "ready" in strip and ":30000" in strip, strip
        assert "1✘" in strip and "disk" in strip, strip
        assert "extract 42%" in strip, strip
        assert "PAUSED" in strip and "BELOW RESERVE" in strip, strip
        assert "GPU" in strip or "BELOW RESERVE" in strip, strip  # at 80 columns the warnings come first
        # Every tab keeps it.
        for number in "1234567":
            await pilot.press(number)
            await pilot.pause(0.05)
            assert any("PAUSED" in line for line in [ln for ln in screen_lines(app) if ln.strip()][:4]), number


async def test_strip_says_restart_when_the_server_drifted_from_console_toml(tmp_path):
    ws = console_workspace(tmp_path)
    engine = Engine(ws)

    async def no_pollers() -> None:
        return None

    engine.start = no_pollers
    engine.server_drift = lambda: ["server.attention_backend: running triton, console.toml flashinfer"]
    app = ConsoleApp(engine)
    async with app.run_test(size=(120, 40)) as pilot:
        engine._emit(ServerUpdated(server_status("ready")))
        await wait_until(pilot, lambda: app.query_one(StatusStrip).state.drift)
        await pilot.pause(0.1)
        assert "restart server to apply" in screen_text(app)


# ----------------------------------------------------------------------------- keys


def test_one_key_table_navigation_never_starts_and_start_stop_are_uniform():
    keys = {k.key: k for k in KEYS}
    assert len(keys) == len(KEYS), "a key bound twice in the table"
    for nav in ("j", "k", "g", "G", "h", "l", "up", "down"):
        assert nav not in keys or not keys[nav].mutates, nav
    assert "j" not in keys and "k" not in keys  # navigation belongs to the lists, not to actions
    start, stop = keys["s"], keys["S"]
    assert start.mutates and stop.mutates
    for pane in ("server", "pipeline", "extraction", "training", "evaluation"):
        assert pane in start.panes and pane in stop.panes
    assert not any(k.action.startswith("start") for k in KEYS if k.key != "s")
    text = "\n".join(plain(line) for line in help_lines())
    for key in KEYS:
        if not key.action.startswith("show_tab"):
            assert key.help in text, key
    for key, _text in NAVIGATION:
        assert key in text


async def test_read_only_console_neither_shows_nor_accepts_what_it_cannot_do(tmp_path):
    ws = console_workspace(tmp_path)
    driver = Engine(ws)
    try:
        app = ConsoleApp(Engine(ws, drive=False))
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.press("5")
            await pilot.pause(0.1)
            footer = screen_lines(app)[-1]
            assert "S Stop" not in footer and "s Start" not in footer, footer
            await pilot.press("S")
            await pilot.pause(0.1)
            assert not isinstance(app.screen, ConfirmScreen)  # refused at the key, not after `y`
            await pilot.press("3")
            await pilot.press("s")
            await pilot.pause(0.1)
            assert not isinstance(app.screen, ConfirmScreen)
            assert not driver.jobs.list()
            titles = [c.title for c in app.get_system_commands(app.screen)]
            assert not any(t.startswith(("Start", "Stop")) for t in titles), titles
            await pilot.press("question_mark")
            await pilot.pause(0.1)
            assert "Read-only" in screen_text(app) and "start or resume" not in screen_text(app)
    finally:
        await driver.close()


async def test_starting_a_long_job_asks_with_duration_and_disk_need(tmp_path):
    ws = console_workspace(tmp_path)
    engine = Engine(ws)
    app = ConsoleApp(engine)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("5")
        await pilot.press("s")
        await wait_until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.pause(0.1)
        text = screen_text(app)
        assert "Start the train job" in text and "Estimated duration" in text and "Disk:" in text, text
        await pilot.press("n")
        await pilot.pause(0.2)
        assert not engine.jobs.list()


# ----------------------------------------------------------------------------- scrolling by keys


async def test_red_stage_failing_check_and_fix_reachable_by_keys_at_80x24(tmp_path):
    ws = console_workspace(tmp_path)
    engine = Engine(ws)

    async def no_pollers() -> None:
        return None

    engine.start = no_pollers
    app = ConsoleApp(engine)
    checks = tuple(CheckResult(f"check {i}", Status.PASS, f"measured value {i} within bounds") for i in range(12))
    checks += (CheckResult("speedup", Status.FAIL, "0.82× of plain decoding [0.79, 0.85]",
                           fix="train longer: acceptance length 1.9 is below the break-even 2.3"),)
    async with app.run_test(size=(80, 24)) as pilot:
        for stage in stages():
            if stage.name == "evaluate":
                engine._emit(StageUpdated(StageReport("evaluate", stage.title, StageState.FAILED, checks)))
        pane = app.query_one(PipelinePane)
        pane.select_stage("evaluate")
        await pilot.pause(0.2)
        assert "train longer" not in screen_text(app)  # below the fold at 80x24
        await pilot.press("tab")  # into the detail area
        for _ in range(20):
            await pilot.press("j")
        await pilot.pause(0.2)
        text = screen_text(app)
        assert "✘ speedup: 0.82× of plain decoding" in text, text
        assert "fix: train longer" in text, text
        # `/` filters the stage list: only the red one, then Esc shows all nine again
        await pilot.press("shift+tab")
        await pilot.press("slash")
        await pilot.press(*"fail")
        await pilot.press("enter")
        await pilot.pause(0.2)
        assert pane.shown_stages() == ["evaluate"] and pane.selected_stage == "evaluate"
        assert " model " not in screen_text(app)
        await pilot.press("escape")
        await pilot.pause(0.2)
        assert len(pane.shown_stages()) == 9


# ----------------------------------------------------------------------------- the Jobs pane


async def test_jobs_pane_lists_jobs_tails_logs_searches_and_stops(tmp_path):
    ws = console_workspace(tmp_path)
    engine = Engine(ws)
    app = ConsoleApp(engine)
    code = ("import sys, time\nfor i in range(400):\n    print(f'line {i} working', flush=True)\n"
            "print('needle here', flush=True)\ntime.sleep(60)\n")
    failing = engine.jobs.start("train", [sys.executable, "-c", "raise SystemExit('CUDA error: bad thing')"])
    for _ in range(100):
        if not engine.jobs.get(failing.id).active:
            break
        time.sleep(0.1)
    running = engine.jobs.start("evaluate", [sys.executable, "-c", code])
    try:
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.press("7")
            pane = app.query_one(JobsPane)
            await wait_until(pilot, lambda: len(pane.jobs) == 2)
            pane.select_job(failing.id)
            await wait_until(pilot, lambda: pane.log_job == failing.id and pane.lines)
            await pilot.pause(0.2)
            text = screen_text(app)
            assert "failed 1" in text and "CUDA error: bad thing" in text, text
            pane.select_job(running.id)
            await wait_until(pilot, lambda: any("needle" in line for line in pane.lines), 15)
            await pilot.pause(0.3)
            assert "needle here" in screen_text(app)  # follows the end
            pane.query_one("#jobs-log-scroll").focus()  # Tab from the list; `/` then searches the log
            await pilot.press("slash")
            await pilot.press(*"line 12 ")
            await pilot.press("enter")
            await pilot.pause(0.3)
            assert "line 12 working" in screen_text(app) and not pane.follow
            # `/` with the list focused filters the jobs; Esc clears
            pane.query_one("#jobs-table").focus()
            await pilot.press("slash")
            await pilot.press(*"fail")
            await pilot.press("enter")
            await pilot.pause(0.2)
            assert [j.id for j in pane.shown_jobs()] == [failing.id]
            assert running.id not in screen_text(app)
            await pilot.press("escape")
            await pilot.pause(0.2)
            assert len(pane.shown_jobs()) == 2
            pane.select_job(running.id)
            await pilot.pause(0.1)
            # stop on the row asks, then stops
            await pilot.press("S")
            await wait_until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
            await pilot.press("y")
            await wait_until(pilot, lambda: not engine.jobs.get(running.id).active, 30)
            assert all(len(line.rstrip()) <= 80 for line in screen_lines(app))
    finally:
        if engine.jobs.get(running.id).active:
            engine.jobs.stop_sync(running.id, grace=2)


def test_readme_key_list_matches_the_key_table():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("### Keys"):readme.index("## Commands")]
    for key in KEYS:
        if key.action.startswith("show_tab"):
            continue
        assert f"`{key.shown_key}`" in section, key.shown_key
        assert key.help in section, key.help
    for stale in ("`x`", "`T`", "`K`", "`X`", "`l`"):
        assert stale not in section, stale
