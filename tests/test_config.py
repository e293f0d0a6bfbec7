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


def test_cli_reports_bad_config_without_traceback(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "console.toml").write_text("[server]\nprot = 1\n")
    proc = subprocess.run([sys.executable, "-m", "eagle3_console", "check", "disk", "-w", str(ws)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "server.prot" in proc.stderr and "did you mean 'port'?" in proc.stderr
