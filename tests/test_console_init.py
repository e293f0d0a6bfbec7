"""`eagle3-console init DIR` (issue 21): a non-empty directory that is not a workspace is refused,
naming what is in it; an empty or new directory, or an existing workspace, is fine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from eagle3_console.cli import refuse_init_reason


def run_init(target: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eagle3_console", "init", str(target)], capture_output=True,
                          text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])


def test_init_refuses_a_source_checkout_and_names_what_is_there(tmp_path):
    checkout = tmp_path / "checkout"
    (checkout / "src").mkdir(parents=True)
    (checkout / "setup.py").write_text("print('hi')\n")
    (checkout / "README.md").write_text("# a project\n")
    result = run_init(checkout)
    assert result.returncode == 2, result
    assert "is not empty and is not a workspace" in result.stderr
    assert "README.md, setup.py, src/" in result.stderr
    assert not (checkout / "console.toml").exists()


def test_init_accepts_new_empty_and_existing_workspaces(tmp_path):
    assert refuse_init_reason(tmp_path / "new") is None
    empty = tmp_path / "empty"
    empty.mkdir()
    assert refuse_init_reason(empty) is None
    result = run_init(empty)
    assert result.returncode == 0, result.stderr
    assert (empty / "console.toml").exists() and "Workspace ready in" in result.stdout
    assert refuse_init_reason(empty) is None  # a workspace already
    (tmp_path / "file").write_text("x")
    assert "not a directory" in refuse_init_reason(tmp_path / "file")
