"""Issue 20, item 4, replayed as found: console.toml changed while the server runs.

The server keeps the settings it was started with. Before: after `extract.spool_dir` changed, the
server stage and the capture stage stayed green, the next extraction marked every sample bad and
exited 0 ("succeeded"), and the segments the old server wrote stayed in the old spool; after
`server.port` changed nothing said which port the server really runs on. Now the running
settings are compared with what console.toml would launch (engine.server.drift): the stages say
which setting differs (running value vs console.toml) and "restart the server to apply", an
extraction refuses to start against a server that captures elsewhere, an extraction whose samples
are (nearly) all bad fails, and the segments an earlier server left in an old spool are swept.

Everything runs against real local target servers (tiny Llama on CPU) on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.processes import free_port, lock_held_by_another_process
from tests.helpers.workspaces import make_workspace, write_conversations
from engine.checks.context import CheckContext
from engine.config import set_value
from engine.extract.guard import ExtractionRefused
from engine.extract.job import Extractor
from engine.pipeline import Pipeline
from engine.server.manager import ServerManager
from engine.workspace import Workspace
from faults import ledger

RESTART = "restart the server to apply"
N = 12


@pytest.fixture(scope="module")
def model8(tiny_chat_model_dir, tmp_path_factory) -> Path:
    """The tiny chat model with 8 decoder layers, so a second valid set of capture layers exists."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    target = tmp_path_factory.mktemp("tiny8") / "m"
    shutil.copytree(tiny_chat_model_dir, target)
    config = LlamaConfig.from_pretrained(target)
    config.num_hidden_layers = 8
    torch.manual_seed(1)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.2)
    for name in target.glob("model*.safetensors"):
        name.unlink()
    model.save_pretrained(target)
    return target


def _ws(root: Path, model_dir: Path, **changes) -> Workspace:
    ws = make_workspace(root, model_dir, **{"dataset.path": "train.jsonl", "extract.concurrency": 2,
                                            "extract.max_retries": 0, "server.restart_on_crash": False, **changes})
    write_conversations(ws.root / "train.jsonl", N, seed=5)
    return ws


def _change(ws: Workspace, key: str, value) -> Workspace:
    """Edit console.toml on disk, as a user with an editor would; a fresh Workspace reads it."""
    config = set_value(Workspace(ws.root).config, key, value)
    ws.save_config(config)
    return Workspace(ws.root)


def _stage(ws: Workspace, name: str):
    return asyncio.run(Pipeline(CheckContext(Workspace(ws.root)), persist=False).run_stage(name))


def _named(report, check: str):
    return next((r for r in report.results if r.name == check), None)


def _status(ws: Workspace, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eagle3_console", "status", "-w", str(ws.root), *extra],
                          capture_output=True, text=True, timeout=120)


def _segments(spool: Path) -> dict[str, int]:
    """rid folder -> segment files in it."""
    if not spool.is_dir():
        return {}
    return {d.name: sum(1 for f in d.iterdir() if f.is_file()) for d in spool.iterdir() if d.is_dir()}


@pytest.fixture(scope="module")
def running(model8, tmp_path_factory):
    """One real server started from console.toml; each test edits console.toml and restores it."""
    root = tmp_path_factory.mktemp("drift")
    ws = _ws(root / "ws", model8, **{"extract.spool_dir": str(root / "spoolA")})
    original = ws.config_path.read_text()
    manager = ServerManager(ws)
    status = asyncio.run(manager.start())
    assert status.state == "ready"
    yield ws, manager, root, original
    asyncio.run(manager.stop(grace=5))


@pytest.fixture
def server(running):
    ws, manager, root, original = running
    ws.config_path.write_text(original)
    yield ws, manager, root
    ws.config_path.write_text(original)


# ------------------------------------------------------------------ (a) the stages say what differs


def test_no_drift_when_console_toml_matches(server):
    ws, manager, _ = server
    assert manager.drift() == []
    report = _stage(ws, "server")
    assert report.state.value == "passed", [r.to_dict() for r in report.results]


