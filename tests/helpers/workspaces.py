"""Real workspaces for tests, and conversations to put in them."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from engine.config import set_value
from engine.workspace import Workspace, init_workspace
from tests.helpers.models import write_min_model
from tests.helpers.processes import free_port


def make_workspace(root: Path, model_dir: Path, **changes: Any) -> Workspace:
    """A real workspace at `root` on a loadable model (`model_dir`), with a free port, the CPU
    device, a private spool and no disk reserves; `changes` are dotted config keys."""
    ws = init_workspace(root)
    config = ws.config
    defaults = {"model.path": str(model_dir), "server.port": free_port(), "server.device": "cpu",
                "server.startup_timeout_s": 60.0, "extract.spool_dir": str(root / "spool"),
                "extract.disk_reserve_gb": 0.0, "extract.spool_reserve_gb": 0.0}
    for key, value in {**defaults, **changes}.items():
        config = set_value(config, key, value)
    ws.save_config(config)
    return ws


def console_workspace(tmp_path: Path, **settings: Any) -> Workspace:
    """A real non-demo workspace at `tmp_path/ws` on a config-only model (`tmp_path/model`): what
    the console needs to show its panes; no stage job can run on it. `settings`: dotted keys."""
    ws = init_workspace(tmp_path / "ws", demo=False)
    config = ws.config
    base = {"model.path": str(write_min_model(tmp_path / "model")), "extract.spool_dir": "spool",
            "extract.disk_reserve_gb": 0.0}
    for key, value in {**base, **settings}.items():
        config = set_value(config, key, value)
    ws.save_config(config)
    return Workspace(ws.root)


def write_conversations(path: Path, n: int, seed: int = 0) -> Path:
    """n small OpenAI-format conversations with varied lengths."""
    rng = random.Random(seed)
    words = ["gpu", "disk", "server", "token", "hello", "world", "capture", "layer", "draft", "speed"]
    with open(path, "w") as handle:
        for i in range(n):
            q = " ".join(rng.choice(words) for _ in range(rng.randint(3, 12)))
            a = " ".join(rng.choice(words) for _ in range(rng.randint(4, 20)))
            handle.write(json.dumps({"id": f"c{i:03d}", "messages": [
                {"role": "user", "content": q}, {"role": "assistant", "content": a}]}) + "\n")
    return path


def copy_demo(template: Workspace, root: Path) -> Workspace:
    """A private copy of the session's demo workspace (without the template's console lock)."""
    import shutil

    shutil.copytree(template.root, root, ignore=shutil.ignore_patterns(".console.lock"))
    return Workspace(root)
