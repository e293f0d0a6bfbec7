"""Evaluation: speculative decoding equals greedy, acceptance rises with training, report + stage gate, pane.

Everything runs for real on a tiny random Llama (hidden 64, 4 layers, vocab ~300, weights N(0, 0.2)):
transformers target with KV cache, our drafter, the real training loop on real records, the
evaluation as a real detached job. The SGLang backend cannot run here (no SGLang, no GPU): its argv
and reply/metrics parsing are tested here, its measurement in tests/test_evaluate_sglang.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from engine.evaluate.specdec import (  # noqa: E402
    DraftRunner,
    aux_features,
    greedy_decode,
    speculative_decode,
)
from tests.helpers.drafters import AUX, make_drafter, training_attention_reference  # noqa: E402

TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run ~8x faster on one thread than on two contended cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    from transformers import AutoTokenizer

    from tests.helpers.models import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("eval_target"))
    tok = AutoTokenizer.from_pretrained(str(path))
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def target(target_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(target_dir)).eval()


PROMPTS = [[5, 6, 7, 8, 9], [3], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51], [200, 17, 99, 3, 250, 8]]


def test_draft_runner_is_the_training_attention(target):
    """Flat-cache chain drafting gives the logits of Eagle3Drafter.draft_logits (the TTT forward)."""
    drafter = make_drafter(target)
    ids, aux, reference = training_attention_reference(target, drafter)
    with torch.no_grad():
        for n in (1, 6, 10):
            runner = DraftRunner(drafter)
            hidden = runner.extend(ids[:, 1:n + 1], drafter.project(aux[:, :n]))[:, -1:]
            for k in range(3):
                got = drafter.logits(hidden)[0, -1]
                assert torch.allclose(got, reference[k][0, n - 1], atol=1e-4), (n, k)
                hidden = runner.extend(ids[:, n + 1 + k:n + 2 + k], hidden)


@pytest.mark.parametrize("steps", [1, 3, 5])
def test_random_drafter_output_equals_greedy(target, steps):
    drafter = make_drafter(target, seed=steps)
    for prompt in PROMPTS:
        base = greedy_decode(target, prompt, 40)
        spec = speculative_decode(target, drafter, prompt, 40, steps, AUX)
        assert spec.tokens == base.tokens
        assert len(set(base.tokens)) > 5  # the target does not degenerate into one token
        assert spec.verify_steps >= (40 - 1) // (steps + 1)
        assert spec.acceptance_length == pytest.approx(len(spec.tokens) / spec.verify_steps)
        assert all(a >= b for a, b in zip(spec.accepted, spec.accepted[1:]))  # a chain: i+1 needs i


def test_half_precision_divergence_from_greedy_is_explained_in_the_report(target_dir, target):
    """In bfloat16 a verify forward and one-token decoding round differently, so outputs can part
    (float32: identical, the test above); the report says why instead of leaving it a mystery."""
    from transformers import AutoModelForCausalLM

    from engine.evaluate.local_eval import precision_note
    from engine.evaluate.report import PromptResult, first_mismatch

    half_target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.bfloat16).eval()
    drafter = make_drafter(target, seed=3).to(torch.bfloat16)
    drafter.d2t.data = drafter.d2t.data.to(torch.int64)
    results = []
    for i, prompt in enumerate(PROMPTS):
        base = greedy_decode(half_target, prompt, 60)
        spec = speculative_decode(half_target, drafter, prompt, 60, 3, AUX)
        results.append(PromptResult(id=str(i), prompt_tokens=len(prompt), completion_tokens=len(spec.tokens),
                                    verify_steps=spec.verify_steps, accepted=list(spec.accepted),
                                    spec_seconds=spec.seconds, base_seconds=base.seconds,
                                    base_completion_tokens=len(base.tokens),
                                    matches_greedy=spec.tokens == base.tokens,
                                    first_mismatch=first_mismatch(spec.tokens, base.tokens)))
    same = [PromptResult(**{**r.__dict__, "matches_greedy": True}) for r in results]
    one_differs = [PromptResult(**{**same[0].__dict__, "matches_greedy": False}), *same[1:]]
    assert precision_note("bfloat16", same) is None
    assert precision_note("float16", one_differs).startswith(f"1 of {len(PROMPTS)} outputs differ from greedy")
    assert precision_note("float32", one_differs) is None, "in float32 a difference is a bug, not rounding"
    differ = sum(1 for r in results if not r.matches_greedy)
    if differ == 0:  # bfloat16 rounding on a CPU depends on its instruction set and oneDNN
        pytest.skip("this CPU's bfloat16 kept every output equal to greedy: nothing to explain")
    assert precision_note("bfloat16", results).startswith(
        f"{differ} of {len(PROMPTS)} outputs differ from greedy: in bfloat16")


def test_stop_token_ends_both_decodes_identically(target):
    drafter = make_drafter(target)
    base = greedy_decode(target, PROMPTS[0], 40)
    stop = base.tokens[6]
    cut_base = greedy_decode(target, PROMPTS[0], 40, [stop])
    cut_spec = speculative_decode(target, drafter, PROMPTS[0], 40, 3, AUX, [stop])
    assert cut_spec.tokens == cut_base.tokens == base.tokens[:base.tokens.index(stop) + 1]


def test_oracle_drafter_equals_greedy_and_its_first_draft_is_always_accepted(target_dir):
    """Oracle-ish: a bigram target (every layer's o_proj/down_proj zeroed, so each hidden state is the
    token's embedding E[x]; LM-head row y = rmsnorm(E[perm^-1(y)]), so greedy follows x -> perm(x)),
    and a drafter that knows it: fc selects the third aux slice (E[x_t]), its layer adds nothing, and
    its LM head scores perm^2 — the token after next. So draft 1 is always right and later chain
    drafts only by chance: verify steps accept 1 or more drafts, never 0."""
    from transformers import AutoModelForCausalLM

    bigram = AutoModelForCausalLM.from_pretrained(str(target_dir)).eval()
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
    assert greedy_decode(bigram, [5], 4).tokens == [int(perm[5]), int(perm[perm[5]]), int(perm[perm[perm[5]]]),
                                                      int(perm[perm[perm[perm[5]]]])]
    drafter = make_drafter(bigram, draft_vocab=vocab, hot_ids=torch.arange(vocab))
    with torch.no_grad():
        drafter.fc.weight.zero_()
        drafter.fc.weight[:, 2 * h:] = torch.eye(h)
        drafter.midlayer.self_attn.o_proj.weight.zero_()
        drafter.midlayer.mlp.down_proj.weight.zero_()
        drafter.norm.weight.fill_(1.0)
        drafter.lm_head.weight.copy_(normed[inv[inv]])
    total_steps = total_first = 0
    for prompt in PROMPTS:
        base = greedy_decode(bigram, prompt, 40)
        spec = speculative_decode(bigram, drafter, prompt, 40, 3, AUX)
        assert spec.tokens == base.tokens
        total_steps += spec.verify_steps
        total_first += spec.accepted[0]
        assert spec.acceptance_length >= 1.9
    assert total_first == total_steps


# ----------------------------------------------------------------------------- the pipeline


def _build_workspace(root: Path, target_dir: Path, target):
    """A workspace with real extraction records of the target's own greedy replies to 8 prompts,
    and the same conversations as the held-out set."""
    from transformers import AutoTokenizer

    from engine.dataset.tokenize import prompt_ids
    from engine.records import append_manifest, save_token_counts, write_record, write_run_meta
    from engine.workspace import init_workspace

    ws = init_workspace(root)
    cfg = ws.config
    cfg.model.path = str(target_dir)
    cfg.model.dtype = "float32"
    cfg.server.device = "cpu"
    cfg.dataset.eval_path = "eval.jsonl"
    cfg.dataset.max_seq_len = 256
    cfg.train.epochs = 38
    cfg.train.learning_rate = 1e-2
    cfg.train.ttt_steps = 3
    cfg.train.draft_vocab_size = 200
    cfg.train.eval_fraction = 0.0
    cfg.train.save_every = 100000
    cfg.train.log_every = 100
    cfg.evaluate.num_prompts = 6
    cfg.evaluate.max_new_tokens = 40
    ws.save_config(cfg)
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    run_dir = ws.hidden_dir
    counts = torch.zeros(target.config.vocab_size, dtype=torch.int64)
    lines = []
    words = ["hello", "tokens", "paris", "draft", "laptop", "states", "model", "pass"]
    for i in range(8):
        messages = [{"role": "user", "content": f"{words[i]} {words[(i * 3) % 8]} {i}"}]
        ids = prompt_ids(tok, messages)
        reply = greedy_decode(target, ids, 40).tokens
        full = torch.tensor([ids + reply])
        with torch.no_grad():
            out = target(input_ids=full, output_hidden_states=True)
        mask = torch.zeros(full.shape[1], dtype=torch.int64)
        mask[len(ids):] = 1
        entry = write_record(run_dir, i, f"s{i:03d}", full[0], mask, aux_features(out.hidden_states, AUX)[0],
                             out.hidden_states[-1][0])
        append_manifest(run_dir, entry)
        counts += torch.bincount(torch.tensor(reply), minlength=counts.shape[0])
        lines.append(json.dumps({"id": f"s{i:03d}", "messages": messages + [
            {"role": "assistant", "content": tok.decode(reply)}]}))
    save_token_counts(run_dir, counts)
    write_run_meta(run_dir, {"num_samples": 8, "hidden_size": target.config.hidden_size, "layers": [0, 1, 2],
                             "layers_sglang": AUX})
    (ws.root / "eval.jsonl").write_text("\n".join(lines) + "\n")
    return ws


def _run_job(ws) -> tuple[dict, list[dict]]:
    """The evaluate stage's job, started the way the console starts it; returns (report, events)."""
    from engine.evaluate.report import read_report
    from engine.jobs.manager import JobManager
    from engine.registry import start_evaluate

    jobs = JobManager(ws.jobs_dir)
    job = start_evaluate(ws, jobs)
    deadline = time.monotonic() + 90
    while jobs.get(job.id).state in ("starting", "running"):
        assert time.monotonic() < deadline, jobs.tail(job.id, 30)
        time.sleep(0.2)
    info = jobs.get(job.id)
    assert info.state == "succeeded", jobs.tail(job.id, 30)
    events, _ = jobs.events(job.id)
    return read_report(ws.eval_dir), events


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, target_dir, target):
    """Untrained export -> evaluate job -> report; real Trainer -> export -> evaluate job -> report."""
    from engine.train.export import export_drafter
    from engine.train.loop import Trainer

    torch.set_num_threads(1)
    ws = _build_workspace(tmp_path_factory.mktemp("ws"), target_dir, target)
    trainer = Trainer(ws, device="cpu")
    trainer.setup()  # same shape, vocabulary and seed as the trained one, no steps
    untrained = trainer.model
    export_dir = ws.drafter_dir / "export"
    export_drafter(untrained, export_dir)
    untrained_report, _ = _run_job(ws)
    for leftover in ws.drafter_dir.iterdir():  # a fresh training run in the same place
        if leftover.is_file():
            leftover.unlink()
    assert Trainer(ws, device="cpu").run() == 0
    trained_report, events = _run_job(ws)
    return ws, untrained_report, trained_report, events


