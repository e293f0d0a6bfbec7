"""The evaluation report: per-prompt results, overall figures, the drafter's identity, and text rendering.

Pure Python (no torch): the console and `eagle3-console status` read it.

Conventions (SGLang's, so local and SGLang numbers compare):
  acceptance length = completion tokens / verify steps (the target's bonus token counts, and so
      does the first token, which comes from the prefill); 1.0 means no draft was ever accepted.
  acceptance per draft position i = verify steps whose i-th draft was accepted / all verify steps
      (unconditional, so it falls with i; 1 + their sum is the acceptance length up to the
      prefill token and the max_new_tokens cut).
  speedup = tokens/s with speculation / tokens/s without, over the same prompts in the same run.

Version 2 adds the measurement with its noise (engine.evaluate.stats): per concurrency level
(`levels`), per speculative setting, the median per-request speedup over prompts x rounds with a
seeded 95 % bootstrap interval and a three-way verdict, throughput and per-request latency each
side, the break-even acceptance length, the load average during the run (`load`), the
recommendation (`recommendation`: best setting per level as SGLang flags, and where speculation
stops paying), and the identity of the export and of the target that were measured.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from engine.io import atomic
from engine.evaluate import stats
from engine.io.jsonfile import read_json_object
from engine.errors import EngineError

REPORT = "report.json"
VERSION = 2
SLOWER = "slower than no speculation"
EXPORT_DIR = "export"  # = engine.train.export.EXPORT_DIR / WEIGHTS (that module imports torch;
WEIGHTS = "model.safetensors"  # checks and the console must not) — pinned by tests/test_evaluate.py
CONFIG = "config.json"
MANIFEST = "manifest.json"  # = engine.train.export.MANIFEST (pinned by tests/test_evaluate.py)


class ReportError(EngineError):
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
                 prompts: list[PromptResult], notes: list[str] | None = None, levels: list[dict] | None = None,
                 load: dict[str, Any] | None = None) -> dict[str, Any]:
    """`levels`: level_summary() dicts (local backend); without them the per-prompt results give
    one level (concurrency 1, one round) so the SGLang backend has the same verdict rules."""
    if levels is None and prompts:
        tally = Tally()
        for p in prompts:
            tally.add_counts(p.base_completion_tokens, p.base_seconds, p.completion_tokens, p.spec_seconds,
                             p.verify_steps, list(p.accepted), p.matches_greedy)
            tally.wave_walls.append((p.base_seconds, p.spec_seconds))
        steps = settings.get("spec_steps") or 0
        levels = [level_summary(1, steps, {steps: tally}, len(prompts), 1)]
    levels = list(levels or [])
    for level in levels:
        best = setting_of(level, level.get("best"))
        for s in level["settings"]:
            sglang = isinstance(s.get("key"), str)
            s["fix"] = stats.fix_text(s["speedup"]["verdict"], s.get("acceptance_length"), s.get("break_even"),
                                      load, s.get("spec_steps"), None if sglang else level.get("best"),
                                      best_label=(best or {}).get("label") if sglang and best is not s else None)
    report = {
        "version": VERSION,
        "created_at": time.time(),
        "backend": backend,
        "drafter": drafter,
        "target": target,
        "settings": settings,
        "notes": list(notes or []),
        "overall": overall(prompts),
        "prompts": [p.to_dict() for p in prompts],
        "load": load,
        "levels": levels,
    }
    report["measurement"] = primary(report)
    report["recommendation"] = recommendation(report)
    return report


# ----------------------------------------------------------------------------- levels and settings


@dataclass(frozen=True, order=True)
class SpecSetting:
    """One SGLang speculative setting. Local levels key their settings by steps alone (top-k 1);
    SGLang levels by `key` ("steps/topk/draft_tokens"), so both report shapes read alike."""

    steps: int
    topk: int = 1
    draft_tokens: int = 0  # 0: steps + 1 (what SGLang serves at top-k 1)

    def __post_init__(self) -> None:
        if self.draft_tokens == 0:
            object.__setattr__(self, "draft_tokens", self.steps + 1)

    @property
    def key(self) -> str:
        return f"{self.steps}/{self.topk}/{self.draft_tokens}"

    @property
    def label(self) -> str:
        return f"steps {self.steps} top-k {self.topk} draft tokens {self.draft_tokens}"


def setting_label(steps: int, topk: int = 1, draft_tokens: int | None = None, sglang: bool = False) -> str:
    """How a setting is named in text: `3 steps` locally, with top-k and draft tokens for SGLang."""
    return SpecSetting(steps, topk, draft_tokens or 0).label if sglang else f"{steps} steps"


@dataclass
class Tally:
    """Requests of one level measured both ways with one speculative setting."""

    samples: list[float] = field(default_factory=list)  # per-request speedup (spec tok/s / base tok/s)
    base_tokens: int = 0
    spec_tokens: int = 0
    verify: int = 0
    accepted: list[int] = field(default_factory=list)
    base_latency: list[float] = field(default_factory=list)
    spec_latency: list[float] = field(default_factory=list)
    cycle: list[float] = field(default_factory=list)  # per request: seconds per verify cycle
    token_cost: list[float] = field(default_factory=list)  # per request: seconds per baseline token
    matches: int = 0
    compared: int = 0
    wave_walls: list[tuple[float, float]] = field(default_factory=list)  # (baseline, speculative) wall per wave

    def add(self, base_ids: list[int], base_s: float, spec_ids: list[int], spec_s: float, verify: int,
            accepted: list[int]) -> None:
        self.add_counts(len(base_ids), base_s, len(spec_ids), spec_s, verify, accepted, base_ids == spec_ids)

    def add_counts(self, base_tokens: int, base_s: float, spec_tokens: int, spec_s: float, verify: int,
                   accepted: list[int], matches: bool | None) -> None:
        base_rate, spec_rate = _rate(base_tokens, base_s), _rate(spec_tokens, spec_s)
        if base_rate and spec_rate:
            self.samples.append(spec_rate / base_rate)
        self.base_tokens += base_tokens
        self.spec_tokens += spec_tokens
        self.verify += verify
        for i, a in enumerate(accepted):
            if i >= len(self.accepted):
                self.accepted.append(0)
            self.accepted[i] += a
        self.base_latency.append(base_s)
        self.spec_latency.append(spec_s)
        if verify:
            self.cycle.append(spec_s / verify)
        if base_tokens:
            self.token_cost.append(base_s / base_tokens)
        if matches is not None:
            self.compared += 1
            self.matches += bool(matches)

    def acceptance_length(self) -> float | None:
        return round(self.spec_tokens / self.verify, 3) if self.verify else None

    def running_median(self) -> float | None:
        m = stats.median(self.samples)
        return None if m is None else round(m, 3)

    def summary(self, steps: int, setting: SpecSetting | None = None) -> dict[str, Any]:
        """`setting`: an SGLang setting (keyed "steps/topk/draft_tokens"); None: local, keyed by steps."""
        base_wall = sum(b for b, _ in self.wave_walls)
        spec_wall = sum(s for _, s in self.wave_walls)
        return {
            "spec_steps": steps,
            "spec_topk": setting.topk if setting else 1,
            "spec_draft_tokens": setting.draft_tokens if setting else steps + 1,
            "key": setting.key if setting else steps,
            "label": setting.label if setting else setting_label(steps),
            "speedup": stats.summarize(self.samples),
            "base_tokens_per_s": _rate(self.base_tokens, base_wall),
            "spec_tokens_per_s": _rate(self.spec_tokens, spec_wall),
            "base_latency_s": stats.median(self.base_latency),
            "spec_latency_s": stats.median(self.spec_latency),
            "acceptance_length": self.spec_tokens / self.verify if self.verify else None,
            "position_accept": [a / self.verify for a in self.accepted] if self.verify else [],
            # Fastest measured costs: load only ever adds time, so the minima are the machine's own.
            "cycle_seconds": min(self.cycle) if self.cycle else None,
            "token_seconds": min(self.token_cost) if self.token_cost else None,
            "break_even": stats.break_even(min(self.cycle) if self.cycle else None,
                                           min(self.token_cost) if self.token_cost else None),
            "greedy_matches": self.matches,
            "greedy_compared": self.compared,
        }


def level_summary(concurrency: int, configured: int | SpecSetting, tallies: dict[Any, Tally], waves: int,
                  rounds: int) -> dict[str, Any]:
    """One concurrency level: every setting's summary, the configured one and the best one.
    Keys of `tallies` (and `configured`): steps (local backend) or SpecSetting (SGLang)."""
    settings = [t.summary(k.steps, k) if isinstance(k, SpecSetting) else t.summary(k)
                for k, t in sorted(tallies.items()) if t.samples]
    best = best_setting(settings)
    return {"concurrency": concurrency, "waves": waves, "rounds": rounds,
            "configured": configured.key if isinstance(configured, SpecSetting) else configured,
            "best": _key(best) if best else None, "settings": settings}


def _key(setting: dict[str, Any]) -> Any:
    return setting.get("key", setting.get("spec_steps"))


def best_setting(settings: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The setting with the highest median speedup; a tie goes to less work per cycle (fewer draft
    tokens to verify, then fewer steps)."""
    scored = [s for s in settings if (s.get("speedup") or {}).get("median") is not None]
    if not scored:
        return None
    return max(scored, key=lambda s: (s["speedup"]["median"], -(s.get("spec_draft_tokens") or s["spec_steps"] + 1),
                                      -s["spec_steps"]))


