"""Typed workspace configuration (`<ws>/console.toml`).

Every section is a dataclass; parsing walks the dataclass fields so the schema lives in
one place. User mistakes become a `ConfigError` naming the file, the key, the bad value
and the fix; an unknown key suggests the nearest valid one.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

CONFIG_NAME = "console.toml"


class ConfigError(Exception):
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


@dataclass
class ModelConfig:
    """The target model whose drafter we build."""

    path: str = ""  # HF model directory; relative paths are relative to the workspace
    backend: str = "local"  # local | sglang
    capture_layers: list[int] = field(default_factory=list)  # 0-indexed outputs; [] = default
    tp_size: int = 1
    dp_size: int = 1
    ep_size: int = 1
    dtype: str = "auto"  # auto | bfloat16 | float16 | float32

    CHOICES = {"backend": ("local", "sglang"), "dtype": ("auto", "bfloat16", "float16", "float32")}
    HELP = {
        "path": "the target model directory (config.json, weights, tokenizer)",
        "capture_layers": "0-indexed decoder layers whose outputs feed the drafter; [] picks [1, L//2-1, L-4]",
    }


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 30000
    device: str = "auto"  # local backend: auto | cpu | cuda
    api_key: str = ""
    attention_backend: str = ""  # sglang: "" = per GPU architecture
    extra_args: list[str] = field(default_factory=list)
    startup_timeout_s: float = 600.0
    restart_on_crash: bool = True
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str = ""

    CHOICES = {"device": ("auto", "cpu", "cuda")}


@dataclass
class GpuConfig:
    nccl_preset: str = "none"  # none | pcie-sm120 | p2p-off
    disable_nvls: bool = True
    sample_interval_s: float = 1.0
    slow_sample_interval_s: float = 5.0


@dataclass
class DatasetConfig:
    path: str = ""
    eval_path: str = ""
    format: str = "auto"  # auto | messages | sharegpt
    max_seq_len: int = 2048
    on_bad_line: str = "skip"  # skip | stop

    CHOICES = {"format": ("auto", "messages", "sharegpt"), "on_bad_line": ("skip", "stop")}


@dataclass
class ExtractConfig:
    output_dir: str = "hidden"
    run: str = "run1"
    spool_dir: str = "/dev/shm/eagle3-spool"
    create_output_dir: bool = True
    disk_reserve_gb: float = 50.0
    spool_reserve_gb: float = 1.0
    concurrency: int = 4
    endpoints: list[str] = field(default_factory=list)  # extra server URLs for data-parallel extraction
    max_retries: int = 2


@dataclass
class TrainConfig:
    output_dir: str = "drafters"
    run: str = "run1"
    epochs: int = 2
    learning_rate: float = 1e-4
    warmup_ratio: float = 0.02
    max_len: int = 2048
    batch_size: int = 1
    grad_clip: float = 0.5
    ttt_steps: int = 7
    draft_vocab_size: int = 32000
    save_every: int = 500
    log_every: int = 10
    eval_fraction: float = 0.05
    num_gpus: int = 1
    seed: int = 0


@dataclass
class EvaluateConfig:
    output_dir: str = "eval"
    run: str = "run1"
    num_prompts: int = 40
    max_new_tokens: int = 256
    spec_steps: int = 3
    spec_topk: int = 1
    spec_draft_tokens: int = 4


@dataclass
class UiConfig:
    theme: str = "eagle3-dark"
    refresh_s: float = 1.0


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

# Numeric lower bounds: (section, key) -> (minimum, inclusive)
_MINIMUMS: dict[tuple[str, str], float] = {
    ("model", "tp_size"): 1,
    ("model", "dp_size"): 1,
    ("model", "ep_size"): 1,
    ("server", "port"): 1,
    ("server", "startup_timeout_s"): 1,
    ("server", "nnodes"): 1,
    ("server", "node_rank"): 0,
    ("gpu", "sample_interval_s"): 0.1,
    ("gpu", "slow_sample_interval_s"): 0.1,
    ("dataset", "max_seq_len"): 16,
    ("extract", "disk_reserve_gb"): 0,
    ("extract", "spool_reserve_gb"): 0,
    ("extract", "concurrency"): 1,
    ("extract", "max_retries"): 0,
    ("train", "epochs"): 1,
    ("train", "learning_rate"): 1e-12,
    ("train", "warmup_ratio"): 0,
    ("train", "max_len"): 16,
    ("train", "batch_size"): 1,
    ("train", "grad_clip"): 0,
    ("train", "ttt_steps"): 1,
    ("train", "draft_vocab_size"): 2,
    ("train", "save_every"): 1,
    ("train", "log_every"): 1,
    ("train", "eval_fraction"): 0,
    ("train", "num_gpus"): 1,
    ("evaluate", "num_prompts"): 1,
    ("evaluate", "max_new_tokens"): 1,
    ("evaluate", "spec_steps"): 1,
    ("evaluate", "spec_topk"): 1,
    ("evaluate", "spec_draft_tokens"): 1,
    ("ui", "refresh_s"): 0.1,
}
_MAXIMUMS: dict[tuple[str, str], float] = {
    ("server", "port"): 65535,
    ("train", "warmup_ratio"): 1,
    ("train", "eval_fraction"): 0.9,
}
_NAME_KEYS = {("extract", "run"), ("train", "run"), ("evaluate", "run")}


def _suggest(key: str, valid: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.5)
    return f"did you mean '{close[0]}'?" if close else "valid keys: " + ", ".join(sorted(valid))


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is list:
        (inner,) = typing.get_args(tp)
        return "a list of " + {int: "integers", float: "numbers", str: "strings"}.get(inner, str(inner))
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, str(tp))


def _convert(file: Path, key: str, value: Any, tp: Any) -> Any:
    """Check `value` against the field type `tp`; ints are accepted for floats."""
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
            raise ConfigError(file, key, "must be an integer", "write a whole number without quotes", value)
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(file, key, "must be a number", "write a number without quotes", value)
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(file, key, "must be a string", 'put the value in double quotes', value)
        return value
    raise TypeError(f"unsupported config field type {tp!r}")  # programming error, not user error


def _build_section(file: Path, name: str, cls: type, raw: Any) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(file, name, "must be a table", f"write it as a [{name}] section", raw)
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for key, value in raw.items():
        dotted = f"{name}.{key}"
        if key not in fields:
            raise ConfigError(file, dotted, "unknown key", _suggest(key, fields))
        converted = _convert(file, dotted, value, hints[key])
        choices = getattr(cls, "CHOICES", {}).get(key)
        if choices and converted not in choices:
            raise ConfigError(file, dotted, "is not a valid choice", "use one of " + ", ".join(choices), value)
        low = _MINIMUMS.get((name, key))
        if low is not None and converted < low:
            raise ConfigError(file, dotted, f"must be at least {low:g}", f"set it to {low:g} or more", value)
        high = _MAXIMUMS.get((name, key))
        if high is not None and converted > high:
            raise ConfigError(file, dotted, f"must be at most {high:g}", f"set it to {high:g} or less", value)
        values[key] = converted
    section = cls(**values)
    _check_section(file, name, section)
    return section


def _check_section(file: Path, name: str, section: Any) -> None:
    """Cross-field and semantic checks that types alone cannot express."""
    from engine.names import UnsafeNameError, check_name

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
        from engine import nccl

        try:
            nccl.get_preset(section.nccl_preset)
        except ValueError as exc:
            raise ConfigError(file, "gpu.nccl_preset", "unknown NCCL preset", str(exc), section.nccl_preset) from None
    if name == "server" and section.host not in ("127.0.0.1", "localhost", "::1"):
        # Allowed, but only when asked for explicitly: the caller shows a warning.
        pass


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
    return Config(**sections)


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


def model_num_layers(model_dir: Path) -> int | None:
    """num_hidden_layers from config.json (text_config for multimodal wrappers), or None."""
    try:
        data = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    for holder in (data, data.get("text_config") or {}, data.get("language_config") or {}):
        if isinstance(holder, dict) and isinstance(holder.get("num_hidden_layers"), int):
            return holder["num_hidden_layers"]
    return None


def validate_against_model(config: Config, workspace: Path, file: Path | str = CONFIG_NAME) -> None:
    """Checks that need the model's config.json: capture layer ids within range."""
    if not config.model.path or not config.model.capture_layers:
        return
    layers = model_num_layers(resolve_path(workspace, config.model.path))
    if layers is None:
        return  # the `model` stage reports an unreadable model; nothing to compare here
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
    return dataclasses.replace(config, **{section_name: new_section})
