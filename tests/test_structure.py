"""The shape of the code: no import cycle between the product's modules, and no module reaches into
another's privates (`_name`): neither imports one nor calls one on an object. Read from the sources with `ast`
(imports inside functions count too: a lazy import that closes a cycle is still a cycle; imports under
`if TYPE_CHECKING:` do not: they never run, they only name a type for the checker). And a job's events.jsonl
is decoded in one place (engine.jobs.events): every other module reads its typed events."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("eagle3_console", "engine", "themes")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the nodes inside `if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`) blocks."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            for child in node.body:
                inside.update(id(n) for n in ast.walk(child))
    return inside


def _imports(module: str, path: Path, runtime_only: bool = False) -> list[tuple[str, str, int]]:
    """(imported module, imported name or "", line) for every import in the file, relative ones resolved;
    `runtime_only`: without those for the type checker alone."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: list[tuple[str, str, int]] = []
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    skip = _type_checking_only(tree) if runtime_only else set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out.extend((alias.name, "", node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*parts, base] if base else parts)
            out.extend((base, alias.name, node.lineno) for alias in node.names)
    return out


def _target(name: str, imported: str) -> str | None:
    """The product module an import reaches: `from pkg import mod` reaches pkg.mod, `from mod import f` mod."""
    if imported and f"{name}.{imported}" in MODULES:
        return f"{name}.{imported}"
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        targets = {_target(name, imported) for name, imported, _ in _imports(module, path, runtime_only=True)}
        graph[module] = {t for t in targets if t and t != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for succ in graph.get(node, ()):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_cycle_finder_finds_a_cycle():
    """The finder itself: a cycle through a lazy import is found (else an empty answer proves nothing)."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_through_console_modules():
    assert "eagle3_console.cli" in MODULES and "eagle3_console.cli_jobs" in MODULES
    through_ui = [c for c in cycles(_graph()) if any(not m.startswith("engine.") for m in c)]
    assert through_ui == [], "break the cycle: move what both need into a third module"


def test_no_import_cycle_between_engine_modules():
    assert cycles(_graph()) == [], "break the cycle: move what both need into a lower module"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports(modules: dict[str, Path]) -> list[str]:
    """`path:line imports module.name` for every import of a `_private` module or name of another
    product module (outside modules are not ours to judge: `torch._dynamo` is torch's business)."""
    offenders = []
    for module, path in modules.items():
        for name, imported, line in _imports(module, path):
            target = _target(name, imported)
            if target is None or target == module or target not in MODULES:
                continue
            if any(_private(part) for part in [*name.split("."), imported]):
                offenders.append(f"{path.relative_to(ROOT)}:{line} imports {name}.{imported or ''}".rstrip("."))
    return offenders


def _defined_privates(tree: ast.AST) -> set[str]:
    """The `_names` a module defines: functions, classes and methods, names it assigns, and the
    attributes its classes set on `self`/`cls`."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
              and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            names.add(node.attr)
    return {n for n in names if _private(n)}


def _own_object(value: ast.expr) -> bool:
    """`self._x`, `cls._x`, `super()._x`: the class's own; `other._x`: the same class's other instance,
    by the convention of `__eq__`-like methods."""
    if isinstance(value, ast.Name):
        return value.id in ("self", "cls", "other")
    return isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super"


def private_reaches(sources: dict[str, str]) -> list[str]:
    """`module:line expr (a private of owner)` for each `obj._name` where `_name` is defined by
    another product module and `obj` is not the class's own (`self`, `cls`, `super()`).
    Without types, ownership is read from names: a `_name` this module does not define but another
    does is that module's. A private that two modules both define is not judged (rare, and a miss
    rather than a false alarm); outside privates (`os._exit`, `torch._dynamo`) are never ours."""
    trees = {module: ast.parse(text, module) for module, text in sources.items()}
    defined = {module: _defined_privates(tree) for module, tree in trees.items()}
    offenders = []
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)) or _own_object(node.value):
                continue
            owners = sorted(m for m, names in defined.items() if m != module and node.attr in names)
            if owners and node.attr not in defined[module]:
                offenders.append(f"{module}:{node.lineno} {ast.unparse(node)} (a private of {', '.join(owners)})")
    return offenders


def test_the_private_finders_find_a_reach():
    """The finders themselves (else an empty answer proves nothing): a method called on another
    module's object, a function taken from another module, and what is allowed."""
    sources = {
        "a": "class A:\n    def _hidden(self):\n        return self._state\n"
             "    def __init__(self):\n        self._state = 1\n\ndef _helper():\n    pass\n",
        "b": "import os\nimport a\n\ndef use(x):\n    x._hidden()\n    a._helper()\n    os._exit(0)\n"
             "    return x.__class__\n",
        "c": "class C:\n    def _hidden(self):\n        return super()._hidden()\n"
             "    def __eq__(self, other):\n        return self._hidden() == other._hidden()\n",
    }
    assert private_reaches(sources) == ["b:5 x._hidden (a private of a, c)", "b:6 a._helper (a private of a)"]


def test_no_module_imports_a_private_of_another():
    """A lower layer (server, extraction, training) must not lean on another module's internals: a
    helper two modules need is public in the lower one (or in a small module of its own)."""
    assert private_imports(MODULES) == [], "make the name public where it is defined (rename it) and update its callers"


def test_no_module_calls_a_private_of_another_modules_object():
    """e.g. online training called `extractor._capture()`: what another module uses is the class's
    public surface, named so, and a change to a private stays inside its module."""
    sources = {module: path.read_text(encoding="utf-8") for module, path in MODULES.items()}
    assert private_reaches(sources) == [], "give the method a public name where it is defined and update its callers"


# Modules whose `["type"]` is not a job event's (job events are read typed, engine.jobs.events).
NOT_JOB_EVENTS = {
    "engine.checks.train": "metrics.jsonl's closing `failed` line (engine.train.loop)",
    "eagle3_console.panes.training": "metrics.jsonl's records (engine.train.loop)",
    "engine.dataset.regenerate": "an SGLang reply's finish_reason",
    "engine.dataset.formats": "a chat message's content parts",
    "engine.localserver.app": "an ASGI scope",
}


def _reads_type(node: ast.AST) -> bool:
    """`x["type"]` (read) or `x.get("type", ...)`."""
    if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
        return isinstance(node.slice, ast.Constant) and node.slice.value == "type"
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
            and bool(node.args) and isinstance(node.args[0], ast.Constant) and node.args[0].value == "type")


