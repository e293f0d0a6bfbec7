"""Fixtures giving tests SGLang 0.5.23's own code: the wheel, its source, and an importable install.

The wheel is downloaded once (pip; kept in pytest's cache dir or $EAGLE3_SGLANG_CACHE) and installed
with --no-deps into that cache together with the small pure-Python packages its model and parser
modules import. Native kernel packages that have no CPU build are stood in for by native_stubs.py;
all of SGLang's own modules are the wheel's. Without network the tests that need it skip, saying why.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

VERSION = "0.5.23"
# What SGLang's server_args / model / loader modules import (pure Python, small).
IMPORT_DEPS = ["orjson", "pybase64", "requests", "pillow", "msgspec", "pyzmq", "ipython", "aiohttp", "dill",
               "openai", "partial_json_parser", "einops", "fastapi", "setproctitle"]
JUDGE_DIR = Path(__file__).resolve().parent


def _pip(*args: str, timeout: float = 600) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args], check=True,
                   timeout=timeout, capture_output=True)


@pytest.fixture(scope="session")
def sglang_cache(request, tmp_path_factory) -> Path:
    """$EAGLE3_SGLANG_CACHE, pytest's cache (kept between runs), or a temporary folder (CI)."""
    explicit = os.environ.get("EAGLE3_SGLANG_CACHE")
    if explicit:
        return Path(explicit)
    cache = getattr(request.config, "cache", None)
    if cache is not None:
        return Path(cache.mkdir(f"sglang-{VERSION}"))
    return tmp_path_factory.mktemp(f"sglang-{VERSION}")


@pytest.fixture(scope="session")
def sglang_wheel(sglang_cache) -> Path:
    wheels = sorted(sglang_cache.glob(f"sglang-{VERSION}-*.whl"))
    if not wheels:
        try:
            _pip("download", "--no-deps", f"sglang=={VERSION}", "-d", str(sglang_cache), timeout=300)
        except (subprocess.SubprocessError, OSError) as exc:
            pytest.skip(f"cannot download the sglang {VERSION} wheel (no network to PyPI?): {exc}")
        wheels = sorted(sglang_cache.glob(f"sglang-{VERSION}-*.whl"))
    if not wheels:
        pytest.skip(f"pip download produced no sglang {VERSION} wheel")
    return wheels[0]


@pytest.fixture(scope="session")
def sglang_src(sglang_wheel, sglang_cache) -> Path:
    src = sglang_cache / "src"
    marker = src / ".complete-3"
    if not marker.exists():
        with zipfile.ZipFile(sglang_wheel) as wheel:
            for name in wheel.namelist():
                if name.startswith(("sglang/srt/arg_groups/", "sglang/srt/model_executor/", "sglang/srt/models/",
                                    "sglang/srt/constants.py", "sglang/srt/managers/tokenizer_manager.py")):
                    wheel.extract(name, src)
        marker.write_text("ok")
    return src / "sglang" / "srt"


@pytest.fixture(scope="session")
def sglang_importable(sglang_wheel, sglang_cache) -> list[str]:
    """sys.path entries under which `import sglang.srt...` runs the wheel's code on this CPU."""
    pkg, deps = sglang_cache / "pkg", sglang_cache / "deps"
    marker = sglang_cache / ".installed-2"
    if not marker.exists():
        try:
            if not (pkg / "sglang").is_dir():
                _pip("install", "--no-deps", "--target", str(pkg), str(sglang_wheel))
            _pip("install", "--target", str(deps), *IMPORT_DEPS)
        except (subprocess.SubprocessError, OSError) as exc:
            pytest.skip(f"cannot install sglang's import dependencies into {sglang_cache}: {exc}")
        marker.write_text("ok")
    return [str(JUDGE_DIR), str(pkg), str(deps)]


def run_with_sglang(importable: list[str], script: Path | str, *args: str, timeout: float = 300) -> str:
    """Run a script (a file or code) where the wheel imports; its stdout, or AssertionError with stderr."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join(importable)
    command = [sys.executable, str(script)] if isinstance(script, Path) else [sys.executable, "-c", script]
    done = subprocess.run([*command, *args], capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stderr[-4000:]}"
    return done.stdout


def last_json_line(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])
