"""The stages before calibration: load the model, fix inputs, clean the graph, plan placement, and
read the calibration data once.

    loaded, plan = prepare("model.onnx", config)        # what quantize and calibrate both start from
"""
from __future__ import annotations

import os
import time
from typing import Callable

import numpy as np

from .graph import io
from .config import QuantizeConfig, config_from
from .samples.data import CalibrationData, InputSpec, random_data, read_arrays
from .errors import QdqError
from .precisions.formats import OPSETS
from .passes.base import PassResult
from .passes.batchnorm import fold_batchnorm
from .passes.constants import fold_constants
from .passes.fold_scale import fold_scalar_scales
from .passes.fix_inputs import fix_inputs, inline_constant_ifs
from .passes.no_ops import remove_no_ops
from .placement import load_ruleset, plan_placement
from .placement.plan import Plan
from .recipes.small_regions import refine
from .execution.memory import fits
from .execution.profile import step
from .graph.view import GraphView
from .ops import vocabulary

MAX_INLINE_ROUNDS = 8          # nesting depth of If nodes inlined once their conditions are constant


def model_inputs(graph) -> list[InputSpec]:
    specs = []
    for t in graph.inputs:
        if t.dtype is None:
            raise QdqError(f"model input '{t.name}' has no declared type", "re-export the model with typed inputs")
        shape = tuple(t.shape) if t.shape is not None else None
        specs.append(InputSpec(t.name, np.dtype(t.dtype), shape))
    return specs


def refuse_quantized(loaded: io.Loaded) -> None:
    vocab = vocabulary()        # asked once per op type (a GraphView's tensor map is not needed)
    found = sorted(op for op in {n.op for n in loaded.graph.nodes} if vocab.is_(op, "quant"))
    if found:
        raise QdqError(f"the model already holds quantization ({', '.join(found)})",
                       "give qdqgraph the float model it came from (or inspect this one with `qdqgraph report`)")


def load_model(model, config: QuantizeConfig, warnings: list[str] | None = None) -> tuple[io.Loaded, list[PassResult]]:
    """Refuse a model file whose weights cannot fit in the memory left (execution.memory.fits; its
    warning, where the peak may not fit, goes to `warnings`), load, refuse already-quantized models,
    and make the config's fixed inputs constants."""
    if isinstance(model, (str, os.PathLike)) and os.path.isfile(model):
        tight = fits(model)             # before the weights are read
        if tight and warnings is not None:
            warnings.append(tight)
    fmt_opset, why = OPSETS[config.precision]
    loaded = io.load(model, min_opset=fmt_opset, why=why)
    refuse_quantized(loaded)
    passes = []
    if config.fixed_inputs:
        fixed = fix_inputs(loaded.graph, config.fixed)
        loaded.fixed_inputs = tuple(fixed["fixed"])
        passes.append(fixed)
    return loaded, passes


def clean(loaded: io.Loaded) -> list[PassResult]:
    """Remove inference no-ops, fold constants, inline Ifs whose condition became constant (in
    rounds: an inlined branch may decide another If), fold BatchNormalization and constant scalar
    multiplies after linear layers. In place."""
    out = [_timed(remove_no_ops, loaded), _timed(fold_constants, loaded)]
    for _ in range(MAX_INLINE_ROUNDS):
        inlined = _timed(inline_constant_ifs, loaded)
        if not inlined.changed:
            break
        out += [inlined, _timed(fold_constants, loaded)]
    out.append(_timed(fold_batchnorm, loaded))
    out.append(_timed(fold_scalar_scales, loaded))
    return out


def _timed(run, loaded: io.Loaded) -> PassResult:
    """`run(graph)`, a step of the run's profile named after the pass, its seconds in the result."""
    with step(run.__name__):
        start = time.perf_counter()
        out = run(loaded.graph)
        out.seconds += time.perf_counter() - start
    return out


def plan_for(loaded: io.Loaded, config: QuantizeConfig, float_nodes: tuple = (),
             placed: Callable[[Plan], None] | None = None) -> Plan:
    """The placement plan of the (cleaned) graph as it is now, small INT8 regions returned to float
    (P14, qdqgraph.recipes.small_regions); `float_nodes`: (node, why) the fallback returns to float;
    `placed(plan)` is called with the placement's plan before P14 refines it."""
    ruleset = load_ruleset(config.rules, config.precision, config.target)
    selection = config.selection(float_nodes)
    with step("placement"):
        plan = plan_placement(loaded.graph, ruleset, selection)
    if placed is not None:
        placed(plan)
    with step("refine (P14)"):
        return refine(loaded.graph, plan, ruleset, selection, loaded.dims)


def check_plan(loaded: io.Loaded, plan: Plan) -> list[str]:
    """Refuse what cannot be quantized here; warnings for what is passed through."""
    view = GraphView(loaded.graph)
    for s in plan.activation_sites():
        dt = view.dtype(view.tensors[s.tensor])
        if np.dtype(dt) != np.float32:
            raise QdqError(f"tensor '{s.tensor}' is {np.dtype(dt).name}; qdqgraph quantizes float32 models",
                           "export the model in float32 (FP16 islands are made after quantization)")
    custom = sorted({(n.domain, n.op, n.name) for n in loaded.graph.nodes if n.domain not in ("", "ai.onnx", None)})
    return [f"custom op {domain}::{op} ({name}) is passed through unquantized; its neighbours are quantized by "
            f"their own rules" for domain, op, name in custom]


def prepare(model, config: QuantizeConfig | None = None, warnings_to: list[str] | None = None,
            **options) -> tuple[io.Loaded, Plan]:
    """Load, fix inputs, clean and plan: what `quantize` and `calibrate` both start from. Loading's
    warnings (a memory peak that may not fit) go to `warnings_to`."""
    cfg = config_from(config, **options)
    loaded, _ = load_model(model, cfg, warnings_to)
    clean(loaded)
    plan = plan_for(loaded, cfg)
    check_plan(loaded, plan)
    return loaded, plan


def data_dims(loaded: io.Loaded, data: CalibrationData | None) -> dict[str, int]:
    """The symbolic dimensions' values at the first calibration sample's shapes (io.bound_dims):
    where the model is calibrated, and predicted; {} without data."""
    if data is None or not data.count:
        return {}
    return io.bound_dims(loaded, {k: v.shape for k, v in data.sample(0).items()})


def read_data(loaded: io.Loaded, calib, config: QuantizeConfig) -> CalibrationData:
    """The calibration data, read once and checked against the model's inputs: a .npz/.npy path, a
    folder of them (streamed a file at a time), a folder of images (with config.preprocess), a dict
    {input: array}, or "random" (with a warning)."""
    inputs = model_inputs(loaded.graph)
    if isinstance(calib, str) and calib == "random":
        return CalibrationData(random_data(inputs), inputs, config.samples, random=True)
    arrays = read_arrays(calib, inputs, config.preprocess, ignore=loaded.fixed_inputs)
    return CalibrationData(arrays, inputs, config.samples)


def is_real(calib) -> bool:
    return calib is not None and not (isinstance(calib, str) and calib == "random")
