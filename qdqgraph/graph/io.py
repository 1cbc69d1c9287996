"""The one module that touches ONNX protobufs: load, save (atomic), shape inference, checker.

Everything else works on onnx-graphsurgeon graphs. `load` gives a `Loaded` (the graph plus what
of the original ModelProto must survive a rewrite: metadata, IR version, producer); `save` writes
a graph back, with external data when the model is too large for one protobuf.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from . import export as fast_export, outputs, wire
from .view import bodies, tensor_map
from ..errors import QdqError
from ..precisions.formats import FOUR_BIT_TYPES
from ..ops import CONSTANT
from onnx.external_data_helper import (ExternalDataInfo, load_external_data_for_model, load_external_data_for_tensor,
                                       _get_all_tensors, _open_external_data_fd, uses_external_data)
from onnx import version_converter
from onnx_graphsurgeon.exporters.onnx_exporter import OnnxExporter
from onnx_graphsurgeon.importers.onnx_importer import OnnxImporter, get_onnx_tensor_shape

# A protobuf cannot exceed 2 GiB; above this many bytes of tensors a model is written with its
# tensors in a side file. A module constant so that tests can lower it.
EXTERNAL_DATA_THRESHOLD = 1_800_000_000
# Opset needed for per-channel QuantizeLinear/DequantizeLinear (the `axis` attribute).
MIN_OPSET = 13
# Node metadata key that records which rule placed a Q/DQ node.
RULE_KEY = "qdqgraph.rule"
# Model metadata key: the tensors whose values the written model scales per channel against the float
# model's (a smoothing or an equalization folded into the layer that makes them), as a JSON list.
# `compare` does not measure them against the float tensors of the same name.
RESCALED_KEY = "qdqgraph.rescaled"


@dataclass
class Loaded:
    """A model as qdqgraph works on it: a graph, and the model-level fields to keep."""

    graph: gs.Graph
    path: Path | None = None
    ir_version: int = 8
    producer_name: str = ""
    producer_version: str = ""
    doc_string: str = ""
    metadata_props: dict[str, str] = field(default_factory=dict)
    opset_raised_from: int | None = None
    fixed_inputs: tuple[str, ...] = ()     # inputs made constants (qdqgraph.passes.fix_inputs)
    repairs: list[str] = field(default_factory=list)   # what loading repaired in an old or merged export
    dims: dict[str, int] = field(default_factory=dict)  # symbolic dims at the calibration data's shapes (bound_dims)


def opset_of(model: onnx.ModelProto) -> int:
    """The default-domain opset of `model` (0 if it imports none)."""
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx"):
            return o.version
    return 0


def declared_bytes(t: onnx.TensorProto) -> int:
    """The size a tensor's shape and type call for (reading len(raw_data) copies the data: 13 ms
    per pass over ResNet-50's weights). 4-bit types hold two values per byte."""
    if t.data_type in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4):
        return (math.prod(t.dims) + 1) // 2
    return math.prod(t.dims) * _itemsize(t.data_type)


@lru_cache(maxsize=None)
def _itemsize(data_type: int) -> int:
    try:
        return onnx.helper.tensor_dtype_to_np_dtype(data_type).itemsize
    except (KeyError, ValueError, TypeError):
        return 4


def tensor_bytes(model: onnx.ModelProto) -> int:
    """Bytes held in the model's initializers and Constant nodes (top-level graph); data stored
    outside the proto (external data, in-memory stubs) does not count."""
    total = 0
    for t in model.graph.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL:
            total += declared_bytes(t)
    for n in model.graph.node:
        if n.op_type == CONSTANT:
            for a in n.attribute:
                if a.type == onnx.AttributeProto.TENSOR and a.t.data_location != onnx.TensorProto.EXTERNAL:
                    total += declared_bytes(a.t)
    return int(total)


def _write(model: onnx.ModelProto, path: Path) -> None:
    """`model` to `path`, the bytes onnx.save writes, an initializer at a time (wire.write_model:
    a 1.6 GB model 18.4 -> 5.8 s)."""
    with open(path, "wb") as f:
        wire.write_model(model, f)


def _write_external(model: onnx.ModelProto, path: Path, location: str) -> None:
    """Save with tensors in `location` beside `path`, and leave `model` as it was (onnx moves the
    tensors out of the in-memory model when it saves them externally; they are read back)."""
    onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
              location=location, size_threshold=1024)
    load_external_data_for_model(model, str(Path(path).parent))


def interface(source: str | os.PathLike | onnx.ModelProto) -> gs.Graph:
    """A graph of `source`'s inputs (initializers left out) and outputs only, no nodes: what running
    a model needs to know of it. A file is read without its large weights (wire.read_split, skipped)."""
    model = source if isinstance(source, onnx.ModelProto) else _structure(Path(source))
    weights = {t.name for t in model.graph.initializer}
    tensor = OnnxImporter.import_tensor
    return gs.Graph(inputs=[tensor(v) for v in model.graph.input if v.name not in weights],
                    outputs=[tensor(v) for v in model.graph.output])


def _structure(path: Path) -> onnx.ModelProto:
    p = require_model_file(path)
    try:
        model = onnx.ModelProto.FromString(wire.read_split(p, skip=True).model)
    except Exception as e:
        raise _unreadable(p, e) from e
    _require_nodes(model, p)
    return model


def require_model_file(path) -> Path:
    """The model path, if it names a file that exists (a QdqError otherwise)."""
    p = Path(path)
    if not p.exists():
        raise QdqError(f"model file not found: {p}", "check the path")
    if p.is_dir():
        raise QdqError(f"{p} is a folder, not an ONNX file", "pass the .onnx file inside it")
    outputs.require_regular(p, "model")          # a FIFO would hang the read
    if not os.access(p, os.R_OK):
        raise QdqError(f"cannot read {p}: permission denied", "check the file's permissions")
    return p


def read_model(path: str | os.PathLike, external_data: bool = True) -> onnx.ModelProto:
    """Read an ONNX file with its external data, or raise a QdqError that says what is wrong.
    `external_data=False`: the graph alone, unchecked, for a look at its inputs or the prediction
    recorded in it (the checker then runs later; `finish_reading` reads and checks the rest)."""
    p = require_model_file(path)
    try:
        model = onnx.load(str(p), load_external_data=external_data)
    except Exception as e:
        raise _unreadable(p, e) from e
    _require_nodes(model, p)
    if external_data:
        validate(model, str(p))
    return model


def finish_reading(model: onnx.ModelProto, path: str | os.PathLike) -> bool:
    """What `read_model(path, external_data=False)` left out of `model` (in place): the external
    data its tensors refer to, read as onnx.load reads it, then the checker. Returns whether any
    external data was read (a caller that looked at the graph alone looks again)."""
    p = Path(path)
    external = False
    try:
        for t in _get_all_tensors(model):
            if uses_external_data(t):
                load_external_data_for_tensor(t, str(p.parent))
                external = True
    except Exception as e:
        raise _unreadable(p, e) from e
    validate(model, str(p))
    return external


# a model file this large holds its weights itself; below it, the file is read for the external data
# it refers to (the graph alone: a few MB)
_GRAPH_READ_MAX_BYTES = 64 << 20


def bytes_on_disk(path: str | os.PathLike) -> int:
    """The model file's bytes and those of the external data files it names (each once, those that
    exist): what loading it will hold in memory, give or take the graph."""
    p = Path(path)
    total = p.stat().st_size
    if total >= _GRAPH_READ_MAX_BYTES:
        return total
    try:
        model = onnx.load(str(p), load_external_data=False)
    except Exception:            # noqa: BLE001 - unreadable: loading says why
        return total
    files = {e.value for t in _external_tensors(model) for e in t.external_data if e.key == "location"}
    return total + sum((p.parent / f).stat().st_size for f in files if (p.parent / f).is_file())


def _unreadable(p: Path, e: Exception) -> QdqError:
    """The one-line error for a model file that cannot be read (protobuf's DecodeError, onnx's
    ValidationError or OSError, wire.WireError)."""
    if isinstance(e, PermissionError):         # the model, or its external data
        return QdqError(f"cannot read {e.filename or p}: permission denied", "check the file's permissions")
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return QdqError(f"{p} is not a readable ONNX model ({first})",
                    "pass a .onnx file exported by your framework (it may be truncated or corrupt)")


def _require_nodes(model: onnx.ModelProto, p: Path) -> None:
    if not model.graph.node:
        raise QdqError(f"{p} holds no graph nodes: it is not an ONNX model, or it is empty",
                       "pass a .onnx file exported by your framework")


IN_MEMORY_LOCATION = "qdqgraph-in-memory"      # a stub's location: its data is an array held apart
# initializers read apart from the proto (wire.read_split): the float types shape inference and the
# checker already see as typed inputs (_shapes_only), so what they see is unchanged
_APART_TYPES = {onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.FLOAT16: np.float16,
                onnx.TensorProto.DOUBLE: np.float64}


