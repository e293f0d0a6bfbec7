"""Security properties on a real server started with an API key, and source-level rules.

- servers bind 127.0.0.1 by default; the console's jobs open no other listening socket;
- the API key is accepted, required, and never written to logs, job records, events or state;
- files that may hold the key are user-only (console.toml, state/server.json);
- request ids and run names that could climb out of their directory are refused;
- no subprocess with the shell switched on (nor os.system / os.popen) anywhere in engine/ and eagle3_console/.
"""

from __future__ import annotations

import ast
import asyncio
import json
import stat
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.helpers.workspaces import make_workspace, write_conversations
from engine.config import ConfigError, parse_config
from engine.server.manager import ServerManager
from faults import ledger, zygote

KEY = "sk-fault-suite-3f9a1c77d2"
ROOT = Path(__file__).resolve().parents[2]


def _listening(pids: set[int]) -> list[tuple[int, str, int]]:
    return [(c.pid, c.laddr.ip, c.laddr.port) for c in psutil.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.pid in pids]


def _group(pid: int) -> set[int]:
    try:
        proc = psutil.Process(pid)
        return {pid, *(p.pid for p in proc.children(recursive=True))}
    except psutil.Error:
        return set()


@pytest.fixture(scope="module")
def keyed(tiny_chat_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("keyed")
    ws = make_workspace(root / "ws", tiny_chat_model_dir, **{"server.api_key": KEY, "dataset.path": "train.jsonl",
                                                               "extract.concurrency": 1})
    write_conversations(ws.root / "train.jsonl", 16, seed=9)
    manager = ServerManager(ws)
    status = asyncio.run(manager.start())
    yield ws, manager, status
    asyncio.run(manager.stop(grace=5))


def test_server_and_jobs_listen_only_on_the_servers_loopback_port(keyed):
    ws, manager, status = keyed
    job = manager.job()
    proc = zygote.start("extract", ["--workspace", str(ws.root)], ws.jobs_dir / "extract-sec")
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (ws.hidden_dir / "manifest.jsonl").exists():
            time.sleep(0.05)
        assert proc.exitcode is None, "extraction ended before the sockets were looked at"
        pids = _group(job.supervisor_pid) | _group(proc.pid)
        listening = _listening(pids)
    finally:
        proc.join(120)
    port = ws.config.server.port
    assert listening and all(ip == "127.0.0.1" and p == port for _, ip, p in listening), listening
    assert {pid for pid, _, _ in listening} == {job.pid}, "only the server process listens"
    assert proc.exitcode == 0
    ledger.add("security", trials=1, records=len(listening))


def test_api_key_is_required_and_never_written_down(keyed):
    ws, manager, status = keyed
    url = status.url
    with httpx.Client(timeout=30, trust_env=False) as http:
        denied = http.post(f"{url}/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}})
        assert denied.status_code == 401 and KEY not in denied.text
        ok = http.post(f"{url}/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}},
                       headers={"Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200
    leaks = []
    for path in [*ws.jobs_dir.rglob("*"), *ws.state_dir.rglob("*"), *ws.hidden_dir.rglob("*.json*")]:
        if path.is_file() and KEY.encode() in path.read_bytes():
            leaks.append(str(path.relative_to(ws.root)))
    assert not leaks, f"API key written to {leaks}"
    record = json.loads((ws.state_dir / "server.json").read_text())
    assert KEY not in json.dumps(record["argv"]) and KEY not in json.dumps(record.get("env", {}))
    for secret_file in (ws.config_path, ws.state_dir / "server.json"):
        mode = stat.S_IMODE(secret_file.stat().st_mode)
        assert mode & 0o077 == 0, f"{secret_file.name} is {oct(mode)}: other users could read the key"
    ledger.add("security", trials=1)


def test_request_ids_that_climb_out_of_the_spool_are_refused(keyed):
    ws, manager, status = keyed
    outside = ws.spool_dir.parent / "evil"
    with httpx.Client(timeout=30, trust_env=False, headers={"Authorization": f"Bearer {KEY}"}) as http:
        for rid in ("../evil", "..", "a/../../evil", "/tmp/evil", "evil/..", ".hidden", "x" * 300):
            reply = http.post(f"{status.url}/generate", json={"input_ids": [1, 2, 3], "rid": rid,
                                                              "sampling_params": {"max_new_tokens": 0}})
            assert reply.status_code == 400, (rid, reply.status_code, reply.text)
            assert "rid" in reply.json()["error"]["message"]
    assert not outside.exists()
    assert not any(p.name.startswith(".hidden") for p in ws.spool_dir.iterdir())
    ledger.add("security", trials=1, faults=7)


@pytest.mark.parametrize("key", ["extract.run", "train.run", "evaluate.run"])
@pytest.mark.parametrize("value", ["../up", "..", "a/b", "/abs", "", ".dot", "x" * 200])
def test_run_names_that_are_not_plain_names_are_refused(key, value):
    section, name = key.split(".")
    with pytest.raises(ConfigError) as info:
        parse_config(f'[{section}]\n{name} = {json.dumps(value)}\n')
    assert key in str(info.value) and "run name" in str(info.value)


def _sources() -> list[Path]:
    return sorted([*(ROOT / "engine").rglob("*.py"), *(ROOT / "eagle3_console").rglob("*.py")])


def test_no_shell_anywhere_in_the_sources():
    offenders = []
    files = _sources()
    assert len(files) > 30
    for path in files:
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            for kw in node.keywords:
                if kw.arg == "shell" and not (isinstance(kw.value, ast.Constant) and kw.value.value is False):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} shell=")
            func = node.func
            if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
                if (func.value.id, func.attr) in {("os", "system"), ("os", "popen"), ("subprocess", "getoutput"),
                                                  ("subprocess", "getstatusoutput")}:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {func.value.id}.{func.attr}")
    assert not offenders, offenders
    ledger.add("security", trials=1, records=len(files))


def test_a_job_started_with_an_api_key_on_argv_does_not_record_it(tmp_path):
    """SGLang takes its key as --api-key on argv: the child gets it, job.json must not."""
    import sys

    from engine.jobs.manager import JobManager

    jobs = JobManager(tmp_path / "jobs")
    seen = tmp_path / "seen.json"
    code = f"import json, sys; json.dump(sys.argv[1:], open({str(seen)!r}, 'w'))"
    job = jobs.start("server", [sys.executable, "-c", code, "--api-key", KEY, f"--admin-api-key={KEY}"],
                     cwd=tmp_path)
    deadline = time.monotonic() + 30
    while jobs.get(job.id).active and time.monotonic() < deadline:
        time.sleep(0.05)
    assert json.loads(seen.read_text()) == ["--api-key", KEY, f"--admin-api-key={KEY}"]
    for path in job.dir.iterdir():
        assert KEY.encode() not in path.read_bytes(), f"{path.name} holds the API key"
    assert jobs.get(job.id).argv[-3:] == ("--api-key", "***", "--admin-api-key=***")
