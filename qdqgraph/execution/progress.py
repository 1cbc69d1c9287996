"""How the stages report progress: a `progress` object given to quantize, calibrate, compare or
the sensitivity analysis is called with counts as work is done (`progress(n)`); if it also has
`stage(name, total, unit)`, it is told when a stage over data starts and how long it is (the CLI's
bars use that for their total and ETA)."""
from __future__ import annotations


def stage(progress, name: str, total: int | None = None, unit: str = "sample") -> None:
    """Start a stage on `progress` if it draws stages; a plain callable just counts."""
    start = getattr(progress, "stage", None)
    if start is not None:
        start(name, total, unit)


def step(progress, n: int = 1) -> None:
    if progress is not None:
        progress(n)
