"""Launch spec for a real SGLang server: `python -m sglang.launch_server` argv + environment.

Every flag chosen for capture comes with a note saying why (LaunchSpec.notes), and the
capture layers are shown in both numberings. Version differences come from
engine.sglang.versions; nothing version-specific is spelled out here.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from engine.system import nccl
from engine.system.gpusets import visible_devices_env
from engine.server.spec import LaunchSpec
from engine.sglang.versions import (
    UnsupportedSglangError,
    VersionProfile,
    detect_profile,
    profile_for,
)

HOOK_FACTORY = "engine.sglang.hook:make_capture_hook"
HOOK_NAME = "eagle3-console-capture"
ENV_SPOOL = "EAGLE3_CAPTURE_SPOOL"
ENV_LAYERS = "EAGLE3_CAPTURE_LAYERS"
# Set it to print a command for a machine whose SGLang this one cannot import.
ENV_VERSION_OVERRIDE = "EAGLE3_SGLANG_VERSION"
SM120_BACKEND = "triton"
_UNPROBED = object()
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the directory holding `engine/`


def _config_error(workspace, key: str, problem: str, fix: str, value=None):
    from engine.config import ConfigError

    return ConfigError(workspace.config_path, key, problem, fix, value)


def _profile(workspace, version: str | None) -> VersionProfile:
    version = version or os.environ.get(ENV_VERSION_OVERRIDE) or None
    try:
        return profile_for(version) if version else detect_profile()
    except UnsupportedSglangError as exc:
        message = str(exc)
        problem, _, fix = message.partition(" Fix: ")
        raise _config_error(workspace, "model.backend", problem, fix or "install a supported SGLang") from None


def probe_compute_capability() -> tuple[int, int] | None:
    """Compute capability of the first GPU via NVML; None when NVML or GPUs are absent."""
    from engine.system.gpu import GpuSampler

    sampler = GpuSampler()
    try:
        snap = sampler.sample()
    finally:
        sampler.close()
    caps = [g.compute_capability for g in snap.gpus if g.compute_capability] if snap.available else []
    return caps[0] if caps else None


def choose_attention_backend(configured: str, capability: tuple[int, int] | None) -> tuple[str | None, str]:
    """(backend to pass or None, note). The user's choice always wins."""
    from engine.system.gpu import architecture_name

    if configured:
        return configured, f"attention backend {configured!r} (server.attention_backend)"
    if capability is None:
        return None, "attention backend left to SGLang: compute capability unknown (NVML unavailable)"
    if capability[0] == 12:
        return SM120_BACKEND, (f"attention backend {SM120_BACKEND!r}: {architecture_name(capability)} hangs with "
                               "flashinfer and has no trtllm_mla kernels")
    return None, f"attention backend left to SGLang's default for {architecture_name(capability)}"


def _flag_name(arg: str) -> str:
    return arg.split("=", 1)[0]


def _check_extra_args(workspace, extra: list[str], profile: VersionProfile, capture: bool, emitted: set[str]) -> None:
    for arg in extra:
        name = _flag_name(arg)
        if capture and name in profile.capture_forbidden:
            raise _config_error(workspace, "server.extra_args", f"{name} breaks hidden-state capture",
                                "remove it from server.extra_args (or start the server without capture)", arg)
        if name in emitted:
            raise _config_error(workspace, "server.extra_args",
                                f"{name} is already set by the console from its own config",
                                "remove it from server.extra_args and use the matching console.toml key", arg)


