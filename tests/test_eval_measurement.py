"""Evaluation an operator can trust (issue 23): the speedup with its noise (bootstrap interval of the
median over prompts x rounds), the three-way verdict, the break-even fix text, batched decoding per
concurrency level, the recommendation sweep, staleness on a changed export or target, verdicts that
do not flip on a loaded machine, and the pane's per-concurrency table on the visible screen.

Real tiny models (tests/conftest.build_tiny_model), real decoding; a real CPU hog process for load.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from engine.evaluate import stats


# ----------------------------------------------------------------------------- the interval and the verdict


def test_bootstrap_interval_contains_the_true_median_and_narrows_with_more_samples():
    rng = random.Random(7)
    true_median = 1.2  # lognormal around 1.2: median exactly 1.2

    def draw(n):
        return [true_median * rng.lognormvariate(0.0, 0.3) for _ in range(n)]

    small, large = draw(24), draw(600)
    lo_s, hi_s = stats.bootstrap_interval(small)
    lo_l, hi_l = stats.bootstrap_interval(large)
    assert lo_s <= true_median <= hi_s
    assert lo_l <= true_median <= hi_l
    assert hi_l - lo_l < (hi_s - lo_s) / 2  # ~sqrt(25) = 5x narrower; at least 2x
    assert stats.bootstrap_interval(small) == (lo_s, hi_s)  # seeded: reproducible
    assert stats.bootstrap_interval([1.3]) == (1.3, 1.3) and stats.bootstrap_interval([]) is None
    s = stats.summarize(small)
    assert s["samples"] == 24 and s["interval"][0] <= s["median"] <= s["interval"][1]
    tight = stats.summarize([1.01] * 30)  # no spread at all: still +-2 %, so not "faster" on 1 %
    assert tight["interval"] == pytest.approx([1.01 * 0.98, 1.01 * 1.02]) and tight["verdict"] == stats.INCONCLUSIVE


def test_verdict_rules_above_below_and_straddling():
    assert stats.verdict_of((1.05, 1.4)) == stats.FASTER
    assert stats.verdict_of((0.6, 0.97)) == stats.SLOWER
    assert stats.verdict_of((0.9, 1.2)) == stats.INCONCLUSIVE
    assert stats.verdict_of((1.0, 1.3)) == stats.INCONCLUSIVE  # touching 1.0 is not "above"
    assert stats.verdict_of(None) is None
    noisy = [0.28, 17.6, 0.9, 1.3, 0.5, 2.1, 1.0, 0.7, 1.6, 1.1]  # the spread issue 23 saw on a loaded box
    assert stats.summarize(noisy)["verdict"] == stats.INCONCLUSIVE


def test_fix_text_tells_a_weak_drafter_from_noise():
    load = {"before": 3.1, "after": 2.9, "max": 3.4, "cpus": 2}
    weak = stats.fix_text(stats.SLOWER, 1.4, 1.9, load, steps=3, best_steps=1)
    assert weak.startswith("weak drafter: acceptance length 1.40 is below the break-even 1.90")
    assert "spec_steps 1" in weak
    noise = stats.fix_text(stats.SLOWER, 2.76, 1.9, load)
    assert noise.startswith("not the drafter: acceptance length 2.76 is above the break-even 1.90")
    assert "load average (1 min) 3.10 before, 2.90 after, 3.40 peak on 2 CPUs" in noise
    unsure = stats.fix_text(stats.INCONCLUSIVE, 2.76, 1.9, load)
    assert unsure.startswith("inconclusive: the 95% interval straddles 1.0×") and "3.40 peak" in unsure
    assert stats.fix_text(stats.FASTER, 2.76, 1.9, load) == ""
    assert stats.break_even(0.004, 0.002) == 2.0  # a verify cycle costs two plain steps


# ----------------------------------------------------------------------------- the sweep and the recommendation


def _tally(speedups, al=2.0):
    from engine.evaluate.report import Tally

    t = Tally()
    for i, sp in enumerate(speedups):
        tokens = 40
        base_s = 1.0 + 0.01 * i
        t.add_counts(tokens, base_s, tokens, base_s / sp, int(tokens / al), [10, 5], True)
        t.wave_walls.append((base_s, base_s / sp))
    return t


def test_sweep_picks_the_best_setting_and_writes_its_sglang_flags():
    from engine.evaluate.report import build_report, recommendation_lines, render_table, sglang_flags
    from engine.evaluate.sglang_eval import speculative_argv

    level1 = {1: _tally([1.10, 1.12, 1.15, 1.11] * 3), 2: _tally([1.40, 1.45, 1.38, 1.42] * 3),
              3: _tally([1.30, 1.31, 1.29, 1.33] * 3), 4: _tally([1.20, 1.18, 1.22, 1.21] * 3),
              5: _tally([1.05, 1.02, 1.07, 1.03] * 3)}
    level4 = {1: _tally([1.08, 1.12, 1.09, 1.11] * 3), 2: _tally([1.02, 1.04, 1.01, 1.03] * 3),
              3: _tally([0.95, 0.97, 0.93, 0.96] * 3), 4: _tally([0.85, 0.86, 0.84, 0.88] * 3),
              5: _tally([0.80, 0.81, 0.79, 0.82] * 3)}
    level16 = {s: _tally([0.90 - 0.02 * s, 0.88 - 0.02 * s, 0.91 - 0.02 * s] * 4) for s in range(1, 6)}
    from engine.evaluate.report import level_summary

    levels = [level_summary(1, 3, level1, 4, 3), level_summary(4, 3, level4, 1, 3), level_summary(16, 3, level16, 1, 3)]
    assert [lv["best"] for lv in levels] == [2, 1, 1]
    export = "/ws/drafters/run1/export"
    report = build_report(backend="local", drafter={"path": export, "sha256": "ab" * 32}, target={},
                          settings={"spec_steps": 3, "rounds": 3}, prompts=[], levels=levels,
                          load={"before": 0.2, "after": 0.3, "max": 0.3, "cpus": 2})
    rec = report["recommendation"]
    assert [(x["concurrency"], x["spec_steps"], x["serve_speculative"]) for x in rec["levels"]] == [
        (1, 2, True), (4, 1, True), (16, 1, False)]
    assert rec["levels"][0]["flags"] == (
        "--speculative-algorithm EAGLE3 --speculative-draft-model-path /ws/drafters/run1/export "
        "--speculative-num-steps 2 --speculative-eagle-topk 1 --speculative-num-draft-tokens 3")
    assert sglang_flags(export, 2) == speculative_argv([], export, 2, 1, 3)  # the SGLang backend's own argv
    assert rec["stops_paying_at"] == 16 and "stops paying at concurrency 16" in rec["text"]
    assert report["measurement"]["spec_steps"] == 3 and report["measurement"]["speedup"]["verdict"] == "faster"
    text = render_table(report)
    assert "concurrency 1: 2 steps, 1.41×" in text and "serve with --speculative-algorithm EAGLE3" in text
    assert "concurrency 16: serve without speculation" in text
    assert recommendation_lines(report)[-1].strip() == rec["text"]


def test_concurrency_levels_are_checked_and_those_above_the_prompt_count_skipped():
    pytest.importorskip("torch")
    from engine.evaluate.local_eval import EvalError, plan_levels

    assert plan_levels([16, 1, 4], 8) == ([1, 4], ["concurrency 16 skipped: 8 prompts cannot keep that many "
                                                   "requests in flight (raise evaluate.num_prompts)"])
    assert plan_levels([1, 4, 16], 40) == ([1, 4, 16], [])
    assert plan_levels([8], 3)[0] == [3]
    with pytest.raises(EvalError, match="evaluate.concurrency"):
        plan_levels([1, 0], 8)


# ----------------------------------------------------------------------------- staleness


def test_evaluate_is_amber_stale_when_the_export_or_the_target_changes(tmp_path):
    from engine.checks.base import StageState, Status, stage_state
    from engine.checks.context import CheckContext
    from engine.checks.evaluate import check_evaluate
    from engine.evaluate.report import (
        PromptResult,
        build_report,
        export_identity,
        target_identity,
        write_report,
    )
    from engine.workspace import init_workspace

    ws = init_workspace(tmp_path / "ws")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 4}))
    cfg = ws.config
    cfg.model.path = str(model)
    ws.save_config(cfg)
    export = ws.drafter_dir / "export"
    export.mkdir(parents=True)
    (export / "model.safetensors").write_bytes(b"weights-1")
    (export / "config.json").write_text('{"draft_vocab_size": 32}')
    prompts = [PromptResult(f"p{i}", 5, 40, 20, [12, 6], 1.0, 1.5, 40, True, None) for i in range(4)]

    def fresh():
        report = build_report(backend="local", drafter=export_identity(export), target=target_identity(model),
                              settings={"spec_steps": 2}, prompts=prompts, load=None)
        write_report(ws.eval_dir, report)
        return {r.name: r for r in check_evaluate(CheckContext(ws))}

    results = fresh()
    assert results["drafter"].status is Status.PASS and "target (config.json sha256" in results["drafter"].evidence
    assert results["speedup"].status is Status.PASS
    (model / "model.safetensors").write_bytes(b"target weights")
    for path, text, what in ((export / "config.json", '{"draft_vocab_size": 64}', "export's config.json changed"),
                             (export / "model.safetensors", "weights-2", "export's model.safetensors changed"),
                             (model / "config.json", '{"num_hidden_layers": 8}', "target's config.json changed"),
                             (model / "model.safetensors", "fine-tuned", "target's weights changed")):
        fresh()
        path.write_text(text)
        results = check_evaluate(CheckContext(ws))
        assert [r.name for r in results] == ["drafter"] and results[0].status is Status.WARN, results
        assert "stale" in results[0].evidence and what in results[0].evidence, results[0].evidence
        assert "run evaluate" in results[0].fix
        assert stage_state(results) is StageState.WARNED  # amber, not red: nothing is known to be wrong


def test_inconclusive_is_amber_and_slower_is_red(tmp_path):
    from engine.checks.base import Status
    from engine.checks.context import CheckContext
    from engine.checks.evaluate import check_evaluate
    from engine.evaluate.report import PromptResult, build_report, export_identity, target_identity, write_report
    from engine.workspace import init_workspace

    ws = init_workspace(tmp_path / "ws")
    export = ws.drafter_dir / "export"
    export.mkdir(parents=True)
    (export / "model.safetensors").write_bytes(b"w")
    (export / "config.json").write_text("{}")

    def speedup_check(speedups):
        prompts = [PromptResult(f"p{i}", 5, 40, 20, [12, 6], 1.0, sp, 40, True, None)
                   for i, sp in enumerate(speedups)]
        write_report(ws.eval_dir, build_report(
            backend="local", drafter=export_identity(export), target=target_identity(ws.model_dir),
            settings={"spec_steps": 2}, prompts=prompts, load={"before": 2.5, "after": 2.7, "max": 3.0, "cpus": 2}))
        return {r.name: r for r in check_evaluate(CheckContext(ws))}["speedup"]

    unsure = speedup_check([0.8, 1.3, 0.9, 1.2, 1.1, 0.85])
    assert unsure.status is Status.WARN and "INCONCLUSIVE" in unsure.evidence and "3.00 peak" in unsure.evidence
    slow = speedup_check([0.7, 0.72, 0.69, 0.71])
    assert slow.status is Status.FAIL and "slower than no speculation" in slow.evidence and slow.fix
    fast = speedup_check([1.3, 1.32, 1.29, 1.31])
    assert fast.status is Status.PASS and "faster than no speculation" in fast.evidence


# ----------------------------------------------------------------------------- real decoding

torch = pytest.importorskip("torch")


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    """A bigram target (every layer adds nothing, LM head follows a permutation) and a drafter that
    knows it two tokens ahead, as tests/test_evaluate.py's oracle test: draft 1 is always accepted."""
    from transformers import AutoModelForCausalLM

    from tests.helpers.models import build_tiny_model
    from tests.helpers.drafters import make_drafter

    path = build_tiny_model(tmp_path_factory.mktemp("oracle"))
    bigram = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    h, vocab = bigram.config.hidden_size, bigram.config.vocab_size
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(3))
    inv = torch.argsort(perm)
    with torch.no_grad():
        for layer in bigram.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = bigram.get_input_embeddings().weight
        normed = emb * torch.rsqrt(emb.pow(2).mean(-1, keepdim=True) + bigram.config.rms_norm_eps)
        bigram.lm_head.weight.copy_(normed[inv])
    drafter = make_drafter(bigram, draft_vocab=vocab, hot_ids=torch.arange(vocab))
    with torch.no_grad():
        drafter.fc.weight.zero_()
        drafter.fc.weight[:, 2 * h:] = torch.eye(h)
        drafter.midlayer.self_attn.o_proj.weight.zero_()
        drafter.midlayer.mlp.down_proj.weight.zero_()
        drafter.norm.weight.fill_(1.0)
        drafter.lm_head.weight.copy_(normed[inv[inv]])
    # A random drafter for the rows whose acceptance differs (and a stop token) per row.
    return bigram, drafter, make_drafter(AutoModelForCausalLM.from_pretrained(str(path)).eval(), seed=1), path


