"""Stage `disk`: output directories exist (or are created) and are writable; the run fits."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from engine.checks.base import CheckResult, failed, passed, warned
from engine.checks.context import CheckContext
from engine.system.disk import bytes_per_token, fmt_bytes, records_bytes, usage_for

GIB = 2**30


def _writable(label: str, path: Path, create: bool) -> CheckResult:
    if not path.exists():
        if not create:
            return failed(label, f"{path} does not exist",
                          f"create it (mkdir -p {path}) or set extract.create_output_dir = true")
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            return failed(label, f"cannot create {path}: {exc.strerror}", "choose a directory on a disk you can write to")
        created = " (created)"
    else:
        created = ""
    if not path.is_dir():
        return failed(label, f"{path} exists and is not a directory", "point the setting at a directory")
    probe = path / f".write-probe-{uuid.uuid4().hex[:8]}"
    try:
        with open(probe, "wb") as handle:
            handle.write(b"x")
            handle.flush()
            os.fsync(handle.fileno())
        probe.unlink()
    except OSError as exc:
        return failed(label, f"{path} is not writable: {exc.strerror}",
                      f"fix permissions (chown/chmod) on {path} or choose another directory")
    return passed(label, f"{path} writable{created}")


def estimate_tokens(ctx: CheckContext) -> tuple[int, str]:
    """Tokens the extraction will capture: exact from the dataset stage if it ran, else estimated."""
    tokens, _, source = estimate_extraction(ctx)
    return tokens, source


def estimate_extraction(ctx: CheckContext) -> tuple[int, int, str]:
    """(tokens, records, where the figures come from) of the extraction: exact from the dataset
    stage if it ran, else estimated from the file's size."""
    from engine.dataset.stats_cache import load_cached_stats  # written by the dataset stage

    stats = load_cached_stats(ctx.workspace)
    if stats is not None:
        tokens = stats["total_tokens_after_truncation"]
        samples = stats.get("samples")
        return tokens, samples if isinstance(samples, int) else max(tokens // 512, 1), "from the dataset stage"
    path = ctx.workspace.path(ctx.config.dataset.path) if ctx.config.dataset.path else None
    if path is None or not path.is_file():
        return 0, 0, "no dataset yet"
    # ~3.5 bytes of JSONL per token is typical for English chat data, and a few hundred tokens a
    # sample; the dataset stage makes both exact.
    tokens = int(path.stat().st_size / 3.5)
    return tokens, max(tokens // 512, 1), "estimated from the dataset file size (run the dataset stage for exact counts)"


def check_disk(ctx: CheckContext) -> list[CheckResult]:
    cfg = ctx.config
    ws = ctx.workspace
    from engine.registry import online_training

    online = online_training(cfg)
    if online:
        from engine.train.window import window_dir

        output = _writable("window_dir", window_dir(ws), cfg.extract.create_output_dir)
    else:
        output = _writable("output_dir", ws.hidden_dir, cfg.extract.create_output_dir)
    results = [
        output,
        _writable("spool_dir", ws.spool_dir, True),
        _writable("drafters_dir", ws.drafter_dir, True),
    ]
    results.append(_window_budget(ctx) if online else _budget(ctx))
    return results


def _window_budget(ctx: CheckContext) -> CheckResult:
    """Online/hybrid training: the disk holds the window (train.window_gb), not the whole extraction."""
    from engine.system.disk import tree_bytes
    from engine.train.window import window_budget, window_dir

    cfg = ctx.config
    hidden = _hidden_size(ctx)
    if isinstance(hidden, CheckResult):
        return hidden
    tokens, source = estimate_tokens(ctx)
    per_token = bytes_per_token(hidden, cfg.extract.aux_format)
    offline = tokens * per_token
    window = window_budget(cfg)
    there = tree_bytes(window_dir(ctx.workspace))  # kept records of an earlier run stay counted in the window
    needed = max(window - there, 0)
    reserve = int(cfg.extract.disk_reserve_gb * GIB)
    usage = usage_for("hidden", str(window_dir(ctx.workspace)), reserve)
    summary = (f"train.mode = {cfg.train.mode}: captured states on disk never exceed the window, "
               f"{fmt_bytes(window)} (train.window_gb = {cfg.train.window_gb:g}, plus one batch per trainer rank if a batch is "
               f"larger; {fmt_bytes(there)} of it there now); an offline extraction would need {fmt_bytes(offline)} "
               f"({tokens:,} tokens × {fmt_bytes(per_token)}, {source}); the spool also holds the "
               f"{cfg.extract.concurrency} capture(s) in flight; free {fmt_bytes(usage.free)}, reserve "
               f"{fmt_bytes(reserve)} on {usage.mount}")
    if needed > usage.free - reserve:
        return failed("budget", summary, "set a smaller train.window_gb, free space there, or set extract.output_dir "
                                         "on another disk (the window lives under it)")
    return passed("budget", summary)


def written_so_far(ctx: CheckContext, hidden: int) -> tuple[int, int, int, str]:
    """(tokens, records, bytes) already in the current run, and a note when some are not counted.

    Records count when the run was made for this model width, max_seq_len, dataset and aux format (the
    extraction resumes those and writes only the rest); a run made with other settings is
    refused by the extraction, so its records are not counted against the budget.
    """
    from engine.records import RecordError, read_manifest, read_run_meta

    run_dir = ctx.workspace.hidden_dir
    if not (run_dir / "run.json").is_file():
        return 0, 0, 0, ""
    try:
        meta = read_run_meta(run_dir)
        entries, _ = read_manifest(run_dir)
    except (RecordError, OSError):
        return 0, 0, 0, f"; the records in {run_dir} are unreadable and not counted"
    cfg = ctx.config
    dataset = str(ctx.workspace.path(cfg.dataset.path)) if cfg.dataset.path else ""
    if (meta.get("hidden_size") != hidden or meta.get("max_seq_len") != cfg.dataset.max_seq_len
            or meta.get("dataset") != dataset or meta.get("aux_format", "bf16") != cfg.extract.aux_format):
        return 0, 0, 0, f"; the records in {run_dir} were made with other settings and are not counted"
    return sum(e.tokens for e in entries.values()), len(entries), sum(e.bytes for e in entries.values()), ""


def _hidden_size(ctx: CheckContext) -> int | CheckResult:
    """The target's hidden size, or the amber result both budgets give when the model is unreadable."""
    from engine.model.target import TargetError, plan_target

    try:
        return plan_target(ctx.workspace.model_dir, list(ctx.config.model.capture_layers)).hidden_size
    except TargetError:
        return warned("budget", "hidden size unknown (model config unreadable)", "fix the `model` stage first")


def _budget(ctx: CheckContext) -> CheckResult:
    cfg = ctx.config
    hidden = _hidden_size(ctx)
    if isinstance(hidden, CheckResult):
        return hidden
    tokens, samples, source = estimate_extraction(ctx)
    per_token = bytes_per_token(hidden, cfg.extract.aux_format)
    # Only what remains is written: records already in the run are resumed, not redone.
    done_tokens, done_samples, done_bytes, note = written_so_far(ctx, hidden)
    todo = max(tokens - done_tokens, 0)
    needed = records_bytes(todo, max(samples - done_samples, 1), hidden, cfg.extract.aux_format) if todo else 0
    reserve = int(cfg.extract.disk_reserve_gb * GIB)
    usage = usage_for("hidden", str(ctx.workspace.hidden_dir), reserve)
    where = f"free {fmt_bytes(usage.free)}, reserve {fmt_bytes(reserve)} on {usage.mount}"
    if not done_tokens:
        summary = (f"needs {fmt_bytes(needed)} ({tokens:,} tokens × {fmt_bytes(per_token)} and {samples:,} records' "
                   f"headers, {source}){note}, {where}")
    elif not todo:
        summary = (f"needs nothing more: all {tokens:,} tokens already written ({fmt_bytes(done_bytes)} in "
                   f"{ctx.workspace.hidden_dir}, {source}), {where}")
    else:
        summary = (f"needs {fmt_bytes(needed)} more ({todo:,} tokens still to write × {fmt_bytes(per_token)} and "
                   f"{max(samples - done_samples, 1):,} records' headers; "
                   f"{done_tokens:,} of {tokens:,} tokens already written, {fmt_bytes(done_bytes)} in "
                   f"{ctx.workspace.hidden_dir}; {source}), {where}")
    if not todo and usage.free < reserve:
        return warned("budget", summary, f"nothing is left to write here, but {usage.mount} is under its reserve: "
                                         "free space there before jobs that write to it")
    if needed > usage.free - reserve:
        return failed("budget", summary,
                      "use fewer samples, a shorter dataset.max_seq_len, or extract.output_dir on another disk")
    return passed("budget", summary)