def build_sglang_spec(workspace, capture: bool = True, port: int | None = None, *, version: str | None = None,
                      compute_capability=_UNPROBED) -> LaunchSpec:
    """The SGLang launch for this workspace; ConfigError naming the fix for a config it cannot serve."""
    from engine.model.target import TargetError, workspace_plan

    cfg = workspace.config
    profile = _profile(workspace, version)
    model_dir = workspace.model_dir
    port = port or cfg.server.port
    notes: list[str] = [f"SGLang {profile.version} (profile in engine/sglang/versions.py)"]
    argv = [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", str(model_dir),
        "--host", cfg.server.host,
        "--port", str(port),
        "--tp-size", str(cfg.model.tp_size),
        "--dp-size", str(cfg.model.dp_size),
        "--ep-size", str(cfg.model.ep_size),
    ]
    if cfg.model.dtype != "auto":
        argv += ["--dtype", cfg.model.dtype]
    if cfg.server.api_key:
        argv += ["--api-key", cfg.server.api_key]
    if cfg.server.nnodes > 1:
        if not cfg.server.dist_init_addr:
            raise _config_error(workspace, "server.dist_init_addr", "is empty but server.nnodes > 1",
                                "set it to host:port of node 0, the same on every node")
        if cfg.server.node_rank >= cfg.server.nnodes:
            raise _config_error(workspace, "server.node_rank", f"must be below server.nnodes ({cfg.server.nnodes})",
                                "number the nodes 0 .. nnodes-1", cfg.server.node_rank)
        argv += ["--nnodes", str(cfg.server.nnodes), "--node-rank", str(cfg.server.node_rank),
                 "--dist-init-addr", cfg.server.dist_init_addr]
        notes.append(f"multi-node: node {cfg.server.node_rank} of {cfg.server.nnodes}, rendezvous "
                     f"{cfg.server.dist_init_addr}")
    capability = probe_compute_capability() if compute_capability is _UNPROBED else compute_capability
    backend, note = choose_attention_backend(cfg.server.attention_backend, capability)
    if backend:
        argv += ["--attention-backend", backend]
    notes.append(note)
    for flags, why in profile.base_flags:
        argv += list(flags)
        notes.append(f"{' '.join(flags)}: {why}")

    env_set: dict[str, str] = {"PYTHONUNBUFFERED": "1"}
    layers: list[int] = []
    if capture:
        try:
            plan = workspace_plan(workspace)
        except TargetError as exc:
            raise _config_error(workspace, "model.capture_layers" if cfg.model.capture_layers else "model.path",
                                str(exc), "fix the `model` stage first") from None
        refusal = plan.sglang_refusal()
        if refusal:
            raise _config_error(workspace, "model.backend", refusal, "capture this target with the local backend",
                                cfg.model.backend)
        layers, flag_ids = list(plan.capture_layers), plan.sglang_ids
        for flags, why in profile.capture_flags:
            argv += list(flags)
            notes.append(f"{' '.join(flags)}: {why}")
        argv += [*profile.aux_capture_flags, profile.aux_layer_ids_flag, *(str(i) for i in flag_ids)]
        notes.append(f"{' '.join(profile.aux_capture_flags)}: SGLang's own EAGLE-3 aux capture without a draft; "
                     "the speculative algorithm only names the capture convention and resolves to None")
        notes.append(f"capture layers: {plan.describe_layers()}; passed as {profile.aux_layer_ids_flag} "
                     f"{' '.join(map(str, flag_ids))}")
        hook = [{
            "name": HOOK_NAME,
            "target_modules": [profile.hook_target],
            "hook_factory": HOOK_FACTORY,
            "config": {"layers": layers, "layers_sglang": plan.layers_to_capture, "sglang": profile.version},
        }]
        argv += ["--forward-hooks", json.dumps(hook, separators=(",", ":"))]
        notes.append(f"--forward-hooks: {HOOK_FACTORY} on '{profile.hook_target}' in every TP worker writes spool "
                     "segments from TP rank 0 (one writer per DP group), pure EXTEND batches only")
        notes.append("no speculative decoding flags: verify batches would look like prefill; mixed chunks stay off "
                     "(they put decode rows into prefill batches); chunked prefill stays on, segments are stitched "
                     "by rid and position")
        env_set[ENV_SPOOL] = str(workspace.spool_dir)
        env_set[ENV_LAYERS] = ",".join(str(i) for i in layers)
    emitted = {a for a in argv[3:] if a.startswith("--")}
    _check_extra_args(workspace, list(cfg.server.extra_args), profile, capture, emitted)
    argv += list(cfg.server.extra_args)

    # The workers re-import our hook by module name: make the package importable there.
    existing = os.environ.get("PYTHONPATH", "")
    env_set["PYTHONPATH"] = _PACKAGE_ROOT + (os.pathsep + existing if existing else "")
    gpus = visible_devices_env(cfg.server.gpus)  # server.gpus: the TP ranks' GPUs, apart from the trainer's
    if gpus:
        env_set.update(gpus)
        notes.append(f"CUDA_VISIBLE_DEVICES={gpus['CUDA_VISIBLE_DEVICES']}: server.gpus (numbered as nvidia-smi)")
    env = nccl.build_child_env(cfg.gpu.nccl_preset, base_env=os.environ, disable_nvls=cfg.gpu.disable_nvls,
                               extra=env_set)
    notes.append(f"NCCL preset '{cfg.gpu.nccl_preset}' in the server's environment")
    shown = {**nccl.effective_nccl_vars(env), **env_set}
    return LaunchSpec(
        backend="sglang", argv=argv, env=env, env_set=shown, host=cfg.server.host, port=port,
        api_key=cfg.server.api_key or None, capture=bool(capture and layers), spool_dir=str(workspace.spool_dir),
        capture_layers=tuple(layers), notes=tuple(notes),
    )


def hook_layers(info: dict) -> tuple[list[int] | None, list[int] | None]:
    """(our layers, SGLang layers_to_capture) of the capture hook in a server's /server_info, if it runs one."""
    hooks = info.get("forward_hooks")
    if isinstance(hooks, str):
        try:
            hooks = json.loads(hooks)
        except ValueError:
            hooks = None
    for spec in hooks or []:
        if isinstance(spec, dict) and spec.get("hook_factory") == HOOK_FACTORY:
            config = spec.get("config") or {}
            return config.get("layers"), config.get("layers_sglang")
    return None, None
