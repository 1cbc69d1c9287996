"""The stage profile of a run: seconds and memory per stage, and per step inside a stage.

A report's `stage(name)` (qdqgraph.report.RunLog) records a row here; code inside a stage that
wants its own steps timed (a pass of `clean`, the search of a recipe, the export and re-import of
the float islands) opens `step(name)`, which records a nested row ("clean/fold_constants") in the
report whose stage is open, and does nothing outside a run. Each row holds:

- `seconds`: wall time, summed when a stage or step runs more than once (`calls` counts them);
- `rss_mb`: the process's resident memory when it ended (/proc/self/statm; absent elsewhere);
- `peak_rss_mb`: the process's high-water mark of resident memory when it ended
  (resource.getrusage's ru_maxrss). The mark never falls: a stage raised the peak only where its
  mark is above the one of the row before it, and a stage whose own peak stayed under an earlier
  one shows that earlier mark.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
import sys
import time
from typing import Iterator

_ACTIVE: contextvars.ContextVar[Profile | None] = contextvars.ContextVar("qdqgraph_profile", default=None)

try:
    _PAGE = os.sysconf("SC_PAGE_SIZE")
except (AttributeError, ValueError, OSError):      # pragma: no cover - not POSIX
    _PAGE = 4096


def peak_rss_mb() -> float:
    """The process's high-water mark of resident memory in MiB (ru_maxrss: KiB on Linux, bytes on macOS)."""
    try:
        import resource
    except ImportError:                              # pragma: no cover - Windows
        return 0.0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def rss_mb() -> float | None:
    """The process's resident memory now in MiB, or None where /proc is missing."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE / 2**20
    except (OSError, ValueError, IndexError):
        return None


class Profile:
    """Rows in the order they first ran: path ("stage" or "stage/step") -> seconds, calls, memory."""

    def __init__(self) -> None:
        self.rows: dict[str, dict] = {}
        self._open: list[str] = []
        # a full collection as each stage ends, set by a run on a large model (execution.memory.collects_every_stage):
        # the garbage of a stage (a graph and its weights are cycles) goes before the next one starts
        self.collect = False

    def path(self, name: str) -> str:
        """The row a stage or step called `name` opened now is counted in."""
        return "/".join([*self._open, name])

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        path = self.path(name)
        self.rows.setdefault(path, {"seconds": 0.0, "calls": 0})     # a parent row comes before its steps
        self._open.append(name)
        token = _ACTIVE.set(self)
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.collect and len(self._open) == 1:
                from .memory import collect
                collect()
            seconds = time.perf_counter() - start
            _ACTIVE.reset(token)
            self._open.pop()
            row = self.rows[path]
            row["seconds"] += seconds
            row["calls"] += 1
            now = rss_mb()
            if now is not None:
                row["rss_mb"] = round(now, 1)
            row["peak_rss_mb"] = round(peak_rss_mb(), 1)

    def to_dict(self) -> dict[str, dict]:
        return {k: dict(v, seconds=round(v["seconds"], 4)) for k, v in self.rows.items()}

    def _tree(self) -> list[str]:
        """The paths, each stage's steps right after it (a stage run twice shows its steps once)."""
        children: dict[str, list[str]] = {}
        for path in self.rows:
            children.setdefault(path.rpartition("/")[0], []).append(path)
        out: list[str] = []

        def walk(parent: str) -> None:
            for path in children.get(parent, []):
                out.append(path)
                walk(path)
        walk("")
        return out

    def lines(self) -> list[str]:
        """The profile as the CLI prints it with --verbose: one line per stage, its steps indented."""
        if not self.rows:
            return []
        width = max(len(k.rsplit("/", 1)[-1]) + 2 * k.count("/") for k in self.rows)
        out = [f"profile: {'stage':<{width}}  {'seconds':>8}  {'RSS MB':>7}  {'peak RSS MB':>11}  (peak: the "
               f"process's high-water mark when the stage ended)"]
        total = sum(row["seconds"] for path, row in self.rows.items() if "/" not in path)
        for path in self._tree():
            row = self.rows[path]
            depth = path.count("/")
            label = "  " * depth + path.rsplit("/", 1)[-1] + (f" x{row['calls']}" if row["calls"] > 1 else "")
            rss = f"{row['rss_mb']:.0f}" if "rss_mb" in row else "-"
            out.append(f"  {label:<{width + 9}}{row['seconds']:>8.2f}  {rss:>7}  {row.get('peak_rss_mb', 0):>11.0f}")
        out.append(f"  {'total':<{width + 9}}{total:>8.2f}")
        return out


@contextlib.contextmanager
def step(name: str) -> Iterator[None]:
    """Time `name` as a step of the stage open in this run's report; nothing outside a run."""
    active = _ACTIVE.get()
    if active is None:
        yield
        return
    with active.stage(name):
        yield
