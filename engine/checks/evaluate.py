"""Stage `evaluate`: green only with a report measured for the CURRENT drafter export and target,
with output equal to greedy decoding and speculation measurably faster than none.

The speedup check follows the report's three-way verdict (engine.evaluate.stats): green when the
95 % interval of the median speedup lies above 1.0, red below, amber when it straddles 1.0 (the
measurement cannot tell). A report of another export or target is amber "stale"."""

from __future__ import annotations

import math
from typing import Any

from engine.checks.base import CheckResult, failed, passed, warned
from engine.checks.context import CheckContext

RUN_FIX = "run the evaluation: `eagle3-console run evaluate`"


def _running(ws, job) -> str:
    """`evaluation running (job X)` plus its newest progress: requests x rounds done, running acceptance."""
    from engine.jobs.events import Progress
    from engine.jobs.manager import JobManager

    text = f"evaluation running (job {job.id})"
    try:
        events, _ = JobManager(ws.jobs_dir).read_events(job.id)
    except Exception:  # progress is a courtesy; the job's state is the fact
        return text
    last = next((e for e in reversed(events) if isinstance(e, Progress)), None)
    if last is None:
        return text
    parts = [f"{last.done}/{last.total} {last.unit or 'requests x rounds'}"]
    if last.concurrency is not None:
        parts.append(f"concurrency {last.concurrency} round {last.round}/{last.rounds}")
    if last.setting:  # SGLang backend: the server measured now
        parts.append(f"server {last.setting}")
    if last.acceptance_length is not None and math.isfinite(last.acceptance_length):
        parts.append(f"acceptance length so far {last.acceptance_length:.2f}")
    if last.speedup is not None and math.isfinite(last.speedup):
        parts.append(f"median speedup so far {last.speedup:.2f}×")
    return text + ": " + ", ".join(parts)


def check_evaluate(ctx: CheckContext) -> list[CheckResult]:
    from engine.evaluate import stats
    from engine.evaluate.report import (
        EXPORT_DIR,
        WEIGHTS,
        ReportError,
        fix_line,
        fmt_num,
        read_report,
        recommendation_lines,
        stale_reasons,
        verdict,
        verdict_kind,
    )
    from engine.jobs.manager import JobManager

    ws = ctx.workspace
    active = JobManager(ws.jobs_dir).active("evaluate")
    if active:
        return [failed("report", _running(ws, active[0]), "wait for it to finish")]
    weights = ws.drafter_dir / EXPORT_DIR / WEIGHTS
    if not weights.is_file():
        return [failed("drafter", f"no drafter export at {weights.parent}",
                       "train a drafter first: `eagle3-console run train`")]
    try:
        report = read_report(ws.eval_dir)
    except ReportError as exc:
        return [failed("report", str(exc), RUN_FIX)]
    results: list[CheckResult] = []
    measured = report.get("drafter") or {}
    stale = stale_reasons(report, weights.parent, ws.model_dir)
    if stale:
        return [warned("drafter", "stale: the report no longer describes what would be served: " + "; ".join(stale),
                       "re-run the evaluation for the current drafter and target: " + RUN_FIX)]
    target = (report.get("target") or {}).get("config_sha256")
    results.append(passed("drafter", f"report is for the current export {weights.parent} (sha256 "
                                     f"{str(measured.get('sha256'))[:12]}…)"
                                     + (f" and target (config.json sha256 {target[:12]}…)" if target else "")))
    o = report["overall"]
    results.append(_correctness(report))
    rates = " ".join(f"{r * 100:.0f}%" for r in o.get("position_accept") or [])
    al = o.get("acceptance_length")
    m = report.get("measurement") or {}
    if al is None:
        results.append(failed("acceptance", "no verify step was measured (every prompt stopped at once?)",
                              "raise evaluate.max_new_tokens, or check the held-out prompts"))
    else:
        be = m.get("break_even")
        results.append(passed("acceptance", f"acceptance length {fmt_num(al)} over {o.get('prompts')} prompts "
                                            f"({o.get('completion_tokens')} tokens, {o.get('verify_steps')} "
                                            f"verify steps)" + (f"; per draft position {rates}" if rates else "")
                                            + (f"; break-even {be:.2f} at the measured step costs" if be else "")))
    kind = verdict_kind(report)
    text = verdict(report)
    if kind is None:
        results.append(failed("speedup", "speedup not measured", RUN_FIX))
    elif kind == stats.SLOWER:
        results.append(failed("speedup", text, fix_line(report) or
                              "a drafter this weak costs more than it saves: train longer or on more (regenerated) "
                              "data, check the aux layer ids, or lower evaluate.spec_steps"))
    elif kind == stats.INCONCLUSIVE:
        results.append(warned("speedup", text, fix_line(report) or "re-run on an idle machine"))
    else:
        results.append(passed("speedup", text))
    levels = report.get("levels") or []
    if len(levels) > 1 or (report.get("recommendation") or {}).get("swept"):
        per = "; ".join(f"{lv['concurrency']}: {_level_verdict(lv)}" for lv in levels)
        rec = recommendation_lines(report)
        results.append(passed("concurrency", f"per concurrency (configured steps): {per}"
                              + (". " + " ".join(line.strip() for line in rec[1:]) if rec else "")))
    return results


def _level_verdict(level: dict) -> str:
    from engine.evaluate.report import best_setting, setting_of
    from engine.evaluate.stats import fmt_interval

    s = setting_of(level, level.get("configured")) or best_setting(level.get("settings") or []) or {}
    sp = s.get("speedup") or {}
    return f"{fmt_interval(sp)} {sp.get('verdict') or '—'}"


def _correctness(report: dict) -> CheckResult:
    o = report["overall"]
    compared, matches = o.get("greedy_compared") or 0, o.get("greedy_matches") or 0
    if not compared:
        return warned("greedy", "outputs were not compared with plain greedy decoding", RUN_FIX)
    if matches == compared:
        return passed("greedy", f"speculative output = greedy output on {matches}/{compared} prompts")
    bad: dict[str, Any] = next((p for p in report.get("prompts") or [] if p.get("matches_greedy") is False), {})
    evidence = (f"speculative output differs from greedy on {compared - matches}/{compared} prompts "
                f"(first: {bad.get('id')} at token {bad.get('first_mismatch')})")
    dtype = (report.get("target") or {}).get("dtype")
    if dtype == "float32":  # exact arithmetic leaves no near-tie excuse: the pipeline is wrong
        return failed("greedy", evidence, "a bug in speculative decoding or the drafter export; report it")
    return warned("greedy", evidence + "; in reduced precision a batched verify can flip near-tied tokens",
                  "rerun with model.dtype = \"float32\" to tell numerics from a bug")
