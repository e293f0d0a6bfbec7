"""Job events for tests: one event of any kind with every field filled."""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.jobs.events import JobEvent

SAMPLES = {"int": 7, "float": 1.5, "str": "text", "bool": True, "tuple": ("a", 1)}


def sample(cls: type[JobEvent]) -> JobEvent:
    """An event of `cls` with every named field set to a value of its type."""
    values: dict[str, Any] = {f.name: SAMPLES[str(f.type).split(" ")[0].split("[")[0]]
              for f in dataclasses.fields(cls) if f.name not in ("t", "extra")}
    return cls(**values)
