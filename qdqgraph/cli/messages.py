"""Warnings on stderr: one stream, one prefix, each said once per run."""
from __future__ import annotations

import sys

_SAID: set[str] = set()


def warn(message: str) -> None:
    text = str(message).strip()
    if text and text not in _SAID:
        _SAID.add(text)
        print(f"qdqgraph: warning: {text}", file=sys.stderr)


def warn_all(lines) -> None:
    for w in lines:
        warn(w)


def reset() -> None:
    _SAID.clear()
