"""Progress bars on stderr: one per stage that runs over data (calibration, sensitivity, compare,
--verify), with its total and an ETA. None when stderr is not a terminal or with --quiet.

The pipeline calls `progress.stage(name, total)` where it knows a total, then `progress(n)` as
work is done; any plain callable works as `progress` too (it just gets the counts).
"""
from __future__ import annotations

import shutil
import sys


class Bars:
    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.bar = None

    def stage(self, name: str, total: int | None = None, unit: str = "sample") -> None:
        from tqdm import tqdm
        self.close()
        columns = shutil.get_terminal_size((80, 24)).columns
        # a pseudo-terminal may report 0 columns: tqdm would then draw nothing
        self.bar = tqdm(total=total, desc=name, unit=unit, file=self.stream, leave=False,
                        dynamic_ncols=columns > 0, ncols=None if columns > 0 else 80)

    def __call__(self, n: int = 1) -> None:
        if self.bar is None:
            self.stage("working")
        self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def bars(args) -> Bars | None:
    if getattr(args, "quiet", False) or not sys.stderr.isatty():
        return None
    try:
        import tqdm  # noqa: F401
    except ImportError:
        return None
    return Bars()


def run_with_bars(args, fn):
    """`fn(progress)` with the command's progress bars (None when quiet), closed however it ends."""
    progress = bars(args)
    try:
        return fn(progress)
    finally:
        if progress is not None:
            progress.close()