PROMPTS = [[5, 6, 7, 8, 9], [3], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51], [200, 17, 99, 3, 250, 8],
           [11, 12], [90, 91, 92, 93, 94, 95, 96]]


@pytest.mark.parametrize("steps", [1, 3])
def test_batched_decoding_equals_batch1_greedy_row_for_row(oracle, steps):
    """Concurrency N: N requests in one batch, each at its own length and acceptance; every row's
    tokens are batch-1 greedy's, verify counts are batch-1 speculation's, rows leave when they stop."""
    from transformers import AutoModelForCausalLM

    from engine.evaluate.batched import batched_greedy, batched_speculative
    from engine.evaluate.specdec import greedy_decode, speculative_decode
    from tests.helpers.drafters import AUX

    bigram, good, _random, path = oracle
    plain = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    for target, drafter in ((bigram, good), (plain, good)):  # accepting everything; accepting by chance
        stop = [greedy_decode(target, PROMPTS[0], 30).tokens[7]]
        ref = [greedy_decode(target, p, 30, stop) for p in PROMPTS]
        one = [speculative_decode(target, drafter, p, 30, steps, AUX, stop) for p in PROMPTS]
        base = batched_greedy(target, PROMPTS, 30, stop)
        spec = batched_speculative(target, drafter, PROMPTS, 30, steps, AUX, stop)
        assert [r.tokens for r in base] == [r.tokens for r in ref] == [r.tokens for r in spec]
        assert [r.verify_steps for r in spec] == [r.verify_steps for r in one]
        assert [r.accepted for r in spec] == [r.accepted for r in one]
        assert len({len(r.tokens) for r in ref}) > 1  # rows really end at different steps
        assert all(r.seconds > 0 for r in base + spec)


