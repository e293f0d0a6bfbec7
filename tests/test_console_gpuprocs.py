"""The GPU process list (issue 21): memory and utilisation on the GPUs attributed to our server,
trainer and evaluation. No GPU here: a hand-built snapshot (the scenes' 8 H200s with processes) and
an injected parent-pid lookup stand in for NVML and /proc."""

from __future__ import annotations

from tests.helpers.screen import screen_text, wait_until
from tests.helpers.workspaces import console_workspace
from textual.content import Content

from engine.core import Engine
from engine.events import GpuUpdated, JobsUpdated
from eagle3_console.app import ConsoleApp
from eagle3_console.gpuprocs import attribute, process_lines
from eagle3_console.panes import GpuPane
from tests.helpers.scenes import gpu_snapshot, job, scene_parent

GIB = 2**30
JOBS = (job("server-1", "server", "running", pid=4242), job("train-1", "train", "running", pid=4300),
        job("old-eval", "evaluate", "succeeded", 0, pid=4500))


def test_processes_are_attributed_to_our_jobs_through_their_parents():
    rows = attribute(gpu_snapshot(processes=True), JOBS, scene_parent)
    by_pid = {r.pid: r for r in rows}
    assert [by_pid[p].role for p in (5001, 5002, 5003, 5004)] == ["server worker (TP)"] * 4
    assert by_pid[5001].job_id == "server-1" and by_pid[5001].gpus == (0,) and by_pid[5001].memory == 96 * GIB
    assert by_pid[6001].role == "trainer rank" and by_pid[6001].job_id == "train-1"
    assert by_pid[9999].role == "other" and not by_pid[9999].ours
    assert rows[-1].pid == 9999  # ours first
    assert by_pid[5002].util == 17  # the utilisation of the GPU it is on
    # A job that has ended owns nothing any more; a job's own process is named by its role.
    direct = attribute(gpu_snapshot(processes=True), (job("train-1", "train", "running", pid=6001),),
                       scene_parent)
    assert {r.pid: r.role for r in direct}[6001] == "trainer"
    lines = [Content.from_markup(line).plain for line in process_lines(rows, 78)]
    assert all(len(line) <= 78 for line in lines), lines
    assert "ours 420.0G · others 40.0G" in lines[-1]


def test_no_nvml_no_process_list():
    assert attribute(gpu_snapshot(available=False), JOBS, scene_parent) == []


async def test_gpu_pane_shows_whose_memory_it_is(tmp_path):
    engine = Engine(console_workspace(tmp_path))

    async def no_pollers() -> None:
        return None

    engine.start = no_pollers
    app = ConsoleApp(engine)
    async with app.run_test(size=(120, 40)) as pilot:
        pane = app.query_one(GpuPane)
        pane.parent_of = scene_parent
        engine._emit(JobsUpdated(JOBS))
        engine._emit(GpuUpdated(gpu_snapshot(processes=True)))
        await pilot.press("1")
        await wait_until(pilot, lambda: pane.process_rows and pane.process_rows[0].ours)
        await pilot.pause(0.2)
        text = screen_text(app)
        assert "server worker (TP)" in text and "trainer rank" in text and "9999 other" in text, text
