"""`quantize`: the Python API that composes the stages (load, clean, plan, calibrate, insert, check)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from . import io
from .calib.collect import collect
from .calib.methods import METHODS
from .data import CalibrationData, InputSpec, random_data, read_arrays
from .errors import InvariantError, QdqError
from .passes.batchnorm import fold_batchnorm
from .passes.check import qdq_violations
from .passes.constants import fold_constants
from .passes.fix_inputs import fix_inputs, inline_constant_ifs
from .passes.insert import WEIGHT_FORMATS, insert_qdq
from .passes.no_ops import remove_no_ops
from .passes.precision import HIGH_PRECISIONS, lower_float_islands, measure_ranges
from .passes.precision import MIN_OPSET as PRECISION_OPSET
from .placement import Plan, Selection, plan_placement
from .report import InsertReport
from .placement import load_ruleset
from .view import GraphView

# The default calibration method: the best across the model zoo (README, "Accuracy"). Percentile
# 99.99 keeps every zoo model within a point of float and rescues the layout detector that max
# calibration breaks; TensorRT's entropy method clips post-ReLU tensors of small CNNs far too hard.
DEFAULT_METHOD = "percentile"
MAX_INLINE_ROUNDS = 8          # nesting depth of If nodes inlined once their conditions are constant


@dataclass
class Result:
    model: onnx.ModelProto
    plan: Plan
    report: InsertReport


def model_inputs(graph) -> list[InputSpec]:
    specs = []
    for t in graph.inputs:
        if t.dtype is None:
            raise QdqError(f"model input '{t.name}' has no declared type", "re-export the model with typed inputs")
        shape = tuple(t.shape) if t.shape is not None else None
        specs.append(InputSpec(t.name, np.dtype(t.dtype), shape))
    return specs


def refuse_quantized(loaded: io.Loaded) -> None:
    view = GraphView(loaded.graph)
    found = sorted({n.op for n in view.nodes if view.vocab.is_(n, "quant")})
    if found:
        raise QdqError(f"the model already holds quantization ({', '.join(found)})",
                       "give qdqgraph the float model it came from (or inspect this one with `qdqgraph report`)")


def clean(loaded: io.Loaded, report: InsertReport | None = None) -> io.Loaded:
    """Remove inference no-ops, fold constants and BatchNormalization in place; record what changed
    in `report`."""
    no_ops = remove_no_ops(loaded.graph)
    folded = fold_constants(loaded.graph).folded
    inlined: list[str] = []
    for _ in range(MAX_INLINE_ROUNDS):   # an inlined branch may decide the condition of another If
        step = inline_constant_ifs(loaded.graph).inlined
        if not step:
            break
        inlined += step
        folded += fold_constants(loaded.graph).folded
    bn = fold_batchnorm(loaded.graph)
    if report is not None:
        report.no_ops_removed = len(no_ops.removed)
        report.constants_folded = folded
        report.ifs_inlined = inlined
        report.batchnorm_folded = len(bn.folded)
        report.batchnorm_kept = [{"node": n, "reason": r} for n, r in bn.kept]
        report.opset_raised_from = loaded.opset_raised_from
    return loaded


def amax_from_states(states: dict, method: str, percentile: float = 99.99) -> dict[str, float]:
    from .calib.methods import compute_amax
    return {k: float(compute_amax(s, method, percentile=percentile)) for k, s in states.items()}


def calibration_data(loaded: io.Loaded, calib, samples: int | None = None, shard: tuple[int, int] | None = None,
                     report: InsertReport | None = None, preprocess: str | None = None) -> CalibrationData:
    inputs = model_inputs(loaded.graph)
    if isinstance(calib, str) and calib == "random":
        arrays = random_data(inputs)
        if report is not None:
            report.warnings.append("calibrated on random data: the scales say nothing about accuracy")
    else:
        arrays = read_arrays(calib, inputs, preprocess, ignore=loaded.fixed_inputs)
    data = CalibrationData(arrays, inputs, samples)
    if shard is not None:
        data = data.shard(*shard)
    return data


def calibrate(loaded: io.Loaded, plan: Plan, calib, method: str = DEFAULT_METHOD, batch_size: int = 1,
              samples: int | None = None, providers: list[str] | None = None, percentile: float = 99.99,
              report: InsertReport | None = None, progress=None, shard=None, keep_states: bool = False,
              preprocess: str | None = None, only: set[str] | None = None, lanes: int | None = None):
    """amax per scale group of `plan` (or of the groups in `only`), from calibration data (path,
    dict of arrays, or "random"). With keep_states, returns the Collected states instead (for
    saving shards). `lanes`: batches run at once on the CPU (default `collect.default_lanes()`);
    the results do not depend on it."""
    groups = plan.groups()
    if only is not None:
        groups = {rep: members for rep, members in groups.items() if rep in only}
    if not groups:
        return {}
    data = calibration_data(loaded, calib, samples, shard, report, preprocess)
    got = collect(loaded, groups, data, method="entropy" if keep_states else method, batch_size=batch_size,
                  providers=providers, progress=progress, lanes=lanes)
    if report is not None:
        report.samples = got.samples
        report.calibration_seconds = got.seconds
        report.method = method
    if keep_states:
        return got
    return exact_ranges(plan, amax_from_states(got.states, method, percentile))


def exact_ranges(plan: Plan, amax: dict[str, float]) -> dict[str, float]:
    """`amax` with the ranges the graph fixes (a one-hot's 1.0) in place of estimated or cached ones."""
    for rep, members in plan.groups().items():
        exact = [plan.sites[t].exact_amax for t in members]
        if rep in amax and all(e is not None for e in exact):
            amax[rep] = max(exact)
    return amax


def _amax_from_cache(plan: Plan, path, can_calibrate: bool = False) -> tuple[dict[str, float], set[str]]:
    """(amax per scale group found in a cache file or a dict {tensor: amax} (API), the groups it
    lacks). Lacking any is an error unless `can_calibrate` (data was given for them)."""
    from .calib.cache import load_cache
    table = dict(path) if isinstance(path, dict) else load_cache(path)
    out, missing = {}, set()
    for rep, members in plan.groups().items():
        found = [table[t] for t in members if t in table]
        if found:
            out[rep] = max(found)
        else:
            missing.add(rep)
    if missing and not can_calibrate:
        first = sorted(missing)[0]
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        where = "the given ranges" if isinstance(path, dict) else f"calibration cache {path}"
        raise QdqError(f"{where} has no range for tensor '{first}'{more}",
                       "add --calib DATA to calibrate what the cache lacks, or pass a cache made for this model")
    return exact_ranges(plan, out), missing


def prepare(model, *, rules=(), exclude_ops=(), exclude_nodes=(), include_nodes=(), float_nodes=(),
            fixed_inputs: dict | None = None, report: InsertReport | None = None) -> tuple[io.Loaded, Plan]:
    """Load, refuse already-quantized models, fix the `fixed_inputs` (name -> value) to constants,
    clean, and plan placement."""
    loaded = io.load(model)
    refuse_quantized(loaded)
    if fixed_inputs:
        fixed = fix_inputs(loaded.graph, fixed_inputs)
        loaded.fixed_inputs = tuple(fixed)
        if report is not None:
            report.fixed_inputs = {k: np.asarray(v).tolist() for k, v in fixed_inputs.items() if k in fixed}
    clean(loaded, report)
    plan = replan(loaded, rules=rules, exclude_ops=exclude_ops, exclude_nodes=exclude_nodes,
                  include_nodes=include_nodes, float_nodes=float_nodes)
    _refuse_unsupported_dtypes(loaded, plan)
    if report is not None:
        custom = sorted({(n.domain, n.op, n.name) for n in loaded.graph.nodes
                         if n.domain not in ("", "ai.onnx", None)})
        for domain, op, name in custom:
            report.warnings.append(f"custom op {domain}::{op} ({name}) is passed through unquantized; "
                                   f"its neighbours are quantized by their own rules")
    return loaded, plan


def replan(loaded: io.Loaded, *, rules=(), exclude_ops=(), exclude_nodes=(), include_nodes=(),
           float_nodes=()) -> Plan:
    """The placement plan of the (cleaned) graph as it is now, small INT8 regions returned to float
    (P14, qdqgraph.placement.refine)."""
    from .placement.refine import refine
    ruleset = load_ruleset(rules)
    selection = Selection(tuple(exclude_ops), tuple(exclude_nodes), tuple(include_nodes), tuple(float_nodes))
    return refine(loaded.graph, plan_placement(loaded.graph, ruleset, selection), ruleset, selection)


def model_id(model) -> str:
    """sha256 of the model file (or of the ModelProto's bytes): ties saved state to its model."""
    import hashlib
    h = hashlib.sha256()
    if isinstance(model, onnx.ModelProto):
        h.update(model.SerializeToString())
    else:
        with open(model, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def quantize(model, calib=None, *, method: str = DEFAULT_METHOD, rules=(), exclude_ops=(), exclude_nodes=(),
             include_nodes=(), weights: str = "int8", batch_size: int = 1, samples: int | None = None,
             providers: list[str] | None = None, percentile: float = 99.99, calib_cache=None,
             accuracy_budget: float | None = None, max_float_layers: int | None = None,
             sensitivity_samples: int = 8, preprocess: str | None = None, high_precision: str = "fp16",
             bias_correction: bool = False, smooth_quant: float | None = None, fixed_inputs: dict | None = None,
             lanes: int | None = None, progress=None) -> Result:
    """Float ONNX (path or ModelProto) in, Q/DQ ModelProto out, with the plan and a report.

    `calib` is a .npz/.npy path, a folder of them, a dict {input name: array (samples first)}, or
    "random"; `calib_cache` (a qdqgraph JSON or TensorRT calibration cache, or a dict tensor ->
    amax) replaces it. With `accuracy_budget` (minimum output SQNR in dB against float, on the
    first `sensitivity_samples` calibration samples) and/or `max_float_layers`, the most sensitive
    quantized nodes are returned to float (see qdqgraph.sensitivity). `high_precision` is the type
    of the float islands in the written model ("fp16" by default, "bf16", or "fp32"; see
    qdqgraph.passes.precision); sensitivity and fallback work on the float32 Q/DQ model.
    `smooth_quant` (alpha in [0, 1]) migrates activation outliers of quantized MatMul/Gemm inputs
    into their weights first (qdqgraph.passes.smooth). `fixed_inputs` (name -> value) turns those
    inputs into constants, which decides the If nodes they select (qdqgraph.passes.fix_inputs); the
    written model no longer has them, and calibration data for them is ignored. `lanes`: calibration
    batches run at once on the CPU (see `calibrate`).
    """
    if method not in METHODS:
        raise QdqError(f"unknown calibration method {method!r}", f"use one of {', '.join(METHODS)}")
    if high_precision not in HIGH_PRECISIONS:
        raise QdqError(f"unknown high precision {high_precision!r}", f"use one of {', '.join(HIGH_PRECISIONS)}")
    if weights not in WEIGHT_FORMATS:
        raise QdqError(f"unknown weight format {weights!r}", f"use one of {', '.join(WEIGHT_FORMATS)}")
    if calib is None and calib_cache is None:
        raise QdqError("no calibration data given",
                       "pass --calib DATA.npz (or --calib random to insert Q/DQ with meaningless scales)")
    fallback = accuracy_budget is not None or max_float_layers is not None
    real_data = calib is not None and not (isinstance(calib, str) and calib == "random")
    if fallback and not real_data:
        raise QdqError("an accuracy budget needs real calibration data to measure against",
                       "pass --calib DATA.npz")
    if bias_correction and not real_data:
        raise QdqError("bias correction needs calibration data", "pass --calib DATA.npz")
    if smooth_quant is not None and not real_data:
        raise QdqError("--smooth-quant needs calibration data to measure channel ranges", "pass --calib DATA.npz")
    if smooth_quant is not None and not 0.0 <= smooth_quant <= 1.0:
        raise QdqError(f"--smooth-quant alpha must be in [0, 1], got {smooth_quant}", "use 0.5 (the default)")
    selection = dict(rules=rules, exclude_ops=exclude_ops, exclude_nodes=exclude_nodes, include_nodes=include_nodes)
    report = InsertReport(input=str(model) if isinstance(model, (str, os.PathLike)) else None, method=method)
    loaded, plan = prepare(model, report=report, fixed_inputs=fixed_inputs, **selection)
    if smooth_quant is not None:
        from .passes.smooth import channel_ranges, smooth, targets
        found = targets(loaded.graph, plan)
        ranges = channel_ranges(loaded, sorted(found), calibration_data(loaded, calib, samples, preprocess=preprocess))
        report.smoothed = smooth(loaded.graph, found, ranges, smooth_quant).smoothed
        plan = replan(loaded, **selection)
    if calib_cache is not None:
        amax, missing = _amax_from_cache(plan, calib_cache, can_calibrate=real_data)
        if missing:                      # what the plan quantizes beyond the cache, from the data
            amax.update(calibrate(loaded, plan, calib, method, batch_size, samples, providers, percentile, report,
                                  progress, preprocess=preprocess, only=missing, lanes=lanes))
            report.warnings.append(f"{len(missing)} of {len(plan.groups())} scale groups were not in the "
                                   f"calibration cache; calibrated them from the data ({method})")
    else:
        amax = calibrate(loaded, plan, calib, method, batch_size, samples, providers, percentile, report, progress,
                         preprocess=preprocess, lanes=lanes)
    means = None
    if bias_correction:
        from .passes.bias_correction import correct_biases, input_means
        means = input_means(loaded, plan, calibration_data(loaded, calib, samples, preprocess=preprocess))
        report.bias_corrected = len(correct_biases(loaded.graph, plan, means))
    result = _finish(loaded, plan, amax, weights, report)

    def finish(res: Result) -> Result:
        data = calibration_data(loaded, calib, samples, preprocess=preprocess) if real_data else None
        return deploy(res, high_precision, data, providers)

    if not fallback or not plan.activation_sites():
        return finish(result)
    from .sensitivity import choose_fallback, measure
    data = calibration_data(loaded, calib, samples, preprocess=preprocess)
    sens, evaluate = measure(result.model, plan, data, sensitivity_samples,
                             stop_above_db=accuracy_budget)
    chosen, final_db = choose_fallback(sens, evaluate, accuracy_budget, max_float_layers)
    gains = {u.node: u.gain_db for u in sens.units}
    report.fallback = {"budget_db": accuracy_budget, "max_float_layers": max_float_layers,
                       "samples": sens.samples, "all_int8_db": sens.all_int8_db, "final_db": final_db,
                       "seconds": sens.seconds, "float_nodes": chosen,
                       "ranking": [{"node": u.node, "op": u.op, "gain_db": u.gain_db,
                                    "only_int8_db": u.only_quantized_db} for u in sens.ranked()]}
    if not chosen:
        return finish(result)
    per_tensor = {t: amax[rep] for rep, members in plan.groups().items() for t in members}
    float_nodes = tuple((n, f"fallback: returned to float (+{gains[n]:.1f} dB output SQNR alone)") for n in chosen)
    report2 = InsertReport(input=report.input, method=method)
    loaded2, plan2 = prepare(model, report=report2, float_nodes=float_nodes, fixed_inputs=fixed_inputs, **selection)
    amax2, _ = _amax_from_cache(plan2, per_tensor)
    if means is not None:
        from .passes.bias_correction import correct_biases
        report2.bias_corrected = len(correct_biases(loaded2.graph, plan2, means))
    for k in ("samples", "calibration_seconds", "warnings"):
        setattr(report2, k, getattr(report, k))
    report2.fallback = report.fallback
    return finish(_finish(loaded2, plan2, amax2, weights, report2))


def _finish(loaded: io.Loaded, plan: Plan, amax: dict, weights: str, report: InsertReport) -> Result:
    """Insert, stamp provenance, check invariants and the ONNX checker."""
    inserted = insert_qdq(loaded.graph, plan, amax, weights=weights)
    report.fill_from_plan(plan, amax)
    for t in inserted.zero_range:
        report.warnings.append(f"tensor '{t}' was zero over all calibration samples; it got the safe scale "
                               f"(see README: zero-range tensors)")
    out = io.to_model(loaded, inserted.provenance)
    violations = qdq_violations(loaded.graph)
    if violations:
        raise InvariantError("qdqgraph produced a model that breaks its Q/DQ invariants: " + "; ".join(violations[:5]))
    try:
        io.check(out)
    except onnx.checker.ValidationError as e:
        raise InvariantError(f"the quantized model fails the ONNX checker: {str(e).splitlines()[0]}") from e
    return Result(out, plan, report)


def deploy(result: Result, high_precision: str = "fp16", data: CalibrationData | None = None,
           providers: list[str] | None = None) -> Result:
    """The float32 Q/DQ model of `result` with its float islands in `high_precision`, checked, and
    the simulator's prediction for it in the report. With `data`, ops whose outputs reach
    passes.precision.RANGE_LIMIT on a few samples stay float32."""
    model = result.model
    if high_precision != "fp32":
        provenance = {n.name: p.value for n in model.graph.node for p in n.metadata_props if p.key == io.RULE_KEY}
        ranges = measure_ranges(model, data, providers=providers) if data is not None else {}
        if data is None:
            result.report.warnings.append(f"no calibration data: {high_precision} islands were made without "
                                          f"checking activation ranges (rule H5)")
        model, _ = io.raise_opset(model, PRECISION_OPSET, why=f"{high_precision} Q/DQ scales")
        loaded = io.load(model)
        lowered = lower_float_islands(loaded.graph, high_precision, io.opset_of(model), ranges)
        result.report.precision = {"high_precision": high_precision, "retyped_tensors": lowered.retyped,
                                   "casts": lowered.casts, "dq_copies": lowered.dq_copies, "kept_fp32": [{"node": n, "rule": r} for n, r in lowered.kept]}
        for t in lowered.clamped_scales:
            result.report.warnings.append(f"scale {t} does not fit {high_precision}; clamped to stay finite and > 0")
        model = io.to_model(loaded, provenance)
        _check_raised(model, high_precision, result.report)
    else:
        loaded = io.load(model)
    _predict(loaded, result.report)
    return Result(model, result.plan, result.report)


def _check_raised(model: onnx.ModelProto, high_precision: str, report: InsertReport) -> None:
    """The checker on the opset-19 model. Newer shape inference can prove a declared output shape
    wrong that the model's own opset let pass (an exporter's stale declaration, say); then the
    output shapes are left to inference, with a warning, and the check runs again."""
    try:
        io.check(model)
        return
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        first = str(e).strip().splitlines()[0]
        declared = [o for o in model.graph.output if o.type.tensor_type.HasField("shape")]
        if not declared:
            raise InvariantError(f"the {high_precision} model fails the ONNX checker: {first}") from e
    del model.graph.value_info[:]                 # shapes of the old opset, re-inferred below
    saved = {o.name: onnx.TensorShapeProto() for o in declared}
    for o in declared:
        saved[o.name].CopyFrom(o.type.tensor_type.shape)
        o.type.tensor_type.ClearField("shape")
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except onnx.shape_inference.InferenceError as e:
        raise InvariantError(f"the {high_precision} model fails the ONNX checker: {first}") from e
    model.graph.value_info.extend(inferred.graph.value_info)
    shapes = {o.name: o.type.tensor_type for o in inferred.graph.output}
    for o in declared:
        found = shapes.get(o.name)
        o.type.tensor_type.shape.CopyFrom(found.shape if found is not None and found.HasField("shape")
                                          else saved[o.name])
    try:
        io.check(model)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        raise InvariantError(f"the {high_precision} model fails the ONNX checker: {first}") from e
    report.warnings.append(f"at opset {PRECISION_OPSET} the ONNX checker rejects the declared output shapes "
                           f"({first}); the written model declares the shapes inference finds")


def _predict(loaded: io.Loaded, report: InsertReport) -> None:
    """The simulator's prediction for the written model, into the report. A simulator failure
    must not cost the user the model: it becomes a warning naming the error."""
    from .trtsim import simulate
    try:
        report.tensorrt = simulate(loaded.graph).summary
    except Exception as e:  # noqa: BLE001 - reported, not swallowed
        report.warnings.append(f"the TensorRT simulation failed ({type(e).__name__}: {e}); the model is "
                               f"written; please report this")


def _refuse_unsupported_dtypes(loaded: io.Loaded, plan: Plan) -> None:
    view = GraphView(loaded.graph)
    for s in plan.activation_sites():
        dt = view.dtype(view.tensors[s.tensor])
        if np.dtype(dt) != np.float32:
            raise QdqError(f"tensor '{s.tensor}' is {np.dtype(dt).name}; qdqgraph quantizes float32 models",
                           "export the model in float32 (FP16 islands are made after quantization)")


def default_output(path: str | Path) -> Path:
    p = Path(path)
    return p.with_name(p.name[:-5] + ".qdq.onnx" if p.name.endswith(".onnx") else p.name + ".qdq.onnx")
