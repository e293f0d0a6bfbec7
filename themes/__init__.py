"""Console themes, defined as TOML files so they can be edited without touching code.

Each `*.toml` file holds one theme: `name`, `primary` (required), the other Textual colour
slots (`secondary`, `accent`, `warning`, `error`, `success`, `foreground`, `background`,
`surface`, `panel`, `boost`), `dark`, and an optional `[variables]` table of extra design
tokens. Users may drop more files into `<workspace>/themes/`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from textual.theme import Theme

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

THEMES_DIR = Path(__file__).resolve().parent
DEFAULT_THEME = "eagle3-dark"
_COLOUR_KEYS = ("primary", "secondary", "accent", "warning", "error", "success", "foreground",
                "background", "surface", "panel", "boost")
_ALLOWED = set(_COLOUR_KEYS) | {"name", "dark", "luminosity_spread", "text_alpha", "variables"}


class ThemeFileError(ValueError):
    """A theme file that cannot be used, with the file and the reason."""


@dataclass(frozen=True)
class ThemeLoadReport:
    themes: list[Theme]
    errors: list[str]  # one line per file that was skipped


def theme_from_toml(path: Path) -> Theme:
    """Parse one theme file; ThemeFileError names the file and the problem."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ThemeFileError(f"{path}: cannot be read ({exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ThemeFileError(f"{path}: invalid TOML ({exc})") from None
    unknown = sorted(set(data) - _ALLOWED)
    if unknown:
        raise ThemeFileError(f"{path}: unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(sorted(_ALLOWED))}")
    name = data.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ThemeFileError(f"{path}: missing `name = \"...\"`")
    if not isinstance(data.get("primary"), str):
        raise ThemeFileError(f"{path}: missing `primary = \"#rrggbb\"`")
    colours = {k: data[k] for k in _COLOUR_KEYS if k in data}
    for key, value in colours.items():
        if not isinstance(value, str):
            raise ThemeFileError(f"{path}: `{key}` must be a colour string such as \"#1e90ff\"")
    variables = data.get("variables", {})
    if not isinstance(variables, dict) or not all(isinstance(v, str) for v in variables.values()):
        raise ThemeFileError(f"{path}: [variables] must map names to strings")
    shading: dict[str, Any] = {k: float(data[k]) for k in ("luminosity_spread", "text_alpha") if k in data}
    theme = Theme(name=name.strip(), dark=bool(data.get("dark", True)), variables=dict(variables), **colours,
                  **shading)
    try:
        theme.to_color_system().generate()  # bad colour strings fail here, not at first paint
    except Exception as exc:
        raise ThemeFileError(f"{path}: {exc}") from None
    return theme


def load_theme_dir(directory: Path) -> ThemeLoadReport:
    """Every valid theme in `directory` (sorted by file name); bad files are reported, not fatal."""
    themes: list[Theme] = []
    errors: list[str] = []
    if not directory.is_dir():
        return ThemeLoadReport(themes, errors)
    for path in sorted(directory.glob("*.toml")):
        try:
            themes.append(theme_from_toml(path))
        except ThemeFileError as exc:
            errors.append(str(exc))
    return ThemeLoadReport(themes, errors)


def load_themes() -> list[Theme]:
    """The themes shipped with the console (eagle3-dark, eagle3-light, eagle3-contrast)."""
    report = load_theme_dir(THEMES_DIR)
    if report.errors:  # a broken shipped theme is a packaging bug: fail loudly in tests
        raise ThemeFileError("; ".join(report.errors))
    return report.themes


__all__ = ["DEFAULT_THEME", "ThemeFileError", "ThemeLoadReport", "load_theme_dir", "load_themes", "theme_from_toml"]