def read_weights_apart(path: str | os.PathLike) -> tuple[onnx.ModelProto, Apart]:
    """`read_model`, with the top-level graph's large float initializers (SHAPES_ONLY_MIN_BYTES or
    more) read from the file straight into 64-byte-aligned arrays (wire.read_split) and left in the
    model as stubs (data_location EXTERNAL, location IN_MEMORY_LOCATION). Returns (model, name ->
    array); `load` puts the arrays into the graph. Loading a 453 MB encoder peaked at 2.2x the file
    with onnx.load (the file's bytes, the parsed proto and the arrays at once). A file onnx reads
    as text (by its extension) is read by onnx.load."""
    p = require_model_file(path)
    if onnx.serialization.registry.get_format_from_file_extension(p.suffix) not in (None, "protobuf"):
        return read_model(p), Apart()
    try:
        split = wire.read_split(p, SHAPES_ONLY_MIN_BYTES)
        model = onnx.ModelProto.FromString(split.model)
        del split.model
        arrays = Apart(_take_apart(model, split.raw))
        del split
        _read_external(model, p.parent, arrays)
    except QdqError:
        raise
    except Exception as e:
        raise _unreadable(p, e) from e
    _require_nodes(model, p)
    validate(model, str(p))
    return model, arrays


class Apart(dict):
    """Weights read apart from the proto (name -> array), and the names of those read from external
    data (onnx.load marks them stored in the proto, data_location DEFAULT, and so are they written)."""

    def __init__(self, arrays: dict[str, np.ndarray] | None = None):
        super().__init__(arrays or {})
        self.external: set[str] = set()


def _read_external(model: onnx.ModelProto, base: Path, arrays: Apart) -> None:
    """What onnx.load reads of the external data, the top-level graph's float initializers straight
    into aligned arrays (stubs in the model, as `_take_apart` leaves them): a model of external data
    is then held once, not as raw_data and again as the arrays read out of it."""
    names: dict[str, int] = {}
    for t in model.graph.initializer:
        names[t.name] = names.get(t.name, 0) + 1
    for t in model.graph.initializer:
        if (not uses_external_data(t) or in_memory(t) or names[t.name] > 1 or t.data_type not in _APART_TYPES
                or declared_bytes(t) < SHAPES_ONLY_MIN_BYTES):
            continue
        data = _external_array(t, base)
        if data is not None:
            arrays[t.name] = data.view(_APART_TYPES[t.data_type]).reshape(tuple(t.dims))
            arrays.external.add(t.name)
            _set_in_memory(t, data.nbytes)
    for t in _get_all_tensors(model):
        if uses_external_data(t) and not in_memory(t):
            load_external_data_for_tensor(t, str(base))


def _external_array(t: onnx.TensorProto, base: Path) -> np.ndarray | None:
    """The external data of `t` read into an aligned uint8 array, where it is what its shape and type
    declare (None otherwise: onnx's reader then reads it, and the checker says what is wrong). The
    file is opened as onnx opens it (the location checked to stay in the model's folder), and the
    offset and length checked against the file as onnx checks them."""
    info = ExternalDataInfo(t)
    fd = _open_external_data_fd(str(base), info.location, t.name, True)
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        start = info.offset or 0
        length = info.length if info.length is not None else size - start
        if start > size or length != declared_bytes(t) or start + length > size:
            return None
        f.seek(start)
        data = wire.aligned_empty(length)
        if length and f.readinto(data.data) != length:
            return None
        return data


def _take_apart(model: onnx.ModelProto, raw: dict[int, np.ndarray]) -> dict[str, np.ndarray]:
    """Stub the initializers whose data `raw` holds (initializer index -> bytes) and return their
    arrays; data of another type, of the wrong size, or of a name two initializers share goes back
    into the proto as onnx would have read it."""
    inits = model.graph.initializer
    names: dict[str, int] = {}
    for t in inits:
        names[t.name] = names.get(t.name, 0) + 1
    arrays: dict[str, np.ndarray] = {}
    for index, data in raw.items():
        t = inits[index]
        dtype = _APART_TYPES.get(t.data_type)
        if (dtype is None or names[t.name] > 1 or t.data_location == onnx.TensorProto.EXTERNAL
                or declared_bytes(t) != data.nbytes):
            t.raw_data = data.tobytes()
            continue
        arrays[t.name] = data.view(dtype).reshape(tuple(t.dims))
        t.ClearField("raw_data")
        t.data_location = onnx.TensorProto.EXTERNAL
        _set_in_memory(t, data.nbytes)
    return arrays


def _set_in_memory(t: onnx.TensorProto, nbytes: int) -> None:
    del t.external_data[:]
    for key, value in (("location", IN_MEMORY_LOCATION), ("offset", "0"), ("length", str(nbytes))):
        entry = t.external_data.add()
        entry.key, entry.value = key, value


def in_memory(t: onnx.TensorProto) -> bool:
    """Whether `t` is a stub whose data is an array held apart (`_stub`, `read_weights_apart`)."""
    return t.data_location == onnx.TensorProto.EXTERNAL and any(
        e.key == "location" and e.value == IN_MEMORY_LOCATION for e in t.external_data)


def validate(model: onnx.ModelProto, name: str = "the model") -> None:
    """onnx.checker (not full_check) on an input model: a clear error instead of a crash later."""
    try:
        if tensor_bytes(model) < EXTERNAL_DATA_THRESHOLD:
            # the weights stay out of the checker's copy (it serializes the model: 0.14 s of its 0.2 s
            # on ResNet-50); their sizes are checked here instead
            onnx.checker.check_model(_weights_as_inputs(model)[0])
            _check_weight_sizes(model)
    except onnx.checker.ValidationError as e:
        first = str(e).strip().splitlines()[0]
        raise QdqError(f"{name} fails the ONNX checker ({first})",
                       "re-export it, or repair it (onnx.checker.check_model shows the details)") from None


def raise_opset(model: onnx.ModelProto, minimum: int = MIN_OPSET,
                why: str = "per-channel Q/DQ") -> tuple[onnx.ModelProto, int | None]:
    """Convert the model to at least `minimum` (`why` needs it: per-channel Q/DQ needs 13). Returns
    (model, old opset or None)."""
    old = opset_of(model)
    if old >= minimum:
        return model, None
    try:
        if tensor_bytes(model) < EXTERNAL_DATA_THRESHOLD:
            converted = version_converter.convert_version(model, minimum)
        else:
            converted = _convert_large(model, minimum)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise QdqError(f"the model's opset {old} could not be raised to {minimum}, which {why} needs ({first})",
                       f"re-export the model at opset {minimum} or newer") from e
    return converted, old


def _convert_large(model: onnx.ModelProto, minimum: int) -> onnx.ModelProto:
    """The version converter on a model past protobuf's 2 GB, which it cannot serialize ("Failed to
    serialize proto"): it converts a copy whose large initializers (of any type: INT8 weights of a
    large model are large too) are typed graph inputs, the nodes needing their types and not their
    values; the initializers are then put back as they were."""
    light = _without_initializers(model)
    declared = {i.name for i in light.graph.input}
    moved = set()
    for t in model.graph.initializer:
        if t.HasField("raw_data") and declared_bytes(t) >= SHAPES_ONLY_MIN_BYTES:
            moved.add(t.name)
            if t.name not in declared:
                light.graph.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
        else:
            light.graph.initializer.add().CopyFrom(t)
    converted = version_converter.convert_version(light, minimum)
    kept = [i for i in converted.graph.input if i.name not in moved or i.name in declared]
    del converted.graph.input[:]
    converted.graph.input.extend(kept)
    converted.graph.initializer.extend(t for t in model.graph.initializer if t.name in moved)
    return converted


_IN_MEMORY_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE, onnx.TensorProto.INT8,
                    onnx.TensorProto.UINT8, onnx.TensorProto.INT32, onnx.TensorProto.INT64}
_FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE}
SHAPES_ONLY_MIN_BYTES = 4096     # float initializers this large enter shape inference as typed inputs
_SHAPES_ONLY_TYPES = _FLOAT_TYPES | {onnx.TensorProto.INT8, onnx.TensorProto.UINT8, onnx.TensorProto.FLOAT8E4M3FN,
                                     onnx.TensorProto.FLOAT8E5M2}


def _shapes_only(t: onnx.TensorProto) -> bool:
    """A large float or 8-bit weight initializer (a written model's INT8 and FP8 weights): the checker
    and shape inference see it as a typed input (those read apart, `read_weights_apart`, too). On a
    453 MB encoder the INT8 weights went through shape inference after the float islands, +560 MB
    at the run's peak; no shape is computed from a weight's values."""
    return t.data_type in _SHAPES_ONLY_TYPES and declared_bytes(t) >= SHAPES_ONLY_MIN_BYTES and (
        t.HasField("raw_data") or in_memory(t))


