"""The job-event contract: one frozen dataclass per kind of line in a job's events.jsonl.

A job reports through engine.jobs.context.JobContext (`ctx.event("paused", reason=...)` or
`ctx.emit(Paused(reason=...))`); the context writes each line from these classes
(`JobEvent.to_dict`), and every reader (engine watchers, panes, CLI) gets them back through
`parse_event`, the one parser. So a field's name and type live in one place: a writer that
passes a field with the wrong type is told so in its log, and a reader never sees it.

Fields that one job writes and others do not are optional (None when absent). Fields the
contract does not name are kept in `extra` (written back as they came); a kind the contract
does not know parses as `UnknownEvent`, never an error. A line that is not a JSON object, has
no `type`, or gives a named field a value of the wrong type is malformed: `parse_lines` skips
it and says why.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterable, Mapping

from engine.errors import EngineError
from engine.io.jsonl import NONFINITE_TEXT

RESERVED = ("t", "type")  # written by the job context itself
_NONFINITE = set(NONFINITE_TEXT.values())


class MalformedEvent(EngineError, ValueError):
    """An events.jsonl line that does not follow the contract (the message says which field and why)."""


@dataclass(frozen=True, kw_only=True)
class JobEvent:
    """One line of events.jsonl. `t`: when the job wrote it (epoch seconds; None if absent)."""

    KIND: ClassVar[str] = ""
    t: float | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)  # fields the contract does not name

    @property
    def kind(self) -> str:
        return self.KIND

    def to_dict(self) -> dict[str, Any]:
        """The line as written: `t`, `type`, the named fields that are set, then `extra`."""
        out: dict[str, Any] = {}
        if self.t is not None:
            out["t"] = self.t
        out["type"] = self.kind
        for f in dataclasses.fields(self):
            if f.name in ("t", "extra"):
                continue
            value = getattr(self, f.name)
            if value is not None:
                out[f.name] = list(value) if isinstance(value, tuple) else value
        out.update(self.extra)
        return out


@dataclass(frozen=True, kw_only=True)
class UnknownEvent(JobEvent):
    """A kind this contract does not know (a newer job, or a typo): kept whole, shown by no pane."""

    type: str = ""

    @property
    def kind(self) -> str:
        return self.type

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {} if self.t is None else {"t": self.t}
        out["type"] = self.type
        out.update(self.extra)
        return out


# -- every job


@dataclass(frozen=True, kw_only=True)
class Progress(JobEvent):
    """How far a job is. `done`/`total` in `unit` (samples, steps, prompts, requests x rounds)."""

    KIND = "progress"
    done: float | None = None
    total: float | None = None
    unit: str | None = None
    eta_s: float | None = None
    paused: str | None = None  # extraction: why it holds ("" when it does not)
    # extraction
    tokens: int | None = None
    total_tokens: int | None = None
    tokens_per_s: float | None = None
    mb_per_s: float | None = None
    bytes: int | None = None
    bad: int | None = None
    output_free: int | None = None
    output_mount: str | None = None
    spool_free: int | None = None
    # training
    loss: float | None = None
    sim_al: float | None = None
    # online/hybrid training (engine.train.online): the data's position, both rates, the window's fill
    mode: str | None = None
    epoch: int | None = None
    epoch_step: int | None = None
    steps_per_epoch: int | None = None
    capture_tokens_per_s: float | None = None
    train_tokens_per_s: float | None = None
    window_bytes: int | None = None
    window_budget: int | None = None
    window_peak: int | None = None
    captured: int | None = None
    producer_cpu: float | None = None  # CPU s per wall s of the capture producer's threads in the trainer
    capture_cpu: float | None = None  # CPU s per wall s of online training's capture process
    # evaluation
    acceptance_length: float | None = None
    speedup: float | None = None
    concurrency: int | None = None
    round: int | None = None
    rounds: int | None = None
    server: str | None = None  # SGLang backend: which server is measuring (plain | speculative)
    setting: str | None = None  # SGLang backend: the speculative setting's label, or "no speculation"
    # dataset regeneration
    written: int | None = None
    skipped: int | None = None
    failed: int | None = None


@dataclass(frozen=True, kw_only=True)
class Started(JobEvent):
    KIND = "started"
    # extraction
    samples: int | None = None
    todo: int | None = None
    resumed: int | None = None
    verified: int | None = None
    hashed: int | None = None
    budget: str | None = None
    truncated: int | None = None
    bad_lines: int | None = None
    # training
    step: int | None = None
    total_steps: int | None = None
    train: int | None = None
    eval: int | None = None
    device: str | None = None
    world: int | None = None
    backend: str | None = None  # training's process group, evaluation's server backend
    mode: str | None = None  # training data: offline, online or hybrid
    epoch: int | None = None
    next_index: int | None = None
    # online/hybrid training's plan (engine.train.online.plan_fields)
    capture_rate_seen: float | None = None
    prefill_s_per_epoch: float | None = None
    window_budget: int | None = None
    window_kept: int | None = None
    keep_budget: int | None = None
    epoch_tokens: int | None = None
    offline_bytes: int | None = None
    eval_kept: int | None = None
    held_out: int | None = None
    window_dir: str | None = None
    # evaluation
    prompts: int | None = None
    skipped: int | None = None
    export: str | None = None
    sha256: str | None = None
    rounds: int | None = None
    concurrency: tuple[Any, ...] | None = None
    sweep_steps: tuple[Any, ...] | None = None
    # dataset regeneration
    input: str | None = None
    out: str | None = None
    url: str | None = None
    total: int | None = None
    already_done: int | None = None


@dataclass(frozen=True, kw_only=True)
class Finished(JobEvent):
    KIND = "finished"
    # extraction
    samples: int | None = None
    bad: int | None = None
    tokens: int | None = None
    bytes: int | None = None
    fingerprint: str | None = None
    finished_at: float | None = None
    # training
    step: int | None = None
    export: str | None = None
    best_sim_al: float | None = None
    best_step: int | None = None
    best_rejected: str | None = None
    # evaluation
    report: str | None = None
    acceptance_length: float | None = None
    speedup: float | None = None
    interval: tuple[Any, ...] | None = None
    verdict: str | None = None
    message: str | None = None
    greedy_matches: int | None = None
    prompts: int | None = None
    table: str | None = None
    # dataset regeneration
    total: int | None = None
    skipped: int | None = None
    written: int | None = None
    failed: int | None = None
    bad_lines: int | None = None
    turns: int | None = None
    stopped: bool | None = None
    failures: tuple[Any, ...] | None = None


@dataclass(frozen=True, kw_only=True)
class Stopped(JobEvent):
    """Stopped on request (SIGTERM) after saving what it had; starting again resumes."""

    KIND = "stopped"
    done: int | None = None
    total: int | None = None
    step: int | None = None


@dataclass(frozen=True, kw_only=True)
class Error(JobEvent):
    KIND = "error"
    message: str | None = None


@dataclass(frozen=True, kw_only=True)
class Paused(JobEvent):
    KIND = "paused"
    reason: str | None = None


@dataclass(frozen=True, kw_only=True)
class Resumed(JobEvent):
    """Extraction: going on after a pause. Training: resumed from the checkpoint of `step`, the data at
    sample `next_index` of epoch `epoch`'s order."""

    KIND = "resumed"
    step: int | None = None
    mode: str | None = None
    epoch: int | None = None
    next_index: int | None = None


