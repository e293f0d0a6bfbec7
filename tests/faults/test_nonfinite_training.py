"""Non-finite training (issue 20, case 1), replayed as it was found.

Found: `train.learning_rate = inf` trained every step on `"loss": NaN, "lr": Infinity`, exited 0;
metrics.jsonl held bare NaN/Infinity (not JSON); pressing `5` (Training) killed the console with
`IndexError` in the plot code, at >= 160 columns it died at start, `screenshot --tabs training`
crashed.

Now: a step whose loss or gradient norm is not finite is not applied; after
engine.train.loop.NONFINITE_LIMIT such steps in a row the run stops (job failed, exit 2) with a
message naming the step and the values; a learning rate that is not a finite positive number is
refused before the first step; every JSONL line is strict JSON; the Training pane, the console at
80x24 and 160x50 and `screenshot --tabs training` render NaN/inf/null values; `train` is red with
the reason. The learning rate is set on the loaded config in memory where it can be (the trainer
must not rely on config validation), and through console.toml for the job.
"""

from __future__ import annotations

import html
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.screen import screen_text
from faults import ledger

REPO = Path(__file__).resolve().parents[2]


def strict_loads(line: str):
    """json.loads that refuses the bare NaN/Infinity/-Infinity Python's json accepts."""
    def refuse(name):
        raise ValueError(f"not JSON: bare {name}")
    return json.loads(line, parse_constant=refuse)


def strict_lines(path: Path) -> list[dict]:
    return [strict_loads(line) for line in path.read_text().splitlines() if line.strip()]


def as_number(value) -> float | None:
    """A metrics value as a float: numbers, the text of a non-finite number, null -> None."""
    return None if value is None else float(value)


@pytest.fixture(scope="module")
def hidden_run(tiny_model_dir, tmp_path_factory) -> Path:
    from tests.helpers.training import make_records

    run_dir = tmp_path_factory.mktemp("hidden_nf") / "run1"
    make_records(tiny_model_dir, run_dir, n=14)
    return run_dir


def _train_ws(root: Path, model_dir: Path, hidden_run: Path, **train):
    from tests.helpers.training import train_workspace

    return train_workspace(root, model_dir, hidden_run, **{"log_every": 1, "save_every": 100, **train})


def test_a_learning_rate_that_blows_up_stops_after_n_nonfinite_steps(tiny_model_dir, hidden_run, tmp_path):
    """Finite but huge (1e30): the first update makes the weights overflow, every later loss is NaN."""
    from engine.train import checkpoint as ckpt
    from engine.train.loop import NONFINITE_LIMIT, Trainer, TrainError

    torch.set_num_threads(1)
    ws = _train_ws(tmp_path / "ws", tiny_model_dir, hidden_run, save_every=2)
    ws.config.train.learning_rate = 1e30  # in memory: whatever config validation allows or refuses
    trainer = Trainer(ws, device="cpu")
    events: list[tuple[str, dict]] = []
    trainer.event = lambda kind, **data: events.append((kind, data))
    started = time.perf_counter()
    with pytest.raises(TrainError) as failure:
        trainer.run()
    message = str(failure.value)
    total = trainer.total_steps
    assert trainer.step < total, f"trained all {total} steps on non-finite values"
    flagged = [data for kind, data in events if kind == "nonfinite"]
    assert len(flagged) == 1, events
    stop = flagged[0]
    assert stop["step"] == trainer.step and stop["streak"] == NONFINITE_LIMIT
    assert stop["first_step"] == trainer.step - NONFINITE_LIMIT + 1
    assert f"step {trainer.step}" in message and f"{NONFINITE_LIMIT} steps in a row" in message, message
    assert "loss nan" in message or "loss inf" in message, message
    assert "train.learning_rate" in message, message  # the fix names the setting

    # Strict JSON; the non-finite steps are logged with their values as text, then the failure line.
    rows = strict_lines(ws.drafter_dir / "metrics.jsonl")
    train_rows = [r for r in rows if r["type"] == "train"]
    assert [r["step"] for r in train_rows] == list(range(1, trainer.step + 1))
    bad = [r for r in train_rows if not math.isfinite(as_number(r["loss"]) or math.nan)]
    assert [r["step"] for r in bad] == list(range(stop["first_step"], trainer.step + 1)), train_rows
    assert rows[-1]["type"] == "failed" and rows[-1]["step"] == trainer.step and rows[-1]["reason"] == "nonfinite"
    assert rows[-1]["message"] == message

    # Nothing non-finite is checkpointed or exported: the last checkpoint is from before the streak.
    assert not (ws.drafter_dir / "export" / "config.json").exists()
    latest = ckpt.latest(ws.drafter_dir)
    if latest is not None:
        assert latest["step"] < stop["first_step"], latest
        state = ckpt.load(ws.drafter_dir)
        assert all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point())

    # The stage is red and says why.
    from engine.checks.base import Status
    from engine.checks.context import CheckContext
    from engine.checks.train import check_train

    results = check_train(CheckContext(ws))
    assert results[0].status is Status.FAIL, results
    assert f"step {trainer.step}" in results[0].evidence and "loss nan" in results[0].evidence, results[0]
    assert "train.learning_rate" in results[0].fix
    ledger.add("non-finite training (lr 1e30)", trials=1, faults=NONFINITE_LIMIT, records=len(rows),
               losses=int(trainer.step >= total))
    print(f"lr 1e30: stopped at step {trainer.step}/{total} after {NONFINITE_LIMIT} non-finite steps "
          f"in {time.perf_counter() - started:.1f} s")