def _weights_as_inputs(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """A copy of `model` whose large float initializers are declared as typed graph inputs instead:
    the checker and shape inference need their shapes, not their values (data propagation reads the
    small integer tensors, which stay). Built field by field, so the weights are not copied. Returns
    (copy, number of inputs appended)."""
    light = _without_initializers(model)
    g = light.graph
    inputs = {i.name for i in g.input}
    added = 0
    for t in model.graph.initializer:
        if _shapes_only(t):
            if t.name not in inputs:
                g.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
                added += 1
        else:
            g.initializer.add().CopyFrom(t)
    return light, added


def _check_weight_sizes(model: onnx.ModelProto) -> None:
    """What the checker would say of the initializers `_weights_as_inputs` keeps out of its sight."""
    for t in model.graph.initializer:
        if _shapes_only(t) and not in_memory(t):           # read apart: its size was checked then
            need = declared_bytes(t)
            if len(t.raw_data) != need:
                raise onnx.checker.ValidationError(
                    f"TensorProto (tensor name: {t.name}) raw_data size ({len(t.raw_data)} bytes) does not match "
                    f"the declared shape and type ({need} bytes required).")


def infer_shapes(model: onnx.ModelProto, inplace: bool = False) -> onnx.ModelProto:
    """ONNX shape inference that keeps symbolic dims; a model it cannot handle is returned as is.
    The weights stay out of it: serializing ResNet-50's 100 MB into onnx's C++ and back took most of
    the 0.45 s it cost. `inplace`: the caller owns `model`, which then takes the inferred nodes,
    shapes and outputs instead of its weights being copied into the result (no second copy of the
    weights, which for a large model doubled the memory while loading)."""
    try:
        if tensor_bytes(model) < EXTERNAL_DATA_THRESHOLD:
            light, added = _weights_as_inputs(model)
            out = onnx.shape_inference.infer_shapes(light, strict_mode=False, data_prop=True)
            if added:
                del out.graph.input[len(out.graph.input) - added:]
            if inplace:
                for name in ("node", "value_info", "output"):
                    field = getattr(model.graph, name)
                    del field[:]
                    field.extend(getattr(out.graph, name))
                return model
            del out.graph.initializer[:]
            out.graph.initializer.extend(model.graph.initializer)
            return out
    except (onnx.shape_inference.InferenceError, ValueError):
        pass
    if any(in_memory(t) for t in model.graph.initializer):
        return model            # weights held apart cannot be written for the file-based inference
    with tempfile.TemporaryDirectory() as d:
        src, dst = Path(d) / "in.onnx", Path(d) / "out.onnx"
        _write_external(model, src, "in.data")
        try:
            onnx.shape_inference.infer_shapes_path(str(src), str(dst), strict_mode=False, data_prop=True)
        except Exception:
            return model
        return onnx.load(str(dst))


def load(path_or_model: str | os.PathLike | onnx.ModelProto, check: bool = True, min_opset: int = MIN_OPSET,
         why: str = "per-channel Q/DQ") -> Loaded:
    """Load a model (path or ModelProto) into a graphsurgeon graph, opset raised to `min_opset`
    (13; 19 for FP8, 21 for INT4 weights: `why` says which), shapes inferred. `check=False` skips
    the ONNX checker on a ModelProto qdqgraph made itself.

    What real exports get wrong is repaired on the way in, and each repair is a line in
    `Loaded.repairs`: repeated opset_import entries of one domain become one (before the opset is
    raised), placeholder and repeated dim names on the graph's inputs and outputs become unique, and
    nodes without a name, or with a repeated one, are named (placement addresses nodes by name).
    Initializers an old exporter also lists as graph inputs stay constants (weights)."""
    arrays = Apart()
    if isinstance(path_or_model, onnx.ModelProto):
        model, path = path_or_model, None
        if check:
            validate(model)
    else:
        path = Path(path_or_model)
        model, arrays = read_weights_apart(path)
    repairs: list[str] = []
    if model.functions:
        if path is None:            # the caller's model stays as it was
            model = _copy(model)
        model, inlined = inline_functions(model)
        repairs += inlined
    if has_sparse(model.graph):
        if path is None and not repairs:            # the caller's model stays as it was
            model = _copy(model)
        repairs += densify_sparse(model)
    if _needs_repair(model):
        if path is None and not repairs:            # the caller's model stays as it was
            model = _copy(model)
        repairs += merge_opset_imports(model)
        repairs += unique_dim_names(model)
    model, raised = raise_opset(model, max(min_opset, MIN_OPSET), why)
    model = infer_shapes(model, inplace=path is not None or raised is not None or bool(repairs))
    try:
        graph = gs.import_onnx(model)
    except Exception as e:
        raise QdqError(f"the model could not be read as a graph ({str(e).splitlines()[0]})",
                       "check it with onnx.checker.check_model") from e
    _materialize(graph, arrays)
    named = name_nodes(graph)
    if named:
        repairs.append(f"{named} nodes without a name or with a repeated one were named (placement addresses "
                       f"nodes by name)")
    return Loaded(graph=graph, path=path, ir_version=model.ir_version,
                  producer_name=model.producer_name, producer_version=model.producer_version,
                  doc_string=model.doc_string,
                  metadata_props={p.key: p.value for p in model.metadata_props},
                  opset_raised_from=raised, repairs=repairs)


def inline_functions(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """The model with its local functions (FunctionProtos in model.functions, which torch's dynamo
    exporter writes) inlined, as a new model: placement sees the ops inside them, and the written
    model holds those ops rather than calls of functions a graph rebuilt from nodes would drop.
    Names the functions' unnamed nodes (in place). Returns the model and a repair line."""
    import onnx.inliner
    names = sorted({f"{f.domain}::{f.name}" if f.domain else f.name for f in model.functions})
    called = {(f.domain, f.name) for f in model.functions}

    def calls(g: onnx.GraphProto) -> int:
        n = 0
        for node in g.node:
            n += (node.domain, node.op_type) in called
            for a in node.attribute:
                n += sum(calls(sub) for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs))
        return n
    count = calls(model.graph)
    for f in model.functions:          # the inliner suffixes each call's copy: ConvRelu/Conv_0__1, ...
        for i, n in enumerate(f.node):
            n.name = n.name or f"{f.name}/{n.op_type}_{i}"
    try:
        out = onnx.inliner.inline_local_functions(model)
    except Exception as e:  # noqa: BLE001 - the inliner's own errors, said as the model's
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise QdqError(f"the model's local functions ({', '.join(names[:5])}) could not be inlined ({first})",
                       "export the model without local functions (torch.onnx.export(..., dynamo=False), "
                       "or onnx.inliner.inline_local_functions)") from e
    del out.functions[:]               # what the graph no longer calls
    return out, [f"{count} call(s) of {len(names)} local function(s) ({', '.join(names[:5])}"
                 f"{', ...' if len(names) > 5 else ''}) inlined: quantization sees the ops inside them"]


def _graphs(g: onnx.GraphProto):
    """`g` and every subgraph in it (If, Loop and Scan bodies), outermost first."""
    yield g
    for node in g.node:
        for a in node.attribute:
            for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                yield from _graphs(sub)


def has_sparse(g: onnx.GraphProto) -> bool:
    """Whether `g` or a subgraph holds a sparse initializer or a Constant of a sparse value."""
    return any(sub.sparse_initializer or any(a.HasField("sparse_tensor") for n in sub.node for a in n.attribute)
               for sub in _graphs(g))


def sparse_to_dense(sparse: onnx.SparseTensorProto) -> onnx.TensorProto:
    """A SparseTensorProto as the dense TensorProto it stands for, of its declared element type
    (its values' type) and shape: indices [NNZ] are linear, [NNZ, rank] coordinates."""
    values = onnx.numpy_helper.to_array(sparse.values)
    indices = onnx.numpy_helper.to_array(sparse.indices).astype(np.int64)
    dims = tuple(sparse.dims)
    dense = np.zeros(int(np.prod(dims, dtype=np.int64)), dtype=values.dtype)
    if indices.ndim == 2:
        indices = np.ravel_multi_index(tuple(indices.T), dims) if indices.size else indices.reshape(-1)
    dense[indices.reshape(-1)] = values.reshape(-1)
    out = onnx.numpy_helper.from_array(dense.reshape(dims), sparse.values.name)
    out.data_type = sparse.values.data_type
    return out


def densify_sparse(model: onnx.ModelProto) -> list[str]:
    """Sparse initializers (graph.sparse_initializer) and sparse Constant values made dense, of the
    element type they declare, in place: qdqgraph quantizes dense weights (a weight's scale comes
    from all its values), and graphsurgeon read sparse ones into float64 arrays, which broke the
    model's types. Returns a repair line."""
    names = []
    for g in _graphs(model.graph):
        for sparse in g.sparse_initializer:
            g.initializer.append(sparse_to_dense(sparse))
            names.append(sparse.values.name)
        del g.sparse_initializer[:]
        for node in g.node:
            for a in node.attribute:
                if a.HasField("sparse_tensor"):          # Constant(sparse_value=...)
                    dense = sparse_to_dense(a.sparse_tensor)
                    a.ClearField("sparse_tensor")
                    a.name, a.type = "value", onnx.AttributeProto.TENSOR
                    a.t.CopyFrom(dense)
                    names.append(node.output[0] if node.output else dense.name)
    return [f"{len(names)} sparse initializer(s) or constant(s) ({', '.join(names[:5])}"
            f"{', ...' if len(names) > 5 else ''}) stored dense, of their declared type: qdqgraph quantizes dense "
            f"weights"]


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


def _domain(d: str) -> str:
    return "" if d == "ai.onnx" else d


def _needs_repair(model: onnx.ModelProto) -> bool:
    domains = [_domain(o.domain) for o in model.opset_import]
    return len(set(domains)) != len(domains) or bool(_dims_to_rename(model))


def merge_opset_imports(model: onnx.ModelProto) -> list[str]:
    """One opset_import entry per domain, at the highest version the model lists for it (in place;
    onnx.compose.merge_models writes one per merged graph, and raising the opset then updates only
    one of them, which onnxruntime refuses). Returns a line per merged domain."""
    versions: dict[str, list[int]] = {}
    for o in model.opset_import:
        versions.setdefault(_domain(o.domain), []).append(o.version)
    repeated = {d: v for d, v in versions.items() if len(v) > 1}
    if not repeated:
        return []
    first_spelling: dict[str, str] = {}
    for o in model.opset_import:
        first_spelling.setdefault(_domain(o.domain), o.domain)
    del model.opset_import[:]
    for d, v in versions.items():
        model.opset_import.append(onnx.helper.make_opsetid(first_spelling[d], max(v)))
    out = []
    for d, v in repeated.items():
        name = f"domain '{d}'" if d else "the default domain"
        mixed = "" if len(set(v)) == 1 else f"; its nodes are read at opset {max(v)}"
        out.append(f"{len(v)} opset_import entries for {name} ({', '.join(map(str, v))}) merged into one at "
                   f"{max(v)}{mixed}")
    return out


PLACEHOLDER_DIMS = ("?", "")     # dim names that mean "unknown", not a symbol shared with other dims


def _dims_to_rename(model: onnx.ModelProto) -> list[tuple[onnx.ValueInfoProto, int]]:
    """(value info, dim index) of every graph input or output dim whose name is a placeholder or
    repeats an earlier dim of the same tensor (TensorRT reads equal names as one symbol: a Paddle
    input [?, 3, ?, ?] would force H == W). Names shared across tensors (a `batch` on every input)
    are symbols the exporter meant and stay."""
    g = model.graph
    weights = {t.name for t in g.initializer}
    found = []
    for vi in [*(i for i in g.input if i.name not in weights), *g.output]:
        if not vi.type.HasField("tensor_type") or not vi.type.tensor_type.HasField("shape"):
            continue
        seen: set[str] = set()
        for k, d in enumerate(vi.type.tensor_type.shape.dim):
            if d.WhichOneof("value") != "dim_param":
                continue
            if d.dim_param in PLACEHOLDER_DIMS or d.dim_param in seen:
                found.append((vi, k))
            seen.add(d.dim_param)
    return found


def unique_dim_names(model: onnx.ModelProto) -> list[str]:
    """Rename the dims `_dims_to_rename` finds to `<tensor>_dim<k>` (made unique against every dim
    name the model uses), in place. A placeholder on a graph output is cleared instead, so that shape
    inference gives it the input dim it follows (an output [?, 32, ?, ?] of the input above becomes
    [x_dim0, 32, x_dim2, x_dim3]). Returns a line per tensor renamed."""
    found = _dims_to_rename(model)
    if not found:
        return []
    g = model.graph
    taken = {d.dim_param for vi in [*g.input, *g.output, *g.value_info]
             if vi.type.HasField("tensor_type") for d in vi.type.tensor_type.shape.dim if d.dim_param}
    outputs = {id(vi) for vi in g.output}
    renamed: dict[str, list[str]] = {}
    for vi, k in found:
        d = vi.type.tensor_type.shape.dim[k]
        if id(vi) in outputs and d.dim_param in PLACEHOLDER_DIMS:
            d.Clear()
            continue
        new, j = f"{vi.name}_dim{k}", 1
        while new in taken:
            new, j = f"{vi.name}_dim{k}_{j}", j + 1
        taken.add(new)
        renamed.setdefault(vi.name, []).append(f"{d.dim_param or '(empty)'} -> {new}")
        d.dim_param = new
    return [f"dims of '{name}' renamed ({', '.join(r)}): TensorRT reads equal dim names as one size"
            for name, r in renamed.items()]


def name_nodes(graph: gs.Graph) -> int:
    """Give every node of `graph` and of its If/Loop bodies a unique, non-empty name, in place:
    `<op>_<k>` (k its place in the walk) for a node without one, `<name>_<k>` for a repeat of an
    earlier node's name; neither collides with a name the model holds. Deterministic: the same model
    gets the same names. Returns how many nodes were named."""
    nodes = [n for g in (graph, *bodies(graph)) for n in g.nodes]
    taken = {n.name for n in nodes if n.name}
    seen: set[str] = set()
    named = 0
    for k, n in enumerate(nodes):
        if n.name and n.name not in seen:
            seen.add(n.name)
            continue
        base = f"{n.name}_{k}" if n.name else f"{n.op}_{k}"
        name, j = base, 1
        while name in taken:
            name, j = f"{base}_{j}", j + 1
        n.name = name
        taken.add(name)
        seen.add(name)
        named += 1
    return named


def _materialize(graph: gs.Graph, arrays: Apart | None = None) -> None:
    """Turn every constant's lazy value into its array now, and keep no reference into the
    ModelProto: graphsurgeon holds each TensorProto until its value is first read, and the graph
    holds the model's opset_import list, and any of them keeps the whole ModelProto (its weights
    included) alive beside the arrays read from it. Each copy of the graph also read its own arrays.
    Types numpy lacks (float8e4m3fn, int4), which graphsurgeon leaves as ONNX type numbers, become
    their ml_dtypes types, as onnx itself reads them. `arrays`: the data of the stubs
    `read_weights_apart` left in the model, by name."""
    graph.import_domains = [onnx.helper.make_opsetid(d.domain, d.version) for d in graph.import_domains or []]
    for g in [graph, *bodies(graph)]:
        if g is not graph and g.import_domains is not None:
            g.import_domains = [onnx.helper.make_opsetid(d.domain, d.version) for d in g.import_domains]
        for t in tensor_map(g).values():
            if isinstance(t, gs.Constant) and isinstance(getattr(t, "_values", None), gs.ir.tensor.LazyValues):
                lazy = t._values
                if arrays and lazy.tensor.name in arrays and in_memory(lazy.tensor):
                    t.values = arrays[lazy.tensor.name]
                    # written in the proto, as onnx.load leaves it: data_location unset, or DEFAULT
                    # where the data was external
                    t.data_location = onnx.TensorProto.DEFAULT if t.name in arrays.external else None
                elif isinstance(lazy.dtype, int):      # float8, int4: onnx reads them as ml_dtypes arrays
                    t.values = onnx.numpy_helper.to_array(lazy.tensor)
                    t._export_dtype = None
                else:
                    t.values  # noqa: B018 - reading it loads it
            elif isinstance(t, gs.Variable) and isinstance(t.dtype, int):
                t.dtype = onnx.helper.tensor_dtype_to_np_dtype(t.dtype)


def _pack_4bit(graph: gs.Graph) -> None:
    """graphsurgeon 0.6.1 writes an int4 array one value per byte, which onnx rejects: hand it
    those constants as TensorProtos onnx packed (two values per byte), which it writes as they are.
    (fast_export.export does the same per graph as it writes it.)"""
    for g in [graph, *bodies(graph)]:
        for t in tensor_map(g).values():
            fast_export.pack_4bit(t)


def to_model(loaded: Loaded, provenance: dict[str, str] | None = None, tidy: bool = True) -> onnx.ModelProto:
    """Export the graph back to a ModelProto, keeping model-level fields and stamping rule ids.
    The graph is cleaned up and sorted first, unless `tidy` is False (the caller's last pass just
    did both)."""
    graph = loaded.graph
    if tidy:
        _tidy(graph)                         # cleanup, then toposort
    model = fast_export.export(graph)        # gs.export_onnx's bytes, built faster (graph/export.py)
    if model is None:                        # a case it leaves to graphsurgeon
        _pack_4bit(graph)
        model = gs.export_onnx(graph, do_type_check=True)
    model.ir_version = max(loaded.ir_version, 7)
    model.producer_name = loaded.producer_name or "qdqgraph"
    model.producer_version = loaded.producer_version
    model.doc_string = loaded.doc_string
    del model.metadata_props[:]
    for k, v in loaded.metadata_props.items():
        p = model.metadata_props.add()
        p.key, p.value = k, v
    if provenance:
        for node in model.graph.node:
            rule = provenance.get(node.name)
            if rule:
                p = node.metadata_props.add()
                p.key, p.value = RULE_KEY, rule
    return model


def _stub(name: str, data_type: int, dims, nbytes: int) -> onnx.TensorProto:
    """An initializer that only refers to data held outside the proto (onnxruntime's external
    initializers from memory supply it)."""
    stub = onnx.TensorProto()
    stub.name, stub.data_type, stub.data_location = name, data_type, onnx.TensorProto.EXTERNAL
    stub.dims.extend(int(d) for d in dims)
    _set_in_memory(stub, nbytes)
    return stub


def stub(name: str, array: np.ndarray) -> onnx.TensorProto:
    """A stub initializer for `array`, which reaches onnxruntime from memory beside the model."""
    return _stub(name, onnx.helper.np_dtype_to_tensor_dtype(array.dtype), array.shape, array.nbytes)


def fill_weights(model: onnx.ModelProto, weights: dict[str, np.ndarray]) -> onnx.ModelProto:
    """A copy of `model` whose stub initializers named in `weights` hold that data again."""
    full = onnx.ModelProto()
    full.CopyFrom(model)
    for i, t in enumerate(full.graph.initializer):
        if t.name in weights:
            full.graph.initializer[i].CopyFrom(onnx.numpy_helper.from_array(weights[t.name], t.name))
    return full


def to_model_and_weights(loaded: Loaded) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """`to_model` for an onnxruntime session: the graph's large constants stay out of the proto as
    stubs and come back as arrays (name -> array, the graph's own arrays, not copies). On ResNet-50
    this skips exporting and then re-reading 100 MB of weights."""
    swapped, arrays = [], {}
    for t in tensor_map(loaded.graph).values():
        v = getattr(t, "_values", None)
        if not isinstance(t, gs.Constant) or v is None or isinstance(v, gs.ir.tensor.SparseValues) \
                or v.nbytes < IN_MEMORY_MIN_BYTES:
            continue
        a = np.ascontiguousarray(t.values)
        try:
            data_type = onnx.helper.np_dtype_to_tensor_dtype(a.dtype)
        except (KeyError, TypeError, ValueError):
            continue
        if data_type not in _IN_MEMORY_TYPES:
            continue
        arrays[t.name] = a
        swapped.append((t, v))
        t._values = gs.ir.tensor.LazyValues(_stub(t.name, data_type, a.shape, a.nbytes))
    try:
        model = to_model(loaded)
    finally:
        for t, v in swapped:
            t._values = v
    # onnxruntime supplies only the main graph's initializers; a constant that an If/Loop body also
    # lists as its own initializer gets its data back there
    for sub in subgraphs(model.graph):
        for i, t in enumerate(sub.initializer):
            if t.name in arrays and t.data_location == onnx.TensorProto.EXTERNAL:
                sub.initializer[i].CopyFrom(onnx.numpy_helper.from_array(arrays[t.name], t.name))
    used = {i.name for i in model.graph.initializer}
    return model, {k: a for k, a in arrays.items() if k in used}


def subgraphs(graph: onnx.GraphProto):
    """Every If/Loop/Scan body under `graph`, nested ones included."""
    for node in graph.node:
        for a in node.attribute:
            for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else
                      list(a.graphs) if a.type == onnx.AttributeProto.GRAPHS else []):
                yield g
                yield from subgraphs(g)