def setting_of(level: dict[str, Any], key: int | str | None) -> dict[str, Any] | None:
    """The level's setting with this key: steps (local reports) or "steps/topk/draft_tokens" (SGLang)."""
    return next((s for s in level.get("settings") or [] if _key(s) == key), None)


def primary(report: dict[str, Any]) -> dict[str, Any] | None:
    """The verdict's measurement: the configured setting at the lowest measured concurrency."""
    levels = report.get("levels") or []
    if not levels:
        return None
    level = levels[0]
    chosen = setting_of(level, level.get("configured")) or best_setting(level.get("settings") or [])
    if chosen is None:
        return None
    return {"concurrency": level["concurrency"], **chosen}


def sglang_flags(export_path: str, steps: int, topk: int = 1, draft_tokens: int | None = None) -> list[str]:
    """The SGLang speculative flags to serve a drafter with (top-k 1: steps + 1 draft tokens; above
    it, the measured draft tokens, else steps x topk + 1)."""
    if draft_tokens is None:
        draft_tokens = steps + 1 if topk == 1 else steps * topk + 1
    return ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(export_path),
            "--speculative-num-steps", str(steps), "--speculative-eagle-topk", str(topk),
            "--speculative-num-draft-tokens", str(draft_tokens)]


def recommendation(report: dict[str, Any]) -> dict[str, Any] | None:
    """Per level the best measured setting with its speedup and flags; where speculation stops paying."""
    levels = report.get("levels") or []
    if not levels:
        return None
    export = (report.get("drafter") or {}).get("path", "EXPORT")
    per_level = []
    stops = None
    for level in levels:
        best = setting_of(level, level.get("best"))
        if best is None:
            continue
        pays = best["speedup"]["verdict"] == stats.FASTER
        flags = sglang_flags(export, best["spec_steps"], best.get("spec_topk") or 1, best.get("spec_draft_tokens"))
        per_level.append({"concurrency": level["concurrency"], "spec_steps": best["spec_steps"],
                          "spec_topk": best.get("spec_topk") or 1, "spec_draft_tokens": best.get("spec_draft_tokens"),
                          "key": _key(best), "label": best.get("label") or setting_label(best["spec_steps"]),
                          "speedup": best["speedup"], "serve_speculative": pays,
                          "flags": " ".join(flags) if pays else ""})
        if not pays and stops is None:
            stops = {"concurrency": level["concurrency"], "verdict": best["speedup"]["verdict"]}
    if stops is None:
        text = (f"speculation pays at every measured concurrency (up to {levels[-1]['concurrency']})"
                if per_level else "nothing measured")
    elif stops["verdict"] == stats.SLOWER:
        text = f"speculation stops paying at concurrency {stops['concurrency']} (every setting measured slower or no better)"
    else:
        text = (f"speculation no longer measurably pays from concurrency {stops['concurrency']} "
                "(best setting inconclusive)")
    keys = [_key(s) for lv in levels for s in lv.get("settings") or []]
    sglang = any(isinstance(k, str) for k in keys)
    swept = sorted(set(keys), key=lambda k: [int(x) for x in str(k).split("/")]) if sglang else \
        sorted({s["spec_steps"] for lv in levels for s in lv.get("settings") or []})
    return {"levels": per_level, "stops_paying_at": stops["concurrency"] if stops else None, "text": text,
            "swept": swept}


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
    """What makes a drafter export *this* export: its path and the sha256 of its weights and of its
    config.json (the layer ids and vocabulary live there). The export's own manifest.json
    (engine.train.export signs both files with their sha256) is reused when its hashes are the
    files' (`signed`); the files are hashed here either way (memoised by file identity), so an
    unsigned export (older version) or a stale manifest never stands in for the bytes."""
    export_dir = Path(export_dir)
    weights = export_dir / WEIGHTS
    config = export_dir / CONFIG
    identity = {"path": str(export_dir.resolve()), "weights": WEIGHTS, "sha256": file_sha256(weights),
                "bytes": weights.stat().st_size, "config_sha256": file_sha256(config) if config.is_file() else None}
    signed = _manifest_hashes(export_dir)
    identity["signed"] = bool(signed) and signed == {WEIGHTS: identity["sha256"], CONFIG: identity["config_sha256"]}
    return identity


