"""Shared pytest fixtures.

`tiny_model_dir`: a real (randomly initialised) Llama checkpoint with a real byte-level BPE
tokenizer, saved with save_pretrained so any code path that loads a HF directory can use it.
Other helpers may append fixtures below; helpers that test modules import live in tests/helpers/.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers.models import CHAT_TEMPLATE, build_tiny_model

# The suite runs on three workers on two cores, and every server and job it starts runs torch: with torch's
# default of one thread per core, those threads outnumber the cores and spin-wait on each other (the
# subprocesses inherit this; code that sets its own count, like the demo build, still does).
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Every job the tests run (and the jobs they start) writes its events in strict mode: an event kind or
# field outside the contract (engine.jobs.events) fails the job instead of drifting from its readers.
os.environ.setdefault("EAGLE3_STRICT_JOB_EVENTS", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama + BPE tokenizer directory, built once per test session."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_chat_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model plus a chat template with {% generation %} (for datasets, probes, extraction)."""
    import json
    import shutil

    target = tmp_path_factory.mktemp("tiny_chat") / "m"
    shutil.copytree(tiny_model_dir, target)
    cfg_path = target / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    return target


# SGLang 0.5.23's own code for the tests that hand it our artifacts (tests/sglang_judge/).
from sglang_judge.wheel import sglang_cache, sglang_importable, sglang_src, sglang_wheel  # noqa: E402,F401


@pytest.fixture(scope="session")
def demo_content(tmp_path_factory: pytest.TempPathFactory):
    """The demo's content (dataset, tokenizer, the tiny target trained on the demo corpus), built once per
    test session: (directory, DemoContent, progress messages). Tests read it; they never change it."""
    from engine.demo import create_demo_content

    root = tmp_path_factory.mktemp("demo") / "ws"
    messages: list[str] = []
    content = create_demo_content(root, progress=messages.append)
    return root, content, messages


@pytest.fixture(scope="session")
def demo_template(demo_content):
    """The demo workspace (`init --demo`) around that content (reused, not rebuilt); tests copy it
    (helpers.workspaces.copy_demo) rather than build their own."""
    from engine.workspace import init_workspace

    return init_workspace(demo_content[0], demo=True)


# CI runs the suite on three workers (pytest-xdist, `--dist loadgroup`), and session and module fixtures
# are built once per worker that uses them: every test that needs one of the fixtures that cost minutes
# (the demo build, the SGLang wheel) goes to the same worker, and so do a module's tests that share a
# module-scoped fixture (a trained drafter, a running server), so each is built once per run.
_COSTLY_FIXTURE_GROUPS = {"demo_content": "demo", "sglang_cache": "sglang"}


def _xdist_group(item: pytest.Item) -> str | None:
    needs = getattr(item, "fixturenames", ())
    group = next((g for fixture, g in _COSTLY_FIXTURE_GROUPS.items() if fixture in needs), None)
    if group is not None:
        return group
    info = getattr(item, "_fixtureinfo", None)
    definitions = info.name2fixturedefs.values() if info is not None else ()
    if any(defs and defs[-1].scope == "module" for defs in definitions):
        return item.module.__name__ if isinstance(item, pytest.Function) else None
    return None


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        group = _xdist_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


# The fault suite's figures (tests/faults/ledger.py), printed at the end of the run. An xdist worker's
# own summary is not shown: each worker hands its rows to the controller, which prints them all.
def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        from faults import ledger

        workeroutput["fault_ledger"] = ledger.export()


@pytest.hookimpl(optionalhook=True)  # an xdist hook: absent when the suite runs without xdist
def pytest_testnodedown(node, error) -> None:
    from faults import ledger

    ledger.merge(getattr(node, "workeroutput", {}).get("fault_ledger", {}))


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    from faults import ledger
    from faults.helpers import SEED

    lines = ledger.table()
    if not lines:
        return
    terminalreporter.write_sep("=", f"fault injection figures (seed {SEED})")
    for line in lines:
        terminalreporter.write_line(line)
