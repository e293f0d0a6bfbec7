"""The online-vs-offline leg of bench/gpu_end_to_end.py (`--compare-online`): what it measures and how.

- `DirPeak`: a thread that sums the bytes of every file under a directory every ~50 ms (the online
  window, whatever its accounting says) and keeps the peak.
- `acceptance_interval`: the evaluation report gives a 95 % bootstrap interval for the speedup only; the
  acceptance length gets one here by the same method (seeded percentile bootstrap, engine.evaluate.stats'
  seed, resamples and level), resampling prompts: sum(completion tokens) / sum(verify steps).
- `trainer_rate`: the drafter trainer's tok/s from its metrics.jsonl, read the way the offline leg always
  read it (median of the logged windows after the first third: compile and warm-up left out).
- `summary`: the block printed and written to results.json against the issue's three goals.
"""

from __future__ import annotations

import json
import random
import statistics
import threading
import time
from pathlib import Path
from typing import Any


class DirPeak(threading.Thread):
    """Peak bytes of the files under `root`, sampled every `interval` s until `stop()`."""

    def __init__(self, root: Path, interval: float = 0.05):
        super().__init__(name=f"dir-peak {root}", daemon=True)
        self.root = Path(root)
        self.interval = interval
        self.peak = 0
        self.peak_at = 0.0  # seconds after start
        self.samples = 0
        self.slowest_sample_s = 0.0
        self._stop_event = threading.Event()
        self._t0 = time.monotonic()

    def run(self) -> None:
        from engine.system.disk import tree_bytes

        while not self._stop_event.is_set():
            t = time.monotonic()
            size = tree_bytes(self.root)  # 0 before the window exists
            self.slowest_sample_s = max(self.slowest_sample_s, time.monotonic() - t)
            self.samples += 1
            if size > self.peak:
                self.peak, self.peak_at = size, t - self._t0
            self._stop_event.wait(self.interval)

    def stop(self) -> dict[str, Any]:
        self._stop_event.set()
        self.join(timeout=10)
        return {"peak_bytes": self.peak, "peak_at_s": round(self.peak_at, 1), "samples": self.samples,
                "seconds": round(time.monotonic() - self._t0, 1), "slowest_sample_ms": round(self.slowest_sample_s * 1e3, 1)}


def acceptance_interval(prompts: list[dict]) -> dict[str, Any]:
    """Acceptance length (completion tokens / verify steps over the prompts) with its 95 % bootstrap interval."""
    from engine.evaluate import stats

    pairs = [(p["completion_tokens"], p["verify_steps"]) for p in prompts if p.get("verify_steps")]
    if not pairs:
        return {"acceptance_length": None, "interval": None, "prompts": 0}
    al = sum(c for c, _ in pairs) / sum(v for _, v in pairs)
    rng = random.Random(stats.SEED)
    draws = []
    for _ in range(stats.BOOTSTRAP):
        pick = rng.choices(pairs, k=len(pairs))
        draws.append(sum(c for c, _ in pick) / sum(v for _, v in pick))
    draws.sort()
    tail = (1.0 - stats.LEVEL) / 2.0
    lo, hi = stats._percentile(draws, tail), stats._percentile(draws, 1.0 - tail)
    return {"acceptance_length": round(al, 3), "interval": [round(lo, 3), round(hi, 3)], "prompts": len(pairs)}


