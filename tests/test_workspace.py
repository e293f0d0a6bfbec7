"""Workspace creation, the driver lock across processes, and the `disk` stage on real disks."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap

import pytest

from engine.checks.context import CheckContext
from engine.config import set_value
from engine.pipeline import Pipeline
from engine.workspace import Workspace, WorkspaceError, find_workspace, init_workspace


def test_init_creates_layout_and_refuses_overwrite(tmp_path):
    ws = init_workspace(tmp_path / "ws")
    for sub in ("jobs", "state", "hidden", "drafters", "eval"):
        assert (ws.root / sub).is_dir()
    assert ws.config_path.is_file()
    assert oct(ws.config_path.stat().st_mode & 0o777) == "0o600"  # may hold an API key
    before = ws.config_path.read_bytes()
    with pytest.raises(WorkspaceError, match="already exists"):
        init_workspace(tmp_path / "ws")
    assert ws.config_path.read_bytes() == before


def test_init_on_a_file_is_a_clear_error(tmp_path):
    target = tmp_path / "afile"
    target.write_text("x")
    with pytest.raises(WorkspaceError, match="not a directory"):
        init_workspace(target)


def test_find_workspace_prefers_explicit_then_cwd_then_default(tmp_path):
    assert find_workspace(str(tmp_path / "x"))[0] == (tmp_path / "x").resolve()
    path, is_default = find_workspace(None, cwd=tmp_path)
    assert path == (tmp_path / "eagle3-workspace").resolve() and is_default
    init_workspace(tmp_path / "here")
    path, is_default = find_workspace(None, cwd=tmp_path / "here")
    assert path == (tmp_path / "here").resolve() and not is_default


def test_lock_is_exclusive_across_processes_and_released_on_death(tmp_path):
    ws = init_workspace(tmp_path / "ws")
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from engine.workspace import Workspace
            ws = Workspace({str(ws.root)!r})
            assert ws.lock.acquire()
            print("locked", flush=True)
            time.sleep(60)
        """)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        second = Workspace(ws.root)
        assert not second.lock.acquire()
        info = second.lock.holder()
        assert info is not None and info.pid == holder.pid
        assert f"pid {holder.pid}" in info.describe()
    finally:
        holder.kill()
        holder.wait()
    third = Workspace(ws.root)
    assert third.lock.acquire(), "the kernel drops an flock when its holder dies: never a stale lock"
    third.lock.release()


def test_engine_attaches_read_only_when_another_drives(tmp_path):
    from engine.core import Engine, ReadOnlyError

    ws = init_workspace(tmp_path / "ws")
    driver = Engine(Workspace(ws.root))
    attached = Engine(Workspace(ws.root))
    try:
        assert not driver.read_only
        assert attached.read_only and attached.lock_holder.pid == os.getpid()
        with pytest.raises(ReadOnlyError, match="read-only"):
            attached._require_driver("start the server")
    finally:
        asyncio.run(attached.close())
        asyncio.run(driver.close())


def _disk_report(ws: Workspace):
    return asyncio.run(Pipeline(CheckContext(ws)).run_stage("disk"))


def _with_model(ws: Workspace, hidden: int = 64) -> None:
    model = ws.root / "models" / "m"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 6, "hidden_size": hidden, "vocab_size": 100}))
    ws.save_config(set_value(ws.config, "model.path", "models/m"))


def test_disk_creates_missing_output_dir_when_configured(tmp_path):
    """The seed's launch failed on a missing output directory: here it is created up front."""
    ws = init_workspace(tmp_path / "ws")
    _with_model(ws)
    ws.save_config(set_value(ws.config, "extract.output_dir", str(tmp_path / "deep" / "new" / "out")))
    report = _disk_report(ws)
    by_name = {r.name: r for r in report.results}
    assert by_name["output_dir"].status.value == "pass"
    assert "(created)" in by_name["output_dir"].evidence
    assert (tmp_path / "deep" / "new" / "out" / "run1").is_dir()


def test_disk_fails_naming_missing_dir_when_creation_is_off(tmp_path):
    ws = init_workspace(tmp_path / "ws")
    _with_model(ws)
    config = set_value(ws.config, "extract.output_dir", str(tmp_path / "absent"))
    ws.save_config(set_value(config, "extract.create_output_dir", False))
    report = _disk_report(ws)
    result = {r.name: r for r in report.results}["output_dir"]
    assert report.state.value == "failed"
    assert result.status.value == "fail" and str(tmp_path / "absent") in result.evidence
    assert "mkdir -p" in result.fix
    assert not (tmp_path / "absent").exists()


def _mount(*args: str) -> bool:
    return subprocess.run(["mount", *args], capture_output=True).returncode == 0


def test_disk_fails_on_unwritable_dir_then_passes_when_fixed(tmp_path):
    """A read-only mount is unwritable even for root (CI runs as root); remounting rw fixes it."""
    ws = init_workspace(tmp_path / "ws")
    _with_model(ws)
    out = tmp_path / "ro"
    out.mkdir()
    if os.geteuid() == 0:
        if not _mount("-t", "tmpfs", "-o", "size=8m", "tmpfs", str(out)):
            pytest.skip("cannot mount tmpfs here")
        (out / "run1").mkdir()
        assert _mount("-o", "remount,ro", str(out))
        fix = lambda: _mount("-o", "remount,rw", str(out))  # noqa: E731
    else:
        (out / "run1").mkdir()
        os.chmod(out / "run1", 0o500)
        fix = lambda: os.chmod(out / "run1", 0o700) or True  # noqa: E731
    try:
        ws.save_config(set_value(ws.config, "extract.output_dir", str(out)))
        report = _disk_report(ws)
        result = {r.name: r for r in report.results}["output_dir"]
        assert report.state.value == "failed"
        assert "not writable" in result.evidence and result.fix
        assert fix()
        report = _disk_report(ws)
        assert {r.name: r for r in report.results}["output_dir"].status.value == "pass"
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", str(out)], capture_output=True)


def test_disk_budget_refuses_when_run_does_not_fit(tmp_path):
    """needs X, free Y, reserve Z on <mount>: a reserve larger than the disk must fail."""
    ws = init_workspace(tmp_path / "ws")
    _with_model(ws, hidden=7168)
    data = ws.root / "train.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n' * 1000)
    config = set_value(ws.config, "dataset.path", "train.jsonl")
    ws.save_config(set_value(config, "extract.disk_reserve_gb", 10_000_000.0))
    budget = {r.name: r for r in _disk_report(ws).results}["budget"]
    assert budget.status.value == "fail"
    for words in ("needs", "free", "reserve", " on /"):
        assert words in budget.evidence
    assert "another disk" in budget.fix
    ws.save_config(set_value(ws.config, "extract.disk_reserve_gb", 0.0))
    budget = {r.name: r for r in _disk_report(ws).results}["budget"]
    assert budget.status.value == "pass", budget.evidence


def test_init_gives_each_workspace_a_free_port(tmp_path):
    """Two workspaces on one host get different server ports, and a port in use is never handed out."""
    import socket

    from engine.workspace import free_server_port, init_workspace

    first = init_workspace(tmp_path / "a").config.server.port
    second = init_workspace(tmp_path / "b").config.server.port
    assert first != second and 30000 <= first < 32768 and 30000 <= second < 32768
    wanted = free_server_port("127.0.0.1", tmp_path / "c")
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", wanted))
        holder.listen()
        got = init_workspace(tmp_path / "c").config.server.port
    assert got != wanted
