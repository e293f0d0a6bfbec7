"""Stage `train`: green only when the SGLang export exists, its config.json is right, its weight
names/shapes are exactly SGLang's llama_eagle3 checkpoint layout (our table in engine/train/export.py,
held to SGLang's real load_weights by tests/test_sglang_judge.py), both files hash to what
manifest.json signed at export and every weight is finite; amber for an unsigned export (no
manifest: written by an older version) whose weights are finite; red with the reason
when the last run of the drafter failed (the `failed` line engine.train.loop writes at the end
of metrics.jsonl, e.g. for non-finite loss or gradients; a resume trims it)."""

from __future__ import annotations

import json
from pathlib import Path

from engine.checks.base import CheckResult, failed, passed, warned
from engine.checks.context import CheckContext

START_FIX = "start training: `eagle3-console run train` (a stopped run resumes from its last checkpoint)"
LAYOUT = ("names and shapes of SGLang's LlamaForCausalLMEagle3 checkpoint layout (our table, held to SGLang's "
          "real load_weights by tests/test_sglang_judge.py)")


def _last_record(metrics_path) -> dict | None:
    """The last complete metrics line with a step (a torn or foreign line is skipped)."""
    try:
        lines = metrics_path.read_text().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            record = json.loads(line)
            int(record["step"])
        except (ValueError, KeyError, TypeError):
            continue
        return record
    return None


def _num(value) -> str:
    """A logged number ("NaN"/"Infinity" are how a non-finite one is logged) as the message spells it."""
    try:
        return f"{float(value):.4g}"
    except (TypeError, ValueError):
        return "?"


def _failure(last: dict | None) -> str | None:
    if not last or last.get("type") != "failed":
        return None
    if last.get("reason") == "nonfinite":
        streak = last.get("streak", "?")
        return (f"training stopped at step {last['step']}: loss {_num(last.get('loss'))}, grad norm "
                f"{_num(last.get('grad_norm'))} (lr {_num(last.get('lr'))}) for {streak} step(s) in a row "
                f"from step {last.get('first_step', '?')}, not applied")
    return str(last.get("message") or f"training failed at step {last['step']} ({last.get('reason', '?')})")


def _mode_text(ctx: CheckContext) -> str:
    """Which mode trained the drafter (data.json beside it), or, before any run, what the configured mode
    will cost: prefill per epoch (at the last capture rate measured) against the disk an offline run needs."""
    from engine.system.disk import fmt_bytes

    try:
        note = json.loads((ctx.workspace.drafter_dir / "data.json").read_text())
    except (OSError, ValueError):
        note = None
    if isinstance(note, dict) and note.get("mode") == "offline":
        return f"trained offline from the records in {note.get('records', '?')}"
    if isinstance(note, dict) and note.get("mode") in ("online", "hybrid"):
        peak = note.get("window_peak")
        used = f", at most {fmt_bytes(int(peak))} used" if isinstance(peak, int) else ""
        return (f"trained {note['mode']} (captured from the server while training): window "
                f"{fmt_bytes(int(note.get('window_budget') or 0))}{used}, {int(note.get('captured') or 0):,} "
                f"captures; an offline run would have stored {fmt_bytes(int(note.get('offline_bytes') or 0))}")
    return _estimate(ctx)


def _estimate(ctx: CheckContext) -> str:
    cfg = ctx.config
    from engine.checks.disk import estimate_tokens
    from engine.system.disk import bytes_per_token, fmt_bytes
    from engine.model.target import TargetError, plan_target
    from engine.train.window import window_budget

    try:
        hidden = plan_target(ctx.workspace.model_dir, list(cfg.model.capture_layers)).hidden_size
    except TargetError:
        return f"train.mode = {cfg.train.mode}"
    tokens, _ = estimate_tokens(ctx)
    offline = fmt_bytes(tokens * bytes_per_token(hidden, ctx.config.extract.aux_format))
    if cfg.train.mode == "offline":
        return f"train.mode = offline: trains from the extraction's records ({offline} for {tokens:,} tokens)"
    from engine.train.window import last_capture_rate

    rate = last_capture_rate(ctx.workspace)
    prefill = (f"≈{tokens / rate:,.0f} s of prefill per epoch at {rate:,.0f} tok/s (the last capture rate measured)"
               if rate else "prefill time per epoch unknown until a capture rate is measured (an extraction or "
                            "online training job)")
    return (f"train.mode = {cfg.train.mode}: each epoch captures its {tokens:,} tokens again, {prefill}, within a "
            f"{fmt_bytes(window_budget(cfg))} window, instead of the {offline} an offline extraction would store")