def test_trained_drafter_accepts_more_than_untrained(pipeline):
    """Measured on the prompts whose records it trained on: a tiny random target has no structure
    that generalises to new prompts, but any misalignment between training and decoding (layer ids,
    shift, positions, d2t) would keep the trained drafter at the untrained level."""
    _, untrained, trained, events = pipeline
    assert untrained["overall"]["acceptance_length"] < 1.3
    assert trained["overall"]["acceptance_length"] > untrained["overall"]["acceptance_length"] + 0.4
    for report in (untrained, trained):
        o = report["overall"]
        assert o["prompts"] == 6 and o["greedy_matches"] == o["greedy_compared"] == 6
        assert o["spec_tokens_per_s"] > 0 and o["base_tokens_per_s"] > 0
        assert len(o["position_accept"]) == 3
        assert o["position_accept"][0] >= o["position_accept"][1] >= o["position_accept"][2]
        assert o["acceptance_length"] == pytest.approx(o["completion_tokens"] / o["verify_steps"])
        # Measured with its noise: 3 rounds, concurrency 1 and 4 (16 > 6 prompts: skipped, said so), steps 1-5.
        assert [lv["concurrency"] for lv in report["levels"]] == [1, 4]
        assert any("concurrency 16 skipped" in n for n in report["notes"])
        for level in report["levels"]:
            assert [s["spec_steps"] for s in level["settings"]] == [1, 2, 3, 4, 5]
            for s in level["settings"]:
                assert s["greedy_matches"] == s["greedy_compared"] > 0  # batched rows equal greedy too
                lo, hi = s["speedup"]["interval"]
                assert lo <= s["speedup"]["median"] <= hi
                assert s["speedup"]["verdict"] in ("faster", "slower", "inconclusive")
        m = report["measurement"]
        assert m["concurrency"] == 1 and m["spec_steps"] == 3 and m["speedup"]["samples"] == 6 * 3
        assert m["break_even"] > 0 and report["load"]["cpus"] >= 1
        assert report["recommendation"]["swept"] == [1, 2, 3, 4, 5]
    progress = [e for e in events if e["type"] == "progress"]
    assert progress[-1]["done"] == progress[-1]["total"] == (6 + 4) * 3  # requests x rounds, both levels
    assert {e["concurrency"] for e in progress} == {1, 4} and progress[-1]["acceptance_length"] > 1.0