def _setup(target, drafter):
    from engine.evaluate.local_eval import LocalSetup
    from tests.helpers.drafters import AUX

    return LocalSetup(target, drafter, AUX, [], "cpu", "float32", [])


def test_measurement_reports_levels_sweep_and_progress(oracle):
    from engine.evaluate.local_eval import measure_local
    from engine.evaluate.prompts import EvalPrompt
    from engine.evaluate.report import build_report

    bigram, good, _random, _ = oracle
    prompts = [EvalPrompt(f"p{i}", p) for i, p in enumerate(PROMPTS)]
    events = []
    m = measure_local(_setup(bigram, good), prompts, 24, spec_steps=2, sweep_steps=[1, 3], rounds=2,
                      levels=[4, 1, 16], progress=events.append)
    assert [lv["concurrency"] for lv in m["levels"]] == [1, 4]
    assert m["notes"] == ["concurrency 16 skipped: 6 prompts cannot keep that many requests in flight (raise "
                          "evaluate.num_prompts)"]
    assert events[-1]["done"] == events[-1]["total"] == (6 + 4) * 2
    assert [e["done"] for e in events] == sorted(e["done"] for e in events)
    assert all(e["acceptance_length"] >= 1.9 for e in events)  # draft 1 is always right
    for level in m["levels"]:
        assert [s["spec_steps"] for s in level["settings"]] == [1, 2, 3]
        for s in level["settings"]:
            assert s["greedy_matches"] == s["greedy_compared"] == len(prompts if level["concurrency"] == 1 else
                                                                      prompts[:4]) * 2
            assert s["acceptance_length"] >= 1.9 and s["break_even"] > 0
            assert s["base_tokens_per_s"] > 0 and s["spec_latency_s"] > 0
    report = build_report(backend="local", drafter={"path": "/e", "sha256": "0" * 64}, target={},
                          settings={"spec_steps": 2}, prompts=m["prompt_results"], levels=m["levels"], load=m["load"])
    assert report["overall"]["prompts"] == 6 and report["overall"]["completion_tokens"] > 6 * 2 * 20
    assert report["load"]["cpus"] >= 1 and report["load"]["max"] >= 0


