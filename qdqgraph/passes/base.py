"""What every pass returns: one result type, from which the run report is built.

A pass takes a graph (and what it needs: a plan, ranges), changes the graph in place and returns a
`PassResult`: its name, whether it changed anything (`changed` is false when nothing did, so a
driver can tell a fixpoint), counts for the summary line, details for the JSON report (the nodes it
touched, with the reason where it left one alone), and warnings that name a tensor or node.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class PassResult:
    name: str
    changed: bool = False
    counts: dict[str, int] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def __getitem__(self, key: str):
        """A detail by name: result["folded"]."""
        return self.details[key]

    def count(self, key: str) -> int:
        return int(self.counts.get(key, 0))

    def to_dict(self) -> dict:
        return {"name": self.name, "changed": self.changed, "counts": dict(self.counts),
                "details": self.details, "warnings": list(self.warnings), "seconds": round(self.seconds, 4)}


def result(name: str, changed: bool, *, warnings: list[str] | None = None, **details) -> PassResult:
    """A PassResult whose counts are the lengths (or values) of its list, dict and int details."""
    counts = {k: (v if isinstance(v, int) else len(v)) for k, v in details.items()
              if isinstance(v, (int, list, dict)) and not isinstance(v, bool)}
    return PassResult(name, bool(changed), counts, details, list(warnings or []))
