"""Launch spec for the embedded local target server (`python -m engine.localserver`)."""

from __future__ import annotations

import os
import sys

from engine.system import nccl
from engine.system.gpusets import visible_devices_env
from engine.server.spec import LaunchSpec


def build_local_spec(workspace, capture: bool = True, port: int | None = None) -> LaunchSpec:
    from engine.config import ConfigError
    from engine.model.target import TargetError, workspace_plan

    cfg = workspace.config
    model_dir = workspace.model_dir
    layers: list[int] = []
    if capture:
        try:
            layers = list(workspace_plan(workspace).capture_layers)
        except TargetError as exc:  # never start a capture server that silently captures nothing
            raise ConfigError(workspace.config_path, "model.path", str(exc),
                              "fix the `model` stage, or start the server without capture") from None
    port = port or cfg.server.port
    argv = [
        sys.executable, "-m", "engine.localserver",
        "--model-path", str(model_dir),
        "--host", cfg.server.host,
        "--port", str(port),
        "--device", cfg.server.device,
        "--dtype", cfg.model.dtype,
    ]
    if capture and layers:
        argv += ["--capture-layers", ",".join(str(i) for i in layers), "--spool-dir", str(workspace.spool_dir)]
    env_set: dict[str, str] = {"PYTHONUNBUFFERED": "1"}
    # The key travels in the environment, not argv: argv is visible to every user in `ps`.
    if cfg.server.api_key:
        env_set["LOCALSERVER_API_KEY"] = cfg.server.api_key
    env_set.update(visible_devices_env(cfg.server.gpus))  # server.gpus: apart from the trainer's
    env = nccl.build_child_env(cfg.gpu.nccl_preset, base_env=os.environ, disable_nvls=cfg.gpu.disable_nvls,
                               extra=env_set)
    shown = {**nccl.effective_nccl_vars(env), **env_set}
    return LaunchSpec(
        backend="local", argv=argv, env=env, env_set=shown, host=cfg.server.host, port=port,
        api_key=cfg.server.api_key or None, capture=bool(capture and layers), spool_dir=str(workspace.spool_dir),
        capture_layers=tuple(layers),
        notes=("local transformers server: no prefix cache, so every prompt token is computed and captured",),
    )


def build_spec(workspace, capture: bool = True, port: int | None = None) -> LaunchSpec:
    """The launch for the configured backend."""
    if workspace.config.model.backend == "sglang":
        from engine.sglang.launch import build_sglang_spec  # arrives with the SGLang backend

        return build_sglang_spec(workspace, capture=capture, port=port)
    return build_local_spec(workspace, capture=capture, port=port)