@dataclass(frozen=True, kw_only=True)
class SweptTemp(JobEvent):
    KIND = "swept_temp"
    count: int | None = None


# -- extraction


@dataclass(frozen=True, kw_only=True)
class Planning(JobEvent):
    KIND = "planning"
    dataset: str | None = None


@dataclass(frozen=True, kw_only=True)
class ResumeRepair(JobEvent):
    KIND = "resume_repair"
    problems: tuple[Any, ...] | None = None
    redo: int | None = None


@dataclass(frozen=True, kw_only=True)
class BadSample(JobEvent):
    KIND = "bad_sample"
    id: str | None = None
    reason: str | None = None


@dataclass(frozen=True, kw_only=True)
class Retry(JobEvent):
    KIND = "retry"
    id: str | None = None
    attempt: int | None = None
    reason: str | None = None


@dataclass(frozen=True, kw_only=True)
class Incomplete(JobEvent):
    KIND = "incomplete"
    missing: tuple[Any, ...] | None = None
    count: int | None = None


@dataclass(frozen=True, kw_only=True)
class ServerDrift(JobEvent):
    KIND = "server_drift"
    message: str | None = None
    url: str | None = None
    differences: tuple[Any, ...] | None = None


@dataclass(frozen=True, kw_only=True)
class ServerDown(JobEvent):
    KIND = "server_down"
    url: str | None = None


