"""The Textual console, driven with Pilot on a real workspace and a real engine.

No GPU exists in CI, so the GPU pane is exercised in its "NVML unavailable" state through the
real sampler; the row renderer is checked separately against a hand-built snapshot (the only
fake here, since NVML cannot answer on this machine).
"""

from __future__ import annotations

import os
import re
import sys

import pytest
from textual.content import Content
from textual.widgets import Static

from engine.config import load_config
from engine.core import Engine
from engine.system.disk import usage_for
from engine.workspace import Workspace, WorkspaceLock
from eagle3_console.app import TABS, ConsoleApp, closing_summary
from eagle3_console.header import ConsoleHeader
from eagle3_console.panes import ExtractionPane, GpuPane, PipelinePane
from eagle3_console.panes.gpu import gpu_rows
from tests.helpers.screen import screen_lines, screen_text, wait_until
from tests.helpers.workspaces import console_workspace

PANE_CLASSES = {"gpus": "GpuPane", "server": "ServerPane", "pipeline": "PipelinePane",
                "extraction": "ExtractionPane", "training": "TrainingPane", "evaluation": "EvaluationPane",
                "jobs": "JobsPane"}
STAGES = ["gpus", "model", "dataset", "server", "capture", "disk", "extract", "train", "evaluate"]


# ----------------------------------------------------------------------------- helpers


def fully_on_screen(app, widget) -> bool:
    region = widget.region
    return region.area > 0 and app.screen.region.contains_region(region)


@pytest.fixture
def ws(tmp_path) -> Workspace:
    return console_workspace(tmp_path)


# ----------------------------------------------------------------------------- layout


async def test_tabs_reachable_by_number_keys_at_80x24(ws):
    app = ConsoleApp(Engine(ws))
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        assert app.query_one("#tabs").display
        for number, (tab, _label) in enumerate(TABS, start=1):
            await pilot.press(str(number))
            await pilot.pause()
            for other, cls in PANE_CLASSES.items():
                pane = app.query_one(cls)
                assert pane.display == (other == tab), (tab, other)
            assert fully_on_screen(app, app.query_one(PANE_CLASSES[tab]))
        await pilot.press("3")
        await pilot.pause()
        table = app.query_one("#stage-table")
        assert table.has_focus
        assert fully_on_screen(app, table) and table.region.height >= 10  # header + nine stages
        text = screen_text(app)
        for stage in STAGES:
            assert re.search(rf"\b{stage}\b", text), stage
        footer = screen_lines(app)[-1]
        for key, label in (("q", "Quit"), ("r", "Check"), ("R", "Check all"), ("s", "Start"), ("?", "Help")):
            assert key in footer and label in footer
        app.save_screenshot("/tmp/console_80x24.svg")
        for line in screen_lines(app):
            assert len(line.rstrip()) <= 80


async def test_all_seven_panes_visible_together_at_200x60(ws):
    app = ConsoleApp(Engine(ws))
    async with app.run_test(size=(200, 60)) as pilot:
        await wait_until(pilot, lambda: app.query_one(ExtractionPane).usages)
        await wait_until(pilot, lambda: app.query_one(GpuPane).snapshot is not None)
        await pilot.pause(0.2)  # let the layout settle after the first samples
        assert not app.query_one("#tabs").display
        panes = [app.query_one(cls) for cls in PANE_CLASSES.values()]
        for pane in panes:
            assert pane.display and fully_on_screen(app, pane), type(pane).__name__
        for i, a in enumerate(panes):
            for b in panes[i + 1:]:
                assert not a.region.overlaps(b.region)
        text = screen_text(app)
        for title in ("GPUs & NCCL", "Server", "Pipeline", "Extraction", "Training", "Evaluation", "Jobs"):
            assert title in text
        app.save_screenshot("/tmp/console_200x60.svg")
        # 120-199 columns: two columns, Pipeline on the left and the chosen pane beside it.
        await pilot.resize_terminal(140, 40)
        await pilot.pause()
        assert app.query_one("#tabs").display
        await pilot.press("4")
        await pilot.pause()
        shown = [cls for cls in PANE_CLASSES.values() if app.query_one(cls).display]
        assert shown == ["PipelinePane", "ExtractionPane"], shown
        assert not app.query_one(PipelinePane).region.overlaps(app.query_one(ExtractionPane).region)
        # Narrowing the terminal switches back to tabs without losing the pipeline cursor.
        app.query_one(PipelinePane).select_stage("disk")
        await pilot.resize_terminal(100, 30)
        await pilot.pause()
        assert app.query_one("#tabs").display
        assert app.query_one(PipelinePane).selected_stage == "disk"