def raw_event_reads(sources: dict[str, str]) -> list[str]:
    """`module:line what` for each place outside engine.jobs that reads a job's events itself: calls the
    dict reader `.events(` (JobManager.events, kept for tests and bench), reads a `"type"` key (outside
    NOT_JOB_EVENTS), or names the events.jsonl file (EVENTS_FILE and the typed readers do)."""
    offenders = []
    for module, source in sources.items():
        if module == "engine.jobs" or module.startswith("engine.jobs."):
            continue  # the contract and its one parser
        for node in ast.walk(ast.parse(source, module)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "events":
                offenders.append(f"{module}:{node.lineno} {ast.unparse(node.func)}( (raw dicts)")
            elif _reads_type(node) and module not in NOT_JOB_EVENTS:
                offenders.append(f"{module}:{node.lineno} {ast.unparse(node)}")
            elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
                  and node.value.rsplit("/", 1)[-1] == "events.jsonl"):
                offenders.append(f"{module}:{node.lineno} {node.value!r} (read by name)")
    return offenders


def test_the_event_read_finder_finds_raw_reads():
    sources = {
        "engine.checks.x": 'def f(jobs, job):\n    events, _ = jobs.events(job.id)\n'
                           '    return [e for e in events if e.get("type") == "progress" or e["type"] == "paused"]\n',
        "engine.train.y": '"""Reads events.jsonl."""\n\ndef f(job):\n    return (job.dir / "events.jsonl").read_text()\n',
        "eagle3_console.z": 'def f(jobs, job, e, d):\n    d["type"] = "x"\n    return jobs.read_events(job.id), e.kind\n',
        "engine.jobs.manager": 'def f(self, e):\n    return self.events(e["type"])\n',
        "engine.localserver.app": 'def f(scope):\n    return scope["type"]\n',
    }
    assert raw_event_reads(sources) == [
        "engine.checks.x:2 jobs.events( (raw dicts)", "engine.checks.x:3 e.get('type')", "engine.checks.x:3 e['type']",
        "engine.train.y:4 'events.jsonl' (read by name)",
    ]


def test_job_events_are_read_typed_outside_the_job_subsystem():
    """engine.jobs.events is the one parser of events.jsonl: everything else (the runner, stage checks,
    panes, the CLI) reads its typed events through JobManager.read_events, the engine's watcher or
    engine.watchers.last_events, so a field's name and type live in one place (issue 24)."""
    assert all(module in MODULES for module in NOT_JOB_EVENTS), "NOT_JOB_EVENTS names a module that is gone"
    sources = {module: path.read_text(encoding="utf-8") for module, path in MODULES.items()}
    assert raw_event_reads(sources) == [], ("read typed events (JobManager.read_events, engine.watchers.last_events) "
                                            "and isinstance/attributes (engine.jobs.events), not dicts")