@dataclass(frozen=True, kw_only=True)
class ServerUp(JobEvent):
    KIND = "server_up"
    url: str | None = None


@dataclass(frozen=True, kw_only=True)
class ServerRestart(JobEvent):
    KIND = "server_restart"
    exit_code: int | None = None


@dataclass(frozen=True, kw_only=True)
class ServerRestartFailed(JobEvent):
    KIND = "server_restart_failed"
    reason: str | None = None


# -- training


@dataclass(frozen=True, kw_only=True)
class Checkpoint(JobEvent):
    KIND = "checkpoint"
    step: int | None = None
    path: str | None = None


@dataclass(frozen=True, kw_only=True)
class Window(JobEvent):
    """Online/hybrid training (engine.train.online): the capture window planned at start, and at the end
    what it held at most. Its live fill and the two rates ride on the progress lines (as extra fields)."""

    KIND = "window"
    mode: str | None = None
    window_budget: int | None = None
    window_peak: int | None = None
    captured: int | None = None
    producer_cpu_s: float | None = None  # CPU seconds of the producer's threads in the trainer's process
    capture_cpu_s: float | None = None  # CPU seconds of the capture process


@dataclass(frozen=True, kw_only=True)
class CheckpointRejected(JobEvent):
    KIND = "checkpoint_rejected"
    path: str | None = None
    message: str | None = None


@dataclass(frozen=True, kw_only=True)
class CheckpointUnverified(JobEvent):
    KIND = "checkpoint_unverified"
    path: str | None = None
    message: str | None = None


@dataclass(frozen=True, kw_only=True)
class CheckpointFallback(JobEvent):
    KIND = "checkpoint_fallback"
    path: str | None = None
    step: int | None = None
    message: str | None = None


@dataclass(frozen=True, kw_only=True)
class CheckpointSkipped(JobEvent):
    KIND = "checkpoint_skipped"
    step: int | None = None
    reason: str | None = None


@dataclass(frozen=True, kw_only=True)
class LearningRateChanged(JobEvent):
    KIND = "learning_rate_changed"
    step: int | None = None
    old: float | None = None
    new: float | None = None


@dataclass(frozen=True, kw_only=True)
class Nonfinite(JobEvent):
    KIND = "nonfinite"
    step: int | None = None
    first_step: int | None = None
    streak: int | None = None
    loss: float | None = None
    grad_norm: float | None = None
    lr: float | None = None
    message: str | None = None


@dataclass(frozen=True, kw_only=True)
class Eval(JobEvent):
    KIND = "eval"
    step: int | None = None
    sim_al: float | None = None
    loss: float | None = None


# -- evaluation


@dataclass(frozen=True, kw_only=True)
class Loaded(JobEvent):
    KIND = "loaded"
    device: str | None = None
    dtype: str | None = None
    hidden_state_indices: tuple[Any, ...] | None = None


@dataclass(frozen=True, kw_only=True)
class Phase(JobEvent):
    KIND = "phase"
    name: str | None = None


# -- dataset regeneration


@dataclass(frozen=True, kw_only=True)
class SampleFailed(JobEvent):
    KIND = "sample_failed"
    id: str | None = None
    line: int | None = None
    error: str | None = None


