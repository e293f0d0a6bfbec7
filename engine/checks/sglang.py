"""Extra preflight checks when model.backend = "sglang".

`check_sglang_model(ctx)` (model stage): SGLang importable + version supported, GPU
architecture quirks, NCCL all-reduce across the local GPUs with the chosen preset.
`check_sglang_server_info(info, ctx)` (server stage): /server_info confirms the capture-safe
flags and shows the capture layers in both numberings.
"""

from __future__ import annotations

from typing import Any

from engine.system import nccl
from engine.checks.base import CheckResult, failed, passed, warned
from engine.checks.context import CheckContext

RESTART_FIX = "restart the server from the console, which launches it with the capture-safe flags"


def check_sglang_install(ctx: CheckContext) -> CheckResult:
    from engine.sglang.versions import UnsupportedSglangError, detect_profile, installed_version

    try:
        profile = detect_profile()
    except UnsupportedSglangError as exc:
        problem, _, fix = str(exc).partition(" Fix: ")
        return failed("sglang", problem, fix)
    try:
        import importlib.util

        found = importlib.util.find_spec("sglang") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return failed("sglang", f"sglang {installed_version()} is installed but not importable",
                      "reinstall it: pip install --force-reinstall 'sglang==" + profile.version + "'")
    return passed("sglang", f"sglang {installed_version()} (profile {profile.version})")


def check_gpu_quirks(ctx: CheckContext, snap=None) -> list[CheckResult]:
    from engine.system.gpu import architecture_name
    from engine.sglang.launch import choose_attention_backend

    snap = snap if snap is not None else ctx.snapshot()
    if not snap.available or not snap.gpus:
        return [warned("gpu_quirks", f"GPU architecture unknown ({snap.reason or 'no GPUs'})",
                       "run on the GPU box; the attention backend is then chosen per architecture")]
    cc = snap.gpus[0].compute_capability
    backend, note = choose_attention_backend(ctx.config.server.attention_backend, cc)
    results = []
    if cc and cc[0] == 12 and backend == "flashinfer":
        results.append(warned("attention", f"{architecture_name(cc)} with attention backend flashinfer",
                              "SM120 hangs with flashinfer: set server.attention_backend = \"triton\" (or \"\")"))
    else:
        results.append(passed("attention", note))
    preset = ctx.config.gpu.nccl_preset
    env = nccl.build_child_env(preset, base_env=ctx.environ, disable_nvls=ctx.config.gpu.disable_nvls)
    p2p_off = env.get("NCCL_P2P_DISABLE") == "1"
    if len(snap.gpus) > 1 and snap.interconnect.startswith("PCIe") and cc and cc[0] == 12 and not p2p_off:
        results.append(warned("p2p", f"{len(snap.gpus)}x {architecture_name(cc)} over {snap.interconnect} with P2P on "
                                     f"(preset '{preset}')",
                              "NCCL all-reduce can hang with P2P over PCIe on RTX PRO 6000 (NVIDIA/nccl#1999); "
                              "if the all-reduce check times out, set gpu.nccl_preset = \"p2p-off\""))
    else:
        results.append(passed("p2p", f"{snap.interconnect}, P2P {'off' if p2p_off else 'on'} (preset '{preset}')"))
    return results


def check_allreduce(ctx: CheckContext, snap=None, timeout: float = 120.0) -> CheckResult:
    from engine.sglang.allreduce import run_allreduce_check

    snap = snap if snap is not None else ctx.snapshot()
    count = len(snap.gpus) if snap.available else 0
    preset = ctx.config.gpu.nccl_preset
    if count < 2:
        return warned("allreduce", f"skipped: needs >= 2 GPUs, {count} visible",
                      "nothing to check on one GPU; tensor parallelism needs two or more")
    env = nccl.build_child_env(preset, base_env=ctx.environ, disable_nvls=ctx.config.gpu.disable_nvls)
    result = run_allreduce_check(count, env, preset, timeout=timeout)
    if result.ok:
        return passed("allreduce", f"{count} GPUs, preset '{preset}': bus bandwidth {result.bus_gbps:.1f} GB/s "
                                   f"({result.seconds:.1f}s)")
    tail = " | ".join(result.log_tail[-3:])
    return failed("allreduce", f"{result.error}" + (f" — {tail}" if tail else ""),
                  "try gpu.nccl_preset = \"p2p-off\" (P2P over PCIe hangs on some boards), then re-check")


def check_sglang_model(ctx: CheckContext) -> list[CheckResult]:
    results = [check_sglang_install(ctx)]
    snap = ctx.snapshot()
    results += check_gpu_quirks(ctx, snap)
    results.append(check_allreduce(ctx, snap))
    return results


def check_sglang_server_info(info: dict[str, Any], ctx: CheckContext) -> list[CheckResult]:
    """Radix cache off, no speculative algorithm, metrics on, aux capture + our hook loaded."""
    from engine.sglang.launch import hook_layers

    problems = []
    if info.get("disable_radix_cache") is not True:
        problems.append("radix cache is ON (cached prefixes are never recomputed, so never captured)")
    if info.get("speculative_algorithm"):
        problems.append(f"speculative_algorithm={info.get('speculative_algorithm')} (verify batches look like prefill)")
    if info.get("enable_metrics") is not True:
        problems.append("metrics are off")
    if info.get("enable_mixed_chunk"):
        problems.append("mixed chunks are on (decode rows inside prefill batches)")
    if info.get("enable_return_aux_hidden_states") is not True:
        problems.append("SGLang's aux capture is off (--enable-return-aux-hidden-states)")
    layers, layers_sglang = hook_layers(info)
    if layers is None:
        problems.append("the eagle3-console capture hook is not in --forward-hooks")
    evidence = (f"SGLang {info.get('version')}: disable_radix_cache={info.get('disable_radix_cache')}, "
                f"speculative_algorithm={info.get('speculative_algorithm')}, enable_metrics={info.get('enable_metrics')}, "
                f"aux ids {info.get('return_aux_hidden_state_layer_ids')}, capture layers {layers} "
                f"(SGLang layers_to_capture {layers_sglang})")
    if problems:
        return [failed("flags", "; ".join(problems) + f" — {evidence}", RESTART_FIX)]
    return [passed("flags", evidence)]
