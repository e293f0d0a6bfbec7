"""Engine file watchers (engine.watchers) on real files, and the Engine publishing what they read."""

from __future__ import annotations

import ast
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

from engine.io.atomic import write_json
from engine.core import Engine
from engine.events import EvaluationReport, Event, JobEvents, JobLogTail, TrainingMetrics
from engine.jobs.events import Finished, Paused, Progress
from engine.watchers import JsonFileWatch, JsonlTail, LogTail, WorkspaceFiles, tail_lines
from engine.workspace import init_workspace


async def test_jsonl_tail_follows_by_offset_and_rereads_a_replaced_or_truncated_file(tmp_path):
    path = tmp_path / "m.jsonl"
    tail = JsonlTail(path)
    assert await tail.read() == (b"", False)  # missing: nothing, no reset
    path.write_bytes(b'{"a":1}\n{"a":2')
    assert await tail.read() == (b'{"a":1}\n', False)  # the torn line waits
    with open(path, "ab") as handle:
        handle.write(b'}\n{"a":3}\n')
    assert await tail.read() == (b'{"a":2}\n{"a":3}\n', False)
    assert await tail.read() == (b"", False)
    # Replaced atomically (a resumed run trims the file): same size, new inode -> from the start.
    replacement = tmp_path / "m.tmp"
    replacement.write_bytes(b'{"b":1}\n{"b":2}\n{"b":3}\n')
    os.replace(replacement, path)
    assert await tail.read() == (b'{"b":1}\n{"b":2}\n{"b":3}\n', True)
    # Truncated in place: smaller than the offset -> from the start.
    with open(path, "r+b") as handle:
        handle.truncate(0)
        handle.write(b'{"c":1}\n')
    assert await tail.read() == (b'{"c":1}\n', True)
    path.unlink()
    assert await tail.read() == (b"", True)  # gone: what was shown is gone too


async def test_json_file_watch_reads_only_on_change_and_names_the_problem(tmp_path):
    path = tmp_path / "report.json"
    watch = JsonFileWatch(path, "evaluation report", "; run the evaluate stage again")
    assert await watch.read() == (True, None, f"no evaluation report at {path}")
    assert (await watch.read())[0] is False
    write_json(path, {"overall": {}})
    assert await watch.read() == (True, {"overall": {}}, "")
    assert (await watch.read())[0] is False
    assert await watch.read(force=True) == (True, {"overall": {}}, "")
    path.write_text("{broken")
    changed, data, problem = await watch.read()
    assert changed and data is None and "is unreadable" in problem and problem.endswith("run the evaluate stage again")


async def test_log_tail_sends_the_last_lines_when_the_log_grows(tmp_path):
    path = tmp_path / "log.txt"
    path.write_text("".join(f"line {i}\n" for i in range(5000)))
    assert await tail_lines(path, 3, block=64) == ["line 4997", "line 4998", "line 4999"]
    log = LogTail(path, lines=2)
    assert await log.read() == (True, ["line 4998", "line 4999"])
    assert await log.read() == (False, [])
    with open(path, "a") as handle:
        handle.write("last\n")
    assert await log.read() == (True, ["line 4999", "last"])


async def test_workspace_files_report_metrics_pointers_and_report_once_per_change(tmp_path):
    drafter, evals = tmp_path / "drafter", tmp_path / "eval"
    files = WorkspaceFiles(drafter, evals)
    first = await files.poll()
    assert [type(e) for e in first] == [EvaluationReport]  # no metrics yet; the report's absence is news once
    assert first[0].report is None and "no evaluation report at" in first[0].problem
    assert await files.poll() == []
    drafter.mkdir()
    (drafter / "metrics.jsonl").write_text('{"type":"train","step":1}\n')
    write_json(drafter / "checkpoints" / "latest.json", {"step": 1, "path": "step-00000001"})
    write_json(evals / "report.json", {"prompts": []})
    events = await files.poll()
    metrics = next(e for e in events if isinstance(e, TrainingMetrics))
    assert metrics.records == ({"type": "train", "step": 1},) and metrics.latest == {"step": 1, "path": "step-00000001"}
    report = next(e for e in events if isinstance(e, EvaluationReport))
    assert report.report is None and "no 'overall' section" in report.problem
    assert await files.poll() == []


def make_ws(tmp_path: Path):
    return init_workspace(tmp_path / "ws")


