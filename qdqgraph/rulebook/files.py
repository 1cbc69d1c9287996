"""Where the bundled rule files live and how any rule file is read.

The bundled files are package data: the repository's top-level `rules/` folder is installed as
`qdqgraph/rules/` (pyproject.toml) and read through `importlib.resources`, so they are found in a
wheel, an sdist build or an editable checkout alike. A rule file (bundled or a user's `--rules`) is
read whole into a `RuleFile`: its name for errors, its text for line numbers, its TOML data.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path

from ..errors import QdqError
from ..graph.outputs import require_regular

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

MARKER = "op_classes.toml"      # a folder holding this file is a rules folder


@lru_cache(maxsize=1)
def bundled_dir():
    """The bundled rules folder (a Traversable): the installed package data, or, in an editable
    checkout, the repository's `rules/` beside the package."""
    installed = resources.files("qdqgraph").joinpath("rules")
    if installed.joinpath(MARKER).is_file():
        return installed
    checkout = Path(__file__).resolve().parents[2] / "rules"
    if (checkout / MARKER).is_file():
        return checkout
    raise QdqError("qdqgraph's bundled rule files are missing from this installation",
                   "reinstall qdqgraph (pip install --force-reinstall qdqgraph)")


def bundled(*parts: str):
    """A bundled rule file or folder, e.g. bundled("tensorrt", "fusion.toml")."""
    out = bundled_dir()
    for p in parts:
        out = out.joinpath(p)
    return out


def bundled_files(folder: str) -> list:
    """The .toml files of a bundled folder, sorted by name."""
    return sorted((f for f in bundled(folder).iterdir() if f.name.endswith(".toml")), key=lambda f: f.name)


@dataclass(frozen=True)
class RuleFile:
    source: str       # the path, for error messages
    text: str
    data: dict


def read_rule_file(path) -> RuleFile:
    """Read a TOML rule file (a path or a bundled Traversable); every failure is a QdqError that
    names the file and the fix."""
    source = str(path)
    if isinstance(path, str):
        path = Path(path)
    if isinstance(path, Path):
        p = path
        if not p.exists():
            raise QdqError(f"rule file not found: {p}", "check the --rules path")
        if p.is_dir():
            raise QdqError(f"rule file {p} is a folder", "pass the .toml file itself")
        require_regular(p, "rule file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise QdqError(f"{source} is not a text file", "pass a TOML rule file (see rules/placement.toml)") from None
    except OSError as e:
        raise QdqError(f"rule file {source} cannot be read ({e.strerror or e})", "check the path and its permissions") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise QdqError(f"{source}: invalid TOML ({e})", "fix the file (TOML syntax)") from None
    except RecursionError:
        raise QdqError(f"{source}: nested too deeply to be a rule file", "fix the file") from None
    return RuleFile(source, text, data)


def read_toml(path) -> dict:
    return read_rule_file(path).data