def trainer_rate(metrics_path: Path) -> dict[str, Any]:
    metrics = [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line.strip()]
    lines = [m for m in metrics if m.get("type", "train") == "train" and "tokens_per_s" in m]
    evals = [m for m in metrics if m.get("type") == "eval"]
    return {
        "steps": lines[-1].get("step") if lines else None,
        "tok_s": round(statistics.median([m["tokens_per_s"] for m in lines[len(lines) // 3:]])) if lines else None,
        "final_eval": {k: v for k, v in (evals[-1] if evals else {}).items() if k in ("loss", "sim_al", "acc", "accept")},
    }


def job_rate(events: list[dict], tokens_per_step: float | None = None) -> dict[str, Any]:
    """The online job's own figures from its events: wall from `started` to `finished`, the producer's
    and consumer's rates as its progress events reported them (median after the first third)."""
    started = next((e for e in events if e.get("type") == "started"), {})
    finished = next((e for e in reversed(events) if e.get("type") == "finished"), {})
    progress = [e for e in events if e.get("type") == "progress"]
    tail = progress[len(progress) // 3:]

    def med(key: str, digits: int | None = None) -> float | None:
        values = [e[key] for e in tail if isinstance(e.get(key), (int, float))]
        return round(statistics.median(values), digits) if values else None

    window = next((e for e in reversed(events) if e.get("type") == "window"), {})
    wall = (finished["t"] - started["t"]) if finished.get("t") and started.get("t") else None
    return {"job_seconds": round(wall, 1) if wall else None, "capture_tok_s_median": med("capture_tokens_per_s"),
            "train_tok_s_median": med("train_tokens_per_s"), "progress_events": len(progress),
            # CPU s per wall s of the producer's threads inside the trainer (they share its GIL)
            "producer_cpu_median": med("producer_cpu", 3), "producer_cpu_s": window.get("producer_cpu_s"),
            # the same of the capture process, outside the trainer (requests, spool reads, record writes)
            "capture_cpu_median": med("capture_cpu", 3), "capture_cpu_s": window.get("capture_cpu_s"),
            "window_peak_reserved": window.get("window_peak"), "captured": window.get("captured"),
            "epoch_tokens": started.get("epoch_tokens"), "offline_bytes": started.get("offline_bytes"),
            "eval_kept": started.get("eval_kept"), "held_out": started.get("held_out")}


def summary(offline_eval: dict, online_eval: dict, capture_tok_s: float | None, offline_tok_s: float | None,
            online_tok_s: float | None, window: dict, budget: int) -> dict[str, Any]:
    """The issue's three goals, each with its figures and a yes/no."""
    a, b = offline_eval.get("interval"), online_eval.get("interval")
    al_a, al_b = offline_eval.get("acceptance_length"), online_eval.get("acceptance_length")
    overlap = bool(a and b and a[0] <= b[1] and b[0] <= a[1])
    each_within = bool(a and b and al_a is not None and al_b is not None
                       and a[0] <= al_b <= a[1] and b[0] <= al_a <= b[1])
    rates = [r for r in (capture_tok_s, offline_tok_s) if r]
    floor = min(rates) if len(rates) == 2 else None
    ratio = round(online_tok_s / floor, 3) if online_tok_s and floor else None
    return {
        "acceptance": {"offline": offline_eval, "online": online_eval, "intervals_overlap": overlap,
                       "each_within_the_others_interval": each_within},
        "rates": {"capture_tok_s": capture_tok_s, "offline_train_tok_s": offline_tok_s, "online_train_tok_s": online_tok_s,
                  "min_capture_offline": floor, "online_over_min": ratio, "goal": 0.9,
                  "met": bool(ratio is not None and ratio >= 0.9)},
        "window": {**window, "budget_bytes": budget, "met": bool(window.get("peak_bytes", 0) <= budget)},
    }


def render(block: dict[str, Any]) -> str:
    acc, rates, win = block["acceptance"], block["rates"], block["window"]

    def al(side: dict) -> str:
        iv = side.get("interval") or [None, None]
        return f"{side.get('acceptance_length')} [{iv[0]}–{iv[1]}] over {side.get('prompts')} prompts"

    lines = [
        "── online vs offline (same dataset, steps, seed, settings) " + "─" * 20,
        f"acceptance length  offline {al(acc['offline'])}",
        f"                   online  {al(acc['online'])}",
        (f"                   intervals overlap: {acc['intervals_overlap']}; each inside the other's interval: "
         f"{acc['each_within_the_others_interval']}"),
        (f"rates (tok/s)      capture (extraction job) {rates['capture_tok_s']}, offline trainer "
         f"{rates['offline_train_tok_s']}, online trainer {rates['online_train_tok_s']}"),
        (f"                   online / min(capture, offline) = {rates['online_over_min']} (goal >= 0.9: "
         f"{'met' if rates['met'] else 'NOT met'})"),
        (f"window on disk     peak {win.get('peak_bytes', 0):,} B of budget {win['budget_bytes']:,} B "
         f"({win.get('samples')} samples every ~50 ms over {win.get('seconds')} s; goal <= budget: "
         f"{'met' if win['met'] else 'NOT met'})"),
        "─" * 78,
    ]
    return "\n".join(lines)
