"""Helpers the CLI test modules share (conftest.py holds the shared fixtures)."""
from pathlib import Path


def files(folder: Path) -> set:
    """The names in `folder` (to assert what a command left behind)."""
    return {p.name for p in folder.iterdir()}
