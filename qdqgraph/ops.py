"""The op vocabulary: op classes read from rules/op_classes.toml.

This is the one place where ONNX op-type strings are compared. Other modules ask
`vocab.is_(node, "conv")` or refer to the ONNX op types that qdqgraph itself creates through the
constants below.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .rulebook.files import bundled, read_toml

# Op types qdqgraph writes.
QUANTIZE = "QuantizeLinear"
DEQUANTIZE = "DequantizeLinear"
CAST = "Cast"
CONSTANT = "Constant"
IDENTITY = "Identity"
IF = "If"
MUL = "Mul"
MATMUL = "MatMul"
ADD = "Add"
SLICE = "Slice"
ABS = "Abs"
REDUCE_MAX = "ReduceMax"
REDUCE_SUM = "ReduceSum"
EINSUM = "Einsum"
CLIP = "Clip"


def attr_str(attrs: dict, name: str, default: str) -> str:
    v = attrs.get(name, default)
    return v.decode() if isinstance(v, bytes) else str(v)


def nearest_resize(attrs: dict) -> bool:
    """Does a node of class `resize` copy input values (mode nearest, the ONNX default)?"""
    return attr_str(attrs, "mode", "nearest") == "nearest"


def inference_no_op(is_dropout: bool, training_mode, mask_used: bool) -> bool:
    """Is a node of the `no_op` op class an identity at inference? `training_mode` is the value of
    Dropout's third input (None when absent, ... when not a constant)."""
    if not is_dropout:
        return True
    if mask_used:
        return False
    return training_mode is None or (training_mode is not ... and not bool(training_mode))


@dataclass(frozen=True)
class OpClass:
    name: str
    ops: frozenset[str]
    doc: str
    ref: str


class Vocabulary:
    """Op classes by name; `is_(node_or_op, cls)` is the only op-type comparison in qdqgraph."""

    def __init__(self, classes: dict[str, OpClass]):
        self.classes = classes
        self._ops = {name: c.ops for name, c in classes.items()}   # is_ runs millions of times a run

    def is_(self, node_or_op, cls: str) -> bool:
        try:
            ops = self._ops[cls]
        except KeyError:
            raise KeyError(f"unknown op class {cls!r}; classes are in rules/op_classes.toml") from None
        if node_or_op.__class__ is str:         # the common cases first: a plain op name, then a node
            return node_or_op in ops
        return (node_or_op if isinstance(node_or_op, str) else node_or_op.op) in ops

    def known(self, cls: str) -> bool:
        return cls in self.classes

    def ops_of(self, cls: str) -> frozenset[str]:
        return self.classes[cls].ops


def parse_vocabulary(data: dict, source: str) -> Vocabulary:
    if data.get("schema") != 1:
        raise ValueError(f"{source}: expected `schema = 1`")
    classes = {}
    for name, body in data.get("class", {}).items():
        missing = [k for k in ("ops", "doc", "ref") if k not in body]
        if missing:
            raise ValueError(f"{source}: op class {name!r} lacks {', '.join(missing)}")
        classes[name] = OpClass(name, frozenset(body["ops"]), body["doc"], body["ref"])
    return Vocabulary(classes)


@lru_cache(maxsize=1)
def vocabulary() -> Vocabulary:
    path = bundled("op_classes.toml")
    return parse_vocabulary(read_toml(path), str(path))
