"""The prediction stage: the written model's TensorRT engine as the simulator builds it (into the
report, and into the model's metadata for `qdqgraph report`), and the speed line against the FP16
engine of the same model, the written graph without its Q/DQ. `quantize` and its INT4 path predict
through it alike.

The two predictions are single-threaded Python and independent: on a graph of
runtime.LARGE_GRAPH_NODES nodes or more, the FP16 engine's is started in a forked child
(execution.ahead) before the quantized engine's, where a core is free for it, and only its estimate
in milliseconds comes back. Not beside insert --verify's child on two cores: there the three
processes shared two cores and the 10,000-node CNN's insert took longer (25.3 -> 26.3 s, best of 3
alternated runs each). Where no child runs, or it fails, the parent predicts it after the quantized
engine, as it always did: the line is the same either way.
"""
from __future__ import annotations

import time

from .calib.collect import cores
from .execution import ahead
from .execution.profile import step
from .execution.runtime import LARGE_GRAPH_NODES
from .graph import io, proto
from .ops import vocabulary
from .passes.strip import strip_qdq
from .placement import load_ruleset
from .precisions.formats import label
from .report import InsertReport
from .trtsim import SimReport, recorded, simulate, simulate_and_lint
from .trtsim.latency import DEFAULT_GPU, estimate_sim, speed_line
from .trtsim.regions import inner_reformats

__all__ = ["predict_written"]


def predict_written(loaded: io.Loaded, report: InsertReport, target: str, precision: str | None,
                    written: proto.ModelProto, gpu: str | None, busy: int = 0) -> SimReport | None:
    """The written model's prediction into the report (`_predict`), then the speed line (`_speed`).
    `loaded` is the written graph: its last use, its Q/DQ are stripped in place for the FP16 engine.
    `busy`: the cores other work of the run holds meanwhile (insert --verify's child)."""
    gpu_name = gpu or DEFAULT_GPU[target]
    started = _float_ahead(loaded, target, gpu_name, busy)
    try:
        begun = time.perf_counter()
        with report.stage("simulate"):
            sim = _predict(loaded, report, target, precision, written)
        wait = max(WAIT_MIN_S, WAIT_RATIO * (time.perf_counter() - begun))
        _speed(loaded, sim, report, target, gpu_name, started, wait)
    finally:
        if started is not None:           # not read: the quantized engine's prediction failed
            started.cancel()
    return sim


def _predict(loaded: io.Loaded, report: InsertReport, target: str, precision: str | None,
             written: proto.ModelProto) -> SimReport | None:
    """The simulator's prediction for the written model, into the report; returns it for the speed
    line (`_speed`). A simulator failure must not cost the user the model: it becomes a warning
    naming the error. `precision`: what the run asked for, which names a model with no Q/DQ
    (nothing quantized) in the summary. `written`: the model exported from `loaded`, which gets
    the prediction and the linter's findings in its metadata for `qdqgraph report`
    (trtsim.recorded), as report would compute them."""
    try:
        with step("quantized engine"):
            sim = _simulate(loaded, target, written)
            vocab = vocabulary()
            if precision and not any(vocab.is_(n, "quant") for n in loaded.graph.nodes):
                sim.quantized = label(precision)
            report.tensorrt = dict(sim.summary, inner_reformats=inner_reformats(sim), target=target)
        return sim
    except Exception as e:  # noqa: BLE001 - reported, not swallowed
        report.warnings.append(_failed(e))
        return None


def _simulate(loaded: io.Loaded, target: str, written: proto.ModelProto) -> SimReport:
    """The simulation of the written graph; `qdqgraph report`'s table, findings and JSON go into the
    metadata of `written` (trtsim.recorded), from one reading of the graph for both. A linter failure
    only leaves the model without a record: report then computes it (and says what failed)."""
    try:
        sim, found = simulate_and_lint(loaded.graph, region=load_ruleset(target=target).region, target=target,
                                       dims=loaded.dims)
    except Exception:  # noqa: BLE001 - the simulation alone below raises what it has to
        recorded.forget(written)
        return simulate(loaded.graph, target=target, dims=loaded.dims)
    with step("record"):
        recorded.record(written, sim, found, target, loaded.dims)
    return sim


def float_engine_ms(loaded: io.Loaded, target: str, gpu_name: str) -> float:
    """The FP16 engine's estimate (ms on `gpu_name`): the graph of `loaded` without its Q/DQ, which
    are stripped in place (the caller's last use of it, or a child's copy)."""
    strip_qdq(loaded.graph, values=False)
    return float(estimate_sim(simulate(loaded.graph, target=target, dims=loaded.dims), gpu_name).total_ms)


def _float_ahead(loaded: io.Loaded, target: str, gpu_name: str, busy: int = 0) -> ahead.Ahead | None:
    """`float_engine_ms` started in a child where the graph is large enough to pay the fork and a
    core is left for it beside the parent and the `busy` ones."""
    if len(loaded.graph.nodes) < LARGE_GRAPH_NODES or cores() < 2 + busy:
        return None
    return ahead.start(lambda: float_engine_ms(loaded, target, gpu_name))


# The FP16 engine's child has had the quantized engine's prediction time when the parent asks; it is
# waited for WAIT_RATIO times that more (the two cost about the same: 2.0 and 2.5 s on the 10,000-node
# CNN), at least WAIT_MIN_S, then killed and the prediction made here.
WAIT_RATIO = 3.0
WAIT_MIN_S = 30.0


def _speed(loaded: io.Loaded, sim: SimReport | None, report: InsertReport, target: str, gpu_name: str,
           started: ahead.Ahead | None, wait: float) -> None:
    """The speed line: the quantized engine (`_predict`'s) against the FP16 engine of the same
    model, read from `started` (`_float_ahead`) where it ran in a child (waited for `wait`
    seconds at most), else predicted here."""
    if sim is None or report.tensorrt is None:
        return
    try:
        with report.stage("simulate"), step("float engine"):
            try:
                if started is None:
                    raise ahead.Failed("not started ahead")
                float_ms = started.result(wait)
            except ahead.Failed:
                float_ms = float_engine_ms(loaded, target, gpu_name)
        report.tensorrt["speed"] = speed_line(sim, float_ms, gpu_name)
    except Exception as e:  # noqa: BLE001 - reported, not swallowed
        report.warnings.append(_failed(e))


def _failed(e: Exception) -> str:
    """The warning a failed prediction leaves: the model is written all the same."""
    return f"the TensorRT simulation failed ({type(e).__name__}: {e}); the model is written; please report this"
