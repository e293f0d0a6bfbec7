"""Which GPUs each process the engine starts may use: `server.gpus` for the target server,
`train.gpus` for the training job (engine.config.check_gpu_sets keeps them disjoint).

A set is handed over as CUDA_VISIBLE_DEVICES, with CUDA_DEVICE_ORDER=PCI_BUS_ID so that CUDA numbers
the GPUs as nvidia-smi and NVML (the GPU pane, the keys' help) do; CUDA's own default order puts the
fastest GPU first and can differ. An empty set adds nothing: the child sees what the console sees."""

from __future__ import annotations


def visible_devices_env(gpus: list[int]) -> dict[str, str]:
    """The variables that restrict a child process to `gpus` ({} for every visible GPU)."""
    if not gpus:
        return {}
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(int(g)) for g in gpus), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def describe(gpus: list[int]) -> str:
    return "GPU " + ",".join(str(g) for g in gpus) if gpus else "every visible GPU"


def split_text(config) -> str:
    """How the GPUs are shared out, for the `gpus` stage: "server GPU 0,1 · trainer GPU 2,3"."""
    return f"server {describe(config.server.gpus)} · trainer {describe(config.train.gpus)}"