def _manifest_hashes(export_dir: Path) -> dict[str, str] | None:
    try:
        data = read_json_object(Path(export_dir) / MANIFEST, ReportError, "export manifest", "")
        files = data["files"]
        return {name: str(files[name]["sha256"]) for name in (WEIGHTS, CONFIG)}
    except (ReportError, KeyError, TypeError):
        return None


def target_identity(model_dir: Path) -> dict[str, Any]:
    """The target measured: its directory, the sha256 of its config.json and the id of its weights
    (engine.model.weights_id: a fine-tune saved over them changes it, the config stays)."""
    from engine.model.weights_id import readable_weights_id

    config = Path(model_dir) / CONFIG
    return {"path": str(Path(model_dir).resolve()),
            "config_sha256": file_sha256(config) if config.is_file() else None,
            "weights": readable_weights_id(model_dir)}


def stale_reasons(report: dict[str, Any], export_dir: Path, model_dir: Path) -> list[str]:
    """Why `report` no longer describes the current export and target ([] when it does)."""
    reasons = []
    measured = report.get("drafter") or {}
    current = export_identity(export_dir)
    if Path(str(measured.get("path", ""))).resolve() != Path(current["path"]):
        reasons.append(f"it measured the export at {measured.get('path')}, the current one is {current['path']}")
    if measured.get("sha256") != current["sha256"]:
        reasons.append(f"the export's {WEIGHTS} changed (sha256 {str(measured.get('sha256'))[:12]}… measured, "
                       f"{current['sha256'][:12]}… now)")
    if "config_sha256" in measured and measured.get("config_sha256") != current["config_sha256"]:
        reasons.append(f"the export's {CONFIG} changed (sha256 {str(measured.get('config_sha256'))[:12]}… "
                       f"measured, {str(current['config_sha256'])[:12]}… now)")
    target = report.get("target") or {}
    now = target_identity(model_dir)
    if target.get("path") and Path(str(target["path"])).resolve() != Path(now["path"]):
        reasons.append(f"it measured the target at {target['path']}, model.path is now {now['path']}")
    elif "config_sha256" in target and target.get("config_sha256") != now["config_sha256"]:
        reasons.append(f"the target's {CONFIG} changed (sha256 {str(target.get('config_sha256'))[:12]}… measured, "
                       f"{str(now['config_sha256'])[:12]}… now)")
    elif target.get("weights") and now["weights"] and target["weights"] != now["weights"]:
        reasons.append(f"the target's weights changed (weights {target['weights']} measured, {now['weights']} now)")
    return reasons


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