@pytest.mark.parametrize("key", ["extract.spool_dir", "model.capture_layers", "model.path"])
def test_a_capture_setting_changed_while_the_server_runs_turns_server_and_capture_red(server, key, model8):
    ws, _, root = server
    running_value, wanted = {
        "extract.spool_dir": (str(root / "spoolA"), str(root / "spoolB")),
        "model.capture_layers": ("[1, 3, 4]", "[1, 2, 5]"),
        "model.path": (str(model8), str(root / "copy" / "m")),
    }[key]
    if key == "model.path" and not Path(wanted).exists():
        shutil.copytree(model8, wanted)
    value = json.loads(wanted) if key == "model.capture_layers" else wanted
    _change(ws, key, value)

    differences = ServerManager(Workspace(ws.root)).drift()
    assert [d.setting for d in differences] == [key], differences
    for stage in ("server", "capture"):
        report = _stage(ws, stage)
        check = _named(report, "settings")
        assert report.state.value == "failed" and check is not None and check.status.value == "fail", \
            [r.to_dict() for r in report.results]
        assert key in check.evidence and running_value in check.evidence and wanted in check.evidence, check.evidence
        assert RESTART in check.fix, check.fix
    out = _status(ws).stdout
    line = next((x for x in out.splitlines() if "console.toml" in x and x.startswith("server")), "")
    assert key in line and RESTART in line, out
    data = json.loads(_status(ws, "--json").stdout)
    assert [d["setting"] for d in data["server"]["drift"]] == [key]
    print(f"\n  {key} changed under a running server: server/capture red — {check.evidence}")
    ledger.add("server drift named (stages, status)", trials=1, faults=1)


def test_weights_replaced_under_a_running_server_turn_server_red_and_refuse_the_extraction(model8, tmp_path):
    """A fine-tune saved over model.path while the server runs: console.toml did not change, yet the server
    holds other weights than the files. Server and capture name both weights and ask for a restart; the
    extraction refuses (its records would be stamped with the new weights and hold the old ones' states);
    after the restart there is nothing to say."""
    from tests.helpers.models import fine_tune_in_place

    model = tmp_path / "target"
    shutil.copytree(model8, model)
    ws = _ws(tmp_path / "ws", model, **{"extract.spool_dir": str(tmp_path / "spool")})
    manager = ServerManager(ws)
    asyncio.run(manager.start())
    try:
        loaded = manager.record()["model_weights"]
        assert manager.drift() == []
        fine_tune_in_place(model)
        differences = ServerManager(Workspace(ws.root)).drift()
        assert [d.setting for d in differences] == ["model.path"], differences
        assert loaded in differences[0].running and str(model) in differences[0].wanted, differences
        for stage in ("server", "capture"):
            check = _named(_stage(ws, stage), "settings")
            assert check is not None and check.status.value == "fail" and RESTART in check.fix, check
            assert f"weights {loaded} (loaded at start)" in check.evidence, check.evidence
        with pytest.raises(ExtractionRefused, match=f"weights {loaded}"):
            asyncio.run(Extractor(Workspace(ws.root), limit=2).run())
        assert not (ws.hidden_dir / "manifest.jsonl").exists()
        asyncio.run(manager.stop(grace=5))
        manager = ServerManager(Workspace(ws.root))
        asyncio.run(manager.start())
        assert manager.drift() == [] and manager.record()["model_weights"] != loaded
    finally:
        asyncio.run(manager.stop(grace=5))
    print(f"\n  weights replaced under the server: {differences[0].describe()}")
    ledger.add("server drift named (stages, status)", trials=1, faults=1)


def test_port_change_is_amber_and_the_extraction_names_the_port_it_uses(server, capsys):
    ws, _, _ = server
    old = ws.config.server.port
    new = free_port()
    ws = _change(ws, "server.port", new)
    report = _stage(ws, "server")
    check = _named(report, "settings")
    assert report.state.value == "warned" and check is not None and check.status.value == "warn", \
        [r.to_dict() for r in report.results]
    assert "server.port" in check.evidence and str(old) in check.evidence and str(new) in check.evidence
    assert RESTART in check.fix
    # (e) the extraction runs against the server where it really is, and says so
    ws = _change(ws, "extract.run", "port-run")
    assert asyncio.run(Extractor(Workspace(ws.root), limit=3).run()) == 0
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    said = [e for e in events if e["type"] == "server_drift"]
    assert said and f":{old}" in said[0]["message"] and str(new) in said[0]["message"], events[:5]
    print(f"\n  server.port {old} -> {new}: server amber; extraction said {said[0]['message']!r}")
    ledger.add("server.port change: extraction names the real port", trials=1, faults=1)


