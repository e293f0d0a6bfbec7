"""Stage `disk`: output directories exist (or are created) and are writable; the run fits."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from engine.checks.base import CheckResult, failed, passed, warned
from engine.checks.context import CheckContext
from engine.disk import bytes_per_token, fmt_bytes, usage_for

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
    from engine.datastats import load_cached_stats  # written by the dataset stage

    stats = load_cached_stats(ctx.workspace)
    if stats is not None:
        return stats["total_tokens_after_truncation"], "from the dataset stage"
    path = ctx.workspace.path(ctx.config.dataset.path) if ctx.config.dataset.path else None
    if path is None or not path.is_file():
        return 0, "no dataset yet"
    # ~3.5 bytes of JSONL per token is typical for English chat data; the dataset stage makes it exact.
    return int(path.stat().st_size / 3.5), "estimated from the dataset file size (run the dataset stage for exact counts)"


def check_disk(ctx: CheckContext) -> list[CheckResult]:
    cfg = ctx.config
    ws = ctx.workspace
    results = [
        _writable("output_dir", ws.hidden_dir, cfg.extract.create_output_dir),
        _writable("spool_dir", ws.spool_dir, True),
        _writable("drafters_dir", ws.drafter_dir, True),
    ]
    results.append(_budget(ctx))
    return results


def _budget(ctx: CheckContext) -> CheckResult:
    from engine.checks.model import read_model_config

    cfg = ctx.config
    try:
        hidden = int(read_model_config(ctx.workspace.model_dir)["hidden_size"])
    except (OSError, ValueError, KeyError):
        return warned("budget", "hidden size unknown (model config unreadable)", "fix the `model` stage first")
    tokens, source = estimate_tokens(ctx)
    per_token = bytes_per_token(hidden)
    needed = tokens * per_token + 256 * max(tokens // 512, 1)  # manifest lines are small
    reserve = int(cfg.extract.disk_reserve_gb * GIB)
    usage = usage_for("hidden", str(ctx.workspace.hidden_dir), reserve)
    summary = (f"needs {fmt_bytes(needed)} ({tokens:,} tokens × {fmt_bytes(per_token)}, {source}), "
               f"free {fmt_bytes(usage.free)}, reserve {fmt_bytes(reserve)} on {usage.mount}")
    if needed > usage.free - reserve:
        return failed("budget", summary,
                      "use fewer samples, a shorter dataset.max_seq_len, or extract.output_dir on another disk")
    return passed("budget", summary)
