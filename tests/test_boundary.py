"""Layer boundaries: the engine never imports Textual; the console app never imports torch.

Both are checked twice: statically (ast scan of the sources) and at run time (import in a
fresh interpreter and look at sys.modules), since a lazy import inside a function passes
one check but not the other.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imported_roots(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    roots: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def _engine_modules() -> list[str]:
    modules = []
    for path in sorted((ROOT / "engine").rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__main__":
            continue  # importing it would run the program
        if parts[-1] == "__init__":
            parts.pop()
        modules.append(".".join(parts))
    return modules


def _run(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_engine_sources_do_not_import_textual_or_console():
    offenders = {}
    for path in (ROOT / "engine").rglob("*.py"):
        bad = _imported_roots(path) & {"textual", "eagle3_console"}
        if bad:
            offenders[str(path.relative_to(ROOT))] = sorted(bad)
    assert offenders == {}


def test_importing_every_engine_module_leaves_textual_unloaded():
    modules = _engine_modules()
    assert "engine.core" in modules and "engine.pipeline" in modules
    code = (
        "import importlib, json, sys\n"
        f"failed = {{}}\n"
        f"for name in {modules!r}:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except (Exception, SystemExit) as exc:\n"
        "        failed[name] = repr(exc)\n"
        "print(json.dumps({'textual': [m for m in sys.modules if m == 'textual' or m.startswith('textual.')],"
        " 'failed': failed}))\n"
    )
    result = _run(code)
    assert result["textual"] == []
    assert result["failed"] == {}, result["failed"]


def test_console_app_import_does_not_load_torch_or_transformers():
    code = (
        "import json, sys\n"
        "import eagle3_console.app\n"
        "print(json.dumps(sorted(m for m in ('torch', 'transformers') if m in sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_console_sources_never_import_torch():
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "eagle3_console").rglob("*.py")
                 if _imported_roots(p) & {"torch", "transformers"}]
    assert offenders == []
