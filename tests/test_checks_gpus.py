"""The `gpus` stage without NVML (real here: this machine has no NVIDIA driver).

Without a GPU the embedded local backend still runs on the CPU, so the stage is amber
(warned), never green; anything that needs a GPU (device cuda, the sglang backend) fails.
"""

from __future__ import annotations

import asyncio

import pytest

from engine.checks.context import CheckContext
from engine.config import set_value
from engine.system.gpu import GpuSampler
from engine.pipeline import Pipeline
from engine.workspace import init_workspace

pytestmark = pytest.mark.skipif(GpuSampler().sample().available, reason="NVML answers here: the GPU path applies")


@pytest.mark.parametrize("changes, state", [
    ({}, "warned"),
    ({"server.device": "cpu"}, "warned"),
    ({"server.device": "cuda"}, "failed"),
    ({"model.backend": "sglang"}, "failed"),
])
def test_no_nvml_is_amber_for_the_cpu_local_backend_and_red_otherwise(tmp_path, changes, state):
    ws = init_workspace(tmp_path / "ws")
    config = ws.config
    for key, value in changes.items():
        config = set_value(config, key, value)
    ws.save_config(config)
    report = asyncio.run(Pipeline(CheckContext(ws)).run_stage("gpus"))
    assert report.state.value == state
    (result,) = report.results
    assert result.evidence.startswith("NVML unavailable")
    assert result.fix