# ----------------------------------------------------------------------------- panes


async def test_gpu_pane_says_nvml_unavailable_here(ws):
    app = ConsoleApp(Engine(ws))
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_until(pilot, lambda: app.query_one(GpuPane).snapshot is not None)
        await pilot.press("1")
        await pilot.pause()
        text = screen_text(app)
        assert "NVML unavailable:" in text
        assert "NCCL preset none" in text and "NCCL_NVLS_ENABLE=0" in text


def test_gpu_rows_fit_the_width():
    """Hand-built snapshot (fake: no NVML here) to check the row layout at pane widths."""
    from engine.system.gpu import GpuSample, GpuSnapshot

    gpus = tuple(GpuSample(index=i, name="NVIDIA RTX PRO 6000 Blackwell", uuid=f"GPU-{i}", compute_capability=(12, 0),
                           utilization_gpu=37 * i % 101, utilization_memory=10, memory_used=(i + 1) * 9 * 2**30,
                           memory_total=96 * 2**30, temperature_c=60 + i * 4, power_w=300.0, power_limit_w=600.0,
                           sm_clock_mhz=2400, max_sm_clock_mhz=2800, pcie_gen=5, pcie_width=16) for i in range(8))
    snap = GpuSnapshot(True, "", "580.1", "13.0", gpus, "PCIe (PHB)", 0.0)
    history = {i: [10, 50, 90, 100][: i % 4 + 1] for i in range(8)}
    for width in (76, 62, 50, 48):
        for hist in (None, history):
            lines = gpu_rows(snap, width, hist)
            assert len(lines) == 1 + 8
            for line in lines:
                assert Content.from_markup(line).cell_length <= width, (width, line)
    assert Content.from_markup(gpu_rows(snap, 76, history)[4]).plain.endswith("▂▅▇█")
    assert "2400MHz" in Content.from_markup(gpu_rows(snap, 76)[1]).plain
    assert "9.0/96G" in Content.from_markup(gpu_rows(snap, 76)[1]).plain


async def test_disk_gauge_shows_workspace_mount(ws):
    app = ConsoleApp(Engine(ws))
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_until(pilot, lambda: app.query_one(ExtractionPane).usages)
        await pilot.press("4")
        await pilot.pause()
        mount = usage_for("workspace", ws.root).mount
        text = screen_text(app)
        assert f"on {mount}" in text
        assert re.search(r"free [\d.]+ \w?i?B of [\d.]+ \w?i?B", text)
        assert "no extraction run yet" in text


# ----------------------------------------------------------------------------- the key test


