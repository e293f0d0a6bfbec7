"""Stage `extract`: green when the manifest covers every sample and every record verifies."""

from __future__ import annotations

import json

from engine.checks.base import CheckResult, failed, passed, warned
from engine.checks.context import CheckContext
from engine.model.weights_id import WEIGHTS_FIX, readable_weights_id, weights_mismatch
from engine.system.disk import fmt_bytes

START_FIX = "start the extraction: `eagle3-console run extract` or `s` on the Extraction pane"


def check_extract_stage(ctx: CheckContext) -> list[CheckResult]:
    """The stage's check. train.mode = online/hybrid captures during training: no extraction is needed, and
    the stage says so (with where the window lives) instead of asking for one; offline, `check_extract`."""
    from engine.registry import online_training
    from engine.train.window import window_budget, window_dir

    cfg = ctx.config
    if not online_training(cfg):
        return check_extract(ctx)
    return [passed("mode", f"not needed: train.mode = {cfg.train.mode!r} captures the states from the server "
                           f"while training, into {window_dir(ctx.workspace)} (at most "
                           f"{fmt_bytes(window_budget(cfg))}, train.window_gb); set train.mode = \"offline\" "
                           "to train from extracted records")]


def check_extract(ctx: CheckContext) -> list[CheckResult]:
    from engine.extract.job import BAD_FIX, bad_summary
    from engine.extract.layout import COMPLETE
    from engine.extract.verify import check_run
    from engine.jobs.manager import JobManager
    from engine.records import RecordError, read_run_meta

    run_dir = ctx.workspace.hidden_dir
    active = JobManager(ctx.workspace.jobs_dir).active("extract")
    try:
        meta = read_run_meta(run_dir)
    except RecordError as exc:
        if active:
            return [failed("run", f"extraction job {active[0].id} is planning the run", "wait for it")]
        return [failed("run", str(exc), START_FIX)]
    mismatch = weights_mismatch(meta, ctx.workspace.model_dir, readable_weights_id(ctx.workspace.model_dir))
    if mismatch:  # every other row would vouch for records of a model nobody trains against
        return [failed("run", f"{run_dir}: {mismatch}", WEIGHTS_FIX)]
    results = [passed("run", f"{run_dir}: {meta.get('num_samples')} samples planned, H={meta.get('hidden_size')}, "
                             f"layers {meta.get('layers')} (SGLang layer ids {meta.get('sglang_layer_ids', '?')} "
                             f"for {meta.get('architecture', '?')})")]
    check = check_run(run_dir, meta.get("hidden_size"))
    planned = int(meta.get("num_samples") or 0)
    try:
        complete = json.loads((run_dir / COMPLETE).read_text())
    except (OSError, ValueError):
        complete = None
    bad_entries = [(i, r) for i, r in _bad_entries(run_dir) if i not in check.good]  # a resume may have redone some
    bad = len(bad_entries)
    covered = len(check.good)
    too_many = None if active else bad_summary(bad_entries, planned, covered)
    if too_many:  # first: the row names it (a run that "succeeded" with nothing is a failure)
        results.append(failed("bad", too_many, BAD_FIX))
    if active:
        results.append(failed("coverage", f"extraction running (job {active[0].id}): {covered}/{planned} samples",
                              "wait for the job to finish"))
    elif complete is None:
        results.append(failed("coverage", f"{covered}/{planned} samples recorded; the run has not finished",
                              "resume it: " + START_FIX))
    elif covered + bad < planned:
        results.append(failed("coverage", f"{covered} records + {bad} bad < {planned} planned",
                              "resume the extraction to redo the missing samples"))
    else:
        results.append(passed("coverage", f"{covered}/{planned} samples, {check.tokens:,} tokens, "
                                          f"{fmt_bytes(check.bytes)}"))
    if check.problems:
        results.append(failed("verify", f"{len(check.problems)} problem(s): {check.problems[0]}",
                              "resume the extraction: damaged records are detected and redone"))
    else:
        results.append(passed("verify", f"{check.checked} records checked, {check.deep_checked} re-hashed: all intact"))
    if bad and not too_many:
        results.append(warned("bad", f"{bad} sample(s) failed after retries (see bad.jsonl)",
                              "inspect bad.jsonl; resuming retries them"))
    return results


def _bad_entries(run_dir) -> list[tuple[str, str]]:
    """(id, reason) of every line of bad.jsonl."""
    try:
        lines = (run_dir / "bad.jsonl").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            out.append((str(row.get("id")), str(row.get("reason", ""))))
        except (ValueError, AttributeError):
            out.append(("?", "unreadable line in bad.jsonl"))
    return out