def test_report_identity_and_final_event_table(pipeline):
    from engine.evaluate.report import file_sha256, render_table

    ws, _, trained, events = pipeline
    weights = ws.drafter_dir / "export" / "model.safetensors"
    assert trained["drafter"]["sha256"] == file_sha256(weights)
    assert trained["drafter"]["config_sha256"] == file_sha256(weights.parent / "config.json")
    assert trained["drafter"]["signed"] is True  # the export's own manifest.json vouches for both hashes
    assert trained["target"]["config_sha256"] == file_sha256(ws.model_dir / "config.json")
    assert Path(trained["drafter"]["path"]) == weights.parent.resolve()
    finished = [e for e in events if e["type"] == "finished"]
    assert finished and finished[0]["table"] == render_table(trained)
    assert "acceptance per draft position" in finished[0]["table"] and "█" in finished[0]["table"]
    assert not list(ws.eval_dir.glob("*.tmp*"))  # atomic write left no temp file


def test_stage_gate_follows_the_current_export_and_speed(pipeline):
    """The report's timing is edited (marked below) to test both sides of the 1.0x rule
    deterministically: the measured CPU speedup of a tiny model depends on the machine's load."""
    import shutil

    from engine.checks.base import StageState, Status, stage_state
    from engine.checks.context import CheckContext
    from engine.checks.evaluate import check_evaluate
    from engine.evaluate.report import SLOWER, PromptResult, build_report, read_report, render_table, write_report

    ws, untrained, trained, _ = pipeline
    ctx = CheckContext(ws)
    report = read_report(ws.eval_dir)

    def with_base_seconds(factor: float) -> dict:
        edited = json.loads(json.dumps(report))
        fields = PromptResult.__dataclass_fields__
        prompts = [PromptResult(**{k: v for k, v in p.items() if k in fields}) for p in edited["prompts"]]
        for p in prompts:
            p.base_seconds = p.spec_seconds * factor  # EDITED timing
        return build_report(backend="local", drafter=edited["drafter"], target=edited["target"],
                            settings=edited["settings"], prompts=prompts, load=edited["load"])

    fast = with_base_seconds(1.5)
    write_report(ws.eval_dir, fast)
    results = {r.name: r for r in check_evaluate(ctx)}
    assert results["drafter"].status is Status.PASS
    assert results["greedy"].status is Status.PASS
    assert results["speedup"].status is Status.PASS and "1.50× [1.47–1.53]" in results["speedup"].evidence
    assert stage_state(list(results.values())) is StageState.PASSED

    slow = with_base_seconds(0.66)
    write_report(ws.eval_dir, slow)
    results = {r.name: r for r in check_evaluate(ctx)}
    assert results["speedup"].status is Status.FAIL and SLOWER in results["speedup"].evidence
    assert "break-even" in results["speedup"].fix
    assert stage_state(list(results.values())) is StageState.FAILED
    table = render_table(slow)
    assert SLOWER in table and "0.66×" in table

    # The export changes (a new training run re-exports): the report no longer counts.
    write_report(ws.eval_dir, fast)
    export = ws.drafter_dir / "export"
    backup = ws.drafter_dir.parent / "export-backup"
    shutil.copytree(export, backup)
    try:
        from engine.train.export import export_drafter, load_export

        drafter = load_export(export)
        with torch.no_grad():
            drafter.norm.weight.mul_(1.01)
        export_drafter(drafter, export)
        results = check_evaluate(ctx)
        assert results[0].name == "drafter" and results[0].status is Status.WARN  # amber: stale
        assert "stale" in results[0].evidence and "model.safetensors changed" in results[0].evidence
        assert stage_state(results) is StageState.WARNED
    finally:
        shutil.rmtree(export)
        shutil.copytree(backup, export)
    assert check_evaluate(ctx)[0].status is Status.PASS