def _measurement(report: dict[str, Any]) -> dict[str, Any] | None:
    m = report.get("measurement")
    return m if isinstance(m, dict) and isinstance(m.get("speedup"), dict) else None


def verdict_kind(report: dict[str, Any]) -> str | None:
    """faster | slower | inconclusive (None: not measured). Version-1 reports: by the point figure."""
    m = _measurement(report)
    if m is not None:
        return m["speedup"].get("verdict")
    speedup = (report.get("overall") or {}).get("speedup")
    if speedup is None:
        return None
    return stats.SLOWER if speedup < 1.0 else stats.FASTER


def is_slower(report: dict[str, Any]) -> bool:
    return verdict_kind(report) == stats.SLOWER


def verdict(report: dict[str, Any]) -> str:
    m = _measurement(report)
    if m is None:
        o = report.get("overall") or {}
        speedup = o.get("speedup")
        figures = (f"{fmt_num(o.get('spec_tokens_per_s'), '.1f')} vs {fmt_num(o.get('base_tokens_per_s'), '.1f')} "
                   "tok/s")
        if speedup is None:
            return "speedup not measured"
        if speedup < 1.0:
            return f"{speedup:.2f}× — {SLOWER} ({figures})"
        return f"{speedup:.2f}× faster than no speculation ({figures})"
    sp = m["speedup"]
    kind = sp.get("verdict")
    where = f"at concurrency {m.get('concurrency')}, {sp.get('samples')} samples"
    figures = (f"{fmt_num(m.get('spec_tokens_per_s'), '.1f')} vs {fmt_num(m.get('base_tokens_per_s'), '.1f')} tok/s; "
               f"{where}")
    interval = stats.fmt_interval(sp)
    if kind == stats.FASTER:
        return f"{interval} faster than no speculation (95% interval; {figures})"
    if kind == stats.SLOWER:
        return f"{interval} — {SLOWER} (95% interval; {figures})"
    if kind == stats.INCONCLUSIVE:
        return (f"{interval} — INCONCLUSIVE: the 95% interval straddles 1.0× ({figures}; "
                f"{stats.load_text(report.get('load'))})")
    return "speedup not measured"


