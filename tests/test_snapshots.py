"""Snapshot tests (pytest-textual-snapshot) of every pane in its empty, running, failed and
done states: at 80x24 (one tab at a time), 120x40 (Pipeline beside the chosen pane) and 200x60
(every pane at once). The status strip is on every frame.

Scenes come from tests/helpers/scenes.py: a real console over a real workspace fed fixed
engine events and fixed files (the 8-GPU snapshot is hand-built: no NVML on CI). Update the
baselines with `pytest tests/test_snapshots.py --snapshot-update` and review the SVG diff.
"""

from __future__ import annotations

import pytest

from tests.helpers.workspaces import console_workspace
from tests.helpers.scenes import apply_scene, make_app

NARROW = [
    ("gpus", "empty"), ("gpus", "running"),
    ("server", "running"), ("server", "failed"),
    ("pipeline", "empty"), ("pipeline", "failed"),
    ("extraction", "running"), ("extraction", "failed"), ("extraction", "done"),
    ("training", "running"), ("training", "failed"),
    ("evaluation", "empty"), ("evaluation", "done"),
    ("jobs", "running"), ("jobs", "failed"),
]
WIDE = ["empty", "running", "failed", "done"]
SPLIT = [("jobs", "failed"), ("extraction", "running"), ("training", "done"), ("gpus", "running")]


@pytest.mark.parametrize(("tab", "scene"), NARROW, ids=[f"{t}-{s}" for t, s in NARROW])
def test_pane_at_80x24(snap_compare, tmp_path, tab, scene):
    app = make_app(console_workspace(tmp_path), scene)

    async def run_before(pilot) -> None:
        await apply_scene(app, pilot, scene, tab)

    assert snap_compare(app, terminal_size=(80, 24), run_before=run_before)


@pytest.mark.parametrize(("tab", "scene"), SPLIT, ids=[f"{t}-{s}" for t, s in SPLIT])
def test_two_columns_at_120x40(snap_compare, tmp_path, tab, scene):
    app = make_app(console_workspace(tmp_path), scene)

    async def run_before(pilot) -> None:
        await apply_scene(app, pilot, scene, tab)

    assert snap_compare(app, terminal_size=(120, 40), run_before=run_before)


@pytest.mark.parametrize("scene", WIDE)
def test_all_panes_at_200x60(snap_compare, tmp_path, scene):
    app = make_app(console_workspace(tmp_path), scene)

    async def run_before(pilot) -> None:
        await apply_scene(app, pilot, scene, "pipeline")

    assert snap_compare(app, terminal_size=(200, 60), run_before=run_before)


@pytest.mark.parametrize(("size", "scene", "shown", "hidden"), [
    ((200, 60), "done", ["56.0 KiB/tok"], "ETA"),  # no estimate to give: bytes per token takes its room
    ((200, 60), "running", ["56.0 KiB/tok"], "ETA"),
    ((80, 24), "running", ["ETA —", "56.0 KiB/tok"], None),  # room for both
])
async def test_extraction_numbers_keep_bytes_per_token_where_an_empty_eta_makes_room(
        tmp_path, size, scene, shown, hidden):
    from tests.helpers.screen import screen_lines

    app = make_app(console_workspace(tmp_path), scene)
    async with app.run_test(size=size) as pilot:
        await apply_scene(app, pilot, scene, "extraction")
        await pilot.pause()
        line = next(line for line in screen_lines(app) if "samples 850/2000" in line or "samples 2000/2000" in line)
        assert all(part in line for part in shown), line
        assert hidden is None or hidden not in line, line
