"""Stage `evaluate`: green only with a report measured for the CURRENT drafter export, with output
equal to greedy decoding and speculation at least as fast as none."""

from __future__ import annotations

from pathlib import Path

from engine.checks.base import CheckResult, failed, passed, warned
from engine.checks.context import CheckContext

RUN_FIX = "run the evaluation: `eagle3-console run evaluate`"


def check_evaluate(ctx: CheckContext) -> list[CheckResult]:
    from engine.evaluate.report import EXPORT_DIR, SLOWER, WEIGHTS, ReportError, file_sha256, fmt_num, read_report
    from engine.jobs import JobManager

    ws = ctx.workspace
    active = JobManager(ws.jobs_dir).active("evaluate")
    if active:
        return [failed("report", f"evaluation running (job {active[0].id})", "wait for it to finish")]
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
    current = file_sha256(weights)
    same_path = Path(str(measured.get("path", ""))).resolve() == weights.parent.resolve()
    if measured.get("sha256") != current or not same_path:
        results.append(failed("drafter", f"the report measured export {measured.get('path')} (sha256 "
                                         f"{str(measured.get('sha256'))[:12]}…), the current export is "
                                         f"{weights.parent} (sha256 {current[:12]}…): the report is stale",
                              "re-run the evaluation for the current drafter: " + RUN_FIX))
        return results
    results.append(passed("drafter", f"report is for the current export {weights.parent} (sha256 {current[:12]}…)"))
    o = report["overall"]
    results.append(_correctness(report))
    rates = " ".join(f"{r * 100:.0f}%" for r in o.get("position_accept") or [])
    al = o.get("acceptance_length")
    if al is None:
        results.append(failed("acceptance", "no verify step was measured (every prompt stopped at once?)",
                              "raise evaluate.max_new_tokens, or check the held-out prompts"))
    else:
        results.append(passed("acceptance", f"acceptance length {fmt_num(al)} over {o.get('prompts')} prompts "
                                            f"({o.get('completion_tokens')} tokens, {o.get('verify_steps')} "
                                            f"verify steps)" + (f"; per draft position {rates}" if rates else "")))
    speedup = o.get("speedup")
    figures = f"{fmt_num(o.get('spec_tokens_per_s'), '.1f')} vs {fmt_num(o.get('base_tokens_per_s'), '.1f')} tok/s"
    if speedup is None:
        results.append(failed("speedup", "speedup not measured", RUN_FIX))
    elif speedup < 1.0:
        results.append(failed("speedup", f"{speedup:.2f}× — {SLOWER} ({figures})",
                              "a drafter this weak costs more than it saves: train longer or on more (regenerated) "
                              "data, check the aux layer ids, or lower evaluate.spec_steps"))
    else:
        results.append(passed("speedup", f"{speedup:.2f}× faster than no speculation ({figures})"))
    return results


def _correctness(report: dict) -> CheckResult:
    o = report["overall"]
    compared, matches = o.get("greedy_compared") or 0, o.get("greedy_matches") or 0
    if not compared:
        return warned("greedy", "outputs were not compared with plain greedy decoding", RUN_FIX)
    if matches == compared:
        return passed("greedy", f"speculative output = greedy output on {matches}/{compared} prompts")
    bad = next((p for p in report.get("prompts") or [] if p.get("matches_greedy") is False), {})
    evidence = (f"speculative output differs from greedy on {compared - matches}/{compared} prompts "
                f"(first: {bad.get('id')} at token {bad.get('first_mismatch')})")
    dtype = (report.get("target") or {}).get("dtype")
    if dtype == "float32":  # exact arithmetic leaves no near-tie excuse: the pipeline is wrong
        return failed("greedy", evidence, "a bug in speculative decoding or the drafter export; report it")
    return warned("greedy", evidence + "; in reduced precision a batched verify can flip near-tied tokens",
                  "rerun with model.dtype = \"float32\" to tell numerics from a bug")
