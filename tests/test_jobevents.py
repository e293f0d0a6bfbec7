"""The job-event contract (engine.jobs.events): what jobs write through the job context is what readers parse."""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import sys
import textwrap
import time
from pathlib import Path

import pytest

from engine.jobs.context import STRICT_EVENTS_ENV, JobContext
from engine.jobs.events import (
    EVENT_TYPES,
    MalformedEvent,
    Paused,
    Progress,
    UnknownEvent,
    parse_event,
    parse_lines,
)
from engine.jobs.manager import JobManager
from tests.helpers.events import sample

REPO = Path(__file__).resolve().parents[1]
JOB_SOURCES = ("engine/extract", "engine/train", "engine/evaluate", "engine/dataset")


def test_every_kind_written_by_a_real_job_through_the_context_parses_back_whole(tmp_path):
    """A real job process emits one fully populated event of every kind; the console parses each back equal."""
    jobs = JobManager(tmp_path / "jobs")
    body = textwrap.dedent("""
        from engine.jobs.context import JobContext
        from engine.jobs.events import EVENT_TYPES
        from tests.helpers.events import sample
        ctx = JobContext.from_env()
        for cls in EVENT_TYPES.values():
            ctx.emit(sample(cls))
    """)
    job = jobs.start("contract", [sys.executable, "-c", body], cwd=REPO)
    deadline = time.monotonic() + 60
    while jobs.get(job.id).active and time.monotonic() < deadline:
        time.sleep(0.05)
    assert jobs.get(job.id).state == "succeeded", jobs.tail(job.id, 20)
    data = (job.dir / "events.jsonl").read_bytes()
    events, skipped, used = parse_lines(data)
    assert skipped == [] and used == len(data)
    assert [e.kind for e in events] == list(EVENT_TYPES)
    for event in events:
        expected = sample(type(event))
        assert event.extra == {}, f"{event.kind}: fields outside the contract {event.extra}"
        assert dataclasses.replace(event, t=None) == expected
        assert isinstance(event.t, float)


def _emitted(path: Path) -> list[tuple[str, str, list[str], int]]:
    """(file, kind, keyword names, line) of every `x.event("kind", k=...)` / `x.progress(...)` call."""
    found = []
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        names = [k.arg for k in node.keywords if k.arg is not None]
        if node.func.attr == "event" and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            found.append((str(path.relative_to(REPO)), node.args[0].value, names, node.lineno))
        elif node.func.attr == "progress" and isinstance(node.func.value, ast.Attribute) \
                and node.func.value.attr == "ctx":
            found.append((str(path.relative_to(REPO)), "progress", names, node.lineno))
    return found


def test_every_event_the_jobs_write_is_in_the_contract_with_its_fields():
    """Drift guard: a job that writes a new kind or field fails here until engine/jobs/events.py names it."""
    calls = [c for src in JOB_SOURCES for path in sorted((REPO / src).rglob("*.py")) for c in _emitted(path)]
    assert len({kind for _f, kind, _n, _l in calls}) >= 20, "the scan found too few event kinds: is it broken?"
    problems = []
    for file, kind, names, line in calls:
        cls = EVENT_TYPES.get(kind)
        if cls is None:
            problems.append(f"{file}:{line}: kind {kind!r} is not in engine.jobs.events.EVENT_TYPES")
            continue
        fields = {f.name for f in dataclasses.fields(cls)}
        problems += [f"{file}:{line}: {kind} field {n!r} is not a field of {cls.__name__}"
                     for n in names if n not in fields]
    assert not problems, "\n".join(problems)


def test_unknown_kind_is_typed_and_kept_whole():
    event = parse_event({"t": 1.0, "type": "telemetry", "gpu": 3})
    assert isinstance(event, UnknownEvent) and event.kind == "telemetry" and event.extra == {"gpu": 3}
    assert event.to_dict() == {"t": 1.0, "type": "telemetry", "gpu": 3}


def test_malformed_lines_are_skipped_with_the_reason_and_a_torn_line_waits():
    lines = [b'{"type":"paused","reason":"disk"}', b"not json", b"[1,2]", b'{"reason":"no type"}',
             b'{"type":"progress","done":"three"}', b'{"type":"progress","done":2,"eta_s":"Infinity","x":1}']
    data = b"\n".join(lines) + b'\n{"type":"resu'
    events, skipped, used = parse_lines(data)
    assert used == len(data) - len(b'{"type":"resu')
    assert [type(e) for e in events] == [Paused, Progress]
    assert events[1].done == 2 and events[1].eta_s == math.inf and events[1].extra == {"x": 1}
    reasons = [s.reason for s in skipped]
    assert reasons[0].startswith("not JSON") and "JSON object" in reasons[1] and "'type'" in reasons[2]
    assert "field 'done' must be float" in reasons[3]
    with pytest.raises(MalformedEvent):
        parse_event({"type": "stopped", "step": 1.5})