def test_missing_report_and_missing_export_fail_with_a_fix(tmp_path):
    from engine.checks.base import Status
    from engine.checks.context import CheckContext
    from engine.checks.evaluate import check_evaluate
    from engine.workspace import init_workspace

    ws = init_workspace(tmp_path / "ws")
    results = check_evaluate(CheckContext(ws))
    assert results[0].status is Status.FAIL and "run train" in results[0].fix
    (ws.drafter_dir / "export").mkdir(parents=True)
    (ws.drafter_dir / "export" / "model.safetensors").write_bytes(b"x")
    results = check_evaluate(CheckContext(ws))
    assert results[0].name == "report" and "run evaluate" in results[0].fix


def test_job_without_an_export_names_the_stage_to_run(tmp_path, capsys):
    from engine.evaluate.job import main
    from engine.workspace import init_workspace

    ws = init_workspace(tmp_path / "ws")
    assert main(["--workspace", str(ws.root)]) == 2
    assert "train stage" in capsys.readouterr().out  # no export yet: names the stage to run


def test_report_constants_match_the_export_module():
    from engine.evaluate import report
    from engine.train import export

    assert (report.EXPORT_DIR, report.WEIGHTS, report.CONFIG, report.MANIFEST) == (
        export.EXPORT_DIR, export.WEIGHTS, export.CONFIG, export.MANIFEST)


