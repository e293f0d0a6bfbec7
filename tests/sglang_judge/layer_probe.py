"""Run SGLang's own `set_eagle3_layers_to_capture` for every architecture in the wheel; print JSON.

Run in a subprocess with the wheel's package dir on sys.path:
    python layer_probe.py NUM_LAYERS IDS_JSON...   (IDS_JSON "null" = SGLang's default)
For each EntryClass architecture whose class (MRO) defines the method, the real function is called
on a stand-in `self` (pp last rank, config.num_hidden_layers). Delegation to an inner model
(`self.model` / `self.language_model`) runs that inner class's real method when its __init__ names
the class, else records what was handed on. Output per architecture: the `layers_to_capture` that
SGLang set, and whether its forward hands aux states to the logits processor by keyword.
"""

import importlib
import inspect
import json
import os
import pkgutil
import re
import sys
import traceback
from types import SimpleNamespace

LAST_RANK = SimpleNamespace(is_last_rank=True, is_first_rank=True, world_size=1, rank_in_group=0)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import native_stubs  # noqa: E402,F401

METHOD = "set_eagle3_layers_to_capture"


class Inner:
    """A stand-in inner model: keeps what SGLang sets on it."""

    def __init__(self, num_layers, cls=None):
        self.layers = [SimpleNamespace() for _ in range(num_layers + 1)]
        self.layers_to_capture = None
        self.handed_on = None
        self.pp_group = LAST_RANK
        self.config = _config(num_layers)
        self.capture_aux_hidden_states = False
        self._cls = cls

    def set_eagle3_layers_to_capture(self, ids):
        if self._cls is not None and hasattr(self._cls, METHOD):
            return getattr(self._cls, METHOD)(self, ids)
        self.handed_on = list(ids) if ids is not None else None  # to a model chosen at run time


def _config(num_layers):
    text = SimpleNamespace(num_hidden_layers=num_layers)
    return SimpleNamespace(num_hidden_layers=num_layers, text_config=text, get_text_config=lambda: text)


def _inner_class(cls, attr, module):
    """The class an __init__ assigns to self.<attr> (`self.model = Qwen2MoeModel(`), if it names one."""
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        try:
            source = inspect.getsource(init)
        except (OSError, TypeError):
            continue
        match = re.search(rf"self\.{attr}\s*=\s*([A-Za-z_][A-Za-z0-9_]*)\(", source)
        if match:
            name = match.group(1)
            found = getattr(sys.modules[klass.__module__], name, None)
            local = re.search(rf"from\s+([\w.]+)\s+import\s+[^\n]*\b{name}\b", source)
            if found is None and local:  # imported inside __init__
                found = getattr(importlib.import_module(local.group(1)), name, None)
            if isinstance(found, type):
                return found
    return None


def _delegates_or_sets_inner(cls):
    """Whether cls's method works on an inner model of its own (a CausalLM), not on itself."""
    for klass in cls.__mro__:
        if METHOD in vars(klass):
            source = inspect.getsource(vars(klass)[METHOD])
            return "self.model" in source or "self.language_model" in source
    return False


def _outer(cls, num_layers, depth=0):
    self = Inner(num_layers)
    module = sys.modules[cls.__module__]
    for attr in ("model", "language_model"):
        inner_cls = _inner_class(cls, attr, module)
        if inner_cls is not None and depth < 2 and _delegates_or_sets_inner(inner_cls):
            setattr(self, attr, _outer(inner_cls, num_layers, depth + 1))  # a full CausalLM inside
        else:
            setattr(self, attr, Inner(num_layers, inner_cls))
    self._cls = cls
    return self


def _captured(obj, depth=0):
    value = getattr(obj, "layers_to_capture", None)
    if value is not None:
        return [int(v) for v in value]
    if getattr(obj, "handed_on", None) is not None:
        return {"handed_on_to_runtime_model": obj.handed_on}
    for attr in ("model", "language_model"):
        inner = getattr(obj, attr, None)
        if inner is not None and depth < 3:
            found = _captured(inner, depth + 1)
            if found is not None:
                return found
    return None


def _keyword_aux(cls):
    """Whether the class's forward passes aux_hidden_states to the logits processor by keyword."""
    for klass in cls.__mro__:
        forward = klass.__dict__.get("forward")
        if forward is None:
            continue
        try:
            source = inspect.getsource(forward)
        except (OSError, TypeError):
            return None
        calls = re.findall(r"self\.logits_processor\((.*?)\n\s*\)", source, flags=re.S)
        if not calls:
            return None
        return any(re.search(r"\baux_hidden_states\s*=", call) for call in calls)
    return None


def main():
    num_layers = int(sys.argv[1])
    id_lists = [json.loads(arg) for arg in sys.argv[2:]]
    import sglang.srt.models as models
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(pp_group=LAST_RANK)  # some models read it from the context

    out, failures, keyword_only = {}, {}, {}
    for info in sorted(pkgutil.iter_modules(models.__path__), key=lambda m: m.name):
        name = f"sglang.srt.models.{info.name}"
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # a model module whose own imports need a GPU stack
            failures[info.name] = f"{type(exc).__name__}: {exc}"[:200]
            continue
        entries = getattr(module, "EntryClass", None)
        if entries is None:
            continue
        for cls in entries if isinstance(entries, (list, tuple)) else [entries]:
            if not isinstance(cls, type):
                continue
            if not hasattr(cls, METHOD):
                if _keyword_aux(cls):
                    keyword_only[cls.__name__] = info.name
                continue
            row = {"module": info.name, "keyword_aux": _keyword_aux(cls), "results": []}
            for ids in id_lists:
                self = _outer(cls, num_layers)
                try:
                    getattr(cls, METHOD)(self, ids)
                    row["results"].append(_captured(self))
                except Exception:
                    row["results"].append("error: " + traceback.format_exc(limit=2)[-300:])
            out[cls.__name__] = row
    print(json.dumps({"architectures": out, "keyword_aux_without_method": keyword_only,
                      "import_failures": failures}))


if __name__ == "__main__":
    main()
