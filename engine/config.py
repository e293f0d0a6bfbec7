"""Typed workspace configuration (`<ws>/console.toml`).

Every section is a dataclass and every key is declared once, with `setting(...)`: type,
default, bounds, choices and help. Parsing, the bounds and choices, and the help comments
written into console.toml all derive from those declarations (`SETTINGS`). User mistakes
become a `ConfigError` naming the file, the key, the bad value and the fix; an unknown key
suggests the nearest valid one. Numbers must be finite (NaN and infinities never pass) and
within their key's bounds.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from engine.errors import EngineError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

CONFIG_NAME = "console.toml"


class ConfigError(EngineError):
    """A configuration mistake, explained for the user (never shown as a traceback)."""

    def __init__(self, file: Path | str, key: str, problem: str, fix: str, value: Any = None):
        self.file = str(file)
        self.key = key
        self.problem = problem
        self.fix = fix
        self.value = value
        where = f"{self.file}: {key}" if key else self.file
        shown = "" if value is None else f" (got {value!r})"
        super().__init__(f"{where}: {problem}{shown}. Fix: {fix}")


# ----------------------------------------------------------------------------- schema
#
# Every key is declared once, below, with `setting(...)`: its type (the annotation), default,
# bounds, choices and help. Validation, the CHOICES/_MINIMUMS/_MAXIMUMS views and the comments
# written into console.toml (`config_comments`) are all derived from these declarations.

_SETTING = "eagle3_setting"  # dataclass field metadata key


@dataclass(frozen=True)
class Setting:
    """One console.toml key as declared: what validation and the written help need.

    `low`/`high` are inclusive bounds; a numeric key has both (and non-finite numbers are
    always refused). `run_name` keys must be plain run names (engine.io.names.check_name)."""

    help: str
    low: float | None = None
    high: float | None = None
    choices: tuple[str, ...] = ()
    run_name: bool = False
    # Filled in by _declared() from the dataclass: "section.key", the field type and its default.
    key: str = ""
    type: Any = None
    default: Any = None

    def range_text(self) -> str:
        return f"{_num(self.low)} to {_num(self.high)}" if self.low is not None and self.high is not None else ""

    def comment(self) -> str:
        """The help written beside the key in console.toml."""
        extra = " | ".join(self.choices) if self.choices else self.range_text()
        return f"{self.help} ({extra})" if extra else self.help


def setting(default: Any = dataclasses.MISSING, *, help: str, low: float | None = None, high: float | None = None,
            choices: tuple[str, ...] = (), run_name: bool = False, factory: Any = dataclasses.MISSING) -> Any:
    """Declare a config key: a dataclass field carrying its Setting (use `factory` for lists)."""
    meta = {_SETTING: Setting(help=help, low=low, high=high, choices=tuple(choices), run_name=run_name)}
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def _num(x: float | None) -> str:
    """A bound as people write it: 65535, 1000000000, 0.1, 1e-12."""
    if x is None:
        return ""
    if isinstance(x, int) or (float(x).is_integer() and abs(x) < 1e16):
        return str(int(x))
    return repr(float(x))


_BIG = 1_000_000_000  # a generous ceiling for counts and intervals: finite, never reached in practice
_SEQ = 1 << 24  # tokens: far above any model's context


@dataclass
class ModelConfig:
    """The target model whose drafter we build."""

    path: str = setting("", help="target model directory (HF format: config.json, weights, tokenizer)")
    backend: str = setting("local", choices=("local", "sglang"), help="server that runs the target")
    # Validated in _check_section and validate_against_model (three distinct increasing ids).
    capture_layers: list[int] = setting(factory=list, help="0-indexed decoder layer outputs fed to the drafter; "
                                                           "[] = [1, L//2-1, L-4]")
    tp_size: int = setting(1, low=1, high=1024, help="tensor-parallel GPUs of the sglang server")
    dp_size: int = setting(1, low=1, high=1024, help="data-parallel replicas of the sglang server")
    ep_size: int = setting(1, low=1, high=1024, help="expert-parallel size of the sglang server, for MoE models")
    dtype: str = setting("auto", choices=("auto", "bfloat16", "float16", "float32"),
                         help="dtype the server loads the weights in")


@dataclass
class ServerConfig:
    host: str = setting("127.0.0.1", help="keep 127.0.0.1 unless other machines must reach the server")
    port: int = setting(30000, low=1, high=65535, help="server port")
    device: str = setting("auto", choices=("auto", "cpu", "cuda"), help="local backend device")
    api_key: str = setting("", help="sent as a Bearer token; never logged")
    attention_backend: str = setting("", help="sglang attention backend; \"\" = chosen per GPU architecture")
    extra_args: list[str] = setting(factory=list, help="extra sglang command-line arguments")
    startup_timeout_s: float = setting(600.0, low=1, high=86400, help="seconds to wait for the server to be healthy")
    restart_on_crash: bool = setting(True, help="restart a crashed server (and resume extraction)")
    nnodes: int = setting(1, low=1, high=1024, help="nodes serving the target with sglang")
    node_rank: int = setting(0, low=0, high=1023, help="this node's rank, below nnodes")
    dist_init_addr: str = setting("", help="multi-node rendezvous HOST:PORT (needed when nnodes > 1)")
    # Checked against train.gpus and model.tp_size in check_gpu_sets; the env is engine.system.gpusets'.
    gpus: list[int] = setting(factory=list, help="GPU indices (as nvidia-smi numbers them) the server runs on; "
                                                 "[] = every visible GPU")


@dataclass
class GpuConfig:
    nccl_preset: str = setting("none", help="NCCL settings: none | pcie-sm120 | p2p-off")  # checked by engine.system.nccl
    disable_nvls: bool = setting(True, help="set NCCL_NVLS_ENABLE=0 in child processes unless already set")
    sample_interval_s: float = setting(1.0, low=0.1, high=3600, help="seconds between GPU samples")
    slow_sample_interval_s: float = setting(5.0, low=0.1, high=3600, help="seconds between slow GPU samples")


@dataclass
class DatasetConfig:
    path: str = setting("", help="training conversations (JSONL)")
    eval_path: str = setting("", help="held-out conversations for evaluation (JSONL)")
    format: str = setting("auto", choices=("auto", "messages", "sharegpt"), help="dataset format")
    max_seq_len: int = setting(2048, low=16, high=_SEQ, help="tokens per sample; longer samples are truncated")
    on_bad_line: str = setting("skip", choices=("skip", "stop"),
                               help="a malformed line: skip counts it and goes on, stop ends the read")


@dataclass
class ExtractConfig:
    output_dir: str = setting("hidden", help="where extraction runs write their records")
    run: str = setting("run1", run_name=True, help="extraction run name")
    spool_dir: str = setting("/dev/shm/eagle3-spool", help="scratch for captured segments; emptied as records commit")
    create_output_dir: bool = setting(True, help="create output_dir when missing")
    disk_reserve_gb: float = setting(50.0, low=0, high=_BIG,
                                     help="extraction pauses when free space drops below this many GiB")
    spool_reserve_gb: float = setting(1.0, low=0, high=_BIG, help="GiB of free space to keep on the spool")
    concurrency: int = setting(4, low=1, high=4096, help="requests in flight")
    endpoints: list[str] = setting(factory=list, help="extra server URLs for data-parallel extraction")
    max_retries: int = setting(2, low=0, high=1000, help="retries of a failed sample before it counts as bad")
    # SGLang answers before its capture hook has written the states (the local server answers after).
    capture_wait_s: float = setting(30.0, low=0, high=3600,
                                    help="how long a sample's capture may take to reach the spool after the server "
                                         "answered, before the sample is retried")
    # engine/aux_fp8.py; issue 22 ships fp8 only once the GPU end to end shows acceptance within 2 % of bf16
    # (bench/gpu_end_to_end.py --compare-fp8), so the default stays bf16.
    aux_format: str = setting("bf16", choices=("bf16", "fp8"),
                              help="how records store the aux states: bf16, or fp8 (e4m3, a scale per token and "
                                   "layer: 0.63 of the disk; readers get bf16 back)")


@dataclass
class TrainConfig:
    output_dir: str = setting("drafters", help="where drafter runs are written")
    run: str = setting("run1", run_name=True, help="drafter run name")
    epochs: int = setting(2, low=1, high=100_000, help="passes over the extracted records")
    # Ceiling: float32's range (the optimizer's arithmetic), not plausibility: the fault suite trains
    # with 1e30 from console.toml to prove a diverging run stops (tests/faults/test_nonfinite_training.py).
    learning_rate: float = setting(1e-4, low=1e-12, high=1e38, help="peak learning rate")
    warmup_ratio: float = setting(0.02, low=0, high=1, help="fraction of steps spent warming up the learning rate")
    max_len: int = setting(2048, low=16, high=_SEQ, help="tokens per training sample")
    batch_size: int = setting(1, low=1, high=65536, help="samples per step")
    grad_clip: float = setting(0.5, low=0, high=1e6, help="gradient norm clip; 0 = no clipping")
    ttt_steps: int = setting(7, low=1, high=64, help="test-time-training unroll steps")
    draft_vocab_size: int = setting(32000, low=2, high=_SEQ, help="drafter vocabulary: the most frequent target tokens")
    save_every: int = setting(500, low=1, high=_BIG, help="steps between checkpoints")
    log_every: int = setting(10, low=1, high=_BIG, help="steps between metric lines")
    eval_fraction: float = setting(0.05, low=0, high=0.9, help="fraction of records held out for validation")
    num_gpus: int = setting(1, low=1, high=1024, help="GPUs to train on (one torchrun rank each)")
    gpus: list[int] = setting(factory=list, help="GPU indices (as nvidia-smi numbers them) the trainer runs on, "
                                                 "num_gpus of them, apart from server.gpus; [] = every visible GPU")
    seed: int = setting(0, low=0, high=2**32 - 1, help="random seed for data order and initialisation")
    # README "Training modes": offline reads extracted records; online captures each epoch into a bounded
    # window and deletes each record once trained; hybrid keeps what the window holds across epochs.
    mode: str = setting("offline", choices=("offline", "online", "hybrid"),
                        help="offline: train on extracted records; online: capture states from the server each "
                             "epoch into a bounded window; hybrid: keep what the window holds, capture the rest")
    window_gb: float = setting(1.0, low=0.0001, high=_BIG,
                               help="online/hybrid: GB (10^9 bytes) of captured states on disk at once")


@dataclass
class EvaluateConfig:
    output_dir: str = setting("eval", help="where evaluation runs are written")
    run: str = setting("run1", run_name=True, help="evaluation run name")
    num_prompts: int = setting(40, low=1, high=1_000_000, help="prompts from dataset.eval_path")
    max_new_tokens: int = setting(256, low=1, high=_SEQ, help="tokens generated per prompt")
    spec_steps: int = setting(3, low=1, high=64, help="speculative steps per verify")
    spec_topk: int = setting(1, low=1, high=64, help="drafter candidates per step")
    spec_draft_tokens: int = setting(4, low=1, high=1024, help="tokens verified per step")
    rounds: int = setting(3, low=1, high=1000, help="measurement rounds; baseline and speculative runs interleave "
                                                    "per prompt in each")
    concurrency: list[int] = setting(factory=lambda: [1, 4, 16],
                                     help="requests in flight measured (1..1024 each); a level above the number "
                                          "of prompts is skipped")
    sweep_steps: list[int] = setting(factory=lambda: [1, 2, 3, 4, 5],
                                     help="speculative steps tried (top-k 1) for the recommendation; [] = only "
                                          "spec_steps")
    # Each entry launches one speculative SGLang server: keep the list short for a large target.
    sglang_sweep: list[list[int]] = setting(factory=lambda: [[1, 1, 2], [2, 1, 3], [3, 1, 4], [5, 4, 8]],
                                            help="SGLang backend: [steps, topk, draft_tokens] settings tried for "
                                                 "the recommendation, one server launch each; [] = only "
                                                 "spec_steps/spec_topk/spec_draft_tokens")


@dataclass
class UiConfig:
    theme: str = setting("eagle3-dark", help="console theme")
    refresh_s: float = setting(1.0, low=0.1, high=3600, help="seconds between pane refreshes")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    gpu: GpuConfig = field(default_factory=GpuConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    extract: ExtractConfig = field(default_factory=ExtractConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    ui: UiConfig = field(default_factory=UiConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "server": ServerConfig,
    "gpu": GpuConfig,
    "dataset": DatasetConfig,
    "extract": ExtractConfig,
    "train": TrainConfig,
    "evaluate": EvaluateConfig,
    "ui": UiConfig,
}


def _declared() -> dict[str, Setting]:
    table: dict[str, Setting] = {}
    for name, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            spec = f.metadata.get(_SETTING)
            if spec is None:  # programming error: every key needs its declaration
                raise TypeError(f"{cls.__name__}.{f.name} is not declared with setting()")
            tp = hints[f.name]
            factory: Any = f.default_factory
            default = factory() if f.default is dataclasses.MISSING else f.default
            if tp in (int, float) and (spec.low is None or spec.high is None):
                raise TypeError(f"{name}.{f.name}: a numeric setting needs both bounds")
            table[f"{name}.{f.name}"] = dataclasses.replace(spec, key=f"{name}.{f.name}", type=tp, default=default)
    return table


# "section.key" -> its declaration: the one table everything below is derived from.
SETTINGS: dict[str, Setting] = _declared()

# Views kept for callers of the earlier tables.
for _name, _cls in SECTIONS.items():
    setattr(_cls, "CHOICES", {k.partition(".")[2]: s.choices for k, s in SETTINGS.items()
                              if s.choices and k.partition(".")[0] == _name})
_MINIMUMS: dict[tuple[str, str], float] = {
    (k.partition(".")[0], k.partition(".")[2]): s.low for k, s in SETTINGS.items() if s.low is not None}
_MAXIMUMS: dict[tuple[str, str], float] = {
    (k.partition(".")[0], k.partition(".")[2]): s.high for k, s in SETTINGS.items() if s.high is not None}
_NAME_KEYS = {(k.partition(".")[0], k.partition(".")[2]) for k, s in SETTINGS.items() if s.run_name}


def config_comments() -> dict[str, str]:
    """The help written beside every key of console.toml, from the declarations."""
    return {key: spec.comment() for key, spec in SETTINGS.items()}


def _suggest(key: str, valid: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.5)
    return f"did you mean '{close[0]}'?" if close else "valid keys: " + ", ".join(sorted(valid))


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is list:
        (inner,) = typing.get_args(tp)
        return "a list of " + {int: "integers", float: "numbers", str: "strings"}.get(inner, str(inner))
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, str(tp))


def _whole(spec: Setting | None) -> str:
    span = spec.range_text() if spec else ""
    return f"write a whole number from {span} without quotes" if span else "write a whole number without quotes"


def _number(spec: Setting | None) -> str:
    span = spec.range_text() if spec else ""
    return f"write a number from {span} without quotes" if span else "write a number without quotes"


def _convert(file: Path, key: str, value: Any, tp: Any, spec: Setting | None = None) -> Any:
    """Check `value` against the field type `tp`; ints are accepted for floats, non-finite numbers never."""
    origin = typing.get_origin(tp)
    if origin is list:
        (inner,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(file, key, f"must be {_type_name(tp)}", f"write e.g. {key.split('.')[-1]} = []", value)
        return [_convert(file, f"{key}[{i}]", item, inner) for i, item in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(file, key, "must be true or false", "write true or false without quotes", value)
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(file, key, "must be an integer", _whole(spec), value)
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(file, key, "must be a number", _number(spec), value)
        try:
            converted = float(value)
        except OverflowError:  # an integer too large for a float
            converted = math.inf
        if not math.isfinite(converted):
            raise ConfigError(file, key, "must be a finite number", _number(spec), value)
        return converted
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(file, key, "must be a string", 'put the value in double quotes', value)
        return value
    raise TypeError(f"unsupported config field type {tp!r}")  # programming error, not user error


def _check_value(file: Path, spec: Setting, value: Any) -> Any:
    """One key's value against its declaration: type, finiteness, choices, bounds."""
    converted = _convert(file, spec.key, value, spec.type, spec)
    if spec.choices and converted not in spec.choices:
        raise ConfigError(file, spec.key, "is not a valid choice", "use one of " + ", ".join(spec.choices), value)
    if spec.low is not None and converted < spec.low:
        raise ConfigError(file, spec.key, f"must be at least {_num(spec.low)}", f"set it from {spec.range_text()}",
                          value)
    if spec.high is not None and converted > spec.high:
        raise ConfigError(file, spec.key, f"must be at most {_num(spec.high)}", f"set it from {spec.range_text()}",
                          value)
    return converted


