"""The writing stage: the inserted graph to the model qdqgraph writes. Bias as an Add, float islands in
the high precision (their ranges measured on calibration samples, rule H5; the opset raised, in memory
where it can be), the full ONNX checker. `quantize` and `fix` write through it alike."""
from __future__ import annotations

import json

import onnx_graphsurgeon as gs

from .config import QuantizeConfig
from .errors import InvariantError, QdqError
from .execution.memory import free_if_large
from .execution.profile import step
from .graph import io, proto
from .graph.view import tensor_map
from .passes.bias_add import bias_to_add
from .passes.precision import MIN_OPSET as PRECISION_OPSET, island_opset, lower_float_islands, measure_ranges
from .report import InsertReport
from .samples.data import CalibrationData
from .trtsim import recorded

__all__ = ["write_model"]


def write_model(loaded: io.Loaded, provenance: dict, cfg: QuantizeConfig, data: CalibrationData | None,
            report: InsertReport, range_cache: dict | None = None) -> tuple[proto.ModelProto, io.Loaded]:
    """The written model: float islands in cfg.high_precision (opset raised to 19 for their
    scales, 22 for BF16 convolutions and poolings), checked. With `data`, ops whose outputs reach
    passes.precision.RANGE_LIMIT on a few samples stay float32. `range_cache`: the ranges measured for
    earlier plans of the same model, reused; what this plan needs beyond them is measured and added
    to it (the fidelity checks build several written models). Returns the model and the graph it was exported from."""
    report.add([bias_to_add(loaded.graph)])        # every onnxruntime session then computes what TensorRT does
    rescaled = sorted({n for p in report.passes for n in p.details.get("rescaled", ())})
    if rescaled:            # what `compare` must not hold against the float tensors of the same name
        loaded.metadata_props[io.RESCALED_KEY] = json.dumps(rescaled, separators=(",", ":"))
    if cfg.high_precision == "fp32":
        with report.stage("insert"):
            model = io.to_model(loaded, provenance, tidy=False)       # insert_qdq left it tidy
            _check_raised(model, "quantized", report)     # the opset raised for per-channel Q/DQ, as below
        recorded.forget(model)          # an input's prediction describes another graph
        return model, loaded
    with report.stage("island ranges"):             # a run on calibration samples (rule H5)
        if data is not None:        # what range_cache lacks of this plan's unbounded tensors is run
            ranges = measure_ranges(loaded, data, providers=list(cfg.providers) if cfg.providers else None,
                                    known=range_cache)
        elif range_cache:
            ranges = range_cache
        else:
            ranges = {}
            report.warnings.append(f"no calibration data: {cfg.high_precision} islands were made without "
                                   f"checking activation ranges (rule H5)")
    with report.stage("float islands"):
        lowered = _at_precision_opset(loaded, provenance, cfg.high_precision, report)
        with step("retype"):
            islands = lower_float_islands(lowered.graph, cfg.high_precision, lowered.graph.opset, ranges)
        report.add([islands])
        with step("export"):
            model = io.to_model(lowered, provenance, tidy=False)      # the islands pass left it tidy
        light = None                    # the model as inference and the checker see it, made once for both
        if lowered is loaded:
            with step("shapes"):        # what reading the opset-19 model back would have inferred
                light = io.light_model(model)
                if io.refine_shapes(lowered.graph, model, light):
                    light = None        # it declares the shapes before
        with step("check"):
            _check_raised(model, cfg.high_precision, report, light)
    recorded.forget(model)              # an input's prediction describes another graph
    return model, lowered


def _raise_for_islands(model: proto.ModelProto, high_precision: str, report: InsertReport) -> proto.ModelProto:
    """The model at the opset its islands need (passes.precision.island_opset). BF16 islands want
    opset 22; a model the converter cannot take there goes to 19, with its convolutions and poolings
    float32 (a warning says so)."""
    wanted = island_opset(high_precision)
    if wanted > PRECISION_OPSET:
        try:
            return io.raise_opset(model, wanted, why=f"{high_precision} convolutions and poolings")[0]
        except QdqError as e:
            report.warnings.append(f"{e.problem}; the ops whose opset-{PRECISION_OPSET} schema has no {high_precision} "
                                   f"(Conv, pooling) stay float32 behind Casts")
    return io.raise_opset(model, PRECISION_OPSET, why=f"{high_precision} Q/DQ scales")[0]


