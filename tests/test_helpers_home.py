"""Test modules share code only through tests/helpers/: none imports another test module or a
conftest (fixtures reach tests through pytest, helpers through `tests.helpers.*`). Read with `ast`,
so imports inside functions count too."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def is_test_module(name: str) -> bool:
    last = name.rsplit(".", 1)[-1]
    return last.startswith("test_") or last == "conftest"


def shared_imports(path: Path, root: Path = TESTS) -> list[str]:
    """`file:line module` for each import of a test module or a conftest in `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found += [f"{path.relative_to(root)}:{node.lineno} {name}" for name in names if is_test_module(name)]
    return found


def test_no_test_module_imports_another_or_a_conftest():
    offenders = [hit for path in sorted(TESTS.rglob("*.py")) for hit in shared_imports(path)]
    assert not offenders, "move what these import into tests/helpers/: " + "; ".join(offenders)


def test_the_scan_sees_top_level_and_function_level_imports(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("from conftest import free_port\nfrom tests.helpers.screen import wait_until\n\n"
                      "def f():\n    from tests.test_console import x\n\nimport faults.test_kill_training\n")
    assert sorted(shared_imports(sample, tmp_path)) == [
        "sample.py:1 conftest", "sample.py:5 tests.test_console", "sample.py:7 faults.test_kill_training"]
