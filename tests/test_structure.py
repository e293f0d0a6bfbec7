"""The shape of the code: no import cycle between the product's modules, and nothing outside
engine/checks reaches into a private (`_name`) of a check module. Read from the sources with `ast`
(imports inside functions count too: a lazy import that closes a cycle is still a cycle; imports under
`if TYPE_CHECKING:` do not: they never run, they only name a type for the checker)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

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


def test_nothing_outside_checks_imports_a_private_of_engine_checks():
    """A lower layer (server, extraction, training) must not lean on a check's internals: a helper
    both need belongs in a module of its own, public."""
    offenders = []
    for module, path in MODULES.items():
        if module == "engine.checks" or module.startswith("engine.checks."):
            continue
        for name, imported, line in _imports(module, path):
            if not (name == "engine.checks" or name.startswith("engine.checks.")):
                continue
            privates = [part for part in [*name.split("."), imported] if part.startswith("_")
                        and not part.startswith("__")]
            if privates:
                offenders.append(f"{path.relative_to(ROOT)}:{line} imports {name}.{imported or ''}".rstrip("."))
    assert offenders == [], offenders