def light_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with its large weights seen as typed inputs (`_weights_as_inputs`), for `check` and
    `refine_shapes`, which can share it while the model stays as it is."""
    return _weights_as_inputs(model)[0]


def check(model: onnx.ModelProto, light: onnx.ModelProto | None = None) -> None:
    """onnx.checker with full_check, its large weights seen as typed inputs (`_weights_as_inputs`;
    `light`: `light_model(model)`, where the caller has it) and their sizes checked here: the
    checker serializes what it is given, parses it again and infers shapes on a copy, which on a
    453 MB encoder's written model (115 MB of INT8 weights) set the run's peak, +410 MB. Past
    protobuf's 2 GB what is left is checked from a temporary file."""
    light = light if light is not None else _weights_as_inputs(model)[0]
    if tensor_bytes(light) < EXTERNAL_DATA_THRESHOLD:
        onnx.checker.check_model(light, full_check=True)
        _check_weight_sizes(model)
        return
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "m.onnx"
        _write_external(model, p, "m.data")
        onnx.checker.check_model(str(p), full_check=True)


def save(model: onnx.ModelProto, path: str | os.PathLike, *, protect: tuple = (), force: bool = True) -> list[Path]:
    """Write `model` to `path` by qdqgraph's output policy (qdqgraph.graph.outputs: atomic, mode from the
    umask, an existing file replaced only with `force`); returns the files written.

    Models whose tensors exceed EXTERNAL_DATA_THRESHOLD are written with external data in
    `<name>.data`, which is written first and removed again if the model cannot be. Paths in
    `protect` (the input model and its data) are never written.
    """
    final = Path(path)
    data_final = final.with_name(final.name + ".data")
    external = tensor_bytes(model) >= EXTERNAL_DATA_THRESHOLD
    for p in protect:
        for target in [final] + ([data_final] if external else []):
            if p is not None and Path(p).resolve() == target.resolve():
                raise QdqError(f"refusing to overwrite the input {'model' if target == final else 'external data'} "
                               f"{target}", "choose another output with -o")
    outputs.check_output(final, "output", force)
    if not external:
        return outputs._as_qdq_error(final, lambda: outputs.write_atomic(final, lambda tmp: _write(model, tmp), force))
    relocated: dict = {}

    def write_data(tmp_data: Path) -> None:
        # onnx writes the data file next to the model under `location`: write both under temporary
        # names, then point the model at the final data name
        scratch = tmp_data.with_name(tmp_data.name + ".model")
        try:
            # the output policy made the temporary file (an empty one, so the name is ours); onnx
            # refuses to write external data into a file that exists
            tmp_data.unlink()
            _write_external(model, scratch, tmp_data.name)
            m = onnx.load(str(scratch), load_external_data=False)
        finally:
            with contextlib.suppress(OSError):
                scratch.unlink()
        for t in _external_tensors(m):
            for e in t.external_data:
                if e.key == "location":
                    e.value = data_final.name
        relocated["model"] = m

    written = outputs._as_qdq_error(final, lambda: outputs.write_atomic(
        final, lambda tmp: onnx.save(relocated["model"], str(tmp)), force, companions=[(data_final, write_data)]))
    return [final] + [p for p in written if p != final]


