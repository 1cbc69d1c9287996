"""Helpers the test modules share (conftest.py holds the shared fixtures)."""
import importlib.util
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def files(folder: Path) -> set:
    """The names in `folder` (to assert what a command left behind)."""
    return {p.name for p in folder.iterdir()}


def benchmark(name: str):
    """benchmarks/NAME.py imported as a module (its folder on sys.path, for the benchmarks it imports)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
