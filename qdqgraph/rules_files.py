"""Where rule files live and how they are read (TOML, with file and line in errors)."""
from __future__ import annotations

import sys
from pathlib import Path

from .errors import QdqError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


def rules_dir() -> Path:
    """The bundled rules/ folder: the checkout's top-level rules/, or the installed package data."""
    here = Path(__file__).resolve().parent
    checkout = here.parent / "rules"
    if (checkout / "op_classes.toml").exists():
        return checkout
    from importlib import resources
    return Path(str(resources.files("qdqgraph.rules")))


def read_toml(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise QdqError(f"rule file not found: {path}", "check the --rules path") from None
    except tomllib.TOMLDecodeError as e:
        raise QdqError(f"{path}: invalid TOML ({e})", "fix the file (TOML syntax)") from None