def _external_tensors(model: onnx.ModelProto):
    for t in _get_all_tensors(model):
        if t.data_location == onnx.TensorProto.EXTERNAL:
            yield t


def with_outputs(model: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    """A copy of `model` whose graph also outputs the tensors `names` (for calibration), each of the
    type the model declares for it (a float16 model's tensors are float16: declared float32,
    onnxruntime refused the model), and untyped where it declares none (onnxruntime infers it)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    present = {o.name for o in g.output}
    known = {vi.name: vi.type.tensor_type.elem_type for vi in [*g.input, *g.value_info, *g.output]
             if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type}
    for name in names:
        if name not in present:
            if name in known:
                g.output.append(onnx.helper.make_tensor_value_info(name, known[name], None))
            else:
                g.output.add().name = name
    return m


IN_MEMORY_MIN_BYTES = 4096       # initializers this large reach onnxruntime from memory, not serialized


def _copy_fields(src, dst, skip: str) -> None:
    """Copy every set field of message `src` into `dst` except the field named `skip`."""
    for fd, value in src.ListFields():
        if fd.name == skip:
            continue
        repeated = fd.is_repeated if hasattr(fd, "is_repeated") else fd.label == fd.LABEL_REPEATED
        if repeated:
            getattr(dst, fd.name).extend(value)
        elif fd.type == fd.TYPE_MESSAGE:
            getattr(dst, fd.name).CopyFrom(value)
        else:
            setattr(dst, fd.name, value)


def _without_initializers(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` without its top-level initializers, built field by field (the weights are
    not copied)."""
    light = onnx.ModelProto()
    _copy_fields(model, light, skip="graph")
    _copy_fields(model.graph, light.graph, skip="initializer")
    return light


def split_weights(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """A copy of `model` whose large top-level initializers only refer to data held outside the
    proto, and that data as arrays (name -> array). onnxruntime takes such arrays as external
    initializers from memory, so a session does not serialize the weights: opening ResNet-50 took
    0.20 s instead of 0.43 s, and a model past protobuf's 2 GB needs no temporary file. The weights
    are read once and not copied again (the copy is built field by field)."""
    light = _without_initializers(model)
    arrays: dict[str, np.ndarray] = {}
    for t in model.graph.initializer:
        if (not t.HasField("raw_data") or declared_bytes(t) < IN_MEMORY_MIN_BYTES
                or t.data_location == onnx.TensorProto.EXTERNAL or t.data_type not in _IN_MEMORY_TYPES):
            light.graph.initializer.add().CopyFrom(t)
            continue
        raw = t.raw_data
        arrays[t.name] = np.frombuffer(raw, dtype=onnx.helper.tensor_dtype_to_np_dtype(t.data_type)).reshape(tuple(t.dims))
        light.graph.initializer.append(_stub(t.name, t.data_type, t.dims, len(raw)))
    return light, arrays


# onnxruntime's CPU provider has no FP16 kernel for most ops: for each FP16 node it lacks one for,
# a graph transformer inserts Casts to float32 and back, then removes every Cast pair it made between
# two such nodes, so an FP16 island runs in float32 (its FP16 constants, already rounded, as they
# are). That transformer's cost grows with the square of the graph: a 10,000-node CNN with FP16
# islands took 27 s to open, 4.4 s as the same Q/DQ graph in float32 (1.0 s as the float model).
# A session that only scores a written model (comparison, fidelity) takes the float32 form of its
# FP16 tensors instead (`widen_fp16`): the same arithmetic for every node onnxruntime has no FP16
# kernel for, and for those it has (DequantizeLinear, Cast, ...) float32 where TensorRT, which
# consumes INT8 weights and activations in the quantized layers, materializes no FP16 value either.
_FP16, _F32 = onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT


def has_fp16_inputs(model: onnx.ModelProto) -> bool:
    """Whether a graph input of `model` is FP16 (its feed decides that type: it is not widened)."""
    return any(v.type.tensor_type.elem_type == _FP16 for v in model.graph.input)


def widen_fp16(model: onnx.ModelProto, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every FP16 tensor of `model` made float32 in place (value types, initializers, constants,
    Cast targets, dtype attributes, in every subgraph), the same values; returns `weights` (stub
    initializers' data, name -> array) with the FP16 arrays widened (new arrays, the others as they
    are). Graph inputs keep their type: call it only where `has_fp16_inputs` is False."""
    widened = dict(weights)
    _widen_graph(model.graph, widened, inputs=False)
    for g in subgraphs(model.graph):             # a body's inputs are its loop state or outer values
        _widen_graph(g, widened, inputs=True)
    return widened


def _widen_graph(g: onnx.GraphProto, weights: dict[str, np.ndarray], inputs: bool) -> None:
    for v in [*(g.input if inputs else []), *g.output, *g.value_info]:
        if v.type.tensor_type.elem_type == _FP16:
            v.type.tensor_type.elem_type = _F32
    for i, t in enumerate(g.initializer):
        if t.data_type != _FP16:
            continue
        if t.name in weights and t.data_location == onnx.TensorProto.EXTERNAL:
            weights[t.name] = weights[t.name].astype(np.float32)
            g.initializer[i].CopyFrom(_stub(t.name, _F32, t.dims, weights[t.name].nbytes))
        else:
            g.initializer[i].CopyFrom(_widened_tensor(t))
    for node in g.node:
        for a in node.attribute:
            if a.type == onnx.AttributeProto.TENSOR and a.t.data_type == _FP16:
                a.t.CopyFrom(_widened_tensor(a.t))
            elif a.type == onnx.AttributeProto.INT and a.name in ("to", "dtype") and a.i == _FP16:
                a.i = _F32


def _widened_tensor(t: onnx.TensorProto) -> onnx.TensorProto:
    return onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(t).astype(np.float32), t.name)


def session_bytes(model: onnx.ModelProto) -> bytes | None:
    """Serialized model for onnxruntime, or None when it must go through a file (too large)."""
    if tensor_bytes(model) < EXTERNAL_DATA_THRESHOLD:
        return model.SerializeToString()
    return None


def save_temp(model: onnx.ModelProto, folder: str) -> str:
    """Write a (large) model with external data into `folder` for onnxruntime; returns its path."""
    p = Path(folder) / "model.onnx"
    _write_external(model, p, "model.data")
    return str(p)


def write_text_atomic(path, text: str, force: bool = True) -> None:
    """Write `text` to `path` by qdqgraph's output policy (qdqgraph.graph.outputs)."""
    outputs.write_text(path, text, force)


def read_json(path, what: str, fix: str):
    """Parse the JSON file at `path`; a missing or unreadable file is a QdqError naming `what` it
    should have been and the `fix`."""
    p = Path(path)
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise QdqError(f"{p} not found (it should be {what})", "check the path") from None
    except IsADirectoryError:
        raise QdqError(f"{p} is a folder, not {what}", fix) from None
    except PermissionError:
        raise QdqError(f"cannot read {p}: permission denied", "check the file's permissions") from None
    except UnicodeDecodeError:
        raise QdqError(f"{p} is not {what} (a binary file, not JSON text)", fix) from None
    except json.JSONDecodeError as e:
        raise QdqError(f"{p} is not {what} (not valid JSON: {e})", fix) from None
    except (OSError, RecursionError) as e:
        raise QdqError(f"{p} cannot be read as {what} ({getattr(e, 'strerror', None) or e})", fix) from None


def repaired_for_compiler(path: str | os.PathLike) -> tuple[bytes | None, list[str]]:
    """The model file as a compiler should parse it: with placeholder or repeated input dim names
    made unique (unique_dim_names), serialized without its external tensors (they stay where the
    file points, beside it), or None when nothing needed repair. Returns the repair lines too."""
    model = onnx.load(str(path), load_external_data=False)
    lines = unique_dim_names(model)
    return (model.SerializeToString() if lines else None), lines


_DEFAULT_DOMAINS = ("", "ai.onnx")
SIGNATURE_CONSTANT_MAX = 64      # integer constants up to this many elements enter a node's signature


def _since(op: str, opset: int) -> int | None:
    try:
        return onnx.defs.get_schema(op, opset, "").since_version
    except onnx.defs.SchemaError:
        return None


def _node_proto(node: gs.Node, rename: dict[str, str] | None = None) -> onnx.NodeProto:
    proto = OnnxExporter.export_node(node)
    if rename:
        proto.input[:] = [rename.get(x, x) for x in proto.input]
        proto.output[:] = [rename.get(x, x) for x in proto.output]
    return proto


def _skeleton(nodes: list[tuple[gs.Node, dict[str, str]]], opset: int, graph: gs.Graph) -> onnx.ModelProto:
    """A model of just `nodes` (each with its tensor renaming) for onnx's version converter: what they
    read from outside is a typed graph input, or a small integer initializer (values an adapter may
    read: axes, pads, sizes); what they write is a graph output."""
    protos: list[onnx.NodeProto] = []
    inputs: dict[str, onnx.ValueInfoProto] = {}
    inits: dict[str, onnx.TensorProto] = {}
    written: set[str] = set()
    for node, rename in nodes:
        protos.append(_node_proto(node, rename))
        written.update(rename.get(t.name, t.name) for t in node.outputs if t.name)
    for node, rename in nodes:
        for t in node.inputs:
            name = rename.get(t.name, t.name)
            if not name or name in written or name in inputs or name in inits:
                continue
            if isinstance(t, gs.Constant) and np.issubdtype(t.values.dtype, np.integer) \
                    and t.values.size <= SIGNATURE_CONSTANT_MAX:
                inits[name] = onnx.numpy_helper.from_array(np.asarray(t.values), name)
                continue
            dtype = t.values.dtype if isinstance(t, gs.Constant) else t.dtype
            shape = t.values.shape if isinstance(t, gs.Constant) else t.shape
            try:
                elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype)) if dtype is not None else 0
            except (KeyError, TypeError, ValueError):
                elem = 0
            dims = [d if isinstance(d, (int, str)) else None for d in shape] if shape is not None else None
            inputs[name] = onnx.helper.make_tensor_value_info(name, elem, dims)
    outputs = [onnx.helper.make_tensor_value_info(n, 0, None) for n in sorted(written)]
    g = onnx.helper.make_graph(protos, "skeleton", list(inputs.values()), outputs, list(inits.values()))
    imports = [onnx.helper.make_opsetid(d.domain, d.version) for d in graph.import_domains or []
               if d.domain not in _DEFAULT_DOMAINS]
    return onnx.helper.make_model(g, opset_imports=[onnx.helper.make_opsetid("", opset), *imports])


def _signature(node: gs.Node, attr_keys: dict | None = None) -> tuple:
    """What onnx's version converter can see of a node, but its tensor names: nodes of one
    signature convert alike. `attr_keys`: the serialized attributes by their plain values, kept
    across the calls of one graph (thousands of Q/DQ share a few: serializing each took most of it)."""
    ins: list[tuple | None] = []
    for t in node.inputs:
        if not t.name:
            ins.append(None)
        elif isinstance(t, gs.Constant):
            v = t.values
            small = v.dtype.kind in "iu" and v.size <= SIGNATURE_CONSTANT_MAX
            ins.append((_dtype_name(v.dtype), v.shape, v.tobytes() if small else None))
        else:
            ins.append((_dtype_name(t.dtype), None if t.shape is None else tuple(t.shape)))
    plain = _plain_attrs(node.attrs) if attr_keys is not None else None
    attrs = attr_keys.get(plain) if attr_keys is not None and plain is not None else None
    if attrs is None:
        attrs = tuple(a.SerializeToString(deterministic=True) for a in OnnxExporter.export_attributes(node.attrs))
        if attr_keys is not None and plain is not None:
            attr_keys[plain] = attrs
    return (node.op, tuple(ins), len(node.outputs), attrs)


_PLAIN_ATTR_TYPES = (int, str, bytes)     # not float: 0.0 and -0.0 are one key
_DTYPE_NAMES: dict[tuple, str] = {}      # (type of the dtype, dtype) -> str(dtype): numpy's str costs 20 us


def _dtype_name(dtype) -> str:
    """str(dtype), remembered per dtype object (keyed with its type: np.float32 and its np.dtype are
    equal, and name differently)."""
    try:
        key = (type(dtype), dtype)
        name = _DTYPE_NAMES.get(key)
    except TypeError:                     # an unhashable value, named each time
        return str(dtype)
    if name is None:
        name = str(dtype)
        if len(_DTYPE_NAMES) < 1024:
            _DTYPE_NAMES[key] = name
    return name


def _plain_attrs(attrs: dict) -> tuple | None:
    """`attrs` as a hashable key, in their order, each value with its exact type (a bool is not an
    int), where every value is an int, a string or a list of them; else None."""
    key = []
    for k, v in attrs.items():
        if type(v) in _PLAIN_ATTR_TYPES:
            key.append((k, type(v), v))
        elif type(v) is list and all(type(x) in _PLAIN_ATTR_TYPES for x in v):
            key.append((k, list, tuple((type(x), x) for x in v)))
        else:
            return None
    return tuple(key)


def raise_graph_opset(graph: gs.Graph, minimum: int) -> bool:
    """Raise `graph`'s ONNX opset to `minimum` in memory, as onnx's version converter would raise the
    exported model: only the nodes whose operator schema changed between the two opsets are looked
    at, one node per signature (op, attributes, input types, small integer constants) is converted
    in a model of those nodes alone, and where the converter rewrites one (Reduce* axes become an
    input at 18, say) every node of that signature is converted and grafted back in its place.
    No weight is copied or serialized. Returns False, the graph untouched, where the converter fails
    or the graph has an If/Loop/Scan body: the caller then converts the exported model."""
    old = graph.opset
    if old >= minimum:
        return True
    since: dict[str, bool] = {}

    def changes(n: gs.Node) -> bool:
        if (n.domain or "") not in _DEFAULT_DOMAINS:
            return False
        if n.op not in since:
            since[n.op] = _since(n.op, old) != _since(n.op, minimum)
        return since[n.op]

    if any(True for _ in graph.subgraphs()):
        # an If/Loop/Scan body reads outer tensors by name, and after the passes it may hold its own
        # tensor of that name: reading the exported model back links it to the outer one again
        return False
    classes: dict[tuple, list[gs.Node]] = {}
    attr_keys: dict = {}
    for n in graph.nodes:
        if changes(n):
            classes.setdefault(_signature(n, attr_keys), []).append(n)
    reps = []
    for k, members in enumerate(classes.values()):
        node = members[0]
        rename = {t.name: f"i{k}_{j}" for j, t in enumerate(node.inputs) if t.name}
        rename.update({t.name: f"o{k}_{j}" for j, t in enumerate(node.outputs) if t.name})
        reps.append((node, rename))
    try:
        converted = version_converter.convert_version(_skeleton(reps, old, graph), minimum).graph
    except Exception:                                # noqa: BLE001 - the exported model's conversion reports it
        return False
    by_output = {o: n for n in converted.node for o in n.output}
    rewritten = []
    for (node, rename), members in zip(reps, classes.values()):
        before = _node_proto(node, rename)
        after = by_output.get(before.output[0]) if before.output else None
        before.ClearField("name")
        if after is not None:
            after = onnx.NodeProto.FromString(after.SerializeToString())
            after.ClearField("name")
        if after is None or after.SerializeToString(deterministic=True) != before.SerializeToString(deterministic=True):
            rewritten += members
    if len(converted.node) != len(reps) and not rewritten:
        return False
    if rewritten and not _graft(graph, rewritten, old, minimum):
        return False
    _set_opset(graph, minimum)
    if rewritten:
        name_nodes(graph)
    return True


def _set_opset(graph: gs.Graph, opset: int) -> None:
    """New opset entries, not the old ones changed: a copy of the graph (graph.copy()) shares them."""
    for g in (graph, *bodies(graph)):
        g.opset = opset
        if g.import_domains is not None:
            g.import_domains = [onnx.helper.make_opsetid(d.domain, opset if d.domain in _DEFAULT_DOMAINS else d.version)
                                for d in g.import_domains]


def _values(graph: gs.Graph) -> int:
    """How many values onnx's IR makes of `graph` exported: inputs, initializers, node outputs (bodies too)."""
    count = 0
    for g in (graph, *bodies(graph)):
        names = {t.name for t in g.inputs}
        count += len(g.inputs) + sum(1 for name, t in g.tensors().items()
                                     if isinstance(t, gs.Constant) and name not in names and not t.inputs)
        count += sum(len(n.outputs) for n in g.nodes)
    return count


def _pad_values(skeleton: onnx.ModelProto, graph: gs.Graph) -> None:
    """Unused scalar initializers, so that the skeleton holds as many values as the exported graph:
    the converter names the tensors it adds by a counter over them (`_v_<n>`), and the grafted
    nodes then carry the names a conversion of the whole model gives them."""
    g = skeleton.graph
    have = len(g.input) + len(g.initializer) + sum(len(n.output) for n in g.node)
    for k in range(_values(graph) - have):
        g.initializer.append(onnx.helper.make_tensor(f"qdqgraph_pad_{k}", onnx.TensorProto.INT8, [], [0]))


def _graft(graph: gs.Graph, nodes: list[gs.Node], old: int, minimum: int) -> bool:
    """Convert `nodes` (tensor names as they are) and put what the converter made of each in its
    place, in the converter's order (a Constant it adds comes before the node that reads it)."""
    try:
        skeleton = _skeleton([(n, {}) for n in nodes], old, graph)
        _pad_values(skeleton, graph)
        converted = version_converter.convert_version(skeleton, minimum)
        made = gs.import_onnx(onnx.shape_inference.infer_shapes(converted))      # types of the tensors it adds
    except Exception:                                # noqa: BLE001 - the exported model's conversion reports it
        return False
    _materialize(made)
    tensors = graph.tensors()
    own = {t.name for n in nodes for t in (*n.inputs, *n.outputs)}
    if any(name in tensors and name not in own for name in made.tensors()):
        return False                                 # a name the converter made is taken in the graph
    wanted = {o.name: n for n in nodes for o in n.outputs if o.name}
    chunks: dict[int, list[gs.Node]] = {}
    pending: list[gs.Node] = []
    for m in made.nodes:
        pending.append(m)
        owner = next((wanted[o.name] for o in m.outputs if o.name in wanted), None)
        if owner is not None:
            chunks[id(owner)] = pending
            pending = []
    if pending or len(chunks) != len(nodes):
        return False

    def ours(t: gs.Tensor) -> gs.Tensor:
        return tensors.get(t.name, t) if t.name else t

    for n in nodes:
        n.inputs.clear()
        n.outputs.clear()
    result: list[gs.Node] = []
    for n in graph.nodes:
        for m in chunks.get(id(n), [n]):
            if m is n:
                result.append(n)
                continue
            ins, outs = [ours(t) for t in m.inputs], [ours(t) for t in m.outputs]
            m.inputs.clear()
            m.outputs.clear()
            result.append(gs.Node(m.op, name=m.name, attrs=dict(m.attrs), inputs=ins, outputs=outs,
                                  domain=m.domain))
    graph.nodes = result
    return True


def refine_shapes(graph: gs.Graph, model: onnx.ModelProto, light: onnx.ModelProto | None = None) -> list[str]:
    """ONNX shape inference (data propagation on) over `model`, just exported from `graph`, with its
    weights kept out of it (`light`: `light_model(model)`, where the caller has it): where it finds
    a shape the graph's passes left open or symbolic, the tensor of `graph` and the model's
    value_info (or output) take it, as they would have on reading the model back. Returns the names
    of the tensors whose shape changed (`light` then declares the old shapes)."""
    if tensor_bytes(model) >= EXTERNAL_DATA_THRESHOLD:
        return []
    try:
        light = light if light is not None else _weights_as_inputs(model)[0]
        out = onnx.shape_inference.infer_shapes(light, strict_mode=False, data_prop=True)
    except (onnx.shape_inference.InferenceError, ValueError):
        return []
    tensors = tensor_map(graph)
    inputs = {t.name for t in graph.inputs}
    # the types `model` declares, which it took from `graph`: where inference found the same, the
    # tensor's shape is the graph's already (most of them; reading each shape back cost more than
    # the inference)
    declared = {vi.name: vi.type for vi in (*model.graph.value_info, *model.graph.output)}
    changed: dict[str, gs.Variable] = {}
    for vi in (*out.graph.value_info, *out.graph.output):
        same = declared.get(vi.name)
        if same is not None and same == vi.type:
            continue
        t = tensors.get(vi.name)
        if not isinstance(t, gs.Variable) or vi.name in inputs or t.dtype is None:
            continue
        shape = get_onnx_tensor_shape(vi)
        if shape is not None and (t.shape is None or list(t.shape) != list(shape)):
            t.shape = shape
            changed[vi.name] = t
    for field in (model.graph.value_info, model.graph.output):
        for vi in field:
            t = changed.get(vi.name)
            if t is not None:
                vi.CopyFrom(onnx.helper.make_tensor_value_info(vi.name, vi.type.tensor_type.elem_type, t.shape))
    return sorted(changed)


def bound_dims(loaded: Loaded, shapes: dict[str, tuple[int, ...]]) -> dict[str, int]:
    """The value each symbolic dimension of `loaded`'s tensors takes when its graph inputs have
    `shapes` (input name -> a calibration sample's shape): ONNX shape inference, data propagation
    on, over the graph with those inputs fixed, each tensor's declared shape read against the
    inferred one. A symbol that comes out with two values, or none, stays unbound. No inference
    runs where the graph inputs' own symbols are the only ones (a CNN's batch dim)."""
    graph = loaded.graph
    tensors = {name: t for name, t in tensor_map(graph).items() if isinstance(t, gs.Variable) and t.shape is not None}
    if not any(isinstance(d, str) for t in tensors.values() for d in t.shape):
        return {}
    seen: dict[str, set[int]] = {}
    for t in graph.inputs:
        if t.name in shapes and t.shape is not None:
            _bind(seen, list(t.shape), [int(v) for v in shapes[t.name]])
    if not all(d in seen for t in tensors.values() for d in t.shape if isinstance(d, str)):
        for name, shape in _inferred_at(loaded, shapes).items():      # symbols the inputs do not carry
            t = tensors.get(name)
            if t is not None:
                _bind(seen, list(t.shape), shape)
    return {d: next(iter(v)) for d, v in sorted(seen.items()) if len(v) == 1}


def _bind(seen: dict[str, set[int]], declared: list, concrete: list) -> None:
    """Each symbol of `declared` to the value `concrete` (the same tensor's shape) has there."""
    if len(declared) == len(concrete):
        for d, v in zip(declared, concrete):
            if isinstance(d, str) and isinstance(v, int) and v > 0:
                seen.setdefault(d, set()).add(v)


def _inferred_at(loaded: Loaded, shapes: dict[str, tuple[int, ...]]) -> dict[str, list]:
    """Tensor name -> the shape ONNX inference (`infer_shapes`, on the graph exported without its
    weights' data) gives it with the graph inputs at `shapes`; only the declared outputs where
    inference cannot run."""
    model, _ = to_model_and_weights(loaded)
    for i in model.graph.input:
        dims = i.type.tensor_type.shape.dim if i.type.tensor_type.HasField("shape") else []
        if i.name in shapes and len(dims) == len(shapes[i.name]):
            for d, v in zip(dims, shapes[i.name]):
                d.Clear()
                d.dim_value = int(v)
    del model.graph.value_info[:]
    out = infer_shapes(model, inplace=True)
    found = {vi.name: get_onnx_tensor_shape(vi) for vi in (*out.graph.value_info, *out.graph.output)}
    return {name: list(shape) for name, shape in found.items() if shape is not None}


def shapes_at(loaded: Loaded, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple]:
    """Tensor name -> its shape when the graph inputs have `shapes` (input name -> a sample's
    shape): ONNX shape inference over the graph with those inputs fixed (`_inferred_at`, the
    declared shapes set aside; a dimension it cannot fix is a symbol's name), the inputs' own
    among them."""
    found = {name: tuple(s) for name, s in _inferred_at(loaded, shapes).items()}
    found.update({name: tuple(int(d) for d in s) for name, s in shapes.items()})
    return found


def _plain(graph: gs.Graph) -> bool:
    """No functions and no node with a subgraph: the graphs the linear cleanup and sort take."""
    if graph.functions:
        return False
    for n in graph.nodes:
        for v in n.attrs.values():
            if isinstance(v, gs.Graph) or (isinstance(v, list) and v and isinstance(v[0], gs.Graph)):
                return False
    return True


def cleanup(graph: gs.Graph) -> gs.Graph:
    """graphsurgeon's `graph.cleanup(remove_unused_graph_inputs=False)`, the same result, with less
    work per node: the producers of the graph inputs dropped, the nodes nothing in the graph's
    outputs reads (walked back by tensor name over the graph's own tensors, as graphsurgeon does)
    disconnected and removed. graphsurgeon's own runs where a node has a subgraph or the graph has
    functions, and where a tensor's producer is not in the node list (it reports that)."""
    if not _plain(graph):
        return graph.cleanup(remove_unused_graph_inputs=False)
    return _cleanup_plain(graph)


def _cleanup_plain(graph: gs.Graph) -> gs.Graph:
    """`cleanup` of a graph `_plain` holds for."""
    nodes = list(graph.nodes)
    member = {id(n) for n in nodes}
    for inp in graph.inputs:
        inp.inputs.clear()
    local = {t.name for n in nodes for t in n.outputs if t.name}
    local.update(t.name for t in graph.inputs)
    local.update(t.name for n in nodes for t in n.inputs if isinstance(t, gs.Constant))
    local.update(t.name for t in graph.outputs if isinstance(t, gs.Constant))
    seen: set[str] = set()

    def wanted(t: gs.Tensor) -> bool:
        if not t.name:
            return True
        if t.name not in local or t.name in seen:
            return False
        seen.add(t.name)
        return True

    used: set[int] = set()
    queue = [t for t in graph.outputs if wanted(t)]
    k = 0
    while k < len(queue):
        for node in queue[k].inputs:
            if id(node) not in member:
                return graph.cleanup(remove_unused_graph_inputs=False)     # reported there
            used.add(id(node))
            queue.extend(t for t in node.inputs if wanted(t))
        k += 1
    kept = []
    for n in nodes:
        if id(n) in used:
            kept.append(n)
        else:
            n.inputs.clear()
            n.outputs.clear()
    graph.nodes = kept
    return graph


def tidy(graph: gs.Graph) -> gs.Graph:
    """`cleanup`, then `toposort`: what a pass leaves behind it (the graph looked over for subgraphs once).
    A graph already tidy (`_tidy_already`: a pass that changed nothing, the first pass after a load)
    is left as it is after one look over it, half the time of the cleanup's walk and the sort's check."""
    if not _plain(graph):
        return toposort(graph.cleanup(remove_unused_graph_inputs=False))
    for inp in graph.inputs:
        inp.inputs.clear()
    if _tidy_already(graph):
        return graph
    return _toposort_plain(_cleanup_plain(graph))


_tidy = tidy            # to_model's own name for it (its `tidy` argument hides the function)


def _tidy_already(graph: gs.Graph) -> bool:
    """Whether `_cleanup_plain` would remove nothing and `_toposort_plain` keep the order (the graph
    inputs' producers already cleared). That holds where the nodes are sorted by level
    (`_sorted_by_level`, which also rules out a cycle), each node writes a graph output or a tensor
    a later node reads, every tensor's producers are in the node list, and no two distinct tensors
    share a name (then the cleanup's walk back by name reaches what a walk by identity reaches:
    with the order, every node, by induction from the last). Where any of that fails, or is not
    worth proving, False: the cleanup and sort run and decide."""
    nodes = graph.nodes
    member = {id(n) for n in nodes}
    outs = {id(t) for t in graph.outputs}
    named: dict[str, gs.Tensor] = {}
    for t in (*graph.inputs, *graph.outputs):
        if t.name and named.setdefault(t.name, t) is not t:
            return False
        for p in t.inputs:
            if id(p) not in member:
                return False
    level: dict[int, int] = {}
    last = 0
    for n in nodes:
        lv = 0
        for t in n.inputs:
            if t.name and named.setdefault(t.name, t) is not t:
                return False
            for p in t.inputs:
                got = level.get(id(p))
                if got is None:
                    return False            # a producer later in the list, or outside it
                if got >= lv:
                    lv = got + 1
        if lv < last:
            return False
        level[id(n)] = last = lv
        used = False
        for t in n.outputs:
            if t.name and named.setdefault(t.name, t) is not t:
                return False
            if not used and (id(t) in outs or any(id(c) in member for c in t.outputs)):
                used = True
        if not used:
            return False
    return True


def _sorted_by_level(nodes: list[gs.Node], member: set[int]) -> bool:
    """Whether each node's producers come before it and the levels never go down along the list.
    `toposort` leaves such a list as it is: the walk finishes each node as it reaches it (its
    producers are done), and the stable sort by level keeps that order."""
    level: dict[int, int] = {}
    last = 0
    for n in nodes:
        lv = 0
        for t in n.inputs:
            for p in t.inputs:
                if id(p) in member:
                    got = level.get(id(p))
                    if got is None:
                        return False
                    lv = max(lv, got + 1)
        if lv < last:
            return False
        level[id(n)] = last = lv
    return True


def toposort(graph: gs.Graph, recurse_subgraphs: bool = True) -> gs.Graph:
    """graphsurgeon's `graph.toposort()`, the same order, in time linear in the graph: each node's
    level is one more than its producers' highest, and the nodes are sorted by level, stably, in
    the order a depth-first walk from the node list finishes them (as graphsurgeon's recursion does).
    graphsurgeon's own sort, 20-40% of a pass on a 10,000-node graph, runs where a node has a
    subgraph or the graph has functions, and where the walk finds a cycle (it reports it)."""
    if not _plain(graph):
        return graph.toposort(recurse_subgraphs=recurse_subgraphs)
    return _toposort_plain(graph, recurse_subgraphs)


def _toposort_plain(graph: gs.Graph, recurse_subgraphs: bool = True) -> gs.Graph:
    """`toposort` of a graph `_plain` holds for."""
    nodes = list(graph.nodes)
    member = {id(n) for n in nodes}
    if _sorted_by_level(nodes, member):
        return graph                    # what a pass's tidy left and nothing changed since: sorted already

    def producers(node: gs.Node) -> list[gs.Node]:
        found = [p for t in node.inputs for p in t.inputs if id(p) in member]
        if len(found) < 2:
            return found
        return list({id(p): p for p in found}.values())        # each once, where it first appears

    level: dict[int, int] = {}
    finished: list[gs.Node] = []
    for root in nodes:
        if id(root) in level:
            continue
        stack = [(root, producers(root), 0)]
        walking = {id(root)}
        while stack:
            node, ins, k = stack[-1]
            while k < len(ins) and id(ins[k]) in level:
                k += 1
            if k < len(ins):
                nxt = ins[k]
                if id(nxt) in walking:
                    return graph.toposort(recurse_subgraphs=recurse_subgraphs)     # a cycle: reported there
                stack[-1] = (node, ins, k + 1)
                walking.add(id(nxt))
                stack.append((nxt, producers(nxt), 0))
                continue
            stack.pop()
            walking.discard(id(node))
            level[id(node)] = 1 + max((level[id(p)] for p in ins), default=-1)
            finished.append(node)
    graph.nodes = sorted(finished, key=lambda n: level[id(n)])
    return graph