def test_engine_exposes_the_drift(server):
    from engine.core import Engine

    ws, _, root = server
    _change(ws, "extract.spool_dir", str(root / "spoolB"))
    engine = Engine(Workspace(ws.root), drive=False)
    try:
        assert [d.setting for d in engine.server_drift()] == ["extract.spool_dir"]
        status = asyncio.run(engine.server.poll())
        assert [d.setting for d in status.drift] == ["extract.spool_dir"]
    finally:
        asyncio.run(engine.close())


# ------------------------------------------------------------------ (b) the extraction refuses


def test_extraction_against_a_server_with_another_spool_refuses_instead_of_marking_all_bad(server):
    ws, _, root = server
    ws = _change(ws, "extract.spool_dir", str(root / "spoolB"))
    ws = _change(ws, "extract.run", "refused")
    before = _segments(root / "spoolA")
    with pytest.raises(ExtractionRefused) as refused:
        asyncio.run(Extractor(Workspace(ws.root)).run())
    message = str(refused.value)
    assert "extract.spool_dir" in message and str(root / "spoolA") in message and str(root / "spoolB") in message
    assert RESTART in message
    assert not (ws.hidden_dir / "manifest.jsonl").exists() and not (ws.hidden_dir / "bad.jsonl").exists()
    assert _segments(root / "spoolA") == before, "nothing captured into the old spool"
    print(f"\n  extraction refused: {message}")
    ledger.add("extraction refused on server drift", trials=1, faults=1)


# ------------------------------------------------------------------ (c) all (or too many) bad fails


def test_an_extraction_whose_samples_are_all_bad_fails_and_the_stage_is_red(server, monkeypatch, capsys):
    """The second line of defence, on the very case found: the spool check bypassed, every sample's
    capture is missing from the spool the extraction reads."""
    from engine.extract import job as extract_job

    ws, _, root = server
    ws = _change(ws, "extract.spool_dir", str(root / "spoolB"))
    ws = _change(ws, "extract.run", "allbad")
    # A capture that never comes is what is tested, not how long the job waits for one (30 s by default).
    ws = _change(ws, "extract.capture_wait_s", 1)
    monkeypatch.setattr(extract_job.Extractor, "check_server", lambda self: asyncio.sleep(0))
    code = extract_job.main(["--workspace", str(ws.root)])
    out = capsys.readouterr().out
    assert code != 0, out[-2000:]
    error = next(line for line in out.splitlines() if line.startswith("extraction: error:"))
    assert "no good sample" in error and f"of {N} samples bad" in error, error
    report = _stage(ws, "extract")
    first = next(r for r in report.results if r.status.value == "fail")
    assert report.state.value == "failed" and first.name == "bad", [r.to_dict() for r in report.results]
    assert f"of {N} samples bad" in first.evidence and "no good sample" in first.evidence, first.evidence
    print(f"\n  every sample bad: exit {code} ({error}); extract red — {first.evidence}")
    ledger.add("extraction with 0 good samples fails", trials=1, faults=1)


def test_bad_above_the_limit_fails_and_below_it_is_amber(server, monkeypatch, capsys):
    from engine.extract import job as extract_job
    from engine.extract.job import MAX_BAD_FRACTION, SampleFailed

    ws, _, _ = server
    real_write = extract_job.Extractor._write
    failing: set[int] = set()

    def write(self, sample, cap, hidden):
        if sample.index in failing:
            raise SampleFailed("injected: record refused")
        return real_write(self, sample, cap, hidden)

    monkeypatch.setattr(extract_job.Extractor, "_write", write)
    allowed = int(MAX_BAD_FRACTION * N)
    failing.update(range(allowed + 1))
    ws = _change(ws, "extract.run", "toomany")
    code = extract_job.main(["--workspace", str(ws.root)])
    out = capsys.readouterr().out
    assert code != 0, out[-2000:]
    report = _stage(ws, "extract")
    first = next(r for r in report.results if r.status.value == "fail")
    assert first.name == "bad" and f"{allowed + 1} of {N} samples bad" in first.evidence and "injected" in first.evidence, \
        first.evidence

    failing.clear()
    failing.update(range(allowed))
    ws = _change(ws, "extract.run", "fewbad")
    assert extract_job.main(["--workspace", str(ws.root)]) == 0
    report = _stage(ws, "extract")
    assert report.state.value == "warned", [r.to_dict() for r in report.results]
    print(f"\n  {allowed + 1}/{N} bad: exit {code}, red; {allowed}/{N} bad: exit 0, amber "
          f"(limit {MAX_BAD_FRACTION:.0%})")
    ledger.add("bad fraction over the limit fails", trials=2, faults=2 * allowed + 1)