async def test_disk_stage_fails_then_passes_after_the_fix(tmp_path):
    blocker = tmp_path / "readonly-parent"
    as_root = os.geteuid() == 0
    if as_root:  # chmod does not stop root: a regular FILE as parent makes mkdir fail for anyone
        blocker.write_text("not a directory\n")
    else:
        blocker.mkdir()
        blocker.chmod(0o500)
    ws = console_workspace(tmp_path, **{"extract.output_dir": str(blocker / "out"), "extract.create_output_dir": True})
    app = ConsoleApp(Engine(ws))
    try:
        async with app.run_test(size=(80, 24)) as pilot:
            pane = app.query_one(PipelinePane)
            await pilot.press("3")
            for _ in range(STAGES.index("disk")):
                await pilot.press("down")
            assert pane.selected_stage == "disk"
            await pilot.press("r")
            await wait_until(pilot, lambda: pane.reports["disk"].ran_at is not None)
            await app.workers.wait_for_complete()
            await pilot.pause()
            assert pane.row_text("disk").startswith("✘ disk failed")
            text = screen_text(app)
            assert re.search(r"✘ +disk +failed +output_dir: cannot create", text)
            detail = Content.from_markup(str(app.query_one("#stage-detail", Static).content)).plain
            assert f"✘ output_dir: cannot create {blocker / 'out' / 'run1'}" in detail
            assert "fix: choose a directory on a disk you can write to" in detail

            if as_root:  # the fix: make the path creatable
                blocker.unlink()
            else:
                blocker.chmod(0o700)
            first_run = pane.reports["disk"].ran_at
            await pilot.press("r")
            await wait_until(pilot, lambda: (pane.reports["disk"].ran_at or 0) > first_run)
            await app.workers.wait_for_complete()
            await pilot.pause()
            assert pane.row_text("disk").startswith("✔ disk passed"), pane.row_text("disk")
            assert re.search(r"✔ +disk +passed", screen_text(app))
            assert (blocker / "out" / "run1").is_dir()
    finally:
        if blocker.is_dir():
            blocker.chmod(0o700)


# ----------------------------------------------------------------------------- themes, attach, quit


async def test_theme_cycles_and_is_saved_and_restored(ws):
    user_themes = ws.root / "themes"
    user_themes.mkdir()
    (user_themes / "mine.toml").write_text('name = "mine"\nprimary = "#ff8800"\ndark = true\n')
    (user_themes / "broken.toml").write_text('name = "broken"\nprimary = 3\n')
    notes = ("# my box: 8x H200, the NVMe at /data\n", '# theme = "nord"  tried: too dim over SSH\n')
    text = ws.config_path.read_text()
    ws.config_path.write_text(notes[0] + text.replace("[ui]\n", "[ui]\n" + notes[1]))
    app = ConsoleApp(Engine(ws))
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        assert app.theme == "eagle3-dark"
        assert app.theme_names == ["eagle3-dark", "eagle3-light", "eagle3-contrast", "mine"]
        assert any("broken.toml" in e for e in app.theme_errors)
        await pilot.press("t")
        await pilot.pause()
        assert app.theme == "eagle3-light"
        await app.workers.wait_for_complete()
    assert load_config(ws.root).ui.theme == "eagle3-light"
    saved = ws.config_path.read_text()
    assert 'theme = "eagle3-light"  # ' in saved, saved  # the key's own help stays beside it
    assert all(note in saved for note in notes), saved  # the operator's notes survive a theme change
    assert saved.replace('"eagle3-light"', '"eagle3-dark"') == notes[0] + text.replace("[ui]\n", "[ui]\n" + notes[1])

    app2 = ConsoleApp(Engine(Workspace(ws.root)))
    async with app2.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        assert app2.theme == "eagle3-light"
        for _ in range(2):  # light -> contrast -> mine
            await pilot.press("t")
        await pilot.pause()
        assert app2.theme == "mine"
        await app2.workers.wait_for_complete()
    assert load_config(ws.root).ui.theme == "mine"


async def test_second_console_attaches_read_only(ws):
    driver = Engine(ws)
    assert not driver.read_only
    try:
        app = ConsoleApp(Engine(Workspace(ws.root)))
        assert app.engine.read_only
        before = ws.config_path.read_text()
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.pause()
            header = app.query_one(ConsoleHeader).line
            assert f"read-only: driven by pid {os.getpid()}" in header
            assert "read-only: driven by" in screen_text(app)
            await pilot.press("t")  # the theme changes for this session only
            await pilot.pause()
            await app.workers.wait_for_complete()
            assert app.theme == "eagle3-light"
        assert ws.config_path.read_text() == before
    finally:
        await driver.close()


