"""One error base: every exception the engine raises for a person to read derives from EngineError,
so the CLI and the console can turn any refusal into one clear line instead of a traceback."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import engine
from engine.errors import EngineError

# Control flow inside one module, never shown to anyone.
INTERNAL = {"engine.extract.job.SampleFailed", "engine.extract.job.SpoolFull", "engine.extract.job.Outage",
            "engine.dataset.formats._LineError"}


def engine_exceptions():
    for info in pkgutil.walk_packages(engine.__path__, "engine."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if inspect.isclass(value) and issubclass(value, BaseException) and value.__module__ == info.name:
                yield f"{info.name}.{name}", value


def test_every_engine_error_derives_from_one_base():
    found = dict(engine_exceptions())
    assert len(found) >= 30
    strays = sorted(name for name, cls in found.items() if name not in INTERNAL and not issubclass(cls, EngineError))
    assert not strays, f"derive these from engine.errors.EngineError: {strays}"
