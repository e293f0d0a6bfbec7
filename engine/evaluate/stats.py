"""Speedup with its noise: the median over samples, a seeded 95 % bootstrap interval, the three-way
verdict, the break-even acceptance length and the fix text. Pure Python (the console reads it).

A sample is one request measured both ways in the same round, close together in time: its speedup
is (speculative tokens/s) / (baseline tokens/s). Samples are pooled over prompts x rounds and the
interval is the percentile bootstrap of their median (resampling samples with replacement,
`BOOTSTRAP` times, `SEED` fixed so a report is reproducible from its samples).

The reported interval is never narrower than +-FLOOR (2 %) of the median: run-to-run differences
that small (CPU frequency, caches, scheduling) are below what one evaluation resolves, and without
the floor two evaluations of a drafter at ~1.0x could give tight intervals on either side of 1.0
(opposite verdicts).

Verdict: `faster` when the whole interval lies above 1.0, `slower` when it lies below, else
`inconclusive` (the measurement cannot tell; the load average is shown with it).
"""

from __future__ import annotations

import math
import random
import statistics
from typing import Any, Sequence

BOOTSTRAP = 2000
SEED = 0
LEVEL = 0.95
FLOOR = 0.02  # the interval spans at least median x (1 -+ FLOOR)
FASTER, SLOWER, INCONCLUSIVE = "faster", "slower", "inconclusive"


def median(values: Sequence[float]) -> float | None:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(values) if values else None


def _percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if len(sorted_values) == 1:
        return sorted_values[0]
    pos = q * (len(sorted_values) - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def bootstrap_interval(samples: Sequence[float], level: float = LEVEL, resamples: int = BOOTSTRAP,
                       seed: int = SEED) -> tuple[float, float] | None:
    """Percentile bootstrap interval of the median of `samples` (None without samples)."""
    values = [float(v) for v in samples if v is not None and math.isfinite(v)]
    if not values:
        return None
    if len(values) == 1:
        return values[0], values[0]
    rng = random.Random(seed)
    n = len(values)
    medians = sorted(statistics.median(rng.choices(values, k=n)) for _ in range(resamples))
    tail = (1.0 - level) / 2.0
    return _percentile(medians, tail), _percentile(medians, 1.0 - tail)


def verdict_of(interval: Sequence[float] | None) -> str | None:
    """faster (interval above 1.0), slower (below), inconclusive (straddles or touches 1.0)."""
    if not interval:
        return None
    lo, hi = interval
    if lo > 1.0:
        return FASTER
    if hi < 1.0:
        return SLOWER
    return INCONCLUSIVE


def summarize(samples: Sequence[float]) -> dict[str, Any]:
    """{median, interval [lo, hi], samples, verdict} of per-request speedups."""
    values = [float(v) for v in samples if v is not None and math.isfinite(v)]
    interval = bootstrap_interval(values)
    mid = median(values)
    if interval is not None and mid is not None:
        interval = (min(interval[0], mid * (1 - FLOOR)), max(interval[1], mid * (1 + FLOOR)))
    return {"median": mid, "interval": list(interval) if interval else None, "samples": len(values),
            "verdict": verdict_of(interval)}


def break_even(cycle_seconds: float | None, token_seconds: float | None) -> float | None:
    """Acceptance length at which speculation breaks even: one verify cycle (draft steps + target
    verify) costs as much as this many plain decoding steps."""
    if not cycle_seconds or not token_seconds or token_seconds <= 0:
        return None
    return cycle_seconds / token_seconds


def load_text(load: dict[str, Any] | None) -> str:
    if not load:
        return "load average not measured"
    cpus = load.get("cpus")
    parts = [f"{load.get('before', 0):.2f} before", f"{load.get('after', 0):.2f} after"]
    if load.get("max") is not None:
        parts.append(f"{load['max']:.2f} peak")
    return "load average (1 min) " + ", ".join(parts) + (f" on {cpus} CPUs" if cpus else "")


def loaded(load: dict[str, Any] | None) -> bool:
    """The machine had more runnable work than CPUs at some point of the run."""
    if not load or not load.get("cpus"):
        return False
    peak = max(float(load.get(k) or 0.0) for k in ("before", "after", "max"))
    return peak > 0.75 * float(load["cpus"])


def fmt_interval(summary: dict[str, Any] | None) -> str:
    if not summary or summary.get("median") is None:
        return "—"
    lo, hi = summary.get("interval") or (None, None)
    text = f"{summary['median']:.2f}×"
    return text + (f" [{lo:.2f}–{hi:.2f}]" if lo is not None else "")


def fix_text(verdict: str | None, acceptance_length: float | None, breakeven: float | None,
             load: dict[str, Any] | None, steps: int | None = None, best_steps: int | None = None,
             best_label: str | None = None) -> str:
    """What to do about a verdict that is not `faster`: a weak drafter (acceptance length below the
    break-even the measured step costs set) is told apart from noise (above it, yet not faster).
    `best_label`: the SGLang sweep's best other setting (steps, top-k and draft tokens)."""
    if verdict == FASTER or verdict is None:
        return ""
    al = "?" if acceptance_length is None else f"{acceptance_length:.2f}"
    be = "?" if breakeven is None else f"{breakeven:.2f}"
    sweep = ""
    if best_steps is not None and steps is not None and best_steps != steps:
        sweep = f"; the sweep measured spec_steps {best_steps} best here"
    elif best_label:
        sweep = f"; the sweep measured {best_label} best here"
    weak = acceptance_length is not None and breakeven is not None and acceptance_length < breakeven
    if weak:
        return (f"weak drafter: acceptance length {al} is below the break-even {be} that the measured step costs "
                f"set (a verify cycle costs {be} plain decoding steps): train longer or on more (regenerated) "
                f"data, check the aux layer ids, or lower evaluate.spec_steps{sweep}")
    if verdict == SLOWER:
        return (f"not the drafter: acceptance length {al} is above the break-even {be}, so by its step costs "
                f"speculation should pay; the loss is timing noise or machine load ({load_text(load)}): "
                "re-run on an idle machine")
    return (f"inconclusive: the 95% interval straddles 1.0× ({load_text(load)}); acceptance length {al} vs "
            f"break-even {be}. Re-run on an idle machine, or raise evaluate.rounds / evaluate.num_prompts to "
            "narrow the interval")
