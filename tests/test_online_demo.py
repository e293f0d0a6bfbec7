"""The issue's CPU goal, for real: the demo workspace (`init --demo`) with `train.mode = "online"` and
`train.window_gb = 0.005` taken through every stage headless (`eagle3-console run all`: a real local
target server, the online training job, the evaluation job). The drafter's evaluated acceptance length
is above 1, and `hidden/` (where the window lives) never holds more than 5 MB: sampled every 20 ms
while the run goes. Slow: the demo (built once per test session, shared) takes minutes on two cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from engine.config import set_value
from engine.system.disk import tree_bytes
from engine.workspace import Workspace
from tests.helpers.processes import free_port
from tests.helpers.workspaces import copy_demo

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]  # the demo build alone takes minutes
WINDOW_BYTES = 5_000_000  # train.window_gb = 0.005


def test_demo_trains_online_within_5_mb_to_an_acceptance_length_above_1(demo_template, tmp_path):
    ws = copy_demo(demo_template, tmp_path / "demo")
    config = ws.config
    # One evaluation pass at concurrency 1 (the verdict rules are the same; the sweep is not the point), and
    # two of the demo's four epochs, which halve the run and still train well past 1 (bench/RESULTS.md,
    # Figures that used to sit in code comments).
    for key, value in {"train.mode": "online", "train.window_gb": 0.005, "server.port": free_port(), "train.epochs": 2,
                       "evaluate.concurrency": [1], "evaluate.sweep_steps": [], "evaluate.rounds": 1}.items():
        config = set_value(config, key, value)
    ws.save_config(config)
    ws = Workspace(ws.root)
    hidden = ws.path(ws.config.extract.output_dir)
    peak, samples, stop = [0], [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], tree_bytes(hidden) if hidden.exists() else 0)
            samples[0] += 1
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.monotonic()
    try:
        run = subprocess.run([sys.executable, "-m", "eagle3_console", "run", "all", "-w", str(ws.root)],
                             capture_output=True, text=True, timeout=1800, cwd=Path(__file__).resolve().parents[1],
                             env={**os.environ, "NO_COLOR": "1"})
    finally:
        stop.set()
        sampler.join()
        subprocess.run([sys.executable, "-m", "eagle3_console", "server", "stop", "-w", str(ws.root)],
                       capture_output=True, timeout=120)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    report = json.loads((ws.eval_dir / "report.json").read_text())
    acceptance = report["overall"]["acceptance_length"]
    note = json.loads((ws.drafter_dir / "data.json").read_text())
    print(f"demo online: acceptance length {acceptance:.2f}, speedup {report['overall'].get('speedup', 0):.2f}x, "
          f"hidden/ peak {peak[0]:,} bytes over {samples[0]} samples (window {WINDOW_BYTES:,}; an offline run "
          f"would store {note['offline_bytes']:,}), {note['captured']:,} captures, {time.monotonic() - started:.0f} s")
    assert note["mode"] == "online" and note["window_budget"] == WINDOW_BYTES
    assert note["offline_bytes"] > WINDOW_BYTES  # the window is smaller than what an offline run stores
    assert acceptance > 1.0
    assert samples[0] > 100 and 0 < peak[0] <= WINDOW_BYTES
    assert not (ws.hidden_dir / "manifest.jsonl").exists()  # nothing was extracted
