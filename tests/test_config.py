"""Config parsing and validation: good files load typed, bad files give a clear error."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine.config import (
    Config,
    ConfigError,
    load_config,
    parse_config,
    render_config,
    set_value,
    validate_against_model,
)
from engine.workspace import demo_config


def test_defaults_are_typed_and_safe():
    config = parse_config("")
    assert isinstance(config, Config)
    assert config.server.host == "127.0.0.1"
    assert config.model.backend == "local"
    assert config.extract.disk_reserve_gb == 50.0
    assert config.train.ttt_steps == 7


def test_full_file_round_trips():
    text = render_config(demo_config())
    again = parse_config(text)
    assert again == demo_config()
    assert render_config(again) == text


def test_int_accepted_for_float():
    config = parse_config("[extract]\ndisk_reserve_gb = 10\n")
    assert config.extract.disk_reserve_gb == 10.0 and isinstance(config.extract.disk_reserve_gb, float)


@pytest.mark.parametrize(
    "text, key, words",
    [
        ('[server]\nport = "30000"\n', "server.port", "must be an integer"),
        ("[server]\nport = 70000\n", "server.port", "at most 65535"),
        ("[extract]\nconcurrency = 0\n", "extract.concurrency", "at least 1"),
        ("[extract]\ncreate_output_dir = 1\n", "extract.create_output_dir", "true or false"),
        ("[model]\ncapture_layers = 3\n", "model.capture_layers", "list of integers"),
        ('[model]\ncapture_layers = [1, "2", 3]\n', "model.capture_layers[1]", "must be an integer"),
        ("[model]\ncapture_layers = [1, -2, 3]\n", "model.capture_layers[1]", "cannot be negative"),
        ("[model]\ncapture_layers = [1, 2]\n", "model.capture_layers", "exactly three"),
        ("[model]\ncapture_layers = [5, 2, 9]\n", "model.capture_layers", "increasing"),
        ('[model]\nbackend = "vllm"\n', "model.backend", "use one of local, sglang"),
        ('[gpu]\nnccl_preset = "pcie"\n', "gpu.nccl_preset", "unknown NCCL preset"),
        ('[train]\nrun = "../escape"\n', "train.run", "invalid run name"),
        ("[model]\nmodel = 1\n", "model.model", "unknown key"),
        ("model = 1\n", "model", "must be a table"),
    ],
)
def test_bad_values_name_key_value_and_fix(text, key, words):
    with pytest.raises(ConfigError) as info:
        parse_config(text, "ws/console.toml")
    err = info.value
    assert err.key == key
    assert words in str(err)
    assert "ws/console.toml" in str(err)
    assert "Fix:" in str(err) and err.fix


def test_unknown_key_suggests_nearest():
    with pytest.raises(ConfigError) as info:
        parse_config("[extract]\ndisk_reserve_gib = 10\n")
    assert "did you mean 'disk_reserve_gb'?" in str(info.value)


def test_unknown_section_suggests_nearest():
    with pytest.raises(ConfigError) as info:
        parse_config("[trian]\nepochs = 1\n")
    assert info.value.key == "trian"
    assert "did you mean 'train'?" in str(info.value)


def test_syntax_error_is_a_config_error():
    with pytest.raises(ConfigError) as info:
        parse_config("[model\npath = 'x'\n", "c.toml")
    assert "not valid TOML" in str(info.value)


def test_missing_file_says_how_to_create(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path)
    assert "eagle3-console init" in str(info.value)


def test_layer_ids_out_of_range_against_model(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 6, "hidden_size": 64, "vocab_size": 100}))
    config = parse_config('[model]\npath = "m"\ncapture_layers = [1, 2, 6]\n')
    with pytest.raises(ConfigError) as info:
        validate_against_model(config, tmp_path)
    assert info.value.key == "model.capture_layers[2]"
    assert "6 decoder layers" in str(info.value)
    ok = parse_config('[model]\npath = "m"\ncapture_layers = [1, 2, 5]\n')
    validate_against_model(ok, tmp_path)  # in range: no error


def test_missing_model_path_is_reported_by_the_model_stage(tmp_path):
    """An empty model path is valid TOML; the `model` check must fail and name the key."""
    import asyncio

    from engine.checks.context import CheckContext
    from engine.pipeline import Pipeline
    from engine.workspace import init_workspace

    ws = init_workspace(tmp_path / "ws")
    report = asyncio.run(Pipeline(CheckContext(ws)).run_stage("model"))
    assert report.state.value == "failed"
    assert "model.path" in report.results[0].evidence


def test_set_value_validates():
    config = demo_config()
    changed = set_value(config, "ui.theme", "eagle3-light")
    assert changed.ui.theme == "eagle3-light" and config.ui.theme != "eagle3-light"
    with pytest.raises(ConfigError):
        set_value(config, "server.port", "abc")


SGLANG_TP2 = '[model]\nbackend = "sglang"\ntp_size = 2\n'


@pytest.mark.parametrize("text, key, words", [
    # Several GPUs each, overlapping: refused, naming both keys and the fix.
    (SGLANG_TP2 + "[server]\ngpus = [0, 1]\n[train]\nnum_gpus = 2\ngpus = [1, 2]\n", "server.gpus",
     ["overlaps train.gpus on GPU(s) [1]", "disjoint", "server.gpus = [0, 1], train.gpus = [2, 3]"]),
    ("[server]\ngpus = [0]\n[train]\nnum_gpus = 2\ngpus = [0, 1]\n", "server.gpus",
     ["overlaps train.gpus on GPU(s) [0]", "only a single GPU may be shared"]),
    ("[train]\ngpus = [2, 3]\n", "train.gpus", ["train.num_gpus = 1", "set train.num_gpus = 2"]),
    ("[train]\nnum_gpus = 4\ngpus = [2, 3]\n", "train.gpus", ["set train.num_gpus = 2", "list 4 GPU(s)"]),
    (SGLANG_TP2 + "[server]\ngpus = [0]\n", "server.gpus",
     ["model.tp_size x model.dp_size = 2 x 1 = 2", "list 2 GPU(s) in server.gpus"]),
    ("[server]\ngpus = [0, 1]\n", "server.gpus", ["local backend runs the target on one GPU", "model.backend"]),
    ("[server]\ngpus = [1, 1]\n", "server.gpus", ["lists a GPU twice"]),
    ("[train]\ngpus = [-1]\n", "train.gpus[0]", ["is not a GPU index"]),
    ('[train]\ngpus = "0,1"\n', "train.gpus", ["list of integers"]),
])
def test_gpu_sets_are_checked_and_errors_name_the_keys_and_fix(text, key, words):
    with pytest.raises(ConfigError) as info:
        parse_config(text)
    assert info.value.key == key and info.value.fix
    for word in words:
        assert word in str(info.value)


def test_gpu_sets_default_to_every_gpu_and_may_share_one():
    assert parse_config("").server.gpus == [] and parse_config("").train.gpus == []  # today's behaviour
    shared = parse_config("[server]\ngpus = [0]\n[train]\ngpus = [0]\n")  # one GPU, server and trainer on it
    assert shared.server.gpus == shared.train.gpus == [0]
    split = parse_config(SGLANG_TP2 + "[server]\ngpus = [0, 1]\n[train]\nnum_gpus = 2\ngpus = [2, 3]\n")
    assert (split.server.gpus, split.train.gpus) == ([0, 1], [2, 3])
    # set_value checks as the file would: what it returns always saves and loads again.
    with pytest.raises(ConfigError, match="train.gpus: overlaps|server.gpus: overlaps"):
        set_value(set_value(split, "train.num_gpus", 2), "train.gpus", [1, 2])
    assert parse_config(render_config(split)) == split


def test_cli_reports_bad_config_without_traceback(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "console.toml").write_text("[server]\nprot = 1\n")
    proc = subprocess.run([sys.executable, "-m", "eagle3_console", "check", "disk", "-w", str(ws)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "server.prot" in proc.stderr and "did you mean 'port'?" in proc.stderr


# ---- every number finite and in range (issue 20, item 3) -------------------------------------

import math  # noqa: E402
import typing  # noqa: E402

from engine.config import SECTIONS  # noqa: E402


def _numeric_keys() -> list[tuple[str, type]]:
    keys = []
    for section, cls in SECTIONS.items():
        for name, tp in typing.get_type_hints(cls).items():
            if tp in (int, float) and name in cls.__dataclass_fields__:
                keys.append((f"{section}.{name}", tp))
    return keys


NUMERIC_KEYS = _numeric_keys()
# (TOML literal, what the error must show of it); every numeric key is non-negative.
BAD_NUMBERS = {
    "nan": ("nan", "nan"),
    "+inf": ("inf", "inf"),
    "-inf": ("-inf", "-inf"),
    "huge": (None, None),  # per type: 1e300 for a float, 10**18 for an integer
    "negative": ("-1", "-1"),
}


def _toml(dotted: str, literal: str) -> str:
    section, _, key = dotted.partition(".")
    return f"[{section}]\n{key} = {literal}\n"


def test_numeric_keys_are_found():
    keys = dict(NUMERIC_KEYS)
    assert len(keys) > 30
    assert keys["train.learning_rate"] is float and keys["extract.disk_reserve_gb"] is float
    assert keys["server.port"] is int and keys["train.seed"] is int


@pytest.mark.parametrize("kind", list(BAD_NUMBERS))
@pytest.mark.parametrize("dotted, tp", NUMERIC_KEYS, ids=[k for k, _ in NUMERIC_KEYS])
def test_every_numeric_key_rejects_non_finite_huge_and_negative(dotted, tp, kind):
    literal, shown = BAD_NUMBERS[kind]
    if kind == "huge":
        literal, shown = ("1e300", "1e+300") if tp is float else (str(10**18), str(10**18))
    with pytest.raises(ConfigError) as info:
        parse_config(_toml(dotted, literal), "ws/console.toml")
    err = info.value
    message = str(err)
    assert err.key == dotted, message
    assert f"(got {shown})" in message, message  # the bad value, as read
    assert "ws/console.toml" in message and "Fix:" in message
    assert any(ch.isdigit() for ch in err.fix), f"the fix should name the valid range: {message}"


@pytest.mark.parametrize("dotted, tp", NUMERIC_KEYS, ids=[k for k, _ in NUMERIC_KEYS])
def test_set_value_rejects_non_finite_numbers(dotted, tp):
    """The console and the tests change keys through set_value: the same rules as the file."""
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(ConfigError) as info:
            set_value(Config(), dotted, bad)
        assert info.value.key == dotted


@pytest.mark.parametrize("text, key", [
    ("[train]\nlearning_rate = nan\n", "train.learning_rate"),
    ("[train]\nlearning_rate = inf\n", "train.learning_rate"),
    ("[train]\ngrad_clip = nan\n", "train.grad_clip"),
    ("[extract]\ndisk_reserve_gb = nan\n", "extract.disk_reserve_gb"),
    ("[extract]\ndisk_reserve_gb = inf\n", "extract.disk_reserve_gb"),
])
def test_issue_20_non_finite_values_are_refused(text, key):
    """The values found accepted by issue 20 (NaN lr died in the job; NaN reserve was a traceback)."""
    with pytest.raises(ConfigError) as info:
        parse_config(text)
    assert info.value.key == key
    assert "finite" in info.value.problem


def test_every_key_is_declared_once_with_help_and_a_default_in_range():
    from engine.config import SETTINGS  # the one table: type, default, bounds, choices, help

    fields = {f"{s}.{f}" for s, cls in SECTIONS.items() for f in cls.__dataclass_fields__}
    assert set(SETTINGS) == fields
    defaults = Config()
    for dotted, spec in SETTINGS.items():
        assert spec.help, f"{dotted} has no help text"
        section, _, key = dotted.partition(".")
        value = getattr(getattr(defaults, section), key)
        if spec.type in (int, float):
            assert spec.low is not None and spec.high is not None, f"{dotted} needs both bounds"
            assert spec.low <= value <= spec.high, dotted
        if spec.choices:
            assert value in spec.choices, dotted
    parse_config(render_config(defaults))  # the defaults themselves validate


@pytest.mark.parametrize("dotted, tp", NUMERIC_KEYS, ids=[k for k, _ in NUMERIC_KEYS])
def test_bounds_themselves_are_accepted(dotted, tp):
    from engine.config import SETTINGS

    spec = SETTINGS[dotted]
    for edge in (spec.low, spec.high):
        value = tp(edge)
        config = set_value(Config(), dotted, value)
        section, _, key = dotted.partition(".")
        assert getattr(getattr(config, section), key) == value


def test_written_console_toml_documents_every_key(tmp_path):
    """Help comes from the same declaration as validation: every key line carries its help,
    and a numeric key's help names its range."""
    from engine.workspace import init_workspace

    ws = init_workspace(tmp_path / "ws")
    text = ws.config_path.read_text()
    lines = [line for line in text.splitlines() if line and not line.startswith(("#", "["))]
    assert lines
    undocumented = [line for line in lines if "  # " not in line]
    assert not undocumented, undocumented
    reserve = next(line for line in lines if line.startswith("disk_reserve_gb ="))
    assert "extraction pauses" in reserve and "0 to" in reserve
    assert parse_config(text) == ws.config


