"""Stage `train`: green only when the SGLang export exists, its config.json is right and its
weight names/shapes are exactly what SGLang's llama_eagle3 loader consumes."""

from __future__ import annotations

import json

from engine.checks.base import CheckResult, failed, passed
from engine.checks.context import CheckContext

START_FIX = "start training: `eagle3-console run train` (a stopped run resumes from its last checkpoint)"


def _last_step(metrics_path) -> int | None:
    try:
        lines = metrics_path.read_text().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return None


def check_train(ctx: CheckContext) -> list[CheckResult]:
    from engine.jobs import JobManager
    from engine.train import checkpoint as ckpt
    from engine.train.export import CONFIG, EXPORT_DIR, check_export

    out = ctx.workspace.drafter_dir
    export = out / EXPORT_DIR
    active = JobManager(ctx.workspace.jobs_dir).active("train")
    steps = _last_step(out / "metrics.jsonl")
    best = ckpt.best(out) or {}
    progress = (f"{steps} steps" if steps is not None else "no steps logged") + (
        f", best simulated acceptance length {best['sim_al']:.3f} (step {best['step']})" if best else "")
    if not (export / CONFIG).is_file():
        if active:
            return [failed("export", f"training running (job {active[0].id}): {progress}", "wait for it to finish")]
        return [failed("export", f"no export in {export}; {progress}", START_FIX)]
    problems = check_export(export)
    if problems:
        return [failed("export", f"{export}: {'; '.join(problems[:3])}",
                       "re-export: resume the training run (it exports at the end), or report a bug")]
    results = [passed("export", f"{export}: config.json and weights match SGLang's LlamaForCausalLMEagle3 loader; "
                                f"{progress}")]
    if active:
        results.append(failed("job", f"training job {active[0].id} still running; the export may be replaced",
                              "wait for it to finish"))
    return results
