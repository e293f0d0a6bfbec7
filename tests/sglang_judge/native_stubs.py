"""Stand-ins for SGLang's native-kernel packages, so its Python code imports on a CPU-only machine.

Only packages with no CPU build (or not needed by the code under test) are stubbed; every module of
SGLang itself is the real one from the 0.5.23 wheel. Importing this module installs the finder.
"""

import importlib.abc
import importlib.machinery
import sys
import types

STUBBED = ("triton", "torchvision", "tvm_ffi", "sentencepiece", "compressed_tensors", "gguf", "sgl_kernel")


class _AnyMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Any()


class _Any(metaclass=_AnyMeta):
    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        if not args and not kwargs:  # a probe of the device (`driver.active.get_current_target()`): none here
            raise RuntimeError("native stub: no device")
        return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else _Any()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Any()

    def __getitem__(self, key):
        return _Any()

    def __iter__(self):
        return iter(())

    def __bool__(self):
        return False

    def __mro_entries__(self, bases):
        return (object,)


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (_Any,), {}) if name[:1].isupper() else _Any()
        setattr(self, name, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__version__ = "3.0.0"
        return module

    def exec_module(self, module):
        pass


if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _Finder())