def _at_precision_opset(loaded: io.Loaded, provenance: dict, high_precision: str,
                        report: InsertReport) -> io.Loaded:
    """The graph at the opset the islands need (passes.precision.island_opset: 19 for their scales,
    22 for BF16 convolutions and poolings), converted in memory (io.raise_graph_opset) for 19; where
    that cannot be done, or for 22, the exported model is converted and read back (a copy: `loaded`
    keeps its opset then)."""
    with step("opset"):
        # a float tensor of unknown type would take the type inference finds on reading back, and
        # the retyping reads types: such a graph takes the way through the exported model
        typed = all(t.dtype is not None for t in tensor_map(loaded.graph).values()
                    if isinstance(t, gs.Variable) and t.inputs)
        if typed and island_opset(high_precision) == PRECISION_OPSET and io.raise_graph_opset(loaded.graph, PRECISION_OPSET):
            return loaded
    with step("export"):
        model = io.to_model(loaded, provenance, tidy=False)           # insert_qdq left it tidy
        free_if_large(loaded)
    with step("opset"):
        model = _raise_for_islands(model, high_precision, report)
    with step("import"):
        lowered = io.load(model, check=False)
        lowered.dims = loaded.dims
        return lowered


def _check_raised(model: proto.ModelProto, what: str, report: InsertReport,
                  light: proto.ModelProto | None = None) -> None:
    """The checker on the model at the opset its Q/DQ or islands raised it to. Newer shape inference
    can prove a declared output shape wrong that the model's own opset let pass (an exporter's stale
    declaration, say), and an output declared with an empty shape (a Paddle export's `shape {}`)
    comes back from the graph without one, which the checker refuses; then the output shapes are
    left to inference, with a warning, and the check runs again. `light`: io.light_model(model),
    where the caller has it."""
    try:
        io.check(model, light)
        return
    except proto.CHECK_ERRORS as e:
        first = str(e).strip().splitlines()[0]
        declared = [o for o in model.graph.output if o.type.tensor_type.HasField("shape")]
        bare = [o for o in model.graph.output if not o.type.tensor_type.HasField("shape")]
        if not declared and not bare:
            raise InvariantError(f"the {what} model fails the ONNX checker: {first}") from e
    del model.graph.value_info[:]                 # shapes of the old opset, re-inferred below
    saved = {o.name: proto.empty_shape() for o in declared}
    for o in declared:
        saved[o.name].CopyFrom(o.type.tensor_type.shape)
        o.type.tensor_type.ClearField("shape")
    try:
        inferred = proto.infer_shapes_lenient(model)
    except proto.CHECK_ERRORS as e:
        raise InvariantError(f"the {what} model fails the ONNX checker: {first}") from e
    model.graph.value_info.extend(inferred.graph.value_info)
    shapes = {o.name: o.type.tensor_type for o in inferred.graph.output}
    for o in declared + bare:
        found = shapes.get(o.name)
        if found is not None and found.HasField("shape"):
            o.type.tensor_type.shape.CopyFrom(found.shape)
        elif o.name in saved:
            o.type.tensor_type.shape.CopyFrom(saved[o.name])
        else:                                      # inference finds none: the empty shape the export declared
            o.type.tensor_type.shape.SetInParent()
    try:
        io.check(model)
    except proto.CHECK_ERRORS as e:
        raise InvariantError(f"the {what} model fails the ONNX checker: {first}") from e
    if declared:
        report.warnings.append(f"at opset {io.opset_of(model)} the ONNX checker rejects the declared output shapes "
                               f"({first}); the written model declares the shapes inference finds")