# ------------------------------------------------------------------ (d) the old spool is swept


def test_segments_an_earlier_server_left_in_the_old_spool_are_swept(model8, tmp_path):
    from engine.capture.segments import open_capture
    from engine.client import ServerClient
    from engine.extract.job import RUN_LOCK, SPOOL_SESSIONS

    old, new = tmp_path / "spoolA", tmp_path / "spoolB"
    ws = _ws(tmp_path / "ws", model8, **{"extract.spool_dir": str(old)})
    manager = ServerManager(ws)
    status = asyncio.run(manager.start())
    output = ws.hidden_dir.parent
    dead, live = output / "run1", output / "run2"
    for run, tag in ((dead, "abc123"), (live, "def456")):
        run.mkdir(parents=True, exist_ok=True)
        (run / SPOOL_SESSIONS).write_text(tag + "\n")
    rids = {"x0-abc123-a0": "dead session", "x1-abc123-a1": "dead session", "x0-def456-a0": "live session",
            "x0-fff000-a0": "another workspace"}

    prompt = [5, 6, 7, 8, 9, 10]

    async def capture_all():
        client = ServerClient(status.url)
        try:
            for rid in rids:
                await client.generate(input_ids=prompt, max_new_tokens=0, rid=rid)
        finally:
            await client.aclose()

    try:
        asyncio.run(capture_all())
        # the server answers before its capture writer publishes: wait as extraction's reader does
        for rid in rids:
            open_capture(old, rid, expected_input_ids=prompt, wait_s=30).close()
        assert set(_segments(old)) == set(rids), _segments(old)
        orphan_bytes = sum(f.stat().st_size for d in old.iterdir() for f in d.iterdir())
        with lock_held_by_another_process(live, RUN_LOCK):
            ws = _change(ws, "extract.spool_dir", str(new))
            asyncio.run(manager.stop(grace=5))
            manager = ServerManager(ws)
            asyncio.run(manager.start())
            assert manager.drift() == [], "the restart applied console.toml"
            left = _segments(old)
            # the dead session's segments are gone; the live one's and another workspace's stay
            assert set(left) == {"x0-def456-a0", "x0-fff000-a0"}, left
        # the live session has ended: the next extraction of that run sweeps it from the old spool too
        ws = _change(ws, "extract.run", "run2")
        assert asyncio.run(Extractor(Workspace(ws.root), limit=2).run()) == 0
        assert set(_segments(old)) == {"x0-fff000-a0"}, _segments(old)
        assert _segments(new) == {}, "the extraction's own captures were released"
    finally:
        asyncio.run(manager.stop(grace=5))
    print(f"\n  old spool: {len(rids) - 1} orphan rid folders ({orphan_bytes:,} bytes) of this workspace swept, "
          "1 of another workspace kept")
    ledger.add("old spool swept after a spool change", trials=1, faults=3)


# ------------------------------------------------------------------ the comparison itself (no server)