def check_value(key: str, value: Any, file: Path | str = CONFIG_NAME) -> Any:
    """Validate one value for `section.key` as console.toml would; returns it converted (ConfigError if bad)."""
    spec = SETTINGS.get(key)
    if spec is None:
        section, _, name = key.partition(".")
        if section not in SECTIONS:
            raise ConfigError(file, key, "unknown section", _suggest(section, SECTIONS))
        fields = {f.name for f in dataclasses.fields(SECTIONS[section])}
        raise ConfigError(file, key, "unknown key", _suggest(name, fields))
    return _check_value(Path(file), spec, value)


def _build_section(file: Path, name: str, cls: type, raw: Any) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(file, name, "must be a table", f"write it as a [{name}] section", raw)
    fields = {f.name for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in fields:
            raise ConfigError(file, f"{name}.{key}", "unknown key", _suggest(key, fields))
        values[key] = _check_value(file, SETTINGS[f"{name}.{key}"], value)
    section = cls(**values)
    _check_section(file, name, section)
    return section


def _check_section(file: Path, name: str, section: Any) -> None:
    """Cross-field and semantic checks that types alone cannot express."""
    from engine.io.names import UnsafeNameError, check_name

    for sec, key in _NAME_KEYS:
        if sec == name:
            value = getattr(section, key)
            try:
                check_name(value, "run name")
            except UnsafeNameError as exc:
                raise ConfigError(file, f"{name}.{key}", str(exc), "choose a plain run name like run1", value) from None
    if name == "model":
        for i, layer in enumerate(section.capture_layers):
            if layer < 0:
                raise ConfigError(
                    file, f"model.capture_layers[{i}]", "layer ids are 0-indexed and cannot be negative",
                    "use ids between 0 and num_hidden_layers-1, or [] for the default", layer,
                )
        if section.capture_layers and len(section.capture_layers) != 3:
            raise ConfigError(
                file, "model.capture_layers", "EAGLE-3 captures exactly three layers",
                "list three layer ids, or [] for the default [1, L//2-1, L-4]", section.capture_layers,
            )
        if section.capture_layers and sorted(set(section.capture_layers)) != list(section.capture_layers):
            raise ConfigError(
                file, "model.capture_layers", "layer ids must be distinct and increasing",
                "list them low to high, e.g. [1, 15, 28]", section.capture_layers,
            )
    if name == "gpu":
        from engine.system import nccl

        try:
            nccl.get_preset(section.nccl_preset)
        except ValueError as exc:
            raise ConfigError(file, "gpu.nccl_preset", "unknown NCCL preset", str(exc), section.nccl_preset) from None
    if name == "evaluate":
        for i, entry in enumerate(section.sglang_sweep):
            problem = sglang_setting_problem(entry)
            if problem:
                raise ConfigError(file, f"evaluate.sglang_sweep[{i}]", problem,
                                  "write [steps, topk, draft_tokens]: [3, 1, 4] (top-k 1 verifies steps + 1 tokens) "
                                  "or e.g. [5, 4, 8] (top-k above 1: 2 to topk + (steps-1)*topk^2 + 1 tokens)", entry)
    if name in ("server", "train"):
        _check_gpu_list(file, f"{name}.gpus", section.gpus)
    if name == "server" and section.host not in ("127.0.0.1", "localhost", "::1"):
        # Allowed, but only when asked for explicitly: the caller shows a warning.
        pass


def _check_gpu_list(file: Path, key: str, gpus: list[int]) -> None:
    for i, gpu in enumerate(gpus):
        if gpu < 0 or gpu > 1023:
            raise ConfigError(file, f"{key}[{i}]", "is not a GPU index", "use the indices nvidia-smi shows, from 0",
                              gpu)
    if len(set(gpus)) != len(gpus):
        raise ConfigError(file, key, "lists a GPU twice", "list each GPU index once, e.g. [0, 1]", gpus)


def check_gpu_sets(config: Config, file: Path | str = CONFIG_NAME) -> None:
    """Which GPUs the server and the trainer use (server.gpus, train.gpus): the trainer's count matches
    train.num_gpus, the sglang server's matches model.tp_size x dp_size, and the two sets are disjoint
    unless both run on the same single GPU (one GPU, shared: the H200 has room for both)."""
    server, train, model = config.server.gpus, config.train.gpus, config.model
    if train and len(train) != config.train.num_gpus:
        raise ConfigError(file, "train.gpus", f"lists {len(train)} GPU(s) but train.num_gpus = "
                          f"{config.train.num_gpus}", f"set train.num_gpus = {len(train)}, or list "
                          f"{config.train.num_gpus} GPU(s) in train.gpus", train)
    if server and model.backend == "sglang" and len(server) != model.tp_size * model.dp_size:
        raise ConfigError(file, "server.gpus", f"lists {len(server)} GPU(s) but model.tp_size x model.dp_size = "
                          f"{model.tp_size} x {model.dp_size} = {model.tp_size * model.dp_size}",
                          f"list {model.tp_size * model.dp_size} GPU(s) in server.gpus, or set model.tp_size "
                          f"(x model.dp_size) to {len(server)}", server)
    if server and model.backend == "local" and len(server) > 1:
        raise ConfigError(file, "server.gpus", "the local backend runs the target on one GPU",
                          "list one GPU in server.gpus, or set model.backend = \"sglang\" to use tensor "
                          "parallelism", server)
    shared = sorted(set(server) & set(train))
    if shared and (len(server) > 1 or len(train) > 1):
        raise ConfigError(file, "server.gpus", f"overlaps train.gpus on GPU(s) {shared}; several GPUs must be "
                          "split into disjoint sets", "list different GPUs in server.gpus and train.gpus (e.g. "
                          "server.gpus = [0, 1], train.gpus = [2, 3]); only a single GPU may be shared, by "
                          "listing the same one in both", {"server.gpus": server, "train.gpus": train})


def sglang_setting_problem(entry: list[int]) -> str:
    """Why [steps, topk, draft_tokens] is not a speculative setting SGLang serves as written ("" if it is).

    SGLang silently rewrites draft_tokens to steps + 1 at top-k 1, and picks its draft tokens from
    topk + (steps-1)*topk^2 candidates, so a larger count fails at the first request."""
    if len(entry) != 3:
        return "must hold three integers [steps, topk, draft_tokens]"
    steps, topk, draft = entry
    if not (1 <= steps <= 64 and 1 <= topk <= 64):
        return "steps and topk must each be from 1 to 64"
    if topk == 1 and draft != steps + 1:
        return f"with top-k 1 SGLang verifies steps + 1 = {steps + 1} tokens, not {draft}"
    most = topk + (steps - 1) * topk * topk + 1
    if not 2 <= draft <= min(most, 1024):
        return f"draft_tokens must be from 2 to {min(most, 1024)} for {steps} steps at top-k {topk}"
    return ""


def parse_config(text: str, file: Path | str = CONFIG_NAME) -> Config:
    """Parse TOML text into a validated Config; raises ConfigError."""
    file = Path(file)
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(file, "", f"is not valid TOML ({exc})", "fix the syntax at the position shown") from None
    sections: dict[str, Any] = {}
    for name, value in raw.items():
        if name not in SECTIONS:
            raise ConfigError(file, name, "unknown section", _suggest(name, SECTIONS))
        sections[name] = _build_section(file, name, SECTIONS[name], value)
    config = Config(**sections)
    check_gpu_sets(config, file)
    return config


def load_config(workspace: Path | str) -> Config:
    path = Path(workspace) / CONFIG_NAME
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(path, "", "not found", f"run `eagle3-console init {workspace}` to create a workspace") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(path, "", f"cannot be read ({exc})", "check the file's permissions and encoding") from None
    return parse_config(text, path)


def resolve_path(workspace: Path, value: str) -> Path:
    """Config paths are relative to the workspace unless absolute; `~` is expanded."""
    path = Path(value).expanduser()
    return path if path.is_absolute() else (Path(workspace) / path)


def validate_against_model(config: Config, workspace: Path, file: Path | str = CONFIG_NAME) -> None:
    """Checks that need the model's config.json: capture layer ids within range."""
    if not config.model.path or not config.model.capture_layers:
        return
    from engine.model.target import TargetError, text_config

    try:
        layers = text_config(resolve_path(workspace, config.model.path)).get("num_hidden_layers")
    except TargetError:
        return  # the `model` stage reports an unreadable model; nothing to compare here
    if not isinstance(layers, int):
        return
    for i, layer in enumerate(config.model.capture_layers):
        if layer >= layers:
            raise ConfigError(
                file, f"model.capture_layers[{i}]",
                f"is out of range: the model has {layers} decoder layers (ids 0..{layers - 1})",
                f"use ids below {layers}, or [] for the default", layer,
            )


# ----------------------------------------------------------------------------- writing


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # TOML basic strings share JSON's escapes
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(type(value))


def render_config(config: Config, comments: dict[str, str] | None = None) -> str:
    """Write a Config back to TOML (every key, so the file documents itself)."""
    comments = comments or {}
    out: list[str] = ["# eagle3-console workspace configuration. Relative paths are relative to this file.", ""]
    for name, cls in SECTIONS.items():
        out.append(f"[{name}]")
        section = getattr(config, name)
        for f in dataclasses.fields(cls):
            note = comments.get(f"{name}.{f.name}")
            line = f"{f.name} = {_toml_value(getattr(section, f.name))}"
            out.append(f"{line}  # {note}" if note else line)
        out.append("")
    return "\n".join(out)


def set_value(config: Config, dotted: str, value: Any) -> Config:
    """Return a copy with one key changed, validated like the file would be."""
    section_name, _, key = dotted.partition(".")
    if section_name not in SECTIONS:
        raise ConfigError(CONFIG_NAME, dotted, "unknown section", _suggest(section_name, SECTIONS))
    raw = dataclasses.asdict(getattr(config, section_name))
    raw[key] = value
    new_section = _build_section(Path(CONFIG_NAME), section_name, SECTIONS[section_name], raw)
    changed = dataclasses.replace(config, **{section_name: new_section})
    check_gpu_sets(changed)  # as the file would be checked: a saved console.toml must load again
    return changed