def header_line(report: dict[str, Any]) -> str:
    s = report.get("settings") or {}
    d = report.get("drafter") or {}
    sha = str(d.get("sha256") or "")[:12]
    rounds = f" · {s.get('rounds')} rounds" if s.get("rounds") else ""
    return (f"backend {report.get('backend', '?')} · drafter {d.get('path', '?')} (sha256 {sha}…) · "
            f"steps {s.get('spec_steps')} top-k {s.get('spec_topk')} draft tokens {s.get('spec_draft_tokens')} · "
            f"max {s.get('max_new_tokens')} new tokens{rounds}")


def level_lines(report: dict[str, Any]) -> list[str]:
    """One row per concurrency level (the configured setting), with its verdict and the best setting."""
    levels = report.get("levels") or []
    if not levels:
        return []
    head = (f"{'conc':>4} {'steps':>5} {'base tok/s':>10} {'spec tok/s':>10} {'base lat':>8} {'spec lat':>8} "
            f"{'AL':>5} {'b-even':>6} {'speedup [95% interval]':<22} {'verdict':<12} best")
    lines = [head, "─" * len(head)]
    for level in levels:
        s = setting_of(level, level.get("configured")) or best_setting(level.get("settings") or []) or {}
        best = setting_of(level, level.get("best"))
        best_text = (f"{best.get('label') or setting_label(best['spec_steps'])} {stats.fmt_interval(best['speedup'])}"
                     if best else "—")
        sp = s.get("speedup") or {}
        key = s.get("key")
        lines.append(f"{level['concurrency']:>4} {key if isinstance(key, str) else s.get('spec_steps', '?'):>5} "
                     f"{fmt_num(s.get('base_tokens_per_s'), '.1f'):>10} {fmt_num(s.get('spec_tokens_per_s'), '.1f'):>10} "
                     f"{fmt_num(s.get('base_latency_s'), '.2f') + 's':>8} {fmt_num(s.get('spec_latency_s'), '.2f') + 's':>8} "
                     f"{fmt_num(s.get('acceptance_length')):>5} {fmt_num(s.get('break_even')):>6} "
                     f"{stats.fmt_interval(sp):<22} {str(sp.get('verdict') or '—'):<12} {best_text}")
    return lines


