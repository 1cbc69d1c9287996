"""`quantize`: the Python API that composes the stages, one way through.

    load (fix inputs) -> clean -> [equalize] -> plan (P14) -> [smooth -> replan] -> calibrate
        -> [bias means] -> [sensitivity -> fallback replan | fidelity: bias correction kept or not,
        fragile heads, the SQNR floor] -> insert -> float islands -> check -> simulate

The model is read once, the calibration data once (streamed where it is a folder), and every
stage works on the same graph in memory; the fallback plans again on it rather than reloading the
file. Every pass returns a PassResult and every stage's time is recorded: the report is built from
them.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable
from pathlib import Path
import time

import numpy as np

from .placement import advice, load_ruleset
from .graph import attention, branches, io, proto
from .recipes import attention_guard, depthwise, output_aware, fidelity, learned_rounding, massive_columns
from .execution import distributed
from .calib.calibration import calibrate_plan, open_session_ahead, ranges_from_cache
from .calib.opening import Opened
from .calib.collect import KEEP_BYTES, KEEP_SAMPLES, output_keeper
from .config import QuantizeConfig, config_from, DEFAULT_SQNR_FLOOR
from .samples.data import CalibrationData
from .errors import InvariantError, QdqError, option
from .precisions.formats import label
from .precisions.registry import precision
from .passes.bias_correction import correct_biases, input_means
from .passes.check import qdq_violations
from .passes.equalize import equalize
from .recipes.equalize import activation_ranges
from .passes.insert import insert_qdq
from .recipes.int4_weights import int4_targets, quantize_int4_weights
from .passes.smooth import channel_ranges, smooth, targets
from .placement.plan import Plan
from .recipes.small_regions import NO_INT8
from .prepare import check_plan, clean, data_dims, is_real, load_model, plan_for, prepare, read_data
from .execution.profile import step
from .report import InsertReport
from .writing import write_model
from .prediction import predict_written
from .execution.memory import collects_every_stage, fewer_collections, free_if_large
from .execution import runtime
from .execution.runtime import register_custom_ops
from .recipes.sensitivity import choose_fallback, measure, output_sqnr
from .trtsim import simulate
from .graph.view import GraphView
from .api_checks import quantize as check_arguments
from .recipes.fidelity.floor import quantized_share

__all__ = ["Result", "quantize", "prepare", "default_output"]


@dataclass
class Result:
    model: proto.ModelProto
    plan: Plan
    report: InsertReport
    config: QuantizeConfig | None = None
    # the float model's outputs on the first calibration samples, where the run computed them (the
    # calibration runs' graph outputs, calib.collect.FloatOutputs, or the fidelity recipes'
    # reference): `qdqgraph insert --verify` compares against them instead of running the float
    # model again (execution.evaluate.compare's `reference`)
    reference: Any = field(default=None, repr=False, compare=False)
    # the work the caller's `ahead` started on the written model (execution.ahead.Ahead), or None
    ahead: Any = field(default=None, repr=False, compare=False)


def _asked_data(cfg: QuantizeConfig) -> list[tuple[str, str, str]]:
    """The options given explicitly that work on calibration data: (option as the user wrote it,
    what it does with the data, how else to get what it is for)."""
    asked = []
    if cfg.accuracy_budget is not None:
        asked.append((option("accuracy_budget", cfg.accuracy_budget), "measures the output SQNR on it", ""))
    elif cfg.max_float_layers is not None:
        asked.append((option("max_float_layers", cfg.max_float_layers), "ranks the nodes by their sensitivity on it", ""))
    if cfg.bias_correction:
        asked.append((option("bias_correction", True), "measures the mean output shift of the INT8 weights on it", ""))
    if cfg.smooth_quant is not None:
        asked.append((option("smooth_quant", cfg.smooth_quant), "measures the channel ranges on it", ""))
    if cfg.output_aware:
        asked.append((option("output_aware", True), "chooses each MatMul/Gemm input's range by the error in the "
                      "layer's output on it", ""))
    if cfg.learned_rounding == "on":
        asked.append((option("learned_rounding", "on"), "learns each weight's rounding on it", ""))
    return asked


def _require_data(cfg: QuantizeConfig, calib, calib_cache) -> None:
    """Refuse, in one line, a run whose explicit options need real calibration data it lacks (none
    is silently dropped)."""
    if precision(cfg.precision).weights_only:
        _require_int4_data(cfg, calib)
        return
    data = option("calib", "DATA.npz", literal=False)
    if calib is None and calib_cache is None:
        raise QdqError("no calibration data given",
                       f"pass {data} (or {option('calib', 'random')} to insert Q/DQ with meaningless scales)")
    if is_real(calib):
        return
    given = f"{option('calib', 'random')} is not data" if calib is not None else \
        f"only a calibration cache was given ({option('calib_cache')})"
    asked = _asked_data(cfg)
    if asked:
        what, does, _ = asked[0]
        raise QdqError(f"{what} {does.replace(' it', ' calibration data')}, and {given}",
                       f"pass {data}, or drop {what}")


def quantize(model, calib=None, *, config: QuantizeConfig | None = None, calib_cache=None, progress=None,
             ahead: Callable | None = None, **options) -> Result:
    """Float ONNX (path or ModelProto) in, Q/DQ ModelProto out, with the plan and a report.

    `calib` is a .npz/.npy path, a folder of them, a folder of images (with `preprocess`), a dict
    {input name: array (samples first)}, or "random"; `calib_cache` (a qdqgraph JSON or TensorRT
    calibration cache, or a dict tensor -> amax) replaces it, or with `calib` supplies what it
    lacks. Everything else is a `QuantizeConfig`, given whole (`config=`) or as keyword arguments
    of the same names (method, percentile, rules, exclude_nodes, high_precision, accuracy_budget, ...);
    see qdqgraph.config for each one and its default.

    `ahead(written ModelProto, reference)`: called once the written model exists, before its
    prediction; what it returns (an execution.ahead.Ahead: work on the model in a child process,
    such as `insert --verify`'s comparison) is `Result.ahead`, and is cancelled if the run fails after it.
    """
    check_arguments(model, calib, config, calib_cache, ahead)
    with fewer_collections(), distributed.scope():     # a Ray started for one stage serves the next
        return _quantize(model, calib, config, calib_cache, progress, options, ahead)


@dataclass
class _Run:
    """What one quantize() run carries from stage to stage."""

    cfg: QuantizeConfig
    calib: object
    calib_cache: object
    progress: object
    report: InsertReport
    loaded: io.Loaded
    data: CalibrationData | None
    plan: Plan = None                # type: ignore[assignment]  # set by the plan stage
    amax: dict = field(default_factory=dict)
    overrides: dict = field(default_factory=dict)   # ranges a recipe chose, over the calibrated ones
    floated: tuple = ()              # nodes the depthwise and attention checks returned to float
    known: dict | None = None        # learned INT8 weights
    means: dict | None = None        # bias correction's input means
    inserted: object = None          # the fallback's inserted trial, when it made one
    measured_: bool | None = None
    reference: object = None         # float outputs on the first samples (calibration's, the fidelity reference), for --verify
    products: massive_columns.Products | None = None   # massive columns' maxima from output-aware's float run
    ahead: Callable | None = None    # quantize()'s `ahead`
    opened: Opened | None = None     # calibration's session, opened while P14 refines the plan

    def drop_opened(self) -> None:
        if self.opened is not None:
            self.opened.drop()
            self.opened = None

    @property
    def real(self) -> CalibrationData | None:
        """The calibration data where it is real (not --calib random)."""
        return self.data if is_real(self.calib) else None

    def measured(self) -> bool:
        """Whether the fidelity recipes measure this run (decided once, before bias correction)."""
        if self.measured_ is None:
            self.measured_ = bool(self.plan.activation_sites()) and _measured(self.cfg, self.calib, self.data,
                                                                              self.loaded, self.plan)
        return self.measured_


@dataclass(frozen=True)
class _Step:
    """A recipe as a stage of the run: its report stage, whether it runs, what it does."""

    stage: str
    wanted: Callable[[_Run], bool]
    apply: Callable[[_Run], None]


def _quantize(model, calib, config, calib_cache, progress, options, ahead=None) -> Result:
    run = _start(model, calib, config, calib_cache, progress, options)
    run.ahead = ahead
    if precision(run.cfg.precision).weights_only:
        return _quantize_int4(run.loaded, run.real, run.cfg, run.report)
    try:
        with run.report.stage("plan"):
            run.plan = plan_for(run.loaded, run.cfg, placed=lambda placed: _open_ahead(run, placed))
            run.report.warnings += check_plan(run.loaded, run.plan)
        if run.opened is not None and any(s.wanted(run) for s in BEFORE_CALIBRATION):
            run.drop_opened()           # a recipe changes the graph or the ranges first
        _steps(run, BEFORE_CALIBRATION)
        _calibrate(run)
    finally:
        run.drop_opened()               # taken or not, its thread has ended before anything forks
    _steps(run, AFTER_CALIBRATION)
    _insert(run)
    return _finish(run)


def _open_ahead(run: _Run, placed: Plan) -> None:
    """Calibration's session opened in a thread while P14 refines `placed` (calib.opening), on a
    large graph whose calibration comes right after the plan: from data (no cache), with no recipe
    before it. Calibration takes it only where the refined plan calibrates the same tensors."""
    if run.data is None or run.calib_cache is not None or len(run.loaded.graph.nodes) < runtime.LARGE_GRAPH_NODES:
        return
    run.plan = placed               # what the recipes' conditions read; P14's plan replaces it
    if not any(s.wanted(run) for s in BEFORE_CALIBRATION):
        with step("calibration session, opened ahead"):     # its export here, its opening in a thread
            run.opened = open_session_ahead(run.loaded, placed, run.cfg)


def _steps(run: _Run, steps: tuple[_Step, ...]) -> None:
    for s in steps:
        if s.wanted(run):
            with run.report.stage(s.stage):
                s.apply(run)


def _start(model, calib, config, calib_cache, progress, options) -> _Run:
    """The configuration checked, the model loaded and cleaned, the data read, equalization."""
    cfg = config_from(config, **options)
    _require_data(cfg, calib, calib_cache)
    for lib in cfg.custom_op_libraries:
        register_custom_ops(lib)
    report = InsertReport(input=str(model) if isinstance(model, (str, os.PathLike)) else None, method=cfg.method,
                          config=cfg.to_dict())
    with report.stage("load"):
        loaded, fixed = load_model(model, cfg, report.warnings)
        report.profile.collect = collects_every_stage(loaded)
        report.add(fixed)
        report.opset_raised_from = loaded.opset_raised_from
        report.repairs = list(loaded.repairs)
        data = read_data(loaded, calib, cfg) if calib is not None else None
        if isinstance(calib, str) and calib == "random":
            report.warnings.append("calibrated on random data: the scales say nothing about accuracy")
    with report.stage("clean"):
        report.add(clean(loaded))
        # the prediction's FLOPs and bytes at the shapes the model is calibrated at, not with each
        # symbolic dimension as 1; placement's P14 still counts at the declared shapes (its reasons
        # give the share at these too): at the data's, it keeps the Whisper tiny.en decoder's layers
        # INT8 (78.5 -> 90.5 % INT8 FLOPs at 64 tokens) and its held-out SQNR falls from 32.9 to
        # 18.0 dB (docs/ACCURACY.md)
        if data is not None and data.count:
            with step("dims"):
                loaded.dims = data_dims(loaded, data)
    run = _Run(cfg, calib, calib_cache, progress, report, loaded, data)
    _steps(run, BEFORE_PLAN)
    return run


def _equalize(run: _Run) -> None:
    stats = activation_ranges(run.loaded, run.data) if run.real is not None else None
    if stats or run.cfg.equalize == "on":     # auto without data: nothing to choose by
        run.report.add([equalize(run.loaded.graph, stats, choose=run.cfg.equalize == "auto")])


def _output_aware_step(run: _Run) -> None:
    assert run.data is not None, "_output_aware asks for real data"
    # the float outputs of the first samples, from the float run the recipe makes anyway: the
    # calibration then need not keep them, and runs only the part of the graph its tensors need
    keeper = output_keeper(run.loaded.graph) if run.reference is None else None
    # and the channel maxima massive columns measures, from the same run (its Products), where it runs
    pooled_only = not _output_aware(run.cfg, run.loaded, run.plan, run.calib)
    run.products = None if pooled_only else massive_columns.Products(run.loaded)
    riders = ((run.products,) if run.products is not None else ()) + ((keeper,) if keeper is not None else ())
    passed, run.overrides = output_aware.run(run.loaded, run.plan, run.data, riders, pooled_only)
    if run.products is not None:
        run.products.close()
    kept = keeper.result() if keeper is not None else None
    if kept is not None and kept.samples >= min(KEEP_SAMPLES, run.data.count):
        run.reference = kept
    run.report.add([passed])
    free_if_large(run.loaded)           # the weights the smoothing replaced, before planning again
    if passed.changed:
        run.plan = plan_for(run.loaded, run.cfg)


def _massive_step(run: _Run) -> None:
    assert run.data is not None, "_output_aware asks for real data"
    passed = massive_columns.run(run.loaded, run.plan, run.data, run.products)
    run.products = None
    run.report.add([passed])
    if passed.changed:
        run.plan = plan_for(run.loaded, run.cfg)


def _smooth_step(run: _Run) -> None:
    found = targets(run.loaded.graph, run.plan)
    ranges = channel_ranges(run.loaded, sorted(found), run.data)
    run.report.add([smooth(run.loaded.graph, found, ranges, run.cfg.smooth_quant)])
    run.plan = plan_for(run.loaded, run.cfg)


def _calibrate(run: _Run) -> None:
    """Ranges for the plan (a recipe's chosen ranges over them), then the If branches."""
    with run.report.stage("calibrate"):
        # the groups a recipe chose a range for take it in place of the calibrated one: they are not
        # calibrated; nor are the float outputs kept again where a recipe's float run kept them
        chosen = {rep for rep, members in run.plan.groups().items() if any(t in run.overrides for t in members)} \
            if run.calib_cache is None else set()
        run.amax, reference = _ranges(run.loaded, run.plan, run.data, is_real(run.calib), run.calib_cache,
                                      run.cfg, run.report, run.progress, chosen, run.reference is None, run.opened)
        run.reference = reference if run.reference is None else run.reference
        for rep, members in run.plan.groups().items():
            chosen_ranges = [run.overrides[t] for t in members if t in run.overrides]
            if chosen_ranges and run.calib_cache is None:
                run.amax[rep] = max(chosen_ranges)
        free_if_large(run.loaded)
    with run.report.stage("if branches"):    # each branch from the samples that take it (qdqgraph.graph.branches)
        branched = branches.quantize_branches(run.loaded, run.real, run.cfg, quantize)
        run.report.add([branched])
        run.report.notes += branches.summary(branched)


def _depthwise_step(run: _Run) -> None:
    assert run.real is not None, "_checks_depthwise asks for real data"
    kept, run.report.depthwise = depthwise.decide(run.loaded, run.plan, run.amax, run.real, run.cfg, run.progress,
                                                  float_outputs=run.reference)
    free_if_large(run.loaded)
    _replan(run, kept)


def _replan(run: _Run, kept: tuple) -> None:
    """The plan with `kept` (node, why) float too, the calibrated ranges carried over."""
    if kept:
        run.floated += kept
        per_tensor = {t: run.amax[rep] for rep, members in run.plan.groups().items() for t in members}
        run.plan = plan_for(run.loaded, run.cfg, run.floated)
        run.amax, _ = ranges_from_cache(run.plan, per_tensor)


def _checks_depthwise(run: _Run) -> bool:
    """--depthwise-check on, real data, INT8 or FP8 activations, and a quantized grouped convolution."""
    return run.cfg.depthwise_check and run.real is not None and run.cfg.format is not None and \
        bool(depthwise.candidates(run.loaded.graph, run.plan))


def _attention_step(run: _Run) -> None:
    kept, run.report.attention = attention_guard.decide(run.loaded, run.plan, run.amax, run.real, run.cfg,
                                                        run.progress, float_outputs=run.reference)
    free_if_large(run.loaded)
    _replan(run, kept)


def _rounding_step(run: _Run) -> None:
    assert run.data is not None, "_learns_rounding asks for data"
    run.known = _learn_rounding(run.loaded, run.plan, run.amax, run.data, run.report, run.progress)
    free_if_large(run.loaded)


def _bias_step(run: _Run) -> None:
    assert run.data is not None, "_require_data and _measured ask for real data"
    run.means = input_means(run.loaded, run.plan, run.data)


def _fallback_step(run: _Run) -> None:
    run.plan, run.amax, run.inserted = _fallback(run.loaded, run.plan, run.amax, run.means, run.data, run.cfg,
                                                 run.report, run.progress, run.floated, run.known)


def _fidelity_step(run: _Run) -> None:
    assert run.data is not None, "_measured asks for real data"
    run.plan, run.amax, run.means, ref = _fidelity(run.loaded, run.plan, run.amax, run.means, run.data, run.cfg,
                                                   run.report, run.progress, run.floated)
    if run.reference is None and sum(a.nbytes for v in ref.outputs.values() for a in v) <= KEEP_BYTES:
        run.reference = ref          # where calibration kept none (a cache): the fidelity recipes' float outputs


# The recipes, in the order they run (each in its own report stage, where wanted)
BEFORE_PLAN = (
    _Step("equalize", lambda r: r.cfg.equalize != "off" and not precision(r.cfg.precision).weights_only, _equalize),
)
BEFORE_CALIBRATION = (
    _Step("output-aware scales", lambda r: _output_aware(r.cfg, r.loaded, r.plan, r.calib)
          or _pooled_only(r.cfg, r.loaded, r.plan, r.calib), _output_aware_step),
    _Step("massive columns", lambda r: _output_aware(r.cfg, r.loaded, r.plan, r.calib), _massive_step),
    _Step("smooth", lambda r: r.cfg.smooth_quant is not None, _smooth_step),
)
AFTER_CALIBRATION = (
    _Step("depthwise check", _checks_depthwise, _depthwise_step),
    _Step("attention check", lambda r: bool(r.plan.activation_sites())
          and bool(attention_guard.attention_gemms(r.loaded.graph, r.plan)), _attention_step),
    _Step("learned rounding", lambda r: _learns_rounding(r.cfg, r.calib, r.loaded, r.plan, r.report)
          and r.data is not None, _rounding_step),
    _Step("bias correction", lambda r: bool(r.cfg.bias_correction)
          or (_auto_bias(r.cfg) and r.measured() and bool(r.plan.weight_sites())), _bias_step),
    _Step("sensitivity", lambda r: r.cfg.fallback and bool(r.plan.activation_sites()), _fallback_step),
    _Step("fidelity", lambda r: not (r.cfg.fallback and r.plan.activation_sites()) and r.measured(), _fidelity_step),
)


def _insert(run: _Run) -> None:
    """The Q/DQ of the plan (or the fallback's trial, already inserted), checked."""
    report, loaded = run.report, run.loaded
    with report.stage("insert"):
        if run.inserted is None:
            if run.means is not None:
                report.add([correct_biases(loaded.graph, run.plan, run.means, run.known)])
            inserted = insert_qdq(loaded.graph, run.plan, run.amax, weights=run.cfg.weights, fmt=run.cfg.format,
                                  known=run.known)
        else:
            trial = run.inserted
            assert isinstance(trial, _Inserted)
            loaded.graph = trial.graph
            report.add(trial.passes)
            inserted = trial.result
        report.add([inserted])
        report.fill_from_plan(run.plan, run.amax)
        for t in inserted["zero_range"]:
            report.warnings.append(f"tensor '{t}' was zero over all calibration samples; it got the safe scale "
                                   f"(docs/CALIBRATION.md)")
        violations = qdq_violations(loaded.graph)
        if violations:
            raise InvariantError("qdqgraph produced a model that breaks its Q/DQ invariants: " + "; ".join(violations[:5]))
    run.inserted = inserted


def _finish(run: _Run) -> Result:
    """The writing stage, the prediction, what to tell the user, --require-int8, the speed line."""
    model_out, final = write_model(run.loaded, run.inserted["provenance"], run.cfg, run.real,  # type: ignore[index]
                                   run.report)
    started = run.ahead(model_out, run.reference) if run.ahead is not None else None
    try:
        result = _predicted(run, model_out, final, busy=int(started is not None))
    except BaseException:
        if started is not None:
            started.cancel()
        raise
    result.ahead = started
    return result


def _predicted(run: _Run, model_out: proto.ModelProto, final: io.Loaded, busy: int = 0) -> Result:
    """The written model's prediction and what it tells the user (see `_finish`); `busy`: the
    cores the caller's work ahead holds meanwhile."""
    cfg, report, loaded, plan = run.cfg, run.report, run.loaded, run.plan
    predict_written(final, report, cfg.target, cfg.precision, model_out, cfg.gpu, busy)
    report.notes += advice.explain(loaded.graph, plan, run.real, report.tensorrt)
    why = next((d.reason for d in plan.decisions.values() if not d.quantized and (d.reason or "").startswith(NO_INT8)),
               None)
    if why:
        report.warnings.append(f"{why}; the model is written in float"
                               + (f" with {cfg.high_precision} islands" if cfg.high_precision != "fp32" else ""))
    little = advice.warning(loaded.graph, plan, report.tensorrt, label(cfg.precision))
    if little:
        report.warnings.append(little)
    _require_share(cfg, loaded, plan, report)
    return Result(model_out, plan, report, cfg, reference=run.reference)


def _require_share(cfg: QuantizeConfig, loaded: io.Loaded, plan: Plan, report: InsertReport) -> None:
    """--require-int8: a QdqError (nothing is written) when the predicted quantized share of the
    weighted FLOPs is below it, naming the first cause."""
    if cfg.require_int8 is None:
        return
    q = label(cfg.precision)
    share = (report.tensorrt or {}).get("int8_flops_share")
    if share is None:
        raise QdqError(f"--require-int8 {cfg.require_int8:g}: the {q} FLOPs share is unknown (the TensorRT "
                       f"simulation failed)", "drop --require-int8, and please report the simulation failure")
    if 100 * share < cfg.require_int8:
        why = advice.causes(loaded.graph, plan)
        raise QdqError(f"{q} FLOPs {100 * share:.1f}% is below --require-int8 {cfg.require_int8:g}"
                       + (f" ({why[0]})" if why else ""),
                       "change what keeps the convolutions and GEMMs float (see the plan with --report), or "
                       "lower --require-int8")


def _require_int4_data(cfg: QuantizeConfig, calib) -> None:
    """INT4 weights calibrate no activation: only AWQ reads data, and only rules decide."""
    if cfg.int4_method == "awq" and not is_real(calib):
        raise QdqError(f"{option('int4_method', 'awq')} searches scales on calibration data, and none was given",
                       f"pass {option('calib', 'DATA.npz', literal=False)}, or {option('int4_method', 'rtn')} "
                       f"(round to nearest, no data)")
    for what, _, _ in _asked_data(cfg):
        raise QdqError(f"{what} applies to INT8 and FP8 activations, not to {option('precision', 'int4')}",
                       f"drop {what}, or use {option('precision', 'int8')} or fp8")


def _nothing_int4(loaded: io.Loaded, plan: Plan, cfg: QuantizeConfig) -> QdqError:
    """The error for an INT4 plan that quantizes no weight: the model has no GEMM with a constant 2-D
    weight, or the plan kept every one float (why, by rule, and how to overrule it)."""
    other = f"use {option('precision', 'int8')} or fp8 for this model"
    targets = [t.node for t in int4_targets(loaded.graph)]
    if not targets:
        return QdqError("no MatMul or Gemm weight to quantize to INT4 (INT4 is weight-only, for GEMMs with a "
                        "constant 2-D weight)", other)
    kept = [plan.decisions[n] for n in targets if n in plan.decisions and not plan.decisions[n].quantized]
    if not kept:
        return QdqError(f"the plan quantizes none of the {len(targets)} MatMul/Gemm weight(s) to INT4", other)
    d = kept[0]
    names = ", ".join(k.node for k in kept[:3]) + (", ..." if len(kept) > 3 else "")
    what = f"the model's {len(targets)} MatMul/Gemm weight(s) ({names})" if len(kept) == len(targets) else \
        f"{len(kept)} of the model's {len(targets)} MatMul/Gemm weights ({names})"
    reason = d.reason.split(" -> float: ")[-1] if " -> float: " in d.reason else d.reason
    if d.rule == "user-exclude":
        yours = ", ".join(dict.fromkeys(k.reason for k in kept if k.rule == "user-exclude"))
        return QdqError(f"no MatMul or Gemm weight is left to quantize to INT4: {what} excluded by {yours}",
                        f"drop {'that exclusion' if ', ' not in yours else 'those exclusions'}, or {other}")
    rule = load_ruleset(cfg.rules, cfg.precision, cfg.target).by_id.get(d.rule)
    pattern = "|".join(re.escape(k.node) for k in kept[:3])
    fix = (f"pass {option('include_nodes', repr(pattern), literal=False)} to quantize "
           f"{'it' if len(kept) == 1 else 'them'} anyway ({d.rule} is advisory), or {other}"
           if rule is not None and getattr(rule, "advisory", False) else other)
    gemv = " as a GEMV" if "GEMV" in d.reason else ""
    return QdqError(f"no MatMul or Gemm weight is left to quantize to INT4: {what} excluded{gemv} by {d.rule} "
                    f"({reason})", fix)


def _quantize_int4(loaded: io.Loaded, data: CalibrationData | None, cfg: QuantizeConfig,
                   report: InsertReport) -> Result:
    """INT4 weights: the plan (rules/int4.toml over placement.toml, users' rules and selections)
    picks the MatMul/Gemm weights; each becomes an INT4 blocked DequantizeLinear
    (qdqgraph.recipes.int4_weights); activations stay in the float type, made FP16 by the islands."""
    with report.stage("plan"):
        plan = plan_for(loaded, cfg)
        chosen = {name for s in plan.weight_sites() for name, _ in s.edges}
        excluded = frozenset(t.node for t in int4_targets(loaded.graph) if t.node not in chosen)
        if not chosen - excluded:
            raise _nothing_int4(loaded, plan, cfg)
    with report.stage("int4 weights"):
        assert cfg.block_size is not None and cfg.int4_method is not None, "QuantizeConfig fills INT4's defaults"
        int4 = quantize_int4_weights(loaded, block_size=cfg.block_size, method=cfg.int4_method, data=data,
                                     exclude=excluded)
        report.add([int4])
        report.int4 = {k: int4[k] for k in ("bytes_before", "bytes_after")} | {
            "weights": len(int4["weights"]), "method": cfg.int4_method, "block_size": cfg.block_size}
        violations = qdq_violations(loaded.graph)
        if violations:
            raise InvariantError("qdqgraph produced a model that breaks its Q/DQ invariants: " + "; ".join(violations[:5]))
    # each DequantizeLinear is stamped with the placement rule of its weight's site
    rule = {s.tensor: s.rule for s in plan.weight_sites()}
    provenance = {w["dequantize"]: rule[name] for name, w in int4["weights"].items()}
    model_out, final = write_model(loaded, provenance, cfg, data, report)
    predict_written(final, report, cfg.target, cfg.precision, model_out, cfg.gpu)
    return Result(model_out, plan, report, cfg)


def _output_aware(cfg: QuantizeConfig, loaded: io.Loaded, plan: Plan, calib) -> bool:
    """Whether to choose linear-layer input ranges by their output error: as configured, or, by
    default, for transformers (a model with an attention block or a LayerNorm, also one written out
    as ops, which placement rule P10-layernorm-decomposed finds), with real data, no --smooth-quant
    of the user's, in INT8 (FP8 keeps small values precise under large ranges: its error is not
    the clipping trade-off the search makes)."""
    if not _searchable(cfg, calib) or cfg.output_aware is False:
        return False
    if cfg.output_aware:
        return True
    view = GraphView(loaded.graph, lazy=True)       # read only: the graph stays as it is
    if any(view.vocab.is_(n, "layernorm") for n in view.nodes) or \
            any((d.rule or "").startswith("P10-layernorm") for d in plan.decisions.values()):
        return True
    g = view.named()
    return any(view.vocab.is_(n, "matmul") and attention.of(g, n) is not None for n in view.nodes)


def _pooled_only(cfg: QuantizeConfig, loaded: io.Loaded, plan: Plan, calib) -> bool:
    """Whether to choose, by default, the input ranges of the layers a global max pool reads alone
    (recipes/pooled.py), in a model `_output_aware` leaves out: there the calibrated range clips the
    rare large values the pool keeps (a file-type classifier's convolution: 31.7 -> 37.7 dB output
    SQNR held out, docs/ACCURACY.md). The same conditions on the data, precision and options."""
    return _searchable(cfg, calib) and cfg.output_aware is None and bool(output_aware.pooled_targets(loaded, plan))


def _searchable(cfg: QuantizeConfig, calib) -> bool:
    """The output-aware search's conditions: real data, no --smooth-quant of the user's, INT8."""
    return is_real(calib) and cfg.smooth_quant is None and cfg.precision == "int8"


def _learns_rounding(cfg: QuantizeConfig, calib, loaded: io.Loaded, plan: Plan, report: InsertReport) -> bool:
    """Whether to learn the INT8 weights' rounding: as configured (`on` was checked when the config
    was made), or, by default, with real data, INT8 weights stored as INT8, PyTorch installed, and
    layers that take at most learned_rounding.AUTO_WORK to learn (measured: it pays its time on
    small models, not on large ones; docs/ACCURACY.md); a larger model gets a note."""
    if cfg.learned_rounding == "off" or cfg.precision != "int8" or cfg.weights != "int8" or not is_real(calib):
        return False
    if cfg.learned_rounding == "on":
        return True
    if learned_rounding.torch_or_none() is None:
        return False
    cost = learned_rounding.work(loaded.graph, plan)
    if cost > learned_rounding.AUTO_WORK:
        report.notes.append(f"learned rounding: not by default on a model this large ({cost:.1e} multiply-adds to "
                            f"learn, over {learned_rounding.AUTO_WORK:.0e}); --learned-rounding on learns it")
        return False
    return cost > 0


def _learn_rounding(loaded: io.Loaded, plan: Plan, amax: dict, data: CalibrationData, report: InsertReport,
                    progress) -> dict | None:
    """The learned INT8 weights ({weight tensor: Known}) for insertion, or None when there is none,
    or when they do not raise the model's output SQNR on calibration samples (float32, against
    float): then every weight is rounded to nearest, and the summary says so."""
    known, details = learned_rounding.learn(loaded, plan, amax, data, progress)
    if known:
        (before, each_before), (after, each_after) = learned_rounding.output_sqnr(loaded, plan, amax, data,
                                                                                  [None, known])
        details.update(sqnr_before_db=before, sqnr_after_db=after, outputs_before_db=each_before,
                       outputs_after_db=each_after, check_samples=learned_rounding.CHECK_SAMPLES)
        worse = [o.name for o, b, a in zip(loaded.graph.outputs, each_before, each_after)
                 if a < b - learned_rounding.MAX_OUTPUT_LOSS_DB]
        if not after > before or worse:
            details["dropped"] = (f"output {worse[0]} loses more than {learned_rounding.MAX_OUTPUT_LOSS_DB:g} dB"
                                  if worse else "the output SQNR did not rise")
            details["learned"] = 0
            known = {}
    details["seconds"] = round(details["seconds"], 3)
    report.add([learned_rounding.record(details)])
    return known or None


def _ranges(loaded: io.Loaded, plan: Plan, data: CalibrationData | None, real: bool, calib_cache,
            cfg: QuantizeConfig, report: InsertReport, progress, chosen: set[str] | frozenset[str] = frozenset(),
            outputs: bool = True, opened: Opened | None = None) -> tuple[dict[str, float], object]:
    """amax per scale group: from the cache (and the data for what it lacks), or from the data;
    and the float outputs the calibration runs computed on the first samples (real data only).
    `chosen`: groups whose range a recipe chose, left out of the calibration from data (their amax
    is missing from what this returns); `outputs`: whether to keep the float outputs (without
    them, the calibration runs only the part of the graph its tensors need); `opened`: a session
    opened ahead for it (calib.opening), used where it is the one calibration needs."""
    if calib_cache is not None:
        amax, missing = ranges_from_cache(plan, calib_cache, can_calibrate=real)
        if missing:
            cal = calibrate_plan(loaded, plan, data, cfg, progress, only=missing)
            amax.update(cal.amax)
            report.samples, report.calibration_seconds = cal.samples, cal.seconds
            report.warnings.append(f"{len(missing)} of {len(plan.groups())} scale groups were not in the "
                                   f"calibration cache; calibrated them from the data ({cfg.method})")
            return amax, cal.outputs
        return amax, None
    left = set(plan.groups()) - chosen
    cal = calibrate_plan(loaded, plan, data, cfg, progress, only=left if chosen and (left or not outputs) else None,
                         keep_outputs=outputs, opened=opened)
    report.samples, report.calibration_seconds = cal.samples, cal.seconds
    return cal.amax, cal.outputs if real else None


@dataclass
class _Inserted:
    """A graph already quantized (the fallback's trial), with what its passes returned."""
    graph: object
    result: object
    passes: list


def _fallback(loaded: io.Loaded, plan: Plan, amax: dict, means, data: CalibrationData, cfg: QuantizeConfig,
              report: InsertReport, progress=None, floated: tuple = (), known: dict | None = None):
    """Measure each quantized unit's sensitivity on a Q/DQ copy of the graph, choose the units to
    return to float, and plan again without them, in memory. The figure reported is the output
    SQNR of the model as it will be written (planned again, float islands and all), measured on
    the sweep's samples against float; while it misses the budget, the next most harmful unit goes
    back to float too, within --max-float-layers. Returns (plan, amax, inserted): the trial copy
    stands as the inserted graph when nothing goes back to float."""
    trial = loaded.graph.copy()
    bias = [correct_biases(trial, plan, means, known)] if means is not None else []
    trial_insert = insert_qdq(trial, plan, amax, weights=cfg.weights, fmt=cfg.format, known=known)
    sens, evaluate = measure(io.Loaded(graph=trial, ir_version=loaded.ir_version), plan, data,
                             cfg.sensitivity_samples, stop_above_db=cfg.accuracy_budget, progress=progress,
                             ray=cfg.ray, reference=loaded)
    chosen, sweep_db = choose_fallback(sens, evaluate, cfg.accuracy_budget, cfg.max_float_layers)
    del evaluate
    per_tensor = {t: amax[rep] for rep, members in plan.groups().items() for t in members}
    limit = cfg.max_float_layers if cfg.max_float_layers is not None else len(plan.decisions)
    budget = cfg.accuracy_budget

    def planned(units: list[str]) -> tuple[Plan, dict]:
        if not units:
            return plan, amax
        gains = {u.node: u.gain_db for u in sens.units}
        float_nodes = tuple((n, f"fallback: returned to float (+{gains.get(n, 0.0):.1f} dB output SQNR alone)")
                            for n in units)
        new_plan = plan_for(loaded, cfg, floated + float_nodes)
        return new_plan, ranges_from_cache(new_plan, per_tensor)[0]

    written_db, why_not = None, None
    while True:
        new_plan, new_amax = planned(chosen)
        try:
            written_db = _written_db(loaded, new_plan, new_amax, means, cfg, data, sens, known)
        except QdqError as e:               # a model onnxruntime cannot run here (bf16 islands on a CPU)
            written_db, why_not = None, e.problem
            break
        if budget is None or written_db >= budget or len(chosen) >= limit:
            break
        if not sens.units:                  # the sweep stopped at the all-INT8 estimate: rank the units now
            sens, evaluate = measure(io.Loaded(graph=trial, ir_version=loaded.ir_version), plan, data,
                                     cfg.sensitivity_samples, progress=progress, ray=cfg.ray, reference=loaded)
            del evaluate
        nxt = next((u.node for u in sens.ranked() if u.node not in chosen), None)
        if nxt is None:
            break
        chosen.append(nxt)
    final_db = written_db if written_db is not None else sweep_db
    report.fallback = {"budget_db": budget, "max_float_layers": cfg.max_float_layers,
                       "samples": sens.samples, "all_int8_db": sens.all_int8_db, "final_db": final_db,
                       "sweep_db": sweep_db, "measured": "written model" if written_db is not None else "sweep",
                       "met": budget is None or final_db >= budget,
                       "seconds": sens.seconds, "float_nodes": chosen,
                       "ranking": [{"node": u.node, "op": u.op, "gain_db": u.gain_db,
                                    "only_int8_db": u.only_quantized_db} for u in sens.ranked()]}
    if why_not:
        report.warnings.append(f"the fallback's {final_db:.1f} dB is the sweep's estimate: the written model "
                               f"could not be run to check it ({why_not})")
    if budget is not None and final_db < budget:
        cap = (f"--max-float-layers {cfg.max_float_layers} reached" if len(chosen) >= limit
               else "no other quantized node to return")
        report.warnings.append(f"the written model's output SQNR is {final_db:.1f} dB, below --accuracy-budget "
                               f"{budget:g} ({len(chosen)} node(s) in float, {cap}); raise --max-float-layers, "
                               f"or exclude more with --exclude-node")
    if not chosen:
        return plan, amax, _Inserted(trial, trial_insert, bias)
    del trial
    plan, amax = planned(chosen)
    return plan, amax, None


def _auto_bias(cfg: QuantizeConfig) -> bool:
    """Bias correction decided by measurement: auto, in INT8 (its shift is INT8's rounding error)."""
    return cfg.bias_correction is None and cfg.precision == "int8"


def _measured(cfg: QuantizeConfig, calib, data, loaded: io.Loaded, plan: Plan) -> bool:
    """Whether the run measures its written model to decide (bias correction auto, fragile heads
    of a model with several outputs, the SQNR floor): real data, and one of them asked for. Fragile
    heads alone measure only where some output has a head that could be kept float (a model whose
    outputs all come out of one trunk, MiniLM's token states and their mean, has none)."""
    if data is None or not is_real(calib) or cfg.high_precision == "bf16":   # onnxruntime's CPU has no BF16
        return False
    if _auto_bias(cfg) or cfg.sqnr_floor is not None:
        return True
    graph = loaded.graph
    return cfg.fragile_heads and len(graph.outputs) > 1 and \
        fidelity.may_have_heads(graph, plan, fidelity.node_flops(graph, loaded.dims))


def _fidelity(loaded: io.Loaded, plan: Plan, amax: dict, means, data: CalibrationData, cfg: QuantizeConfig,
              report: InsertReport, progress=None, floated: tuple = ()):
    """The measured decisions, each on the model as it will be written, against float on the first
    FIDELITY_SAMPLES calibration samples (at least --sensitivity-samples, the sweep's): bias
    correction (auto) kept where it raises the output SQNR; the head of a fragile output kept float;
    below --sqnr-floor, the FLOP-aware fallback. Returns (plan, amax, means, the float reference)."""
    ref = fidelity.reference(loaded, data, max(cfg.sensitivity_samples, FIDELITY_SAMPLES),
                             list(cfg.providers) if cfg.providers else None)
    per_tensor = {t: amax[rep] for rep, members in plan.groups().items() for t in members}
    flops = fidelity.node_flops(loaded.graph, loaded.dims)
    total = sum(flops.values())
    start = time.perf_counter()
    extra: list[tuple[str, str]] = []
    ranges: dict = {}               # the float islands' ranges, measured for the first written model

    def written(float_nodes: list, share: list | None = None) -> tuple[Plan, dict, fidelity.Fidelity]:
        """`share`: gets the written model's INT8 FLOPs share as the simulator predicts it."""
        p = plan_for(loaded, cfg, floated + tuple(float_nodes)) if float_nodes else plan
        a = ranges_from_cache(p, per_tensor)[0] if float_nodes else amax
        model = _written_model(loaded, p, a, means, cfg, data, ranges)
        if share is not None:
            share.append(simulate(model, target=cfg.target, dims=loaded.dims).summary["int8_flops_share"])
        try:
            fid = fidelity.fidelity_of(model, ref)
        except (QdqError, RuntimeError):    # a model onnxruntime cannot run here (a kernel it lacks)
            return p, a, fidelity.Fidelity(float("nan"))
        del model
        return p, a, fid

    _, _, current = written([])
    if np.isnan(current.overall_db):
        report.fidelity = {"skipped": "the written model cannot run in onnxruntime here"}
        return plan, amax, means, ref
    out: dict = {"samples": ref.samples, "first": current.to_dict()}
    if _auto_bias(cfg) and means:
        kept_means, means = means, None          # `written` reads `means`: the model without the correction
        without = written([])[2]
        keep = current.overall_db > without.overall_db
        out["bias_correction"] = {"kept": keep, "with_db": _r(current.overall_db), "without_db": _r(without.overall_db)}
        if keep:
            means = kept_means
        else:
            current = without
    if cfg.fragile_heads and len(current.per_output) > 1:
        out["heads"], current = _fragile_heads(loaded.graph, plan, cfg, current, flops, total, extra, written)
    if cfg.sqnr_floor is not None and current.overall_db < cfg.sqnr_floor:
        floor_plan = plan_for(loaded, cfg, floated + tuple(extra)) if extra else plan
        out["floor"], floored = _floor(loaded, floor_plan, per_tensor, means, data, cfg, flops, current, progress,
                                       extra, written)
        if out["floor"]["kept"]:
            why = f"--sqnr-floor {cfg.sqnr_floor:g}: returned to float (most output SQNR per FLOP)"
            extra += [(u, why) for u in out["floor"]["nodes"]]
            current = floored
    out["final"] = current.to_dict()
    out["float_nodes"] = [n for n, _ in extra]
    out["seconds"] = round(time.perf_counter() - start, 2)
    report.fidelity = out
    if extra:
        plan = plan_for(loaded, cfg, floated + tuple(extra))
        amax = ranges_from_cache(plan, per_tensor)[0]
    return plan, amax, means, ref


def _fragile_heads(graph, plan: Plan, cfg: QuantizeConfig, current, flops: dict, total: float, extra: list,
                   written) -> tuple[list[dict], fidelity.Fidelity]:
    """Each fragile output's head (its last layers, few FLOPs) tried float on the written model; kept
    float where its output gains HEAD_MIN_GAIN_DB. `extra` grows by the kept heads' nodes."""
    floor = cfg.sqnr_floor if cfg.sqnr_floor is not None else DEFAULT_SQNR_FLOOR
    heads = []
    for name in fidelity.fragile_outputs(current, floor):
        units, share = fidelity.head_units(graph, plan, name, flops, total)
        units = [u for u in units if u not in {n for n, _ in extra}]
        if not units:
            continue
        why = f"fragile head: output '{name}' kept float"
        _, _, trial = written(extra + [(u, why) for u in units])
        before, after = current.per_output[name], trial.per_output.get(name, float("nan"))
        entry = {"output": name, "nodes": units, "flops_share": round(share, 6), "before_db": _r(before),
                 "after_db": _r(after), "kept": bool(after >= before + HEAD_MIN_GAIN_DB)}
        heads.append(entry)
        if entry["kept"]:
            extra += [(u, why) for u in units]
            current = trial
    return heads, current


# The written models are compared on more samples than the sweep ranks on: chosen on 8, a float
# fallback on ddddocr_ocr raised their SQNR 24.9 -> 27.6 dB and lowered 16 held-out samples' 24.8 ->
# 21.4 dB; bias correction likewise lost 6.8 dB on the first 8 samples and won 0.6 dB held out.
FIDELITY_SAMPLES = 32
HEAD_MIN_GAIN_DB = 1.0     # a fragile head stays float when that raises its output's SQNR this much


def _r(db: float):
    return round(db, 2) if np.isfinite(db) else str(db)


def _floor(loaded: io.Loaded, plan: Plan, per_tensor: dict, means, data: CalibrationData, cfg: QuantizeConfig,
           flops: dict, current: fidelity.Fidelity, progress, extra: list,
           written) -> tuple[dict, fidelity.Fidelity]:
    """Below --sqnr-floor: the sensitivity sweep on `plan` (the run's, with `extra` float), then the
    units with the most dB per FLOP back to float while at least --floor-int8-flops of the FLOPs
    stay quantized, checked on the written model and kept only when that is better. Returns (what
    was done, for the report; the written model's Fidelity with it)."""
    fmt = cfg.format
    assert cfg.sqnr_floor is not None and fmt is not None, "a floor of INT8 or FP8 runs"
    total = sum(flops.values())
    share = quantized_share(plan, flops)
    minimum = cfg.floor_int8_flops / 100
    allowed = max(0.0, share - minimum) * total
    out: dict = {"floor_db": cfg.sqnr_floor, "before_db": _r(current.overall_db), "int8_share_before": round(share, 4),
                 "min_int8_share": minimum, "nodes": [], "kept": False}
    # only the weighted nodes that fit the budget are swept (the others stay as planned): fewer runs
    candidates = {n for n, f in flops.items() if f <= allowed and (d := plan.decisions.get(n)) is not None
                  and d.quantized}
    if not candidates:
        out.update(sweep_seconds=0.0, units_measured=0,
                   why=f"no quantized Conv/Gemm/MatMul fits the budget ({100 * share:.1f}% of the FLOPs "
                       f"quantized, at least {cfg.floor_int8_flops:g}% to keep)")
        return out, current
    amax = ranges_from_cache(plan, per_tensor)[0]
    trial = loaded.graph.copy()
    if means is not None:
        correct_biases(trial, plan, means)
    insert_qdq(trial, plan, amax, weights=cfg.weights, fmt=fmt)
    sens, evaluate = measure(io.Loaded(graph=trial, ir_version=loaded.ir_version), plan, data,
                             cfg.sensitivity_samples, progress=progress, ray=cfg.ray, reference=loaded,
                             only=candidates, float_only=True)
    del trial
    units, sweep_db, spent = fidelity.floor_units(sens, evaluate, cfg.sqnr_floor, flops, allowed)
    del evaluate
    out.update(sweep_seconds=round(sens.seconds, 2), sweep_db=_r(sweep_db), units_measured=len(sens.units))
    why = f"--sqnr-floor {cfg.sqnr_floor:g}: returned to float"
    # the sweep's estimate misses what planning again does (P14, fusions): while the written model
    # is below the floor, the next units of the ranking join, each checked on the written model
    queue = [u for u in fidelity.floor_ranked(sens, flops) if u not in units]
    best, checks = current, 0
    best_units: list[str] = []
    best_share: float | None = None
    while checks < FLOOR_CHECKS:
        if units:
            engine: list[float] = []
            _, _, after = written(extra + [(u, why) for u in units], engine)
            checks += 1
            if engine[0] < minimum:    # the engine floats more than the nodes (a neighbour loses its INT8 input):
                out["stopped"] = (f"{len(units)} nodes float would leave {100 * engine[0]:.1f}% of the FLOPs INT8 "
                                  f"as TensorRT builds it (at least {cfg.floor_int8_flops:g}% to keep)")
                units.pop()            # fewer of them, and no more
                queue = []
                if units == best_units:
                    break
                continue
            if after.overall_db > best.overall_db:
                best, best_units, best_share = after, list(units), engine[0]
            if after.overall_db >= cfg.sqnr_floor:
                break
        nxt = next((u for u in queue if spent + flops[u] <= allowed), None)
        if nxt is None:
            break
        queue.remove(nxt)
        units.append(nxt)
        spent += flops[nxt]
    out.update(nodes=best_units, flops_share=round(sum(flops[u] for u in best_units) / total, 6) if total else 0.0,
               after_db=_r(best.overall_db), kept=bool(best_units), written_checks=checks,
               int8_share_after=None if best_share is None else round(best_share, 4))
    return out, best


FLOOR_CHECKS = 6           # written models the floor builds and measures at most


def _written_model(loaded: io.Loaded, plan: Plan, amax: dict, means, cfg: QuantizeConfig,
                   data: CalibrationData, range_cache: dict | None = None) -> proto.ModelProto:
    """The model quantize() writes for `plan`, inserted and deployed as the run does, on a copy
    (the float islands' ranges from `range_cache` where it has them: see writing.write_model)."""
    copy = io.Loaded(graph=loaded.graph.copy(), ir_version=loaded.ir_version, fixed_inputs=loaded.fixed_inputs)
    if means is not None:
        correct_biases(copy.graph, plan, means)
    fmt = cfg.format
    assert fmt is not None, "INT4 runs take their own pipeline"
    inserted = insert_qdq(copy.graph, plan, amax, weights=cfg.weights, fmt=fmt)
    model, _ = write_model(copy, inserted["provenance"], cfg, data, InsertReport(), range_cache)
    return model


def _written_db(loaded: io.Loaded, plan: Plan, amax: dict, means, cfg: QuantizeConfig, data: CalibrationData,
                sens, known: dict | None = None) -> float:
    """The output SQNR of the model quantize() writes for `plan` (inserted and deployed as the run
    does, on a copy), on the sensitivity samples against float."""
    copy = io.Loaded(graph=loaded.graph.copy(), ir_version=loaded.ir_version, fixed_inputs=loaded.fixed_inputs)
    if means is not None:
        correct_biases(copy.graph, plan, means, known)
    fmt = cfg.format
    assert fmt is not None, "INT4 runs take their own pipeline, without a fallback"
    inserted = insert_qdq(copy.graph, plan, amax, weights=cfg.weights, fmt=fmt, known=known)
    model, _ = write_model(copy, inserted["provenance"], cfg, data, InsertReport())
    del copy
    return output_sqnr(model, sens)


def default_output(path: str | Path) -> Path:
    p = Path(path)
    return p.with_name(p.name[:-5] + ".qdq.onnx" if p.name.endswith(".onnx") else p.name + ".qdq.onnx")