def test_a_blow_up_after_good_checkpoints_keeps_them_and_a_saner_rate_resumes(tiny_model_dir, hidden_run, tmp_path):
    """Checkpoints are attempted every step while it blows up: none of them is taken (the update of the
    first step made the weights non-finite while its own loss was still finite). Resuming with a sane
    rate continues from the last good checkpoint and clears the failure."""
    from engine.checks.base import Status
    from engine.checks.context import CheckContext
    from engine.checks.train import check_train
    from engine.train import checkpoint as ckpt
    from engine.train.loop import NONFINITE_LIMIT, Trainer, TrainError

    torch.set_num_threads(1)
    ws = _train_ws(tmp_path / "ws", tiny_model_dir, hidden_run, save_every=1)
    Trainer(ws, device="cpu", max_steps=3).run()
    assert ckpt.latest(ws.drafter_dir)["step"] == 3
    ws.config.train.learning_rate = 1e30
    blown = Trainer(ws, device="cpu", resume=True)
    with pytest.raises(TrainError, match=r"resumes from the checkpoint of step 3") as failure:
        blown.run()
    assert blown.step == 3 + 1 + NONFINITE_LIMIT, str(failure.value)  # one finite step broke the weights
    assert ckpt.latest(ws.drafter_dir)["step"] == 3 and ckpt.best(ws.drafter_dir)["step"] <= 3
    state = ckpt.load(ws.drafter_dir)
    assert all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point())
    results = check_train(CheckContext(ws))
    assert results[0].status is Status.FAIL and f"step {blown.step}" in results[0].evidence, results
    assert "resumes from the checkpoint of step 3" in results[0].fix

    ws.config.train.learning_rate = 1e-2
    resumed = Trainer(ws, device="cpu", resume=True, max_steps=2)
    assert resumed.run() == 0 and resumed.step == 5
    rows = strict_lines(ws.drafter_dir / "metrics.jsonl")
    assert [r["step"] for r in rows if r["type"] == "train"] == [1, 2, 3, 4, 5]
    assert all(r["type"] != "failed" for r in rows)
    assert all(math.isfinite(as_number(r["loss"])) for r in rows if r["type"] in ("train", "eval"))
    evidence = check_train(CheckContext(ws))[0].evidence
    assert "stopped" not in evidence and "5 steps" in evidence, evidence
    ledger.add("non-finite training after checkpoints", trials=1, faults=NONFINITE_LIMIT + 1, records=len(rows),
               losses=0)


@pytest.mark.parametrize("value", [math.inf, math.nan, 0.0, -1e-3])
def test_a_learning_rate_that_is_not_finite_positive_is_refused_before_the_first_step(
        tiny_model_dir, hidden_run, tmp_path, value):
    from engine.train.loop import Trainer, TrainError

    ws = _train_ws(tmp_path / "ws", tiny_model_dir, hidden_run)
    ws.config.train.learning_rate = value
    trainer = Trainer(ws, device="cpu")
    with pytest.raises(TrainError, match=r"train\.learning_rate = .*finite number above 0") as failure:
        trainer.run()
    assert getattr(trainer, "step", 0) == 0 and str(value) in str(failure.value)  # no step taken
    assert not (ws.drafter_dir / "metrics.jsonl").exists() or not strict_lines(ws.drafter_dir / "metrics.jsonl")


