"""The onnx library's vocabulary for the rest of qdqgraph: the model type, element-type codes,
operator schemas, the checker's and shape inference's errors, and the few protobuf builders the
passes need. With io.py (files), export.py (graph to ModelProto) and example.py (the built-in
model), the only modules that import onnx (tests/test_architecture.py holds that).
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import GraphProto, ModelProto, TensorProto

__all__ = ["GraphProto", "ModelProto", "TensorProto", "attribute_value", "copy_model", "copy_node", "CHECK_ERRORS", "FLOAT", "INT32", "is_model", "tensor_dtype", "dtype_name",
           "op_schema", "max_inputs", "op_types", "value_info", "tensor", "load_bare", "save_bare",
           "infer_shapes_lenient", "empty_shape"]

FLOAT = TensorProto.FLOAT
INT32 = TensorProto.INT32
# what the checker raises for a model it rejects (shape inference's error included: full checks run it)
CHECK_ERRORS = (onnx.checker.ValidationError, onnx.shape_inference.InferenceError)


def is_model(value: object) -> bool:
    return isinstance(value, ModelProto)


def tensor_dtype(dtype) -> int:
    """The ONNX element-type code of a numpy dtype (ml_dtypes' included); a code stays itself."""
    if isinstance(dtype, (int, np.integer)):
        return int(dtype)
    return int(onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype)))


def dtype_name(code: int) -> str:
    """FLOAT16, INT8, ... for an element-type code."""
    return str(TensorProto.DataType.Name(code))


def op_schema(op: str, opset: int | None = None, domain: str = ""):
    """The schema of `op` at `opset` (the newest without one), or None where onnx knows none."""
    try:
        if opset is None:
            return onnx.defs.get_schema(op, domain=domain)
        return onnx.defs.get_schema(op, opset, domain)
    except onnx.defs.SchemaError:
        return None


def max_inputs(op: str) -> int | None:
    schema = op_schema(op)
    return None if schema is None else int(schema.max_input)


def op_types() -> frozenset[str]:
    """Every operator name onnx has a schema for, in any opset."""
    return frozenset(s.name for s in onnx.defs.get_all_schemas_with_history())


def value_info(name: str, dtype, shape=None) -> onnx.ValueInfoProto:
    return onnx.helper.make_tensor_value_info(name, tensor_dtype(dtype), shape)


def attribute_value(attribute: onnx.AttributeProto):
    return onnx.helper.get_attribute_value(attribute)


def copy_node(node: onnx.NodeProto) -> onnx.NodeProto:
    c = onnx.NodeProto()
    c.CopyFrom(node)
    return c


def copy_model(model: ModelProto) -> ModelProto:
    c = ModelProto()
    c.CopyFrom(model)
    return c


def tensor(array: np.ndarray, name: str) -> TensorProto:
    return onnx.numpy_helper.from_array(array, name)


def to_array(t: TensorProto) -> np.ndarray:
    return onnx.numpy_helper.to_array(t)


def is_external(t: TensorProto) -> bool:
    """Whether `t`'s data lies outside the proto (a file, or an array held apart)."""
    return t.data_location == TensorProto.EXTERNAL


def load_bare(path: str) -> ModelProto:
    """A model file without its external data (the graph and the references only)."""
    return onnx.load(path, load_external_data=False)


def save_bare(model: ModelProto, path: str) -> None:
    onnx.save(model, path)


def empty_shape() -> onnx.TensorShapeProto:
    return onnx.TensorShapeProto()


def infer_shapes_lenient(model: ModelProto) -> ModelProto:
    return onnx.shape_inference.infer_shapes(model, strict_mode=False)
