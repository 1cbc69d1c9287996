"""The TensorRT engines the simulator is measured against (../shared/oracles, see its README): each
oracle's engine layer JSON and the builder of the graph it was built from (qdqgraph/testing/models.py).
tests/test_trtsim_oracles.py asserts on these figures and benchmarks/oracles.py prints them."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..trtsim.diff import Diff, diff
from ..trtsim.engine_report import EngineReport, read_engine_report
from ..trtsim.report import SimReport
from ..trtsim.simulate import simulate
from . import models

# oracle file (under the oracles folder, without .graph.json) -> builder of its Q/DQ graph
ORACLES = {
    "trex/pytorch-resnet18-a100-fp16": lambda: models.resnet18("float"),
    "trex/pytorch-resnet18-a100-qat": lambda: models.resnet18("qat"),
    "trex/pytorch-resnet18-a100-qat-residual": lambda: models.resnet18("qat-residual"),
    "trex/pytorch-resnet18-a100-qat-residual-qgap": lambda: models.resnet18("qat-residual-qgap"),
    "trex/tensorflow-resnet50-rtx3090-qat": models.resnet50_tf_qat,
    "more/trex-mobilenetv2-titanrtx-qat.trex011": lambda: models.mobilenet_v2_qat("qat"),
    "more/trex-mobilenetv2-titanrtx-qat-residual.trex011": lambda: models.mobilenet_v2_qat("qat-residual"),
    "more/trex-mobilenetv2-titanrtx-qat.trex010": lambda: models.mobilenet_v2_qat("qat"),
    "more/trex-mobilenetv2-titanrtx-qat-residual.trex010": lambda: models.mobilenet_v2_qat("qat-residual"),
}


def oracles_dir() -> Path | None:
    """$QDQGRAPH_ORACLES, the copy in <repo>/tests/data/oracles, $QDQGRAPH_SHARED/oracles, or
    <repo>/../shared/oracles; None if absent (an installed package without the repository)."""
    env = os.environ.get("QDQGRAPH_ORACLES")
    if env:
        return Path(env)
    copy = Path(__file__).resolve().parents[2] / "tests" / "data" / "oracles"
    if copy.is_dir():
        return copy
    shared = Path(os.environ.get("QDQGRAPH_SHARED", Path(__file__).resolve().parents[3] / "shared"))
    d = shared / "oracles"
    return d if d.is_dir() else None


def folder_or_exit(given) -> Path | None:
    """A benchmark's --oracles folder, or the default; None (after one line on stderr) when absent."""
    import sys
    folder = given or oracles_dir()
    if folder is None or not Path(folder).is_dir():
        print("no oracles folder: pass --oracles DIR or set QDQGRAPH_SHARED", file=sys.stderr)
        return None
    return Path(folder)


@dataclass
class OracleResult:
    name: str
    sim: SimReport
    engine: EngineReport
    diff: Diff                 # int8 vs float
    exact: Diff                # fp16 and fp32 told apart


def compare(name: str, folder: Path | None = None) -> OracleResult:
    from ..graph import io
    folder = folder or oracles_dir()
    assert folder is not None, "no TensorRT oracle folder here (see oracles_dir)"
    sim = simulate(io.load(ORACLES[name]()).graph)
    engine = read_engine_report(Path(folder) / f"{name}.graph.json")
    return OracleResult(name, sim, engine, diff(sim, engine), diff(sim, engine, exact=True))