def test_the_job_fails_names_the_step_and_writes_strict_json(tiny_model_dir, hidden_run, tmp_path):
    """The real job process (as `run train` starts it): failed state, rc 2, an error event naming the
    step, strict JSON in events.jsonl and metrics.jsonl."""
    from engine.jobs.manager import JobManager
    from engine.train.launch import build_train_argv
    from engine.train.loop import NONFINITE_LIMIT

    ws = _train_ws(tmp_path / "ws", tiny_model_dir, hidden_run, learning_rate=1e30)
    jobs = JobManager(ws.jobs_dir)
    job = jobs.start("train", build_train_argv(ws) + ["--device", "cpu"], cwd=ws.root)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and jobs.get(job.id).state in ("starting", "running"):
        time.sleep(0.2)
    info = jobs.get(job.id)
    assert info.state == "failed", (info, jobs.tail(job.id))
    assert info.exit_code == 2, info
    events = strict_lines(job.dir / "events.jsonl")
    kinds = [e["type"] for e in events]
    assert "nonfinite" in kinds and kinds[-1] == "error", kinds
    stop = next(e for e in events if e["type"] == "nonfinite")
    assert f"step {stop['step']}" in events[-1]["message"] and "loss nan" in events[-1]["message"]
    assert stop["streak"] == NONFINITE_LIMIT
    progress = [e for e in events if e["type"] == "progress"]
    assert any(e.get("loss") == "NaN" for e in progress), progress[-3:]
    rows = strict_lines(ws.drafter_dir / "metrics.jsonl")
    assert rows[-1]["type"] == "failed" and rows[-1]["step"] == stop["step"]
    assert "Traceback" not in (job.dir / "log.txt").read_text()
    ledger.add("non-finite training job", trials=1, faults=NONFINITE_LIMIT, records=len(rows) + len(events),
               losses=0)


# ----------------------------------------------------------------------------- the console

NAN_LINES = [
    # As found: what the job wrote before (bare NaN/Infinity: Python's json reads them).
    '{"type":"train","step":1,"epoch":0.1,"t":1000.0,"lr":Infinity,"grad_norm":0.5,"tokens_per_s":100.0,'
    '"loss":5.5,"loss_pos":[5.5,5.4,5.3],"acc":[0.1,0.05,0.0],"accept":[0.1,0.05,0.0],"sim_al":1.1}',
    '{"type":"train","step":2,"epoch":0.2,"t":1001.0,"lr":Infinity,"grad_norm":NaN,"tokens_per_s":100.0,'
    '"loss":NaN,"loss_pos":[NaN,NaN,NaN],"acc":[NaN,NaN,NaN],"accept":[0.0,0.0,0.0],"sim_al":NaN}',
    '{"type":"eval","step":2,"t":1001.5,"loss":-Infinity,"acc":[NaN,NaN,NaN],"sim_al":Infinity}',
    # Written now: text for non-finite numbers, null where a value is missing.
    '{"type":"train","step":3,"epoch":0.3,"t":1002.0,"lr":1e+30,"grad_norm":"Infinity","tokens_per_s":null,'
    '"loss":"NaN","loss_pos":["NaN","NaN","NaN"],"acc":[null,"NaN",0.0],"accept":[0.0,0.0,0.0],"sim_al":"NaN"}',
    '{"type":"train","step":4,"epoch":0.4,"t":1003.0,"lr":"Infinity","grad_norm":"NaN","tokens_per_s":90.0,'
    '"loss":"NaN","loss_pos":[],"acc":[],"accept":[],"sim_al":null}',
    '{"type":"failed","step":4,"t":1003.1,"reason":"nonfinite","loss":"NaN","grad_norm":"NaN","lr":1e+30,'
    '"message":"training stopped at step 4: loss nan, grad norm nan for 3 steps in a row (steps 2-4)"}',
]