RETRAIN_FIX = ("point model.path back at the weights the drafter was trained against, or train one for this model: "
               "new extract.run and train.run names, then extract and train")


def _trained_for_other_weights(export: Path, model_dir: Path) -> str | None:
    from engine.model.weights_id import readable_weights_id
    from engine.train.export import trained_for

    trained = trained_for(export)
    if trained is None:
        return None
    current = readable_weights_id(model_dir)
    if current is None or current == trained:
        return None
    return (f"{export}: trained against target weights {trained}, but model.path {model_dir} holds weights "
            f"{current}")


def check_train(ctx: CheckContext) -> list[CheckResult]:
    from engine.jobs.manager import JobManager
    from engine.train import checkpoint as ckpt
    from engine.train.export import CONFIG, EXPORT_DIR, MANIFEST, SIGN_FIX, verify_export

    out = ctx.workspace.drafter_dir
    export = out / EXPORT_DIR
    active = JobManager(ctx.workspace.jobs_dir).active("train")
    last = _last_record(out / "metrics.jsonl")
    steps = int(last["step"]) if last else None
    best = ckpt.best(out) or {}
    progress = (f"{steps} steps" if steps is not None else "no steps logged") + (
        f", best simulated acceptance length {best['sim_al']:.3f} (step {best['step']})" if best else "")
    progress += f"; {_mode_text(ctx)}"
    failure = _failure(last)
    if failure and not active:
        earlier = f"; the export in {export} is from an earlier run" if (export / CONFIG).is_file() else ""
        latest = ckpt.latest(out)
        resume = f"it resumes from the checkpoint of step {latest['step']}" if latest else "it starts again"
        fix = (f"lower train.learning_rate or set train.grad_clip, then `eagle3-console run train` ({resume})"
               if (last or {}).get("reason") == "nonfinite" else START_FIX)
        return [failed("run", f"{failure}{earlier}", fix)]
    if not (export / CONFIG).is_file():
        if active:
            return [failed("export", f"training running (job {active[0].id}): {progress}", "wait for it to finish")]
        return [failed("export", f"no export in {export}; {progress}", START_FIX)]
    verdict = verify_export(export)
    if verdict.problems:
        return [failed("export", f"{export}: {'; '.join(verdict.problems[:3])}",
                       f"re-export: {SIGN_FIX}; if the new export is refused too, report a bug")]
    other_target = _trained_for_other_weights(export, ctx.workspace.model_dir)
    if other_target:  # SGLang would load it; it predicts a model this workspace no longer serves
        return [failed("export", other_target, RETRAIN_FIX)]
    finite = f"all {verdict.values:,} weights finite"
    if verdict.signed:
        results = [passed("export", f"{export}: config.json and weights match the {LAYOUT}; sha256 "
                                    f"{verdict.sha256[:12]}… as signed at export in {MANIFEST}, {finite}; {progress}")]
    else:
        results = [warned("export", f"{export}: unverified: no {MANIFEST} (exported by an older version, or the "
                                    f"export stopped before signing it), so nothing says these are the bytes "
                                    f"training wrote; {finite}; config.json and weights match the {LAYOUT}; "
                                    f"{progress}", f"sign it: {SIGN_FIX}")]
    if active:
        results.append(failed("job", f"training job {active[0].id} still running; the export may be replaced",
                              "wait for it to finish"))
    return results
