"""`fix`: any Q/DQ model (a QAT export, another tool's output, a hand-edited graph) rewritten to
TensorRT's placement, its own scales kept.

    result = qdqgraph.fix("model_qat.onnx")                 # or calib="data.npz" for scales it lacks
    onnx.save(result.model, "model.fixed.onnx")
    print(result.report.summary())                           # kept, moved, merged, converted, dropped, added

The stages mirror `quantize`: load -> read the Q/DQ as facts (fix.facts) -> strip them -> plan with
the same rules and selections as `insert` (prepare.plan_for) -> scales from the facts (fix.scales),
calibrating only the groups the model holds no scale for -> insert -> float types -> simulate and
lint before and after. The float graph is not cleaned (no BatchNormalization folded, no constant
folded), so stripping the output gives the graph stripping the input gives. A model whose Q/DQ
already sit where the plan puts them, with scales TensorRT takes, is returned as it was.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from ..graph import proto, io
from .. import api_checks
from ..calib.calibration import calibrate_plan
from ..config import QuantizeConfig, config_from
from ..errors import InvariantError, QdqError
from ..passes.check import qdq_violations
from ..passes.insert import Known, insert_qdq
from ..passes.precision import HIGH_PRECISIONS
from ..execution.memory import fewer_collections
from ..writing import write_model
from ..placement import load_ruleset
from ..placement.plan import Plan
from ..prepare import data_dims, is_real, read_data
from ..execution.runtime import register_custom_ops
from ..trtsim import recorded, simulate_and_lint
from ..graph.view import GraphView
from . import facts as fact_reader, planning
from .report import FixReport
from .scales import Move, as_dtype, choose

__all__ = ["fix", "FixResult", "FixReport", "FIX_HIGH_PRECISIONS", "default_output"]

FIX_HIGH_PRECISIONS = ("keep",) + tuple(HIGH_PRECISIONS)


@dataclass
class FixResult:
    model: proto.ModelProto
    plan: Plan
    report: FixReport
    config: QuantizeConfig


def default_output(path) -> str:
    return str(path).removesuffix(".onnx") + ".fixed.onnx"


def fix(model, calib=None, *, config: QuantizeConfig | None = None, high_precision: str = "keep", progress=None,
        **options) -> FixResult:
    """A Q/DQ model (path or ModelProto) with its Q/DQ where TensorRT's rules put them and its own
    scales kept; `calib` (as for `quantize`) calibrates only tensors the model holds no scale for,
    and without it such tensors are a QdqError naming them. `config` or keyword options as for
    `quantize` (rules, exclude_ops, exclude_nodes, include_nodes, method, ...); the precision is the
    model's. `high_precision`: "keep" (default) leaves the float parts in the types the model has,
    so scales are written bit for bit; fp16/bf16/fp32 retype them as `insert` does."""
    api_checks.fix(model, calib, config)
    if high_precision not in FIX_HIGH_PRECISIONS:
        raise QdqError(f"unknown high precision {high_precision!r}", f"use one of {', '.join(FIX_HIGH_PRECISIONS)}")
    with fewer_collections():
        return _fix(model, calib, config, high_precision, progress, options)


def _config(config: QuantizeConfig | None, precision: str, options: dict) -> QuantizeConfig:
    asked = options.get("precision") or (config.precision if config is not None and "precision" in options else None)
    if asked is not None and asked != precision:
        raise QdqError(f"the model's Q/DQ are {precision.upper()}, and fix keeps a model's precision (asked: {asked})",
                       f"drop the precision, or quantize the float model with `qdqgraph insert --precision {asked}`")
    options = {k: v for k, v in options.items() if k != "precision"}
    if config is None:
        return config_from(None, precision=precision, **options)
    cfg = config_from(config, **options)
    return cfg if cfg.precision == precision else cfg.with_(precision=precision)


def _fix(model, calib, config, high_precision, progress, options) -> FixResult:
    report = FixReport(input=str(model) if isinstance(model, (str, os.PathLike)) else None,
                       high_precision=high_precision)
    with report.stage("load"):
        loaded = io.load(model)
        report.opset_raised_from = loaded.opset_raised_from
        facts = fact_reader.read(loaded.graph)
        cfg = _config(config, facts.precision, options)
        if cfg.fixed_inputs:
            raise QdqError("--fix-input is not supported by fix (it would change the graph, not only its Q/DQ)",
                           "fix the model first, then run `qdqgraph insert` on its float version with --fix-input")
        for lib in cfg.custom_op_libraries:
            register_custom_ops(lib)
        report.config = cfg.to_dict()
        report.warnings += loaded.repairs
        if facts.chained:
            report.warnings.append(f"Q -> DQ -> Q -> DQ chains read as their last pair, the scale their consumers "
                                   f"see (the first DQ of each: {', '.join(facts.chained)})")
        if loaded.opset_raised_from is not None:
            report.warnings.append(f"the model's opset {loaded.opset_raised_from} was raised to {io.MIN_OPSET} "
                                   f"(per-channel Q/DQ need it)")
        data = read_data(loaded, calib, cfg) if calib is not None else None
        if isinstance(calib, str) and calib == "random":
            report.warnings.append("calibrated on random data: the scales of the tensors it calibrates say nothing "
                                   "about accuracy")
    ruleset = load_ruleset(cfg.rules, cfg.precision, cfg.target)
    dims = _dims(loaded, data)
    with report.stage("simulate"):
        report.tensorrt_before, report.lint_before, _ = _predict(loaded.graph, ruleset.region, report, dims,
                                                                 cfg.target)
    with report.stage("strip"):
        report.add([fact_reader.strip(loaded.graph, facts)])
        stripped = loaded.graph.copy()
        fact_reader.restore_clamps(loaded.graph, facts)
        report.clamps = [{"tensor": t, "min": lo, "max": hi} for t, lo, hi in facts.clamps]
        report.read = facts.counts()
    with report.stage("plan"):
        held = {n.name for n, _, _ in facts.edges if n is not None}
        plan, warnings = planning.plan(loaded, cfg, stripped, held)
        report.warnings += warnings
        view = GraphView(loaded.graph)
        choice = choose(view, plan, facts, cfg.format)
    if choice.missing:
        with report.stage("calibrate"):
            _calibrate(loaded, plan, choice, view, data, cfg, report, progress)
    report.moves = choice.moves
    report.activation_sites, report.weight_sites = len(plan.activation_sites()), len(plan.weight_sites())
    if choice.unchanged and high_precision == "keep":
        report.unchanged = True
        report.tensorrt_after, report.lint_after = report.tensorrt_before, list(report.lint_before)
        original = model if proto.is_model(model) else io.read_model(model)
        return FixResult(_dense(original, report), plan, report, cfg)
    with report.stage("insert"):
        inserted = insert_qdq(loaded.graph, plan, {}, weights="qdq" if facts.qdq_weights else "int8",
                              fmt=cfg.format, known=choice.known)
        report.add([inserted])
        violations = qdq_violations(loaded.graph)
        if violations:
            raise InvariantError("fix produced a model that breaks qdqgraph's Q/DQ invariants: " + "; ".join(violations[:5]))
    model_out, final = _types(loaded, inserted["provenance"], cfg, high_precision, data if is_real(calib) else None,
                              report)
    with report.stage("simulate"):
        report.tensorrt_after, report.lint_after, found = _predict(final.graph, ruleset.region, report, dims,
                                                                   cfg.target)
        if found is not None:           # what `report` prints for the written model, kept in it
            recorded.record(model_out, found[0], found[1], cfg.target, dims)
    return FixResult(model_out, plan, report, cfg)


def _dims(loaded: io.Loaded, data) -> dict[str, int]:
    """The symbolic dimensions' values the predictions are made at: the calibration data's first
    sample's shapes where data is given, else those the input's own prediction was made at (its
    metadata, as insert wrote it), else none (each symbolic dimension counts as 1)."""
    return data_dims(loaded, data) if data is not None else recorded.dims_of(loaded)


def _calibrate(loaded, plan, choice, view, data, cfg, report, progress) -> None:
    """Scales for the groups the model holds none for: from the data, or a QdqError naming them."""
    tensors = sorted(t for members in choice.missing.values() for t in members)
    if data is None:
        more = f" and {len(tensors) - 5} more" if len(tensors) > 5 else ""
        raise QdqError(f"the model holds no scale for {len(tensors)} tensor(s) TensorRT's placement quantizes: "
                       f"{', '.join(tensors[:5])}{more}",
                       "pass --calib DATA to calibrate them, or --exclude-node their consumers to keep them float")
    cal = calibrate_plan(loaded, plan, data, cfg, progress, only=set(choice.missing))
    for rep, members in sorted(choice.missing.items()):
        a = float(cal.amax[rep])
        scale = np.asarray(cfg.format.scale_of(a)).reshape(())
        for m in members:
            choice.known[m] = Known(as_dtype(scale, view, m))
            choice.moves.append(Move("added", m, "activation", f"calibrated ({cfg.method}, amax {a:.4g}): the model "
                                     f"held no scale for it or for a tensor it could take one from", amax_after=a))
    choice.missing = {}
    report.calibrated = {"method": cfg.method, "samples": cal.samples, "tensors": len(tensors)}


def _types(loaded: io.Loaded, provenance: dict, cfg: QuantizeConfig, high_precision: str, data, report: FixReport):
    """The written model: its float parts in the types it had ("keep"), or retyped as insert does."""
    mixed = planning.typed(loaded.graph)
    if high_precision != "keep" and mixed:
        report.warnings.append(f"the model already has float parts in another type than float32; they are kept "
                               f"(--high-precision {high_precision} applies to float32 models)")
    if high_precision == "keep" or mixed:
        with report.stage("insert"):
            model = io.to_model(loaded, provenance, tidy=False)
            try:
                io.check(model)
            except proto.CHECK_ERRORS as e:
                raise InvariantError(f"the fixed model fails the ONNX checker: {str(e).splitlines()[0]}") from e
        recorded.forget(model)          # the input's prediction (trtsim.recorded) describes the graph before
        return model, loaded
    return write_model(loaded, provenance, cfg.with_(high_precision=high_precision), data, report)


def _predict(graph, region, report: FixReport, dims: dict[str, int],
             target: str) -> tuple[dict | None, list[str], tuple | None]:
    """The simulator's summary and the linter's findings for `target` (as `qdqgraph report
    --target` prints them), at `dims`; and (simulation, findings) for `recorded.record`, or None
    where it failed."""
    try:
        sim, found = simulate_and_lint(graph, region=region, target=target, dims=dims)
        return dict(sim.summary), [str(d) for d in found], (sim, found)
    except Exception as e:  # noqa: BLE001 - reported, not swallowed
        report.warnings.append(f"the TensorRT simulation failed ({type(e).__name__}: {e}); please report this")
        return None, [], None


def _dense(model: proto.ModelProto, report: FixReport) -> proto.ModelProto:
    """The model as it was, but with sparse initializers stored dense: the full ONNX checker and
    TensorRT's parser take no sparse initializer (a copy; the caller's model is left alone)."""
    if not io.has_sparse(model.graph):
        return model
    copy = proto.ModelProto()
    copy.CopyFrom(model)
    names = io.densify_sparse(copy)
    report.warnings.append(f"the model is written as it was, with its sparse initializer(s) stored dense "
                           f"({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}): the full ONNX checker "
                           f"and TensorRT's parser take none")
    return copy