def test_two_evaluations_on_a_loaded_machine_never_give_opposite_verdicts(oracle):
    """One evaluation on the machine as it is, one with a CPU hog spinning beside it: the verdicts may
    differ in confidence (faster vs inconclusive), never in direction."""
    from engine.evaluate.local_eval import measure_local
    from engine.evaluate.prompts import EvalPrompt

    bigram, good, _random, _ = oracle
    prompts = [EvalPrompt(f"p{i}", p) for i, p in enumerate(PROMPTS * 2)]
    setup = _setup(bigram, good)

    def evaluate():
        m = measure_local(setup, prompts, 24, spec_steps=1, sweep_steps=[], rounds=3, levels=[1])
        return m["levels"][0]["settings"][0]["speedup"], m["load"]

    quiet, _ = evaluate()
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        loaded, load = evaluate()
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    print(f"\nquiet {stats.fmt_interval(quiet)} {quiet['verdict']}; with 2 CPU hogs {stats.fmt_interval(loaded)} "
          f"{loaded['verdict']} ({stats.load_text(load)})")
    assert {quiet["verdict"], loaded["verdict"]} != {stats.FASTER, stats.SLOWER}


# ----------------------------------------------------------------------------- the pane


def _levels_report():
    from engine.evaluate.report import PromptResult, build_report, level_summary

    level1 = {s: _tally([1.2 + 0.05 * s, 1.25 + 0.05 * s, 1.22 + 0.05 * s] * 3) for s in (1, 2, 3)}
    level4 = {s: _tally([1.05, 0.98, 1.1, 0.95] * 3) for s in (1, 2, 3)}
    level16 = {s: _tally([0.8 - 0.02 * s, 0.82 - 0.02 * s, 0.79 - 0.02 * s] * 3) for s in (1, 2, 3)}
    prompts = [PromptResult(f"p{i}", 5, 40, 20, [12, 6], 1.0, 1.3, 40, True, None) for i in range(3)]
    return build_report(backend="local", drafter={"path": "/ws/drafters/run1/export", "sha256": "ab" * 32},
                        target={"dtype": "float32"}, settings={"spec_steps": 2, "spec_topk": 1, "rounds": 3},
                        prompts=prompts, levels=[level_summary(1, 2, level1, 3, 3), level_summary(4, 2, level4, 1, 3),
                                                 level_summary(16, 2, level16, 1, 3)],
                        load={"before": 0.4, "after": 0.5, "max": 0.6, "cpus": 2})