async def test_quit_releases_the_lock_and_help_and_palette_list_actions(ws):
    app = ConsoleApp(Engine(ws))
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        titles = [c.title for c in app.get_system_commands(app.screen)]
        for wanted in ("Run stage checks", "Run all checks", "Next theme", "Keys and help",
                       "Show GPUs", "Show Training", "Close console (jobs keep running)"):
            assert wanted in titles
        await pilot.press("question_mark")
        await pilot.pause()
        assert "jobs keep running" in screen_text(app)
        await pilot.press("escape")
        await pilot.pause()
        assert app.screen is app.screen_stack[0]
        await pilot.press("q")
        await pilot.pause()
    assert app.return_code == 0
    probe = WorkspaceLock(ws.root)
    assert probe.acquire()  # the console let go of the workspace
    probe.release()


async def test_closing_summary_lists_jobs_left_running(ws):
    engine = Engine(ws, drive=False)
    try:
        assert closing_summary(engine) == "Console closed. No jobs running."
        job = engine.jobs.start("sleeper", [sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            summary = closing_summary(engine)
            assert summary.startswith("Console closed. 1 job(s) still running:")
            assert f"{job.id} (sleeper, pid {job.pid})" in summary
        finally:
            engine.jobs.stop_sync(job.id, grace=5)
    finally:
        await engine.close()


async def test_unknown_configured_theme_falls_back_without_overwriting(tmp_path):
    ws = console_workspace(tmp_path, **{"ui.theme": "no-such-theme"})
    app = ConsoleApp(Engine(ws))
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        assert app.theme == "eagle3-dark"
        await app.workers.wait_for_complete()
    assert load_config(ws.root).ui.theme == "no-such-theme"


async def test_eight_gpus_fit_at_80x24_with_trends_and_nccl(ws):
    """A hand-built 8-GPU snapshot (fake: no NVML here) through the real engine event path."""
    from engine.events import GpuUpdated
    from tests.helpers.scenes import gpu_snapshot

    engine = Engine(ws)
    app = ConsoleApp(engine)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        engine.gpu_sampler.close()
        for task in engine._tasks:  # the real sampler would replace the fixed snapshots
            if task.get_name() == "gpu-sampler":
                task.cancel()
        for step in range(5):
            engine._emit(GpuUpdated(gpu_snapshot(step=step)))
        await pilot.press("1")
        await pilot.pause(0.2)
        lines = screen_lines(app)
        rows = [line for line in lines if re.match(r"^│\s+\d H200 ", line)]
        assert len(rows) == 8, "\n".join(lines)
        for row in rows:
            assert re.search(r"\d+%", row) and "/141G" in row and "°C" in row and "W " in row and "MHz" in row
            assert re.search(r"[▁▂▃▄▅▆▇█]{5} +│$", row), row  # the trend: five samples so far
        text = "\n".join(lines)
        assert "interconnect NVLink (18 links/GPU)" in text and "NCCL_NVLS_ENABLE=0" in text
        assert all(len(line.rstrip()) <= 80 for line in lines)


async def test_pipeline_s_starts_only_stages_with_a_job_and_j_only_moves(ws):
    app = ConsoleApp(Engine(ws))
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        pane = app.query_one(PipelinePane)
        pane.select_stage("model")
        await pilot.press("s")
        await pilot.pause()
        assert any("stage 'model' has no job: Enter runs its checks" in n.message for n in app._notifications)
        assert "s Start" in screen_lines(app)[-1]
        # vim navigation: j / k move the cursor and never start anything
        pane.select_stage("disk")
        await pilot.press("j")
        await pilot.pause()
        assert pane.selected_stage == "extract"
        assert app.screen is app.screen_stack[0]  # no start question
        await pilot.press("k")
        await pilot.pause()
        assert pane.selected_stage == "disk"
        await pilot.press("G")
        await pilot.pause()
        assert pane.selected_stage == "evaluate"
        await pilot.press("g")
        await pilot.pause()
        assert pane.selected_stage == "gpus"
        assert not app.engine.jobs.list()
        titles = [c.title for c in app.get_system_commands(app.screen)]
        for wanted in ("Start the extract job", "Start the evaluate job", "Show Evaluation", "Show Jobs",
                       "Reload evaluation report"):
            assert wanted in titles
        assert len(titles) == len(set(titles)), "duplicate palette entries"
        for unbound in ("Quit", "Keys", "Maximize"):
            assert unbound not in titles
