"""The SGLang evaluation backend (issue 23): plain and speculative servers per setting, every
concurrency level with that many concurrent HTTP clients, rounds, intervals, the sweep's choice per
level as SGLang flags, and where speculation stops paying.

No SGLang and no GPU here, so two halves:
  - the orchestration runs for real (the workspace's real SGLang argv builder, servers as real
    supervised job processes, real HTTP on 127.0.0.1), but the processes are tests/sglang_standin.py,
    a stand-in that answers SGLang's endpoints with made-up costs: the figures below are the
    stand-in's, not SGLang's; what is tested is that the evaluation measures and reports them right;
  - SGLang 0.5.23's own ServerArgs (the wheel, tests/sglang_judge/) parses and resolves every argv
    the sweep launches, and must serve exactly the steps, top-k and draft tokens we report.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from engine.evaluate import stats
from engine.evaluate.prompts import EvalPrompt
from engine.evaluate.report import SpecSetting, build_report, level_lines, recommendation_lines, render_table
from engine.evaluate.sglang_eval import (
    SPEC_RUNNING_CAP,
    EvalServer,
    evaluate_sglang,
    plan_servers,
    running_cap_notes,
    settings_notes,
    sweep_settings,
)
from engine.jobs.manager import JobManager

STANDIN = Path(__file__).resolve().parent / "sglang_standin.py"
VERSION_ENV = "EAGLE3_SGLANG_VERSION"  # = engine.sglang.launch.ENV_VERSION_OVERRIDE: no SGLang to detect here


def sglang_workspace(root: Path, model_dir: Path, **changes):
    from engine.config import set_value
    from engine.workspace import init_workspace

    ws = init_workspace(root)
    config = ws.config
    for key, value in {"model.path": str(model_dir), "model.backend": "sglang", "server.startup_timeout_s": 60.0,
                       "extract.spool_dir": str(root / "spool"), "evaluate.spec_steps": 1, "evaluate.spec_topk": 1,
                       "evaluate.spec_draft_tokens": 2, "evaluate.sglang_sweep": [[3, 1, 4], [2, 2, 4]],
                       "evaluate.rounds": 2, "evaluate.concurrency": [1, 4], "evaluate.max_new_tokens": 16,
                       **changes}.items():
        config = set_value(config, key, value)
    ws.save_config(config)
    return ws


@pytest.fixture()
def ws(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setenv(VERSION_ENV, "0.5.23")
    return sglang_workspace(tmp_path / "ws", tiny_model_dir)


def standin_launch(jobs: JobManager, cwd: Path, log: Path, launched: list[list[str]]):
    """Runs the stand-in in place of `python -m sglang.launch_server`, as a supervised job, with the
    rest of the real argv unchanged (the stand-in reads the flags it needs from it)."""

    def launch(kind, argv, env, url, api_key):
        assert argv[1:3] == ["-m", "sglang.launch_server"], argv
        launched.append(list(argv))
        return EvalServer(jobs, kind, [sys.executable, str(STANDIN), *argv[3:]], {**env, "STANDIN_LOG": str(log)},
                          url, api_key, cwd)

    return launch


def test_sglang_backend_measures_every_setting_and_level_and_recommends(ws, tmp_path):
    prompts = [EvalPrompt(f"p{i}", [5 + i, 17, 3 * i + 1, 40]) for i in range(8)]
    export = ws.drafter_dir / "export"
    log, launched, events, phases = tmp_path / "standin.jsonl", [], [], []
    jobs = JobManager(ws.jobs_dir)
    measured = asyncio.run(evaluate_sglang(ws, export, prompts, progress=events.append, on_phase=phases.append,
                                           launch=standin_launch(jobs, ws.root, log, launched)))

    # One launch per setting, plain first; the argv is the real builder's, only the speculative flags differ.
    assert phases == ["eval-server-baseline", "eval-server-spec-1-1-2", "eval-server-spec-2-2-4",
                      "eval-server-spec-3-1-4"]
    base_argv = launched[0]
    assert "--speculative-algorithm" not in base_argv and base_argv[base_argv.index("--model-path") + 1] == str(
        ws.model_dir)
    for argv, (steps, topk, draft) in zip(launched[1:], [(1, 1, 2), (2, 2, 4), (3, 1, 4)]):
        assert argv[:len(base_argv)] == base_argv
        assert argv[len(base_argv):] == ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path",
                                         str(export), "--speculative-num-steps", str(steps),
                                         "--speculative-eagle-topk", str(topk), "--speculative-num-draft-tokens",
                                         str(draft)]
    assert all(job.state not in ("starting", "running") for job in jobs.list())  # every server stopped

    # What each server saw: warm-up first (short requests at each level), then 8 prompts x 2 rounds x 2
    # levels, the level order rotating per round (1, 4 | 4, 1): one at a time at concurrency 1, and
    # 4 in flight at concurrency 4.
    records = [json.loads(line) for line in log.read_text().splitlines()]
    servers: list[list[dict]] = []
    for record in records:
        if "argv" in record:
            servers.append([])
        else:
            servers[-1].append(record)
    assert len(servers) == 4
    for requests in servers:
        assert len(requests) == 5 + 32
        assert all(r["max_new_tokens"] <= 8 for r in requests[:5]) and all(
            r["max_new_tokens"] == 16 for r in requests[5:])
        level1 = requests[5:13] + requests[29:]
        level4 = requests[13:29]
        assert all(r["in_flight"] == 1 for r in level1)
        assert max(r["in_flight"] for r in level4) == 4

    report = build_report(backend="sglang", drafter={"path": str(export), "sha256": "ab" * 32}, target={},
                          settings={"spec_steps": 1, "spec_topk": 1, "spec_draft_tokens": 2, "rounds": 2,
                                    "max_new_tokens": 16},
                          prompts=measured["prompt_results"], notes=measured["notes"], levels=measured["levels"],
                          load=measured["load"])
    # The stand-in's made-up costs: speculation pays alone (3/1/4 best) and costs more than it saves
    # with 4 in flight. These are the stand-in's figures, not SGLang's.
    lv1, lv4 = report["levels"]
    assert (lv1["concurrency"], lv4["concurrency"]) == (1, 4)
    assert lv1["configured"] == "1/1/2" and lv1["best"] == "3/1/4" and lv4["best"] == "1/1/2"
    for level in (lv1, lv4):
        assert [s["key"] for s in level["settings"]] == ["1/1/2", "2/2/4", "3/1/4"]
        assert all(s["speedup"]["samples"] == 16 for s in level["settings"])  # prompts x rounds
        by_key = {s["key"]: s for s in level["settings"]}
        assert by_key["3/1/4"]["acceptance_length"] == 4.0  # the stand-in accepts 3 drafts per verify
        assert by_key["3/1/4"]["position_accept"] == [1.0, 1.0, 1.0]
        assert by_key["2/2/4"]["spec_topk"] == 2 and by_key["2/2/4"]["spec_draft_tokens"] == 4
        assert all(s["greedy_matches"] == s["greedy_compared"] == 16 for s in level["settings"])
        assert all(s["base_tokens_per_s"] and s["spec_tokens_per_s"] and s["base_latency_s"] for s in
                   level["settings"])
    assert all(s["speedup"]["verdict"] == stats.FASTER for s in lv1["settings"])
    assert all(s["speedup"]["verdict"] == stats.SLOWER for s in lv4["settings"])
    assert lv4["settings"][0]["base_tokens_per_s"] > lv1["settings"][0]["base_tokens_per_s"]  # batching pays
    assert report["measurement"]["concurrency"] == 1 and report["measurement"]["key"] == "1/1/2"

    rec = report["recommendation"]
    assert rec["swept"] == ["1/1/2", "2/2/4", "3/1/4"] and rec["stops_paying_at"] == 4
    assert rec["levels"][0]["flags"] == (
        f"--speculative-algorithm EAGLE3 --speculative-draft-model-path {export} --speculative-num-steps 3 "
        "--speculative-eagle-topk 1 --speculative-num-draft-tokens 4")
    assert not rec["levels"][1]["serve_speculative"] and rec["levels"][1]["flags"] == ""
    text = render_table(report)
    assert "recommendation (swept SGLang settings 1/1/2, 2/2/4, 3/1/4 as steps/top-k/draft tokens):" in text
    assert "per concurrency (configured setting as steps/top-k/draft tokens; latency = median per request):" in text
    assert "concurrency 1: steps 3 top-k 1 draft tokens 4, " in text
    assert "concurrency 4: serve without speculation (best: steps 1 top-k 1 draft tokens 2, " in text
    assert "speculation stops paying at concurrency 4" in recommendation_lines(report)[-1]
    assert [line.split()[:2] for line in level_lines(report)[2:]] == [["1", "1/1/2"], ["4", "1/1/2"]]
    assert report["measurement"]["fix"] == "" and all(s["fix"] for s in lv4["settings"])  # what to do when slower
    assert any("one speculative server per setting (3)" in n for n in report["notes"])

    # Per prompt (concurrency 1, configured setting, summed over rounds) and the progress events.
    assert [p["id"] for p in report["prompts"]] == [p.id for p in prompts]
    assert all(p["completion_tokens"] == 32 and p["matches_greedy"] for p in report["prompts"])
    assert events[-1]["done"] == events[-1]["total"] == 4 * 8 * 2 * 2 and not measured["stopped"]
    spec_events = [e for e in events if e["setting"] != "no speculation"]
    assert {e["concurrency"] for e in events} == {1, 4} and {e["round"] for e in events} == {1, 2}
    assert all(e["acceptance_length"] for e in spec_events) and any(e["speedup"] for e in spec_events)


def test_a_stop_request_ends_the_run_with_what_both_sides_completed(ws, tmp_path):
    """Stopping (the job's SIGTERM) while the second speculative server runs: no further launch, that
    server stopped, and the report holds the setting whose runs both sides completed."""
    prompts = [EvalPrompt(f"p{i}", [5 + i, 17, 3 * i + 1, 40]) for i in range(8)]
    phases: list[str] = []
    jobs = JobManager(ws.jobs_dir)
    measured = asyncio.run(evaluate_sglang(ws, ws.drafter_dir / "export", prompts, on_phase=phases.append,
                                           should_stop=lambda: len(phases) >= 3,
                                           launch=standin_launch(jobs, ws.root, tmp_path / "log.jsonl", [])))
    assert phases == ["eval-server-baseline", "eval-server-spec-1-1-2", "eval-server-spec-2-2-4"]
    assert all(job.state not in ("starting", "running") for job in jobs.list())
    assert measured["stopped"] and measured["done"] == 2 * 8 * 2 * 2 < measured["total"]
    assert [[s["key"] for s in lv["settings"]] for lv in measured["levels"]] == [["1/1/2"], ["1/1/2"]]
    assert len(measured["prompt_results"]) == 8


def test_sweep_settings_take_the_configured_one_and_refuse_what_sglang_would_rewrite(ws):
    from engine.evaluate.sglang_eval import SglangEvalError

    ev = ws.config.evaluate
    configured, settings = sweep_settings(ev)
    assert configured == SpecSetting(1, 1, 2) and [s.key for s in settings] == ["1/1/2", "2/2/4", "3/1/4"]
    ev.spec_draft_tokens = 7  # at top-k 1 SGLang serves steps + 1 whatever is written: measured as such, and said
    assert sweep_settings(ev)[0] == SpecSetting(1, 1, 2)
    assert settings_notes(1, 1, 7) == ["with top-k 1 SGLang verifies steps+1 = 2 tokens; evaluate.spec_draft_tokens "
                                       "7 is adjusted by SGLang (measured and reported with 2)"]
    ev.spec_topk, ev.spec_steps, ev.spec_draft_tokens = 4, 2, 40  # 2 steps at top-k 4 offer 20 candidates
    with pytest.raises(SglangEvalError, match=r"evaluate.spec_steps/spec_topk/spec_draft_tokens \(2/4/40\): "
                                              r"draft_tokens must be from 2 to 21"):
        sweep_settings(ev)


def test_every_sweep_argv_is_served_as_reported_by_sglangs_own_server_args(ws, tmp_path, sglang_importable):
    """SGLang 0.5.23 parses each launch's argv and resolves it (resolve_once: the whole resolution
    pipeline, the draft model's config read from our real export; `--device cpu` appended, as this
    machine has no accelerator for SGLang to find); what it would serve must be the steps/top-k/draft
    tokens the report names, and the plain server must have no speculation."""
    torch = pytest.importorskip("torch")
    from engine.config import set_value
    from engine.sglang.launch import build_sglang_spec
    from engine.train.export import export_drafter
    from engine.train.model import DraftConfig, Eagle3Drafter
    from engine.train.vocab import build_vocab
    from sglang_judge.wheel import run_with_sglang

    config = set_value(ws.config, "evaluate.sglang_sweep", [[1, 1, 2], [2, 1, 3], [3, 1, 4], [5, 4, 8], [2, 4, 21]])
    ws.save_config(config)
    target = json.loads((ws.model_dir / "config.json").read_text())
    cfg = DraftConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=160,
                      vocab_size=target["vocab_size"], draft_vocab_size=50, target_hidden_size=target["hidden_size"],
                      aux_layers_sglang=[1, 2, 3])
    model = Eagle3Drafter(cfg)
    vocab = build_vocab(torch.randint(0, 100, (target["vocab_size"],)), 50)
    model.set_vocab(vocab.d2t, vocab.t2d)
    export = export_drafter(model, tmp_path / "export")
    configured, settings = sweep_settings(ws.config.evaluate)
    spec = build_sglang_spec(ws, capture=False, port=30123)
    plan = plan_servers(spec.argv, export, settings)
    assert len(plan) == 6
    script = '''
import argparse, json, sys
import native_stubs
from sglang.srt.server_args import ServerArgs
out = []
for argv in json.loads(sys.argv[1]):
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args(argv + ["--device", "cpu"]))  # no accelerator here
    args.resolve_once()
    d = args.resolved_dict()
    out.append([d["speculative_algorithm"], d["speculative_num_steps"], d["speculative_eagle_topk"],
                d["speculative_num_draft_tokens"], d["speculative_draft_model_path"], d["max_running_requests"]])
print("RESOLVED " + json.dumps(out))
'''
    stdout = run_with_sglang(sglang_importable, script, json.dumps([argv[3:] for _, _, argv in plan]), timeout=300)
    line = next((ln for ln in stdout.splitlines() if ln.startswith("RESOLVED ")), None)
    assert line, stdout[-3000:]
    resolved = json.loads(line[len("RESOLVED "):])
    assert resolved[0][0] is None and resolved[0][5] != SPEC_RUNNING_CAP  # the plain server: no speculation
    for (_, setting, _), served in zip(plan[1:], resolved[1:]):
        assert served == ["EAGLE3", setting.steps, setting.topk, setting.draft_tokens, str(export),
                          SPEC_RUNNING_CAP], setting  # and the running-request cap the report warns about
    assert running_cap_notes(spec.argv, [1, 4, 16]) == []
    (note,) = running_cap_notes(spec.argv, [1, 16, 64])
    assert note.startswith(f"concurrency 64: SGLang runs at most {SPEC_RUNNING_CAP} requests at once")
    assert running_cap_notes(spec.argv + ["--max-running-requests", "128"], [64]) == []


def random_export(model_dir: Path, out: Path) -> Path:
    """A real drafter export (random weights) for the tiny target: what `evaluate` checks and hashes."""
    torch = pytest.importorskip("torch")
    from engine.train.export import export_drafter
    from engine.train.model import DraftConfig, Eagle3Drafter
    from engine.train.vocab import build_vocab

    target = json.loads((model_dir / "config.json").read_text())
    cfg = DraftConfig(hidden_size=target["hidden_size"], num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=target["vocab_size"], draft_vocab_size=50,
                      target_hidden_size=target["hidden_size"], aux_layers_sglang=[1, 2, 3])
    torch.manual_seed(0)
    model = Eagle3Drafter(cfg)
    vocab = build_vocab(torch.randint(0, 100, (target["vocab_size"],)), 50)
    model.set_vocab(vocab.d2t, vocab.t2d)
    return export_drafter(model, out)


async def test_evaluate_job_on_sglang_writes_the_report_the_pane_shows(tmp_path, tiny_chat_model_dir, monkeypatch,
                                                                      capsys):
    """The evaluate job (engine.evaluate.job.Evaluation, in this process so the launcher can be
    injected) on model.backend = "sglang": held-out prompts, the export's identity, report.json,
    progress events; then the Evaluation pane on that report at 160 and 80 columns. Stand-in
    servers (tests/sglang_standin.py): the figures are the stand-in's, not SGLang's."""
    from textual.app import App

    from eagle3_console.panes.evaluation import EvaluationPane
    from engine.evaluate.job import Evaluation
    from engine.evaluate.report import read_report
    from tests.helpers.screen import screen_text

    monkeypatch.setenv(VERSION_ENV, "0.5.23")
    ws = sglang_workspace(tmp_path / "ws", tiny_chat_model_dir, **{"dataset.eval_path": "eval.jsonl",
                                                                   "evaluate.num_prompts": 8})
    (ws.root / "eval.jsonl").write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"question {i} about {w}"}, {"role": "assistant", "content": "answer"}]}) + "\n"
        for i, w in enumerate(["gpus", "disks", "servers", "units", "tokens", "paris", "drafts", "models"])))
    random_export(tiny_chat_model_dir, ws.drafter_dir / "export")
    launched: list[list[str]] = []
    launch = standin_launch(JobManager(ws.jobs_dir), ws.root, tmp_path / "standin.jsonl", launched)
    assert await asyncio.to_thread(Evaluation(ws, launch=launch).run) == 0
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert events[0]["type"] == "started" and events[0]["backend"] == "sglang"
    assert events[0]["sglang_sweep"] == [[3, 1, 4], [2, 2, 4]] and events[0]["concurrency"] == [1, 4]
    progress = [e for e in events if e["type"] == "progress"]
    assert progress[-1]["done"] == progress[-1]["total"] == 128
    assert progress[-1]["unit"] == "requests x rounds x servers"
    assert [e["name"] for e in events if e["type"] == "phase"][0] == "eval-server-baseline"
    assert events[-1]["type"] == "finished" and events[-1]["verdict"] == "faster"

    report = read_report(ws.eval_dir)
    assert report["backend"] == "sglang" and len(launched) == 4
    assert report["drafter"]["path"] == str((ws.drafter_dir / "export").resolve())
    assert report["settings"]["sglang_sweep"] == [[3, 1, 4], [2, 2, 4]] and report["settings"]["rounds"] == 2
    assert [lv["concurrency"] for lv in report["levels"]] == [1, 4]
    assert report["recommendation"]["stops_paying_at"] == 4
    assert not any("one round at concurrency 1" in n for n in report["notes"])

    class Host(App):
        def compose(self):
            yield EvaluationPane(report)

    for size in ((160, 50), (80, 40), (60, 40)):  # 60: the pane's width beside the Pipeline at 120x40
        app = Host()
        async with app.run_test(size=size) as pilot:
            await pilot.pause()
            text = screen_text(app)
            lines = [line.strip("│ ") for line in text.splitlines()]
            for conc, verdict in ((1, "faster"), (4, "slower")):
                assert any(line.split()[:1] == [str(conc)] and verdict in line for line in lines), (size, text)
            assert "steps 3 top-k 1 draft tokens 4" in text, (size, text)  # the best setting at 1, by name
            if size[0] <= 80:  # the compact table names the best setting by steps/top-k/draft, not steps alone
                assert any("speedup [95%]" in line and "best steps/k/draft" in line for line in lines), text
                assert any(line.split()[:1] == ["1"] and " 3/1/4 " in line for line in lines), text
                assert ("base→spec" in text) == (size[0] == 80), text  # at 60 the tok/s column gives way
            assert "serve without speculation" in text and "stops paying at concurrency 4" in text, text


SGLANG_EVAL_JOB = """
import time
from engine.jobs.context import JobContext
ctx = JobContext.from_env()
ctx.event("started", backend="sglang", prompts=8, rounds=2)
ctx.event("progress", unit="requests x rounds x servers", done=40, total=128, concurrency=4, round=1, rounds=2,
          server="eval-server-spec-3-1-4", setting="steps 3 top-k 1 draft tokens 4", acceptance_length=3.1,
          speedup=1.4, eta_s=30.0)
time.sleep(60)
"""


def test_running_sglang_evaluation_names_its_unit_and_server_in_the_stage(tmp_path):
    """A real evaluate-kind job reporting progress as the SGLang backend does: the `evaluate` check
    counts in its unit (every server's requests) and names the setting being measured."""

    from engine.checks.context import CheckContext
    from engine.checks.evaluate import check_evaluate
    from tests.helpers.jobs import start_job_and_wait
    from tests.helpers.workspaces import console_workspace

    ws = console_workspace(tmp_path)
    jobs, job = start_job_and_wait(ws, "evaluate", SGLANG_EVAL_JOB, b"progress")
    try:
        (result,) = check_evaluate(CheckContext(ws))
        assert result.evidence == (f"evaluation running (job {job.id}): 40/128 requests x rounds x servers, "
                                   "concurrency 4 round 1/2, server steps 3 top-k 1 draft tokens 4, acceptance "
                                   "length so far 3.10, median speedup so far 1.40×")
    finally:
        jobs.stop_sync(job.id, grace=5)