@pytest.mark.parametrize("size", [(80, 24), (160, 40)])
async def test_pane_shows_one_row_per_concurrency_on_the_visible_screen(size):
    from textual.app import App

    from tests.helpers.screen import screen_text
    from eagle3_console.panes.evaluation import EvaluationPane, progress_text
    from engine.jobs.events import Progress

    class Host(App):
        def compose(self):
            yield EvaluationPane(_levels_report())

    app = Host()
    async with app.run_test(size=size) as pilot:
        await pilot.pause()
        text = screen_text(app)
        lines = [line.strip("│ ") for line in text.splitlines()]
        for conc, verdict in ((1, "faster"), (4, "inconclusive"), (16, "slower")):
            assert any(line.split()[:1] == [str(conc)] and verdict in line for line in lines), (conc, text)
        assert "1.32× [1.29–1.35]" in text  # level 1, configured 2 steps (median of 1.30, 1.35, 1.32), interval
        assert "faster than no speculation" in text and "(95%" in text
        assert "concurrency 1: 3 steps" in text
        assert "--speculative-num-steps 3" in text and "--speculative-num-draft-tokens 4" in text
        assert "speculation no longer measurably pays from concurrency" in text
        pane = app.query_one(EvaluationPane)
        assert not app.query_one("#evaluation-verdict").has_class("-slower")
    assert progress_text(Progress(done=12, total=30, unit="requests x rounds", concurrency=4, round=2,
                                  rounds=3, acceptance_length=2.345, speedup=1.21)) == (
        "12/30 requests x rounds · concurrency 4 round 2/3 · acceptance length so far 2.35 · "
        "median speedup so far 1.21×")
    assert pane is not None


