"""Stage `dataset`: the training (and eval) JSONL parses, and what its tokens look like.

Evidence: samples, total and trainable tokens, a power-of-two length histogram, how many
samples exceed max_seq_len and how many tokens truncation cuts, samples with no trainable
token, bad lines. Writes `state/dataset_stats.json` (atomic) for the disk budget.
Runs in the pipeline's worker thread (a plain function), never on the event loop.
"""

from __future__ import annotations

import time
from pathlib import Path

from engine.checks.base import CheckResult, failed, passed, warned
from engine.checks.context import CheckContext
from engine.dataset.formats import BadLineError, DatasetError, LineTooLongError
from engine.dataset.stats import DatasetStats, compute_stats, histogram_text
from engine.dataset.tokenize import TokenizerError, load_tokenizer
from engine.dataset.stats_cache import file_fingerprint, write_stats

SHOW_BAD = 3
METHOD_TEXT = {"generation": "the template's {% generation %} blocks",
               "prefix-diff": "prefix-diff (the template has no {% generation %} block)"}


def _file_check(label: str, key: str, path: Path) -> CheckResult | None:
    """None when the file is a readable regular file, else the failure."""
    if not path.exists():
        return failed(label, f"{path} does not exist", f"point dataset.{key} at your JSONL file")
    if not path.is_file():
        return failed(label, f"{path} is not a file", f"point dataset.{key} at a JSONL file")
    return None


def _bad_lines_result(label: str, stats: DatasetStats) -> CheckResult:
    bad = stats.parse.get("bad_lines", [])
    if not stats.bad_count:
        return passed(label, f"no malformed lines ({stats.samples:,} samples, {stats.format} format)")
    shown = "; ".join(f"line {b['line']}: {b['reason']}" for b in bad[:SHOW_BAD])
    more = f" (+{stats.bad_count - SHOW_BAD} more, listed in state/dataset_stats.json)" if stats.bad_count > SHOW_BAD else ""
    return warned(label, f"{stats.bad_count} malformed line(s) skipped: {shown}{more}",
                  "fix or remove those lines; they are not trained on")


def _ids_note(stats: DatasetStats) -> str:
    derived = stats.parse.get("derived_ids") or {}
    if not derived:
        return ""
    parts = ", ".join(f"{n} {why}" for why, n in sorted(derived.items()))
    return f"; ids derived as s<index> for {parts}"


def _model_positions(model_dir: Path) -> int | None:
    """The target's max_position_embeddings, or None when unknown."""
    from engine.model.target import TargetError, text_config

    try:
        value = text_config(model_dir).get("max_position_embeddings")
    except TargetError:
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _truncation_fix(stats: DatasetStats, positions: int | None) -> str:
    """What to do about samples over max_seq_len; never a length past what the model reads."""
    if positions is None or stats.longest <= positions:
        return f"raise dataset.max_seq_len (to {stats.longest} keeps everything) or accept the cut"
    if stats.max_seq_len < positions:
        return (f"raise dataset.max_seq_len, at most to {positions} (the model's max_position_embeddings: "
                "longer samples cannot fit whole), or accept the cut; shorten or drop samples far past it")
    return (f"accept the cut, or shorten those samples: the model reads at most {positions} positions "
            "(max_position_embeddings), so a larger dataset.max_seq_len does not help")