# ----------------------------------------------------------------------------- SGLang (argv + parsing only)


def test_sglang_speculative_argv_replaces_any_speculative_flags():
    from engine.evaluate.sglang_eval import SglangEvalError, speculative_argv, strip_speculative

    base = [sys.executable, "-m", "sglang.launch_server", "--model-path", "/m", "--port", "30001",
            "--speculative-algorithm", "NEXTN", "--speculative-num-steps=2", "--disable-radix-cache"]
    assert strip_speculative(base) == base[:7] + ["--disable-radix-cache"]
    argv = speculative_argv(base, "/ws/drafters/run1/export", 3, 1, 4)
    assert argv[:8] == base[:7] + ["--disable-radix-cache"]
    assert argv[8:] == ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path",
                        "/ws/drafters/run1/export", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
                        "--speculative-num-draft-tokens", "4"]
    assert argv.count("--speculative-algorithm") == 1
    with pytest.raises(SglangEvalError, match="spec_steps"):
        speculative_argv(base, "/x", 0, 1, 4)


def test_sglang_launch_spec_extension(tmp_path, target_dir):
    """With the SGLang launcher of this build (SGLang itself is absent: version and GPU given):
    capture off, then our flags appended."""
    launch = pytest.importorskip("engine.sglang.launch")
    from engine.evaluate.sglang_eval import speculative_argv
    from engine.workspace import init_workspace

    ws = init_workspace(tmp_path / "ws")
    cfg = ws.config
    cfg.model.path = str(target_dir)
    cfg.model.backend = "sglang"
    ws.save_config(cfg)
    spec = launch.build_sglang_spec(ws, capture=False, port=31234, version="0.5.23", compute_capability=(9, 0))
    argv = speculative_argv(spec.argv, ws.drafter_dir / "export", 3, 1, 4)
    assert "--speculative-draft-model-path" in argv and "31234" in argv
    assert not any("forward-hooks" in a for a in argv)


def test_sglang_meta_and_metrics_parsing():
    from engine.evaluate.sglang_eval import metrics_accept_length, parse_spec_meta

    old = parse_spec_meta({"completion_tokens": 40, "spec_verify_ct": 16, "spec_accept_length": 2.5,
                           "spec_accept_histogram": [4, 6, 3, 3]}, 40)
    assert (old.completion_tokens, old.verify_steps, old.accept_length) == (40, 16, 2.5)
    assert old.accepted == [12, 6, 3]  # position i accepted in steps that accepted > i drafts
    new = parse_spec_meta({"completion_tokens": 30, "spec_verify_ct": 10,
                           "spec_correct_drafts_histogram": [2, 8]}, 30)
    assert new.accept_length == 3.0 and new.accepted == [8]
    bare = parse_spec_meta({"completion_tokens": 12}, 12)
    assert bare.verify_steps == 0 and bare.accept_length is None and bare.accepted == []
    text = ("# HELP sglang:spec_accept_length x\n# TYPE sglang:spec_accept_length gauge\n"
            'sglang:spec_accept_length{model_name="m",tp_rank="0"} 2.0\n'
            'sglang:spec_accept_length{model_name="m",tp_rank="1"} 3.0\n'
            "sglang:spec_accept_length_other 9\nsglang:gen_throughput 100\n")
    assert metrics_accept_length(text) == 2.5
    assert metrics_accept_length("sglang:gen_throughput 1\n") is None


