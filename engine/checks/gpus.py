"""Stage `gpus`: NVML present, GPUs visible, compute capability, free memory, NCCL preset."""

from __future__ import annotations

from engine.system import gpusets, nccl
from engine.checks.base import CheckResult, failed, passed, warned
from engine.checks.context import CheckContext
from engine.system.disk import fmt_bytes

NVML_FIX = ("run on the GPU box with the NVIDIA driver loaded (`nvidia-smi` must work); "
            "inside a container pass the GPUs through (--gpus all)")


def check_gpus(ctx: CheckContext) -> list[CheckResult]:
    snap = ctx.snapshot()
    results: list[CheckResult] = []
    if not snap.available:
        cfg = ctx.config
        if cfg.model.backend == "local" and cfg.server.device in ("cpu", "auto"):
            # The embedded default runs on the CPU: no GPU is a limitation, not a failure.
            # The stage is amber, never green, so nothing pretends a GPU was checked.
            return [warned("nvml", f"{snap.reason}; the local backend will run on the CPU",
                           NVML_FIX + " — needed for GPU speed and for the sglang backend")]
        return [failed("nvml", snap.reason, NVML_FIX)]
    results.append(passed("nvml", f"driver {snap.driver_version}, CUDA {snap.cuda_driver_version}"))

    cfg = ctx.config
    needed = cfg.model.tp_size * cfg.model.dp_size if cfg.model.backend == "sglang" else 1
    count = len(snap.gpus)
    if count < needed:
        results.append(failed("visible", f"{count} GPU(s) visible, tp_size×dp_size needs {needed}",
                              "lower model.tp_size/dp_size or check CUDA_VISIBLE_DEVICES"))
    else:
        names = sorted({g.name for g in snap.gpus})
        results.append(passed("visible", f"{count} GPU(s): {', '.join(names)}; needs {needed}"))
    results.append(_split_check(cfg, [g.index for g in snap.gpus]))

    from engine.system.gpu import architecture_name

    caps = sorted({g.compute_capability for g in snap.gpus if g.compute_capability})
    if not caps:
        results.append(warned("capability", "compute capability unreadable", "update the NVIDIA driver"))
    else:
        arch = ", ".join(f"{architecture_name(c)} ({c[0]}.{c[1]})" for c in caps)
        if any(c[0] < 8 for c in caps):
            results.append(failed("capability", arch, "bf16 capture needs compute capability 8.0 or newer"))
        elif any(c[0] == 12 for c in caps) and cfg.model.backend == "sglang" and cfg.server.attention_backend in ("", "flashinfer"):
            results.append(warned("capability", arch + "; SM120 hangs with flashinfer attention",
                                  "the engine uses --attention-backend triton on SM120 unless you set one"))
        else:
            results.append(passed("capability", arch))

    low = []
    for g in snap.gpus:
        if g.memory_total and g.memory_used is not None:
            free = g.memory_total - g.memory_used
            if free < 0.10 * g.memory_total:
                low.append(f"GPU{g.index} {fmt_bytes(free)} free of {fmt_bytes(g.memory_total)}")
    mem_line = ", ".join(
        f"GPU{g.index} {fmt_bytes((g.memory_total or 0) - (g.memory_used or 0))} free" for g in snap.gpus
    )
    if low:
        results.append(warned("memory", "; ".join(low), "stop other processes on these GPUs before starting the server"))
    else:
        results.append(passed("memory", mem_line))

    results.append(_nccl_check(ctx, snap.interconnect))
    return results


def _split_check(cfg, visible: list[int]) -> CheckResult:
    """How server.gpus and train.gpus share the GPUs out (config validation keeps listed sets disjoint)."""
    text = gpusets.split_text(cfg)
    missing = [g for g in dict.fromkeys(cfg.server.gpus + cfg.train.gpus) if g not in visible]
    if missing:
        return failed("split", f"{text}; GPU(s) {missing} not visible (NVML shows {visible})",
                      "list GPU indices nvidia-smi shows in server.gpus and train.gpus")
    server_many = cfg.model.backend == "sglang" and cfg.model.tp_size * cfg.model.dp_size > 1
    together = cfg.train.mode in ("online", "hybrid")  # server and trainer run at the same time
    if together and (server_many or cfg.train.num_gpus > 1) and not (cfg.server.gpus and cfg.train.gpus):
        return warned("split", f"{text}: online training runs both at once, on the same GPUs",
                      "give them disjoint sets, e.g. server.gpus = [0, 1] and train.gpus = [2, 3] "
                      "(with train.num_gpus = 2)")
    return passed("split", text)


def _nccl_check(ctx: CheckContext, interconnect: str) -> CheckResult:
    cfg = ctx.config.gpu
    preset = nccl.get_preset(cfg.nccl_preset)
    env = nccl.build_child_env(cfg.nccl_preset, base_env=ctx.environ, disable_nvls=cfg.disable_nvls)
    shown = " ".join(f"{k}={v}" for k, v in nccl.effective_nccl_vars(env).items()) or "(no NCCL variables)"
    evidence = f"preset '{preset.name}' on {interconnect}: {shown}"
    overridden = [k for k, v in preset.env.items() if k in ctx.environ and ctx.environ[k] != v]
    if overridden:
        return warned("nccl", evidence + f"; your shell sets {', '.join(overridden)} differently",
                      "the preset wins in child processes; unset the variables or change gpu.nccl_preset")
    if "PCIe" in interconnect and preset.name == "none" and ctx.config.model.tp_size > 1:
        return warned("nccl", evidence, "PCIe-only multi-GPU: consider gpu.nccl_preset = \"pcie-sm120\"")
    return passed("nccl", evidence)
