"""End to end, through the console only: a demo workspace from nothing to a green `evaluate`
stage, driven purely by key presses in a Pilot session, with real jobs (a real local target
server, real extraction, real training of a drafter, real evaluation).

The demo workspace is built once per session and copied; the copy is shrunk for CI (fewer
samples, one epoch, fewer evaluation prompts) and gets a free port. The `gpus` stage passes
only where NVML answers; on a CPU-only CI machine it is asserted amber (warned: the local backend
runs on the CPU) and the rest of the pipeline (which runs on CPU) goes green.
"""

from __future__ import annotations

import os
from typing import Iterator

import pytest

from engine.config import set_value
from engine.core import Engine
from engine.jobs.manager import JobManager
from engine.workspace import Workspace
from eagle3_console.app import ConsoleApp
from eagle3_console.confirm import ConfirmScreen
from eagle3_console.panes import EvaluationPane, ExtractionPane, PipelinePane, ServerPane, TrainingPane
from tests.helpers.processes import free_port
from tests.helpers.screen import wait_until
from tests.helpers.workspaces import copy_demo

TRAIN_SAMPLES = 400  # the demo's 400 (fewer train a drafter too weak to beat plain decoding)
# Set EAGLE3_SCREENSHOTS=DIR to save SVGs of the console at work (docs/screenshots).
SCREENSHOTS = os.environ.get("EAGLE3_SCREENSHOTS")
STAGE_ORDER = ["gpus", "model", "dataset", "server", "capture", "disk", "extract", "train", "evaluate"]


@pytest.fixture
def demo_ws(demo_template, tmp_path) -> Iterator[Workspace]:
    root = tmp_path / "ws"
    ws = copy_demo(demo_template, root)
    data = (root / ws.config.dataset.path).read_text().splitlines(keepends=True)
    (root / "data" / "train_ci.jsonl").write_text("".join(data[:TRAIN_SAMPLES]))
    config = ws.config
    for key, value in {"dataset.path": "data/train_ci.jsonl", "train.epochs": 2, "server.port": free_port(),
                       "evaluate.num_prompts": 6, "evaluate.max_new_tokens": 64, "evaluate.spec_steps": 4}.items():
        config = set_value(config, key, value)
    ws.save_config(config)
    yield Workspace(root)
    # A failed run must not leave its server or jobs running after the test (they are detached).
    jobs = JobManager(root / "jobs")
    for job in jobs.active():
        jobs.stop_sync(job.id, grace=5)