@pytest.mark.parametrize("value", ["nan", "inf"])
@pytest.mark.parametrize("argv", [["check", "disk"], ["status"], []], ids=["check", "status", "console"])
def test_cli_non_finite_reserve_is_one_clear_line(tmp_path, argv, value):
    """issue 20: `disk_reserve_gb = nan|inf` was a raw traceback from check, status and the console."""
    from engine.workspace import init_workspace

    ws = init_workspace(tmp_path / "ws")
    text = ws.config_path.read_text()
    lines = [f"disk_reserve_gb = {value}" if line.startswith("disk_reserve_gb =") else line
             for line in text.splitlines()]
    ws.config_path.write_text("\n".join(lines) + "\n")
    proc = subprocess.run([sys.executable, "-m", "eagle3_console", "-w", str(ws.root), *argv],
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1, proc.stderr
    assert "extract.disk_reserve_gb" in err[0] and f"(got {value})" in err[0] and "Fix:" in err[0]


def test_save_setting_changes_one_key_in_place_and_refuses_bad_values_writing_nothing(tmp_path):
    from engine.workspace import init_workspace

    ws = init_workspace(tmp_path / "ws")
    text = "# the operator's note\n" + ws.config_path.read_text().replace("[extract]\n", "[extract]\n# keep 3\n")
    ws.config_path.write_text(text)
    for key, value, said in (("extract.max_retries", -3, "must be at least 0"), ("nosuch.key", 1, "unknown section"),
                             ("ui.nosuch", 1, "unknown key")):
        with pytest.raises(ConfigError, match=said):
            ws.save_setting(key, value)
        assert ws.config_path.read_text() == text
    config = ws.save_setting("extract.max_retries", 3)
    assert config.extract.max_retries == 3 == ws.reload().extract.max_retries
    lines = ws.config_path.read_text().splitlines()
    assert [line for line in lines if line.startswith("max_retries = ")][0].startswith("max_retries = 3  # retries")
    assert ws.config_path.read_text().replace("max_retries = 3", "max_retries = 2") == text