EVENT_TYPES: dict[str, type[JobEvent]] = {
    cls.KIND: cls for cls in (
        Progress, Started, Finished, Stopped, Error, Paused, Resumed, SweptTemp,
        Planning, ResumeRepair, BadSample, Retry, Incomplete, ServerDrift, ServerDown, ServerUp, ServerRestart,
        ServerRestartFailed,
        Checkpoint, Window, CheckpointRejected, CheckpointUnverified, CheckpointFallback, CheckpointSkipped,
        LearningRateChanged, Nonfinite, Eval,
        Loaded, Phase,
        SampleFailed,
    )
}
# Kinds after which a job has nothing more to say (the console reloads what the job wrote).
FINAL_KINDS = frozenset({"finished", "stopped", "error", "incomplete"})


def _coerce(kind: str, name: str, spec: str, value: Any) -> Any:
    """`value` as the field's type says, or MalformedEvent. Non-finite numbers written as text
    ("NaN", "Infinity") come back as floats."""
    if value is None:
        return None
    if spec.startswith("tuple"):
        if isinstance(value, (list, tuple)):
            return tuple(value)
    elif spec.startswith("bool"):
        if isinstance(value, bool):
            return value
    elif spec.startswith("str"):
        if isinstance(value, str):
            return value
    elif spec.startswith("int"):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif spec.startswith("float"):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and value in _NONFINITE:
            return float(value)
    else:
        return value
    raise MalformedEvent(f"{kind} event: field {name!r} must be {spec.replace(' | None', '')}, "
                         f"got {type(value).__name__} {value!r:.60}")


def _field_specs(cls: type[JobEvent]) -> dict[str, str]:
    return {f.name: str(f.type) for f in dataclasses.fields(cls) if f.name not in ("t", "extra")}


_SPECS = {kind: _field_specs(cls) for kind, cls in EVENT_TYPES.items()}


def parse_event(data: Mapping[str, Any]) -> JobEvent:
    """The typed event of one events.jsonl object; MalformedEvent (with the reason) if it breaks the contract."""
    if not isinstance(data, Mapping):
        raise MalformedEvent(f"an event is a JSON object, got {type(data).__name__}")
    kind = data.get("type")
    if not isinstance(kind, str) or not kind:
        raise MalformedEvent("an event needs a 'type' string")
    t = _coerce(kind, "t", "float", data.get("t"))
    cls = EVENT_TYPES.get(kind)
    if cls is None:
        return UnknownEvent(type=kind, t=t, extra={k: v for k, v in data.items() if k not in RESERVED})
    specs = _SPECS[kind]
    named = {name: _coerce(kind, name, specs[name], data[name]) for name in specs if name in data}
    extra = {k: v for k, v in data.items() if k not in specs and k not in RESERVED}
    return cls(t=t, extra=extra, **named)


@dataclass(frozen=True)
class Skipped:
    """A complete line that was not read as an event, and why."""

    line: str
    reason: str


def parse_lines(data: bytes) -> tuple[list[JobEvent], list[Skipped], int]:
    """Events on the complete lines of `data`, the lines skipped (with why), and the bytes those lines use.

    A last line without its newline is still being written: it is left for the next read (not counted).
    """
    complete = data[: data.rfind(b"\n") + 1]
    events: list[JobEvent] = []
    skipped: list[Skipped] = []
    for raw in complete.splitlines():
        if not raw.strip():
            continue
        text = raw.decode("utf-8", errors="replace")
        try:
            events.append(parse_event(json.loads(text)))
        except ValueError as exc:  # JSONDecodeError and MalformedEvent are both ValueErrors
            reason = str(exc) if isinstance(exc, MalformedEvent) else f"not JSON: {exc}"
            skipped.append(Skipped(text[:200], reason))
    return events, skipped, len(complete)


def parse_many(objects: Iterable[Mapping[str, Any]]) -> list[JobEvent]:
    """Typed events of already-decoded objects (tests, fixed scenes), malformed ones left out."""
    out = []
    for obj in objects:
        try:
            out.append(parse_event(obj))
        except MalformedEvent:
            continue
    return out