# ----------------------------------------------------------------------------- rendering and pane


def _sample_report(speedup_base: float) -> dict:
    from engine.evaluate.report import PromptResult, build_report

    prompts = [PromptResult("s000", 10, 40, 20, [14, 6, 2], 1.0, speedup_base, 40, True, None),
               PromptResult("s001", 12, 30, 15, [9, 4, 1], 1.0, speedup_base, 30, False, 17)]
    return build_report(backend="local", drafter={"path": "/ws/drafters/run1/export", "sha256": "ab" * 32},
                        target={"dtype": "bfloat16"}, settings={"spec_steps": 3, "spec_topk": 1,
                                                                "spec_draft_tokens": 4, "max_new_tokens": 40},
                        prompts=prompts, notes=["a note"])


def test_render_table_text():
    from engine.evaluate.report import render_table

    slow = render_table(_sample_report(0.8))
    assert "slower than no speculation" in slow and "0.80×" in slow
    assert "differs at 17" in slow and "1/2" in slow
    assert "draft  1  " in slow and "65.7%" in slow  # 23/35 verify steps accepted draft 1
    fast = render_table(_sample_report(1.4))
    assert "slower" not in fast and "1.40× [1.37–1.43] faster than no speculation" in fast


async def test_evaluation_pane_renders_report_and_red_verdict():
    from textual.app import App
    from textual.widgets import Static

    from eagle3_console.panes.evaluation import EvaluationPane

    class Host(App):
        def compose(self):
            yield EvaluationPane()

    app = Host()
    async with app.run_test(size=(130, 40)) as pilot:
        pane = app.query_one(EvaluationPane)
        text = lambda wid: str(app.query_one(f"#{wid}", Static).render())  # noqa: E731
        assert "no evaluation yet" in text("evaluation-header")
        pane.show_report(_sample_report(0.8))
        await pilot.pause()
        verdict = app.query_one("#evaluation-verdict", Static)
        assert "slower than no speculation" in text("evaluation-verdict") and verdict.has_class("-slower")
        assert "overall" in text("evaluation-table") and "s001" in text("evaluation-table")
        assert "█" in text("evaluation-positions") and "65.7%" in text("evaluation-positions")
        pane.show_report(_sample_report(1.4))
        await pilot.pause()
        assert "faster than no speculation" in text("evaluation-verdict") and not verdict.has_class("-slower")


def test_pane_and_report_do_not_import_torch():
    code = ("import sys; import eagle3_console.panes.evaluation, engine.evaluate.report, engine.checks.evaluate; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_an_export_with_wrong_layer_ids_cannot_pass_evaluation(pipeline, tmp_path):
    """The off-by-one SGLang would serve (ids one too high for a Llama target) is refused by name
    while the records exist; ids that select other layers, with the records gone, make the drafter
    read the wrong states and its acceptance length collapses (a 4-layer target has only three
    capturable layers, so 'other layers' is the same three in another order)."""
    import shutil

    from engine.jobs.manager import JobManager
    from engine.registry import start_evaluate
    from engine.workspace import Workspace

    ws, untrained, trained, _ = pipeline
    copy = Workspace(shutil.copytree(ws.root, tmp_path / "ws", ignore=shutil.ignore_patterns("jobs", "eval")))
    config = copy.drafter_dir / "export" / "config.json"

    def write_ids(ids):
        data = json.loads(config.read_text())
        data["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = ids
        config.write_text(json.dumps(data))
        (config.parent / "manifest.json").unlink(missing_ok=True)  # hand-edited: no longer signed

    write_ids([1, 2, 3])
    jobs = JobManager(copy.jobs_dir)
    job = start_evaluate(copy, jobs)
    deadline = time.monotonic() + 90
    while jobs.get(job.id).state in ("starting", "running"):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert jobs.get(job.id).state == "failed"
    assert "serve the outputs of decoder layers [1, 2, 3] on LlamaForCausalLM, but its records hold layers " \
           "[0, 1, 2]" in "\n".join(jobs.tail(job.id, 30))

    write_ids([2, 1, 0])
    (copy.hidden_dir / "run.json").rename(copy.hidden_dir / "run.json.away")
    report, _ = _run_job(copy)
    wrong = report["overall"]["acceptance_length"]
    assert wrong < trained["overall"]["acceptance_length"] - 0.3, (wrong, trained["overall"])
