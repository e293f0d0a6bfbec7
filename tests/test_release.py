"""`data release` / `data list`: releasing old extraction runs, on real run directories.

Runs are built with the real record writer (safetensors files, manifest, run.json) and a
complete.json written atomically, as the extraction job does; the CLI runs as a real process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine.io import atomic
from engine.extract.job import COMPLETE as JOB_COMPLETE
from engine.records import append_manifest, write_record, write_run_meta
from engine.release import (
    COMPLETE,
    ReleaseError,
    describe_run,
    list_runs,
    newer_verified_run,
    output_dir_of,
    release_run,
)
from engine.workspace import init_workspace

HIDDEN = 4
ROOT = Path(__file__).resolve().parent.parent


def _make_run(output_dir: Path, name: str, samples: int = 3, finished_at: float | None = None,
              created_at: float | None = None) -> Path:
    run_dir = output_dir / name
    created = created_at if created_at is not None else time.time()
    write_run_meta(run_dir, {"hidden_size": HIDDEN, "num_samples": samples, "created_at": created})
    total = 0
    for i in range(samples):
        t = 3 + i
        entry = write_record(run_dir, i, f"s{i}", torch.arange(t), torch.ones(t, dtype=torch.int64),
                             torch.randn(t, 3 * HIDDEN), torch.randn(t, HIDDEN))
        append_manifest(run_dir, entry)
        total += entry.bytes
    if finished_at is not None:
        atomic.write_json(run_dir / COMPLETE, {"samples": samples, "bad": 0, "bytes": total,
                                               "finished_at": finished_at})
    return run_dir


def _tree_size(path: Path) -> int:
    return sum(os.lstat(os.path.join(d, f)).st_size for d, _, fs in os.walk(path) for f in fs)


@pytest.fixture()
def ws(tmp_path):
    """A workspace configured on run2, with an older finished run1 and a newer finished run2."""
    workspace = init_workspace(tmp_path / "ws")
    config = workspace.config
    config.extract.run = "run2"
    workspace.save_config(config)
    out = output_dir_of(workspace)
    now = time.time()
    _make_run(out, "run1", created_at=now - 100, finished_at=now - 90)
    _make_run(out, "run2", created_at=now - 50, finished_at=now - 10)
    return workspace


def _cli(ws, *args, stdin: str | None = None):
    return subprocess.run([sys.executable, "-m", "eagle3_console.cli", "data", *args, "-w", str(ws.root)],
                          input=stdin if stdin is not None else "", capture_output=True, text=True,
                          cwd=ROOT, timeout=60)


def test_complete_marker_name_matches_the_extraction_job():
    assert COMPLETE == JOB_COMPLETE


def test_describe_and_list_runs(ws):
    out = output_dir_of(ws)
    info = describe_run(out, "run1")
    assert (info.name, info.records, info.state) == ("run1", 3, "complete")
    assert info.bytes == _tree_size(out / "run1") > 0
    assert describe_run(out, "run1", verify=True).state == "verified"
    (out / "not-a-run").mkdir()  # no run.json: not listed
    assert [r.name for r in list_runs(ws)] == ["run1", "run2"]


def test_refuses_the_configured_run(ws):
    with pytest.raises(ReleaseError, match="configured run"):
        release_run(ws, "run2", confirmed_name="run2", newer_ok=False)
    assert (output_dir_of(ws) / "run2" / "run.json").is_file()


def test_refuses_without_confirmation_and_deletes_nothing(ws):
    out = output_dir_of(ws)
    before = _tree_size(out / "run1")
    with pytest.raises(ReleaseError, match="confirm by typing"):
        release_run(ws, "run1", confirmed_name=None, newer_ok=False)
    with pytest.raises(ReleaseError, match="does not match"):
        release_run(ws, "run1", confirmed_name="run2", newer_ok=False)
    assert _tree_size(out / "run1") == before
    assert sorted(p.name for p in out.iterdir()) == ["run1", "run2"]


def test_typed_name_deletes_only_that_run(ws):
    out = output_dir_of(ws)
    expected = _tree_size(out / "run1")
    run2_before = _tree_size(out / "run2")
    assert release_run(ws, "run1", confirmed_name="run1", newer_ok=False) == expected
    assert sorted(p.name for p in out.iterdir()) == ["run2"]
    assert _tree_size(out / "run2") == run2_before


def test_newer_verified_run_allows_release(ws):
    out = output_dir_of(ws)
    newer = newer_verified_run(ws, "run1")
    assert newer is not None and newer.name == "run2" and newer.state == "verified"
    assert newer_verified_run(ws, "run2") is None  # run1 is older
    freed = release_run(ws, "run1", confirmed_name=None, newer_ok=True)
    assert freed > 0 and not (out / "run1").exists()


def test_corrupted_newer_run_is_not_verified(ws):
    out = output_dir_of(ws)
    record = next((out / "run2" / "records").rglob("*.safetensors"))
    data = bytearray(record.read_bytes())
    data[-1] ^= 0xFF  # same size, one byte flipped: only the hash tells
    record.write_bytes(bytes(data))
    assert newer_verified_run(ws, "run1") is None
    with pytest.raises(ReleaseError, match="no newer run is verified"):
        release_run(ws, "run1", confirmed_name=None, newer_ok=True)
    assert (out / "run1" / "run.json").is_file()
    damaged = describe_run(out, "run2", verify=True)
    assert damaged.state == "damaged" and any("checksum" in p for p in damaged.problems)


def test_unfinished_newer_run_is_not_verified(ws):
    out = output_dir_of(ws)
    (out / "run2" / COMPLETE).unlink()
    assert describe_run(out, "run2").state == "incomplete"
    assert newer_verified_run(ws, "run1") is None


@pytest.mark.parametrize("name", ["../ws", "..", "run1/../run2", "/etc", ".hidden", "a/b", ""])
def test_traversal_names_are_rejected(ws, name):
    with pytest.raises(ReleaseError, match="invalid run name"):
        release_run(ws, name, confirmed_name=name, newer_ok=False)
    assert (output_dir_of(ws) / "run1").is_dir() and ws.config_path.is_file()


def test_symlinked_run_dir_is_refused_and_its_target_kept(ws, tmp_path):
    target = _make_run(tmp_path / "elsewhere", "precious", finished_at=time.time() - 200)
    link = output_dir_of(ws) / "linked"
    link.symlink_to(target, target_is_directory=True)
    with pytest.raises(ReleaseError, match="symlink"):
        release_run(ws, "linked", confirmed_name="linked", newer_ok=False)
    assert link.is_symlink() and (target / "run.json").is_file()
    assert "linked" not in [r.name for r in list_runs(ws)]


def test_symlinks_inside_a_run_are_unlinked_not_followed(ws, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("user data")
    run1 = output_dir_of(ws) / "run1"
    (run1 / "link-dir").symlink_to(outside, target_is_directory=True)
    (run1 / "link-file").symlink_to(outside / "keep.txt")
    release_run(ws, "run1", confirmed_name="run1", newer_ok=False)
    assert not run1.exists() and (outside / "keep.txt").read_text() == "user data"


def test_not_a_run_is_refused_with_what_was_found(ws):
    out = output_dir_of(ws)
    (out / "stuff").mkdir()
    (out / "stuff" / "notes.txt").write_text("x")
    with pytest.raises(ReleaseError, match=r"no run\.json.*notes\.txt"):
        release_run(ws, "stuff", confirmed_name="stuff", newer_ok=False)
    with pytest.raises(ReleaseError, match=r"no run 'ghost'.*run1, run2"):
        describe_run(out, "ghost")
    assert (out / "stuff" / "notes.txt").is_file()


def test_active_job_after_a_config_change_blocks_release(ws):
    """A real detached job of kind "train"; the config is edited after it started."""
    from engine.jobs.manager import JobManager

    jobs = JobManager(ws.jobs_dir)
    job = jobs.start("train", [sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        deadline = time.time() + 10
        while jobs.get(job.id).state != "running" and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.05)
        ws.save_config(ws.config)  # console.toml changed after the job started
        with pytest.raises(ReleaseError, match="train job .* is running"):
            release_run(ws, "run1", confirmed_name="run1", newer_ok=False)
        assert (output_dir_of(ws) / "run1" / "run.json").is_file()
    finally:
        jobs.kill(job.id)


# ----------------------------------------------------------------------------- the CLI


def test_cli_data_list(ws):
    result = _cli(ws, "list", "--verify")
    assert result.returncode == 0, result.stderr
    assert "run1" in result.stdout and "verified" in result.stdout
    assert "* run2" in result.stdout
    data = json.loads(_cli(ws, "list", "--json").stdout)
    assert [(r["name"], r["state"], r["records"]) for r in data["runs"]] == [("run1", "complete", 3),
                                                                            ("run2", "complete", 3)]


def test_cli_release_without_confirmation_exits_1_and_keeps_the_run(ws):
    out = output_dir_of(ws)
    (out / "run2" / COMPLETE).unlink()  # no newer verified run
    result = _cli(ws, "release", "run1")
    assert result.returncode == 1
    assert "releasing it frees" in result.stdout and "newer verified run: none" in result.stdout
    assert "not released" in result.stderr and "Traceback" not in result.stderr
    assert (out / "run1" / "run.json").is_file()
    result = _cli(ws, "release", "run1", stdin="run2\n")  # typed the wrong name
    assert result.returncode == 1 and (out / "run1").is_dir()
    result = _cli(ws, "release", "run1", "--yes")  # --yes needs a newer verified run
    assert result.returncode == 1 and (out / "run1").is_dir()


def test_cli_release_by_typed_name_and_by_confirm_flag(ws):
    out = output_dir_of(ws)
    _make_run(out, "run0", created_at=time.time() - 500)
    result = _cli(ws, "release", "run0", stdin="run0\n")
    assert result.returncode == 0, result.stderr
    assert "released run0: freed" in result.stdout and not (out / "run0").exists()
    result = _cli(ws, "release", "run1", "--confirm", "run1")
    assert result.returncode == 0, result.stderr
    assert not (out / "run1").exists() and (out / "run2").is_dir()


def test_cli_release_with_newer_verified_run_and_yes(ws):
    result = _cli(ws, "release", "run1", "--yes")
    assert result.returncode == 0, result.stderr
    assert "newer verified run: run2" in result.stdout and "released run1" in result.stdout
    assert not (output_dir_of(ws) / "run1").exists()


@pytest.mark.parametrize("args, message", [
    (["release", "run2", "--confirm", "run2"], "configured run"),
    (["release", "../ws", "--confirm", "../ws"], "invalid run name"),
    (["release", "ghost", "--confirm", "ghost"], "no run 'ghost'"),
    (["release", "run1", "--confirm", "run9"], "does not match"),
])
def test_cli_refusals_are_one_line_without_traceback(ws, args, message):
    result = _cli(ws, *args)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and message in errors[0] and "Traceback" not in result.stderr
    assert (output_dir_of(ws) / "run1").is_dir() and (output_dir_of(ws) / "run2").is_dir()