def _nan_workspace(tmp_path: Path, only_nonfinite: bool = False):
    from tests.helpers.workspaces import console_workspace

    ws = console_workspace(tmp_path)
    ws.drafter_dir.mkdir(parents=True, exist_ok=True)
    lines = [NAN_LINES[i] for i in (1, 3, 4, 5)] if only_nonfinite else NAN_LINES
    (ws.drafter_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return ws


async def _wait(pilot, predicate, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not predicate():
        await pilot.pause(0.05)
    assert predicate(), "condition not reached in time"


@pytest.mark.parametrize("only_nonfinite", [False, True], ids=["mixed", "all-nonfinite"])
async def test_training_pane_renders_nan_inf_null_at_80x24_and_160x50(tmp_path, only_nonfinite):
    from engine.core import Engine
    from eagle3_console.app import ConsoleApp
    from eagle3_console.panes import TrainingPane

    ws = _nan_workspace(tmp_path, only_nonfinite)
    app = ConsoleApp(Engine(ws))
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("5")
        pane = app.query_one(TrainingPane)
        await _wait(pilot, lambda: pane.view.step == 4)
        await pilot.pause(0.3)
        text = screen_text(app)
        assert "step 4" in text and "loss nan" in text, text
        assert "training stopped at step 4" in text, text
        # Only finite points are plotted; a curve with none is not drawn (and does not crash).
        for curve in ("loss", "acc", "al"):
            for xs, ys in pane.plot_data(curve).values():
                assert xs and len(xs) == len(ys) and all(math.isfinite(y) for y in ys)
        if not only_nonfinite:
            assert pane.plot_data("loss")["train"] == ([1.0], [5.5])
        for title in ("accuracy per position", "simulated acceptance length", "loss"):
            await pilot.press("c")
            await pilot.pause(0.2)
            text = screen_text(app)
            assert title in text, text
            if only_nonfinite:
                assert "(no finite values)" in text, text
        await pilot.resize_terminal(160, 50)
        await pilot.pause(0.5)
        text = screen_text(app)
        assert "training stopped at step 4" in text and "loss nan" in text, text
        assert "Pipeline" in text and "Extraction" in text, text  # every pane is on screen
    ledger.add("non-finite metrics in the console", trials=1, faults=len(NAN_LINES), records=len(NAN_LINES))


async def test_console_opens_at_160x50_on_nan_metrics(tmp_path):
    """At >= 200 columns (160 before issue 21's layouts) every pane is on screen from the start: the
    console died before its first frame."""
    from engine.core import Engine
    from eagle3_console.app import ConsoleApp
    from eagle3_console.panes import TrainingPane

    ws = _nan_workspace(tmp_path, only_nonfinite=True)
    app = ConsoleApp(Engine(ws))
    async with app.run_test(size=(200, 60)) as pilot:
        pane = app.query_one(TrainingPane)
        await _wait(pilot, lambda: pane.view.step == 4)
        await pilot.pause(0.5)
        text = screen_text(app)
        assert "training stopped at step 4" in text and "Pipeline" in text, text


def test_screenshot_of_the_training_tab_on_nan_metrics(tmp_path):
    ws = _nan_workspace(tmp_path)
    for size in ("80x24", "160x50"):
        result = subprocess.run([sys.executable, "-m", "eagle3_console", "screenshot", "-w", str(ws.root),
                                 str(tmp_path / "shots"), "--tabs", "training", "--size", size, "--settle", "1"],
                                capture_output=True, text=True, timeout=120, cwd=REPO)
        assert result.returncode == 0, result.stderr[-2000:]
        svg = html.unescape((tmp_path / "shots" / f"training-{size}.svg").read_text()).replace("\xa0", " ")
        assert "training stopped at step 4" in svg and "step 4" in svg, size


def test_the_other_panes_take_nonfinite_numbers():
    """Shared formats, the GPU sparkline and the extraction view: NaN/inf as numbers (bare, from
    older files) and as text (how JSONL writes them now) are unknown, never a crash."""
    from eagle3_console.fmt import fmt_count, fmt_duration, fmt_num
    from eagle3_console.panes.extraction import ExtractionView
    from eagle3_console.panes.gpu import spark_text
    from eagle3_console.render import bar, level_colour

    for value in (math.nan, math.inf, -math.inf):
        assert fmt_count(value) in ("NaN", "inf", "-inf")
        assert fmt_duration(value) == "?"
        assert fmt_num(value) in ("nan", "inf", "-inf")
        assert "╌" in bar(value, 10)  # an unknown value: the muted track
        assert level_colour(value, 80, 95) == "$text-muted"
    assert spark_text([50.0, math.nan, math.inf, 100.0], 4) == spark_text([50.0], 1) + "  █"
    from engine.jobs.events import parse_event

    view = ExtractionView()
    view.apply(parse_event({"type": "started", "samples": 40}))
    for value in (math.nan, "NaN", "Infinity", math.inf):  # read by the contract as the pane gets them
        view.apply(parse_event({"type": "progress", "done": 10, "total": 40, "tokens_per_s": value,
                                "mb_per_s": value, "eta_s": value}))
    assert (view.total, view.done, view.tokens_per_s, view.mb_per_s, view.eta_s) == (40, 10, None, None, None)
    assert list(view.tok_history) == [0.0] * 4 and view.remaining_bytes is None
