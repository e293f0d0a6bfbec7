"""Tests for engine.system.nccl: presets, child environments, and the variables the GPU pane shows."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from engine.system.nccl import PRESETS, NcclPreset, build_child_env, effective_nccl_vars, get_preset, suggest_preset


def test_required_presets_exist() -> None:
    assert {"none", "pcie-sm120", "p2p-off"} <= set(PRESETS)
    assert get_preset("none").env == {}
    assert get_preset("p2p-off").env == {"NCCL_P2P_DISABLE": "1"}
    assert get_preset("pcie-sm120").env == {
        "NCCL_PROTO": "LL",
        "NCCL_ALGO": "Ring",
        "NCCL_P2P_LEVEL": "SYS",
        "NCCL_MAX_NCHANNELS": "16",
        "NCCL_BUFFSIZE": "16777216",
        "NCCL_NTHREADS": "512",
    }
    for name, preset in PRESETS.items():
        assert isinstance(preset, NcclPreset) and preset.name == name and preset.description
        assert all(k.startswith("NCCL_") and isinstance(v, str) for k, v in preset.env.items())


def test_unknown_preset_lists_names_and_suggests() -> None:
    with pytest.raises(ValueError) as info:
        get_preset("pcie-sm12")
    message = str(info.value)
    assert "'pcie-sm12'" in message
    assert "none, p2p-off, pcie-sm120" in message
    assert "Did you mean 'pcie-sm120'?" in message


def test_unknown_preset_without_close_match_has_no_suggestion() -> None:
    with pytest.raises(ValueError, match="valid presets") as info:
        get_preset("zzzzzzzz")
    assert "Did you mean" not in str(info.value)


def test_build_child_env_layers_base_preset_nvls_extra() -> None:
    base = {"PATH": "/usr/bin", "NCCL_PROTO": "Simple", "NCCL_DEBUG": "WARN"}
    env = build_child_env("pcie-sm120", base_env=base, extra={"NCCL_DEBUG": "INFO", "CUDA_VISIBLE_DEVICES": "0,1"})
    assert env["PATH"] == "/usr/bin"
    assert env["NCCL_PROTO"] == "LL"  # preset beats base
    assert env["NCCL_NVLS_ENABLE"] == "0"
    assert env["NCCL_DEBUG"] == "INFO"  # extra last
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert base == {"PATH": "/usr/bin", "NCCL_PROTO": "Simple", "NCCL_DEBUG": "WARN"}  # not mutated
    assert "NCCL_NVLS_ENABLE" not in get_preset("pcie-sm120").env  # shared preset not mutated


def test_nvls_respects_base_and_flag() -> None:
    assert build_child_env("none", base_env={"NCCL_NVLS_ENABLE": "1"})["NCCL_NVLS_ENABLE"] == "1"
    assert "NCCL_NVLS_ENABLE" not in build_child_env("none", base_env={}, disable_nvls=False)
    assert build_child_env("none", base_env={}) == {"NCCL_NVLS_ENABLE": "0"}


def test_build_child_env_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EAGLE3_NCCL_TEST_MARKER", "yes")
    env = build_child_env("p2p-off")
    assert env["EAGLE3_NCCL_TEST_MARKER"] == "yes"
    assert env["NCCL_P2P_DISABLE"] == "1"


def test_build_child_env_rejects_bad_extra_and_preset() -> None:
    with pytest.raises(ValueError, match="unknown NCCL preset"):
        build_child_env("fast", base_env={})
    with pytest.raises(ValueError, match="NCCL_NTHREADS"):
        build_child_env("none", base_env={}, extra={"NCCL_NTHREADS": 512})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="invalid environment variable name"):
        build_child_env("none", base_env={}, extra={"A=B": "1"})


def test_child_process_really_receives_preset() -> None:
    """A real child process started with the built env sees exactly the preset's variables."""
    env = build_child_env("pcie-sm120", base_env={"PATH": os.environ.get("PATH", "")})
    code = "import os, json; print(json.dumps({k: v for k, v in os.environ.items() if k.startswith('NCCL_')}))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, timeout=30)
    seen = json.loads(out.stdout)
    assert seen == {**get_preset("pcie-sm120").env, "NCCL_NVLS_ENABLE": "0"}


def test_effective_nccl_vars_filters_and_sorts() -> None:
    env = {"PATH": "/bin", "NCCL_PROTO": "LL", "CUDA_VISIBLE_DEVICES": "3", "NCCL_ALGO": "Ring",
           "CUDA_HOME": "/usr/local/cuda", "XNCCL_FOO": "1"}
    result = effective_nccl_vars(env)
    assert result == {"CUDA_VISIBLE_DEVICES": "3", "NCCL_ALGO": "Ring", "NCCL_PROTO": "LL"}
    assert list(result) == sorted(result)


def test_suggest_preset() -> None:
    assert suggest_preset((12, 0), "PCIe (SYS)") == "pcie-sm120"
    assert suggest_preset((12, 0), "NVLink (4 active links per GPU)") == "none"
    assert suggest_preset((9, 0), "PCIe (PHB)") == "none"
    assert suggest_preset(None, "unknown") == "none"
