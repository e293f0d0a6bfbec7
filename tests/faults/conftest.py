"""Fixtures of the fault-injection suite, and the figures printed at the end of the run.

One real local target server (tiny Llama on CPU) is shared by the extraction-side tests: each
test gets its own workspace pointing at that server's port and spool. Tests that kill the
server start their own. Every trial is seeded (FAULT_SEED, default 1234) and bounded.
"""

from __future__ import annotations

import asyncio
import os
import subprocess

import pytest

from tests.helpers.processes import free_port
from tests.helpers.workspaces import make_workspace
from faults.helpers import SharedServer, fault_workspace


@pytest.fixture(scope="session")
def shared_server(tiny_chat_model_dir, tmp_path_factory):
    """(port, spool_dir) of a real local server with capture on, shared by the session."""
    from engine.server.manager import ServerManager

    root = tmp_path_factory.mktemp("fault_server")
    spool = root / "spool"
    spool.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=32m,mode=0700", "tmpfs", str(spool)], capture_output=True).returncode == 0
    ws = make_workspace(root / "ws", tiny_chat_model_dir, **{"server.port": free_port(),
                                                            "extract.spool_dir": str(spool)})
    manager = ServerManager(ws)
    asyncio.run(manager.start())
    try:
        yield SharedServer(ws.config.server.port, spool, manager, mounted)
    finally:
        asyncio.run(manager.stop(grace=5))
        if mounted:
            subprocess.run(["umount", "-l", str(spool)], capture_output=True)


@pytest.fixture(scope="module")
def hidden_run(tiny_chat_model_dir, shared_server, tmp_path_factory):
    """Real records of 20 samples, extracted from the shared server."""
    from engine.extract.job import Extractor

    ws = fault_workspace(tmp_path_factory.mktemp("train_src") / "ws", tiny_chat_model_dir, shared_server, n=20)
    assert asyncio.run(Extractor(ws).run()) == 0
    return ws.hidden_dir