async def test_demo_to_green_evaluate_by_keys(demo_ws):
    engine = Engine(demo_ws)
    app = ConsoleApp(engine)
    started_jobs: list[str] = []
    async with app.run_test(size=(100, 32)) as pilot:
        pipeline = app.query_one(PipelinePane)

        def state(stage: str) -> str:
            return pipeline.reports[stage].state.value

        async def check(stage: str, timeout: float = 60) -> str:
            """Select `stage` with the arrow keys and press Enter; wait for its checks to end."""
            while pipeline.selected_stage != stage:
                ahead = STAGE_ORDER.index(stage) > STAGE_ORDER.index(pipeline.selected_stage)
                await pilot.press("down" if ahead else "up")
            await pilot.press("enter")
            await pilot.pause(0.2)
            await wait_until(pilot, lambda: state(stage) not in ("running", "pending"), timeout, f"{stage} checked")
            evidence = "; ".join(f"{r.name}: {r.evidence}" for r in pipeline.reports[stage].results)
            print(f"{stage}: {state(stage)} — {evidence}")  # shown when the test fails
            return state(stage)

        async def shoot(name: str, tab: str) -> None:
            if not SCREENSHOTS:
                return
            focused = app.focused
            for size, suffix in (((160, 50), "160x50"), ((80, 24), "80x24")):
                await pilot.resize_terminal(*size)
                app.action_show_tab(tab)
                await pilot.pause(0.3)
                app.save_screenshot(f"{name}-{suffix}.svg", path=SCREENSHOTS)
            await pilot.resize_terminal(100, 32)
            app.action_show_tab("pipeline")
            if focused is not None:
                focused.focus()
            await pilot.pause(0.2)

        async def run_job(stage: str, pane_type, timeout: float, midway=None) -> None:
            """`s` on the stage asks (estimated time and disk need), `y` starts it: its job appears in its
            pane at once; wait for it to succeed."""
            await pilot.press("s")
            await wait_until(pilot, lambda: isinstance(app.screen, ConfirmScreen), 10, f"{stage} start question")
            await pilot.press("y")
            pane = app.query_one(pane_type)
            await wait_until(pilot, lambda: pane.running_job_id is not None, 10, f"{stage} job shown in its pane")
            job_id = pane.running_job_id
            started_jobs.append(job_id)
            if midway is not None:
                await midway(pane)
            await wait_until(pilot, lambda: not engine.jobs.get(job_id).active, timeout, f"{stage} job to end")
            info = engine.jobs.get(job_id)
            assert info.state == "succeeded", (stage, info.state, info.last_log_lines)

        await pilot.pause()
        assert app.query_one("#stage-table").has_focus
        assert all(state(s) == "pending" for s in STAGE_ORDER)

        # R checks everything: the inputs pass, nothing downstream of the server can yet.
        await pilot.press("R")
        await wait_until(pilot, lambda: all(state(s) not in ("pending", "running") for s in STAGE_ORDER), 90,
                         "all checks")
        nvml = engine.latest_gpu().available
        assert state("gpus") == ("passed" if nvml else "warned")  # local backend on CPU: amber, not green
        assert state("model") == "passed" and state("dataset") in ("passed", "warned")
        for stage in ("server", "capture", "extract", "train", "evaluate"):
            assert state(stage) == "failed", stage

        # server: `s` starts it (capture on); the pane and the check follow.
        while pipeline.selected_stage != "server":
            await pilot.press("down")
        await pilot.press("s")
        server_pane = app.query_one(ServerPane)
        await wait_until(pilot, lambda: server_pane.state == "ready", 120, "server ready")
        assert await check("server") == "passed"
        assert await check("capture") == "passed"
        assert await check("disk") == "passed"

        # extract: not done yet, then its job, then green.
        assert await check("extract") == "failed"
        async def mid_extraction(pane) -> None:
            await wait_until(pilot, lambda: pane.view.done > 0 or not pane.running_job_id, 60, "extraction progress")
            await shoot("extraction-running", "extraction")

        await run_job("extract", ExtractionPane, 150, midway=mid_extraction)
        assert await check("extract") == "passed"
        assert app.query_one(ExtractionPane).view.phase == "finished"

        # train: its job writes curves, the pane reads them, then green.
        assert pipeline.selected_stage == "extract"
        await pilot.press("down")
        await run_job("train", TrainingPane, 150)
        assert await check("train") == "passed"
        assert app.query_one(TrainingPane).view.step is not None

        # evaluate: its job writes report.json; the evaluation pane reloads it; green.
        await pilot.press("down")
        await run_job("evaluate", EvaluationPane, 150)
        verdict = await check("evaluate")
        not_passed = {r.name: r.evidence for r in pipeline.reports["evaluate"].results if r.status.value != "pass"}
        # Green, or amber for one reason only: the speedup's interval straddled 1.0x on a loaded 2-core box
        # (the other test worker's load is named in the evidence). Any other warning or failure is a defect.
        assert verdict == "passed" or (verdict == "warned" and list(not_passed) == ["speedup"]
                                       and "INCONCLUSIVE" in not_passed["speedup"]
                                       and "load average" in not_passed["speedup"]), not_passed
        evaluation = app.query_one(EvaluationPane)
        await wait_until(pilot, lambda: evaluation.report is not None, 10, "evaluation report shown")
        assert evaluation.report["overall"]["acceptance_length"] >= 1.0
        await shoot("training-curves", "training")
        await shoot("evaluation", "evaluation")
        for stage in STAGE_ORDER[1:]:
            assert state(stage) in ("passed", "warned"), stage

        # Stop the server through its pane: it asks first.
        await pilot.press("2")
        await pilot.press("S")
        await pilot.pause()
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("y")
        await wait_until(pilot, lambda: server_pane.state == "stopped", 30, "server stopped")
        await pilot.press("q")
    assert app.return_code == 0
    for job_id in started_jobs:
        assert not engine.jobs.get(job_id).active
