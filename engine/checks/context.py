"""What checks may look at: the workspace, its config and the live samplers."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Mapping

from engine.workspace import Workspace


@dataclass
class CheckContext:
    workspace: Workspace
    # Returns a fresh engine.system.gpu.GpuSnapshot; injected so the console's sampler is reused.
    gpu_snapshot: Callable[[], object] | None = None
    environ: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))

    @property
    def config(self):
        return self.workspace.config

    def snapshot(self):
        if self.gpu_snapshot is not None:
            return self.gpu_snapshot()
        from engine.system.gpu import GpuSampler

        sampler = GpuSampler()
        try:
            return sampler.sample()
        finally:
            sampler.close()