def test_the_context_writes_from_the_dataclass_and_keeps_a_badly_typed_report(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(STRICT_EVENTS_ENV, raising=False)  # outside tests (no strict mode) nothing is lost
    ctx = JobContext(tmp_path)
    ctx.progress(3, None, tokens_per_s=float("nan"), custom="kept")
    ctx.event("paused", reason=42)  # the job's bug: still written, and said in its log
    rows = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert rows[0]["tokens_per_s"] == "NaN" and rows[0]["custom"] == "kept" and rows[0]["done"] == 3
    assert rows[1]["reason"] == 42
    assert "field 'reason' must be str" in capsys.readouterr().err
    with pytest.raises(ValueError):
        ctx.event("paused", type="x")


def test_strict_mode_makes_an_event_outside_the_contract_fail_in_the_job(tmp_path, monkeypatch):
    """EAGLE3_STRICT_JOB_EVENTS (for test runs of real jobs): unnamed kinds and fields, and wrong types, raise."""
    ctx = JobContext(tmp_path)
    monkeypatch.setenv(STRICT_EVENTS_ENV, "1")
    ctx.event("paused", reason="disk")  # per the contract: written
    for kind, data in (("progress", {"done": 1, "unnamed": 2}), ("telemetry", {}), ("paused", {"reason": 3})):
        with pytest.raises(MalformedEvent):
            ctx.event(kind, **data)
    assert len((tmp_path / "events.jsonl").read_text().splitlines()) == 1


def _run_job(jobs: JobManager, kind: str, body: str):
    job = jobs.start(kind, [sys.executable, "-c", textwrap.dedent(body)], cwd=REPO)
    deadline = time.monotonic() + 60
    while jobs.get(job.id).active and time.monotonic() < deadline:
        time.sleep(0.05)
    assert jobs.get(job.id).state == "succeeded", jobs.tail(job.id, 20)
    return job


def test_the_manager_reads_a_jobs_events_typed_from_an_offset(tmp_path):
    """JobManager.read_events, how the runner and the stage checks follow a job: typed events of the complete
    lines after the offset, a line that breaks the contract skipped, a torn last line left for the next read."""
    from engine.jobs.events import Resumed, Started

    jobs = JobManager(tmp_path / "jobs")
    job = _run_job(jobs, "extract", """
        from engine.jobs.context import JobContext
        ctx = JobContext.from_env()
        ctx.event("started", samples=2)
        ctx.progress(1, 2, tokens_per_s=5.0)
        with open(ctx.events_path, "ab") as f:  # a line against the contract, then one being written
            f.write(b'{"type":"progress","done":"three"}\\n{"type":"resu')
    """)
    events, offset = jobs.read_events(job.id)
    assert [type(e) for e in events] == [Started, Progress] and isinstance(events, tuple)
    assert events[0].samples == 2 and events[1].tokens_per_s == 5.0 and isinstance(events[1].t, float)
    size = (job.dir / "events.jsonl").stat().st_size
    assert offset == size - len(b'{"type":"resu') == jobs.events(job.id)[1]  # the raw reader's bytes, the same
    assert jobs.read_events(job.id, offset) == ((), offset)
    with open(job.dir / "events.jsonl", "ab") as f:
        f.write(b'med"}\n')
    events, end = jobs.read_events(job.id, offset)
    assert events == (Resumed(),) and end == size + len(b'med"}\n')
    assert jobs.read_events(job.id, end) == ((), end)


def test_last_capture_rate_reads_the_newest_finite_rate_typed(tmp_path):
    """engine.train.window.last_capture_rate (how online training sizes its window): the newest job's last
    finite positive rate, a non-finite one (written as text) passed over, other kinds' lines ignored."""
    from types import SimpleNamespace

    from engine.train.window import last_capture_rate

    ws = SimpleNamespace(jobs_dir=tmp_path / "jobs")
    jobs = JobManager(ws.jobs_dir)
    assert last_capture_rate(ws) is None
    _run_job(jobs, "extract", """
        from engine.jobs.context import JobContext
        ctx = JobContext.from_env()
        ctx.progress(1, 4, tokens_per_s=120.0)
        ctx.progress(2, 4, tokens_per_s=float("nan"))
        ctx.progress(3, 4, tokens_per_s=float("inf"))
        ctx.event("paused", reason="disk")
    """)
    assert last_capture_rate(ws) == 120.0
    _run_job(jobs, "train", """
        from engine.jobs.context import JobContext
        ctx = JobContext.from_env()
        ctx.progress(1, 9, capture_tokens_per_s=300.0, tokens_per_s=1.0)
        ctx.progress(2, 9, unit="steps")
    """)
    assert last_capture_rate(ws) == 300.0