def _results_for(label: str, stats: DatasetStats, positions: int | None = None) -> list[CheckResult]:
    """Checks on one parsed, tokenised file (label: dataset or eval)."""
    if stats.samples == 0:
        return [failed(f"{label}_parse", f"{stats.file}: no usable samples ({stats.bad_count} malformed lines)",
                       "the file needs JSONL conversations in OpenAI messages or ShareGPT format")]
    results = [_bad_lines_result(f"{label}_parse", stats)]
    pct = 100.0 * stats.trainable_tokens / max(stats.total_tokens_after_truncation, 1)
    results.append(passed(
        f"{label}_tokens",
        f"{stats.samples:,} samples, {stats.total_tokens:,} tokens ({stats.total_tokens_after_truncation:,} after "
        f"truncation), {stats.trainable_tokens:,} trainable ({pct:.0f}%), longest {stats.longest:,}; "
        f"assistant mask by {METHOD_TEXT.get(stats.mask_method, stats.mask_method)}; tokenised in {stats.seconds:.2f} s{_ids_note(stats)}\n"
        + histogram_text(stats.histogram)))
    if stats.over_max_len:
        results.append(warned(
            f"{label}_truncation",
            f"{stats.over_max_len:,} of {stats.samples:,} samples exceed max_seq_len {stats.max_seq_len:,}; "
            f"truncation cuts {stats.truncated_tokens:,} tokens (longest {stats.longest:,})",
            _truncation_fix(stats, positions)))
    else:
        results.append(passed(f"{label}_truncation", f"all samples fit in max_seq_len {stats.max_seq_len:,} "
                                                     f"(longest {stats.longest:,})"))
    if stats.no_trainable:
        ids = ", ".join(stats.no_trainable_ids)
        results.append(warned(f"{label}_trainable",
                              f"{stats.no_trainable:,} samples have no trainable token (e.g. {ids})",
                              "their assistant turns are empty or cut by truncation; fix them or raise max_seq_len"))
    else:
        results.append(passed(f"{label}_trainable", "every sample has assistant tokens to train on"))
    return results


def _scan(label: str, path: Path, tokenizer, cfg, positions: int | None = None) -> tuple[DatasetStats | None, list[CheckResult]]:
    try:
        stats = compute_stats(path, tokenizer, cfg.max_seq_len, cfg.format, cfg.on_bad_line)
    except BadLineError as exc:
        return None, [failed(f"{label}_parse", str(exc.bad),
                             "fix the line, or set dataset.on_bad_line = \"skip\" to count and skip bad lines")]
    except LineTooLongError as exc:
        return None, [failed(f"{label}_parse", exc.evidence, exc.fix)]
    except DatasetError as exc:
        return None, [failed(f"{label}_parse", str(exc), "fix the file as described")]
    return stats, _results_for(label, stats, positions)


def check_dataset(ctx: CheckContext) -> list[CheckResult]:
    ws = ctx.workspace
    cfg = ctx.config.dataset
    if not cfg.path:
        return [failed("dataset_file", "dataset.path is not set", "set dataset.path to a JSONL file of conversations")]
    path = ws.path(cfg.path)
    problem = _file_check("dataset_file", "path", path)
    if problem:
        return [problem]
    try:
        tokenizer = load_tokenizer(ws.model_dir)
    except TokenizerError as exc:
        return [failed("tokenizer", str(exc), "fix the `model` stage first (model.path, tokenizer files)")]
    fingerprint = file_fingerprint(path)
    positions = _model_positions(ws.model_dir)
    stats, results = _scan("dataset", path, tokenizer, cfg, positions)
    data = None
    if stats is not None:
        data = stats.to_dict()
        data.update(dataset=fingerprint, model_path=str(ws.model_dir), measured_at=time.time())
    if cfg.eval_path:
        eval_path = ws.path(cfg.eval_path)
        problem = _file_check("eval_file", "eval_path", eval_path)
        if problem:
            results.append(problem)
        else:
            eval_stats, eval_results = _scan("eval", eval_path, tokenizer, cfg, positions)
            results.extend(eval_results)
            if data is not None and eval_stats is not None:
                data["eval"] = {**eval_stats.to_dict(), "dataset": file_fingerprint(eval_path)}
    if data is not None:
        try:
            write_stats(ws, data)
        except OSError as exc:
            results.append(warned("stats_file", f"cannot write {ws.state_dir}: {exc.strerror}",
                                  "make the workspace's state/ directory writable; the disk budget will estimate"))
    return results