async def test_pane_inconclusive_verdict_is_amber_with_the_load():
    from textual.app import App
    from textual.widgets import Static

    from eagle3_console.panes.evaluation import EvaluationPane
    from engine.evaluate.report import PromptResult, build_report

    prompts = [PromptResult(f"p{i}", 5, 40, 20, [12, 6], 1.0, sp, 40, True, None)
               for i, sp in enumerate([0.8, 1.3, 0.9, 1.2, 1.1, 0.85])]
    report = build_report(backend="local", drafter={"path": "/e", "sha256": "0" * 64}, target={},
                          settings={"spec_steps": 2}, prompts=prompts,
                          load={"before": 2.5, "after": 2.7, "max": 3.0, "cpus": 2})

    class Host(App):
        def compose(self):
            yield EvaluationPane(report)

    app = Host()
    async with app.run_test(size=(120, 30)) as pilot:
        await pilot.pause()
        verdict = app.query_one("#evaluation-verdict", Static)
        assert verdict.has_class("-inconclusive") and not verdict.has_class("-slower")
        assert "INCONCLUSIVE" in str(verdict.render()) and "3.00 peak on 2 CPUs" in str(verdict.render())
        assert str(app.query_one("#evaluation-fix", Static).render()).startswith("fix: ")


# ----------------------------------------------------------------------------- progress in status


EVAL_JOB = """
import time
from engine.jobs.context import JobContext
ctx = JobContext.from_env()
ctx.event("started", backend="local", prompts=8, rounds=3)
ctx.event("progress", unit="requests x rounds", done=12, total=36, concurrency=1, round=2, rounds=3,
          acceptance_length=2.41, speedup=1.33, eta_s=20.0)
time.sleep(60)
"""


def test_running_evaluation_progress_in_status_and_the_stage(tmp_path):
    """A real evaluate-kind job that reports progress as the evaluation does: `status` shows requests x
    rounds done (text) and the running acceptance length (JSON); the `evaluate` check names both."""

    from engine.checks.context import CheckContext
    from engine.checks.evaluate import check_evaluate
    from tests.helpers.jobs import start_job_and_wait
    from tests.helpers.workspaces import console_workspace

    ws = console_workspace(tmp_path)
    jobs, job = start_job_and_wait(ws, "evaluate", EVAL_JOB, b"progress")
    try:
        (result,) = check_evaluate(CheckContext(ws))
        assert result.evidence == (f"evaluation running (job {job.id}): 12/36 requests x rounds, concurrency 1 "
                                   "round 2/3, acceptance length so far 2.41, median speedup so far 1.33×")
        run = lambda *extra: subprocess.run(  # noqa: E731
            [sys.executable, "-m", "eagle3_console", "status", "-w", str(ws.root), *extra], capture_output=True,
            text=True, timeout=60)
        line = next(x for x in run().stdout.splitlines() if x.strip().startswith(job.id))
        assert "evaluate" in line and "12/36 (33%)" in line and "ETA 20s" in line
        entry = next(j for j in json.loads(run("--json").stdout)["jobs"] if j["id"] == job.id)
        assert entry["progress"]["acceptance_length"] == 2.41 and entry["progress"]["done"] == 12
    finally:
        jobs.stop_sync(job.id, grace=5)
