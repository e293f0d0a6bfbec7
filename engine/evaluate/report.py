"""The evaluation report: per-prompt results, overall figures, the drafter's identity, and text rendering.

Pure Python (no torch): the console and `eagle3-console status` read it.

Conventions (SGLang's, so local and SGLang numbers compare):
  acceptance length = completion tokens / verify steps (the target's bonus token counts, and so
      does the first token, which comes from the prefill); 1.0 means no draft was ever accepted.
  acceptance per draft position i = verify steps whose i-th draft was accepted / all verify steps
      (unconditional, so it falls with i; 1 + their sum is the acceptance length up to the
      prefill token and the max_new_tokens cut).
  speedup = tokens/s with speculation / tokens/s without, over the same prompts in the same run.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from engine import atomic
from engine.jsonfile import read_json_object

REPORT = "report.json"
VERSION = 1
SLOWER = "slower than no speculation"
EXPORT_DIR = "export"  # = engine.train.export.EXPORT_DIR / WEIGHTS (that module imports torch;
WEIGHTS = "model.safetensors"  # checks and the console must not) — pinned by tests/test_evaluate.py


class ReportError(Exception):
    """No usable report; the message says what to run."""


@dataclass
class PromptResult:
    id: str
    prompt_tokens: int
    completion_tokens: int
    verify_steps: int
    accepted: list[int]  # per draft position: verify steps that accepted it ([] when unknown)
    spec_seconds: float
    base_seconds: float
    base_completion_tokens: int
    matches_greedy: bool | None = None  # speculative output == greedy output (None: not compared)
    first_mismatch: int | None = None  # index of the first differing token
    server_accept_length: float | None = None  # SGLang: meta_info.spec_accept_length as reported

    @property
    def acceptance_length(self) -> float | None:
        if self.server_accept_length is not None:
            return self.server_accept_length
        return self.completion_tokens / self.verify_steps if self.verify_steps else None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["acceptance_length"] = self.acceptance_length
        data["position_accept"] = [a / self.verify_steps for a in self.accepted] if self.verify_steps else []
        data["spec_tokens_per_s"] = _rate(self.completion_tokens, self.spec_seconds)
        data["base_tokens_per_s"] = _rate(self.base_completion_tokens, self.base_seconds)
        data["speedup"] = _ratio(data["spec_tokens_per_s"], data["base_tokens_per_s"])
        return data


def _rate(tokens: float, seconds: float) -> float | None:
    return tokens / seconds if seconds > 0 else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def overall(prompts: list[PromptResult]) -> dict[str, Any]:
    completion = sum(p.completion_tokens for p in prompts)
    verify = sum(p.verify_steps for p in prompts)
    width = max((len(p.accepted) for p in prompts), default=0)
    accepted = [sum(p.accepted[i] for p in prompts if i < len(p.accepted)) for i in range(width)]
    spec_s = sum(p.spec_seconds for p in prompts)
    base_s = sum(p.base_seconds for p in prompts)
    spec_tps = _rate(completion, spec_s)
    base_tps = _rate(sum(p.base_completion_tokens for p in prompts), base_s)
    server_al = [p.server_accept_length for p in prompts if p.server_accept_length is not None]
    if verify:
        al = completion / verify
    elif server_al:  # SGLang without verify counts: token-weighted mean of what it reported
        al = sum(p.server_accept_length * p.completion_tokens for p in prompts
                 if p.server_accept_length is not None) / max(1, sum(p.completion_tokens for p in prompts
                                                                     if p.server_accept_length is not None))
    else:
        al = None
    compared = [p for p in prompts if p.matches_greedy is not None]
    return {
        "prompts": len(prompts),
        "completion_tokens": completion,
        "verify_steps": verify,
        "acceptance_length": al,
        "position_accept": [a / verify for a in accepted] if verify else [],
        "spec_seconds": spec_s,
        "base_seconds": base_s,
        "spec_tokens_per_s": spec_tps,
        "base_tokens_per_s": base_tps,
        "speedup": _ratio(spec_tps, base_tps),
        "greedy_compared": len(compared),
        "greedy_matches": sum(1 for p in compared if p.matches_greedy),
    }


def build_report(*, backend: str, drafter: dict[str, Any], target: dict[str, Any], settings: dict[str, Any],
                 prompts: list[PromptResult], notes: list[str] | None = None) -> dict[str, Any]:
    return {
        "version": VERSION,
        "created_at": time.time(),
        "backend": backend,
        "drafter": drafter,
        "target": target,
        "settings": settings,
        "notes": list(notes or []),
        "overall": overall(prompts),
        "prompts": [p.to_dict() for p in prompts],
    }


# ----------------------------------------------------------------------------- identity

_HASH_MEMO: dict[tuple, str] = {}


def file_sha256(path: Path) -> str:
    """sha256 of a file, remembered per (path, inode, size, mtime): checks re-run every second."""
    path = Path(path)
    st = path.stat()
    key = (str(path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _HASH_MEMO:
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        _HASH_MEMO[key] = digest.hexdigest()
    return _HASH_MEMO[key]


def export_identity(export_dir: Path) -> dict[str, Any]:
    """What makes a drafter export *this* export: its path and the sha256 of its weights."""
    weights = Path(export_dir) / WEIGHTS
    return {"path": str(Path(export_dir).resolve()), "weights": WEIGHTS, "sha256": file_sha256(weights),
            "bytes": weights.stat().st_size}


# ----------------------------------------------------------------------------- files


def write_report(eval_dir: Path, report: dict[str, Any]) -> Path:
    path = Path(eval_dir) / REPORT
    os.makedirs(eval_dir, exist_ok=True)
    atomic.write_json(path, report)
    return path


def read_report(eval_dir: Path) -> dict[str, Any]:
    path = Path(eval_dir) / REPORT
    data = read_json_object(path, ReportError, "evaluation report", "; run the evaluate stage again")
    if not isinstance(data.get("overall"), dict):
        raise ReportError(f"{path} is not an evaluation report (no 'overall' section)")
    return data


# ----------------------------------------------------------------------------- rendering


def fmt_num(value: float | None, spec: str = ".2f", none: str = "—") -> str:
    return none if value is None else format(value, spec)


def text_bar(fraction: float, width: int = 20) -> str:
    fraction = min(1.0, max(0.0, fraction))
    full = int(round(fraction * width))
    return "█" * full + "░" * (width - full)


def is_slower(report: dict[str, Any]) -> bool:
    speedup = (report.get("overall") or {}).get("speedup")
    return speedup is not None and speedup < 1.0


def verdict(report: dict[str, Any]) -> str:
    o = report.get("overall") or {}
    speedup = o.get("speedup")
    figures = (f"{fmt_num(o.get('spec_tokens_per_s'), '.1f')} vs {fmt_num(o.get('base_tokens_per_s'), '.1f')} "
               "tok/s")
    if speedup is None:
        return "speedup not measured"
    if speedup < 1.0:
        return f"{speedup:.2f}× — {SLOWER} ({figures})"
    return f"{speedup:.2f}× faster than no speculation ({figures})"


def header_line(report: dict[str, Any]) -> str:
    s = report.get("settings") or {}
    d = report.get("drafter") or {}
    sha = str(d.get("sha256") or "")[:12]
    return (f"backend {report.get('backend', '?')} · drafter {d.get('path', '?')} (sha256 {sha}…) · "
            f"steps {s.get('spec_steps')} top-k {s.get('spec_topk')} draft tokens {s.get('spec_draft_tokens')} · "
            f"max {s.get('max_new_tokens')} new tokens")


def table_lines(report: dict[str, Any], max_rows: int = 50) -> list[str]:
    """The per-prompt table plus an `overall` row, fixed-width columns."""
    head = f"{'prompt':<18} {'tokens':>6} {'verify':>6} {'accept len':>10} {'spec tok/s':>10} " \
           f"{'base tok/s':>10} {'speedup':>8}  greedy"
    lines = [head, "─" * len(head)]
    rows = list(report.get("prompts") or [])
    for p in rows[:max_rows]:
        lines.append(_row(str(p.get("id", "?")), p))
    if len(rows) > max_rows:
        lines.append(f"… {len(rows) - max_rows} more prompt(s) in report.json")
    lines.append("─" * len(head))
    o = dict(report.get("overall") or {})
    compared = o.get("greedy_compared") or 0
    o["greedy_text"] = f"{o.get('greedy_matches', 0)}/{compared}" if compared else "—"
    lines.append(_row("overall", o))
    return lines


def _row(name: str, p: dict[str, Any]) -> str:
    speedup = p.get("speedup")
    if "greedy_text" in p:
        greedy = p["greedy_text"]
    else:
        match = p.get("matches_greedy")
        greedy = "—" if match is None else ("same" if match else f"differs at {p.get('first_mismatch')}")
    return (f"{name[:18]:<18} {p.get('completion_tokens', 0):>6} {p.get('verify_steps', 0):>6} "
            f"{fmt_num(p.get('acceptance_length')):>10} {fmt_num(p.get('spec_tokens_per_s'), '.1f'):>10} "
            f"{fmt_num(p.get('base_tokens_per_s'), '.1f'):>10} "
            f"{(fmt_num(speedup) + '×') if speedup is not None else '—':>8}  {greedy}")


def position_lines(report: dict[str, Any], width: int = 20) -> list[str]:
    rates = (report.get("overall") or {}).get("position_accept") or []
    if not rates:
        return ["acceptance per draft position: not reported by this backend"]
    return [f"draft {i + 1:>2}  {text_bar(r, width)} {r * 100:5.1f}%" for i, r in enumerate(rates)]


def render_table(report: dict[str, Any]) -> str:
    """The whole report as plain text for the terminal (headless `run evaluate`)."""
    o = report.get("overall") or {}
    lines = ["Evaluation — " + header_line(report), ""]
    lines += table_lines(report)
    lines += ["", f"acceptance length {fmt_num(o.get('acceptance_length'))} "
                  f"(completion tokens / verify steps, bonus token included)",
              "acceptance per draft position:"]
    lines += ["  " + line for line in position_lines(report)]
    lines += [""] + [f"note: {n}" for n in report.get("notes") or []]
    lines.append(("SLOWER: " if is_slower(report) else "speedup ") + verdict(report))
    return "\n".join(lines)
