"""Adding a stage touches engine/registry.py and one new module: a tenth stage with a job, added that way
to a copy of the product, is checked, started, followed and shown by the unchanged CLI and console (real
subprocesses, a real job, the console's own screenshot)."""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.helpers.workspaces import console_workspace

REPO = Path(__file__).resolve().parents[1]

STAGE_MODULE = '''"""A tenth stage: green once its job has written lint.ok in the workspace."""
import sys

from engine.checks.base import failed, passed


def check_lint(ctx):
    marker = ctx.workspace.root / "lint.ok"
    if marker.exists():
        return [passed("lint", f"{marker} written by the lint job")]
    return [failed("lint", f"{marker} missing", "run the lint job: `eagle3-console run lint`")]


def start_lint(workspace, jobs):
    argv = [sys.executable, "-c", "import pathlib; pathlib.Path('lint.ok').write_text('ok')"]
    return jobs.start("lint", argv, cwd=workspace.root)
'''
REGISTRY_LINE = '''    Stage("lint", "Lint", "a tenth stage", "engine.lint_stage:check_lint", ("model",), fed_by=("lint",),
          job=JobKind("lint", "engine.lint_stage:start_lint", 5.0)),
'''


def _product_with_tenth_stage(root: Path) -> Path:
    src = root / "src"
    for package in ("engine", "eagle3_console", "themes"):
        shutil.copytree(REPO / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    (src / "engine" / "lint_stage.py").write_text(STAGE_MODULE)
    registry = src / "engine" / "registry.py"
    text = registry.read_text()
    end = text.index("\n)\n", text.index("STAGES: tuple[Stage, ...] = ("))
    registry.write_text(text[:end + 1] + REGISTRY_LINE + text[end + 1:])
    return src


def test_a_tenth_stage_is_one_registry_line_and_one_module(tmp_path):
    src = _product_with_tenth_stage(tmp_path)
    ws = console_workspace(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(src)}
    cli = [sys.executable, "-m", "eagle3_console", "-w", str(ws.root)]

    def console(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*cli, *args], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)

    before = json.loads(console("status", "--json").stdout)
    assert [s["stage"] for s in before["stages"]][-1] == "lint" and len(before["stages"]) == 10
    ran = console("run", "lint")
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert (ws.root / "lint.ok").read_text() == "ok"  # the stage's job ran, through the unchanged runner
    after = {s["stage"]: s for s in json.loads(console("status", "--json").stdout)["stages"]}
    assert after["lint"]["state"] == "passed"
    listed = console("jobs", "list")
    assert "lint" in listed.stdout and "succeeded" in listed.stdout, listed.stdout
    shot = console("screenshot", str(tmp_path / "shots"), "--size", "120x40", "--settle", "0.5")
    assert shot.returncode == 0, shot.stderr
    svg = next((tmp_path / "shots").glob("*.svg")).read_text()
    rows = html.unescape("".join(re.findall(r">([^<]*)</text>", svg)))
    # the console's checklist lists it after the nine, green
    assert re.search(r"evaluate\s+pending.*\n.*lint\s+passed", rows), rows