def recommendation_lines(report: dict[str, Any]) -> list[str]:
    rec = report.get("recommendation") or {}
    if not rec.get("levels"):
        return []
    swept = ", ".join(map(str, rec.get("swept") or []))
    if any(isinstance(k, str) for k in rec.get("swept") or []):
        lines = [f"recommendation (swept SGLang settings {swept} as steps/top-k/draft tokens):"]
    else:
        lines = [f"recommendation (swept steps {swept} at top-k 1):"]
    for item in rec["levels"]:
        label = item.get("label") or f"{item['spec_steps']} steps"
        if item.get("serve_speculative"):
            lines.append(f"  concurrency {item['concurrency']}: {label}, "
                         f"{stats.fmt_interval(item['speedup'])} — serve with {item['flags']}")
        else:
            lines.append(f"  concurrency {item['concurrency']}: serve without speculation (best: {label}, "
                         f"{stats.fmt_interval(item['speedup'])}, {item['speedup'].get('verdict')})")
    lines.append("  " + rec.get("text", ""))
    return lines


def fix_line(report: dict[str, Any]) -> str:
    m = _measurement(report) or {}
    return str(m.get("fix") or "")


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
    m = _measurement(report) or {}
    lines = ["Evaluation — " + header_line(report), ""]
    kind = verdict_kind(report)
    lines.append({stats.SLOWER: "SLOWER: ", stats.INCONCLUSIVE: "INCONCLUSIVE: "}.get(kind or "", "speedup ")
                 + verdict(report))
    if fix_line(report):
        lines.append("fix: " + fix_line(report))
    if m.get("break_even") is not None:
        lines.append(f"break-even acceptance length {m['break_even']:.2f} (fastest verify cycle "
                     f"{m['cycle_seconds'] * 1e3:.2f} ms / fastest plain token {m['token_seconds'] * 1e3:.2f} ms); "
                     f"measured {fmt_num(m.get('acceptance_length'))}")
    if report.get("load"):
        lines.append(stats.load_text(report["load"]))
    if report.get("levels"):
        which = ("configured setting as steps/top-k/draft tokens" if report.get("backend") == "sglang"
                 else "configured steps")
        lines += ["", f"per concurrency ({which}; latency = median per request):"] + level_lines(report)
    rec = recommendation_lines(report)
    if rec:
        lines += [""] + rec
    lines += [""] + table_lines(report)
    lines += ["", f"acceptance length {fmt_num(o.get('acceptance_length'))} "
                  f"(completion tokens / verify steps, bonus token included)",
              "acceptance per draft position:"]
    lines += ["  " + line for line in position_lines(report)]
    lines += [""] + [f"note: {n}" for n in report.get("notes") or []]
    return "\n".join(lines)