async def _until(events: list[Event], predicate: Callable[[Event], Any], timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = next((e for e in events if predicate(e)), None)
        if found is not None:
            return found
        await asyncio.sleep(0.05)
    raise AssertionError(f"no matching event among {[type(e).__name__ for e in events]}")


async def test_the_engine_publishes_typed_job_events_metrics_reports_and_the_followed_log(tmp_path):
    ws = make_ws(tmp_path)
    engine = Engine(ws, drive=False)
    seen: list[Event] = []
    engine.subscribe(seen.append)
    body = ("import time\nfrom engine.jobs.context import JobContext\nctx = JobContext.from_env()\n"
            "print('hello from the job', flush=True)\nctx.progress(1, 4, unit='steps')\n"
            "ctx.event('paused', reason='disk')\nctx.event('finished', step=4, export='x')\n")
    job = engine.jobs.start("train", [sys.executable, "-c", body], cwd=Path(__file__).resolve().parents[1])
    await engine.start()
    try:
        batch = await _until(seen, lambda e: isinstance(e, JobEvents) and any(isinstance(x, Finished) for x in e.events))
        assert batch.job_id == job.id and batch.kind == "train"
        kinds = [type(e) for e in seen if isinstance(e, JobEvents) for e in e.events]
        assert kinds == [Progress, Paused, Finished]
        engine.follow_log(job.id)
        log = await _until(seen, lambda e: isinstance(e, JobLogTail) and "hello from the job" in e.lines)
        assert log.job_id == job.id
        report = await _until(seen, lambda e: isinstance(e, EvaluationReport))
        assert report.report is None
        write_json(ws.eval_dir / "report.json", {"overall": {"acceptance_length": 2.5}})
        await _until(seen, lambda e: isinstance(e, EvaluationReport) and e.report is not None)
        ws.drafter_dir.mkdir(parents=True, exist_ok=True)
        (ws.drafter_dir / "metrics.jsonl").write_text(json.dumps({"type": "train", "step": 3}) + "\n")
        metrics = await _until(seen, lambda e: isinstance(e, TrainingMetrics))
        assert metrics.records[0]["step"] == 3
        count = sum(isinstance(e, EvaluationReport) for e in seen)
        await engine.reload_evaluation()  # `u`: sent again though unchanged
        assert sum(isinstance(e, EvaluationReport) for e in seen) == count + 1
    finally:
        await engine.close()


FILE_CALLS = {"open", "read_text", "read_bytes", "write_text", "write_bytes", "stat", "lstat", "exists", "is_file",
              "is_dir", "iterdir", "glob", "rglob", "scandir", "listdir", "load", "fstat", "tail", "events",
              "read_report", "read_json_object", "read_json_object_or_none", "tail_lines", "last_events"}
PANES = Path(__file__).resolve().parents[1] / "eagle3_console" / "panes"


def file_reads(source: str) -> list[str]:
    """Calls in `source` that touch the filesystem (open(), Path.read_text/stat/..., os.stat, json.load, and the
    engine's readers: the job manager's tail()/events(), read_report(), ...), as 'line: name'."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        if name in FILE_CALLS:
            found.append(f"{node.lineno}: {name}()")
    return found


def test_panes_open_no_files():
    """Panes are functions of engine events: the engine's watchers read metrics, reports and logs."""
    reads = {path.name: file_reads(path.read_text(encoding="utf-8")) for path in sorted(PANES.glob("*.py"))}
    assert len(reads) >= 8
    assert {name: calls for name, calls in reads.items() if calls} == {}


def test_the_pane_scan_finds_the_reads_a_pane_used_to_make():
    """The scan above is not vacuous: the training pane of before the watchers polled metrics.jsonl itself."""
    old_training_pane = '''
def read_new_metrics(path, tail):
    stat = os.stat(path)
    with open(path, "rb") as handle:
        return handle.read()

def read_pointer(path):
    return json.loads(path.read_text(encoding="utf-8"))
'''
    assert file_reads(old_training_pane) == ["3: stat()", "4: open()", "8: read_text()"]


async def test_u_has_the_engine_read_the_report_again_even_when_it_looks_unchanged(tmp_path):
    """`u` on Evaluation: the engine re-reads report.json although its size, mtime and inode did not change
    (a file rewritten in place within the filesystem's mtime resolution)."""
    from eagle3_console.app import ConsoleApp
    from eagle3_console.panes import EvaluationPane

    ws = make_ws(tmp_path)
    path = ws.eval_dir / "report.json"
    write_json(path, {"overall": {"acceptance_length": 2.5}, "prompts": []})
    app = ConsoleApp(Engine(ws))
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("6")
        pane = app.query_one(EvaluationPane)
        deadline = time.monotonic() + 20
        while pane.report is None and time.monotonic() < deadline:
            await pilot.pause(0.05)
        assert pane.report is not None and pane.report["overall"]["acceptance_length"] == 2.5
        before = os.stat(path)
        data = path.read_bytes()
        with open(path, "r+b") as handle:  # same inode, same size
            handle.write(data.replace(b"2.5", b"3.5"))
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # same mtime
        await pilot.pause(2.5)  # a few watcher ticks: nothing looks changed, nothing is re-read
        assert pane.report["overall"]["acceptance_length"] == 2.5
        await pilot.press("u")
        deadline = time.monotonic() + 10
        while pane.report["overall"]["acceptance_length"] != 3.5 and time.monotonic() < deadline:
            await pilot.pause(0.05)
        assert pane.report["overall"]["acceptance_length"] == 3.5