def test_compare_names_each_launch_setting_and_never_a_key(model8, tmp_path):
    from engine.server.drift import api_key_fingerprint, compare
    from engine.server.local import build_spec

    ws = _ws(tmp_path / "ws", model8, **{"server.api_key": "old-secret"})
    spec = build_spec(ws)
    record = {"backend": "local", "url": spec.url, "capture": True, "spool_dir": spec.spool_dir,
              "capture_layers": list(spec.capture_layers), "argv": spec.redacted_argv(),
              "api_key_sha256": api_key_fingerprint("old-secret")}
    assert compare(record, spec, ws.config) == []
    config = set_value(set_value(set_value(ws.config, "model.dtype", "bfloat16"), "server.device", "cuda"),
                       "server.api_key", "new-secret")
    ws.save_config(config)
    fresh = Workspace(ws.root)
    found = {d.setting: d for d in compare(record, build_spec(fresh), fresh.config)}
    assert set(found) == {"model.dtype", "server.device", "server.api_key"}, found
    assert all(d.blocking for d in found.values())
    assert "--dtype bfloat16" in found["model.dtype"].wanted and "--device cuda" in found["server.device"].wanted
    text = " ".join(d.describe() for d in found.values())
    assert "secret" not in text
    # a record an older version wrote (no argv, no key fingerprint): only what it has is compared
    old = {k: v for k, v in record.items() if k not in ("argv", "api_key_sha256")}
    assert compare(old, build_spec(fresh), fresh.config) == []


def test_engine_says_it_once_and_rechecks_the_server_stages(tmp_path, model8):
    from engine.core import Engine
    from engine.events import Notice
    from engine.server.drift import Difference
    from engine.server.manager import ServerStatus

    ws = _ws(tmp_path / "ws", model8)
    engine = Engine(Workspace(ws.root), drive=False)
    notices = []
    engine.subscribe(lambda e: notices.append(e.text) if isinstance(e, Notice) else None)
    moved = (Difference("server.port", "30017", "30018", blocking=False),)
    try:
        for _ in range(3):
            engine._on_server(ServerStatus(state="ready", drift=moved))
        engine._on_server(ServerStatus(state="unhealthy", error="poll failed"))  # knows no better: no change
        assert len(notices) == 1 and "server.port" in notices[0] and RESTART in notices[0], notices
        engine._on_server(ServerStatus(state="ready"))
        engine._on_server(ServerStatus(state="ready", drift=moved))
        assert len(notices) == 2, notices
    finally:
        asyncio.run(engine.close())


# ------------------------------------------------------------------ the console's "restart to apply"


async def test_console_applies_console_toml_by_restarting_the_server(model8, tmp_path):
    """The real console on a real drifted server, at 80x24: the strip says so, `a` on the Server pane
    asks naming the setting, `y` restarts the server from console.toml, and the drift is gone."""
    from engine.core import Engine
    from eagle3_console.app import ConsoleApp
    from eagle3_console.confirm import ConfirmScreen
    from tests.helpers.screen import screen_text, wait_until

    ws = _ws(tmp_path / "ws", model8, **{"extract.spool_dir": str(tmp_path / "spoolA"),
                                         "server.port": free_port()})
    manager = ServerManager(ws)
    first = await manager.start()
    assert first.state == "ready" and first.job_id, first
    try:
        ws = _change(ws, "extract.spool_dir", str(tmp_path / "spoolB"))
        engine = Engine(Workspace(ws.root))
        app = ConsoleApp(engine)
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_until(pilot, lambda: "restart srv" in screen_text(app) or "restart server" in screen_text(app),
                             30)
            await pilot.press("2")
            await pilot.press("a")
            await wait_until(pilot, lambda: isinstance(app.screen, ConfirmScreen), 10)
            await pilot.pause(0.3)
            shown = screen_text(app)  # long paths wrap mid-word in the dialog
            assert "extract.spool_dir: the server runs with" in shown and "console.toml says" in shown, shown
            await pilot.press("y")
            # The new server, ready: while the old one stops there is a moment with no drift (none runs) and
            # the last poll's "ready" still held, which is not the restart having happened.
            await wait_until(pilot, lambda: engine.server_status is not None and engine.server_status.state == "ready"
                             and engine.server_status.job_id not in (None, first.job_id)
                             and not engine.server_drift(), 90)
            await wait_until(pilot, lambda: "restart s" not in screen_text(app), 30)
        record = ServerManager(Workspace(ws.root)).record()
        assert record.get("spool_dir") == str(tmp_path / "spoolB")
    finally:
        await ServerManager(Workspace(ws.root)).stop(grace=5)
    ledger.add("console: restart to apply console.toml", trials=1, faults=1)
