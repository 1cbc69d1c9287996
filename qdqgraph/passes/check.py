"""Q/DQ invariants that every qdqgraph output must keep, and that `report` lints in any model."""
from __future__ import annotations

import math

import numpy as np
import onnx_graphsurgeon as gs

from ..precisions.formats import ZERO_POINT_TYPES
from ..ops import DEQUANTIZE, QUANTIZE
from ..graph.view import GraphView


def qdq_violations(graph: gs.Graph) -> list[str]:
    """One line per broken invariant (empty when the graph is sound):
    scales constant, finite and > 0; zero points int8, float8e4m3fn or int4, and all 0; per-channel
    scales with an explicit axis whose length matches; blocked scales whose block size divides the
    axis; Q only on float tensors, DQ only of the zero point's type; no quantized bias."""
    view = GraphView(graph)
    out = []
    for n in view.nodes:
        if n.op in (QUANTIZE, DEQUANTIZE):
            out += _node_violations(view, n)
    return out


def _node_violations(view: GraphView, n: gs.Node) -> list[str]:
    """The broken invariants of one Q or DQ; a scale or zero point that cannot be read ends its checks."""
    where = f"{n.op} {n.name}"
    s = view.constant_value(n.inputs[1]) if len(n.inputs) > 1 else None
    if s is None:
        return [f"{where}: scale is not a constant"]
    out = []
    if not _scale_ok(s):
        out.append(f"{where}: scale has a value that is not finite and > 0")
    qtype, found = _zero_point_violations(view, n, where)
    out += found
    if qtype is None:
        return out
    return (out + _axis_violations(view, n, where, s) + _type_violations(view, n, where, qtype)
            + _bias_violations(view, n, where))


def _zero_point_violations(view: GraphView, n: gs.Node, where: str) -> tuple[np.dtype | None, list[str]]:
    """The quantized type a zero point gives (int8 without one; None when it is not a valid constant),
    and its broken invariants: a supported type, all 0."""
    if not (len(n.inputs) > 2 and n.inputs[2].name):
        return np.dtype(np.int8), []
    z = view.constant_value(n.inputs[2])
    if z is None or np.dtype(z.dtype) not in ZERO_POINT_TYPES:
        return None, [f"{where}: zero point is not an int8, float8e4m3fn or int4 constant"]
    if _nonzero(z):
        return np.dtype(z.dtype), [f"{where}: zero point is not 0 (TensorRT is symmetric only)"]
    return np.dtype(z.dtype), []


def _scale_ok(s: np.ndarray) -> bool:
    """Every value finite and > 0; a one-value float32/float16/float64 scale, the common case, read
    as a Python float (numpy's reductions cost 10 us a call, and a large model has thousands)."""
    if s.size == 1 and s.dtype.kind == "f":
        v = float(s.reshape(-1)[0])
        return math.isfinite(v) and v > 0
    return bool(np.all(np.isfinite(s))) and bool(np.all(s > 0))


def _nonzero(z: np.ndarray) -> bool:
    """A value other than 0 in the zero point (one int8 value read as a Python int)."""
    if z.size == 1 and z.dtype.kind in "iu":
        return int(z.reshape(-1)[0]) != 0
    return bool(np.any(z.astype(np.float32) != 0))


def _axis_violations(view: GraphView, n: gs.Node, where: str, s: np.ndarray) -> list[str]:
    """Blocked scales (see _block_violations), or per-channel scales: an explicit axis whose length matches."""
    x = n.inputs[0]
    if "block_size" in n.attrs:
        return _block_violations(where, n, s, view.shape(x))
    if not (s.ndim == 1 and s.size > 1):
        return []
    if "axis" not in n.attrs:
        return [f"{where}: per-channel scale without an explicit axis (TensorRT would use axis 0)"]
    shape = view.shape(x)
    rank = len(shape or ()) or None
    ax = n.attrs["axis"]
    if shape and rank and isinstance(shape[ax % rank], int) and shape[ax % rank] != s.size:
        return [f"{where}: {s.size} scales for axis {ax} of size {shape[ax % rank]}"]
    return []


def _type_violations(view: GraphView, n: gs.Node, where: str, qtype: np.dtype) -> list[str]:
    """Q only on float tensors; DQ only of its zero point's type."""
    x = n.inputs[0]
    if n.op == QUANTIZE and view.dtype(x) is not None and not view.is_float(x):
        return [f"{where}: quantizes a non-float tensor {x.name}"]
    if n.op == DEQUANTIZE and view.dtype(x) is not None and np.dtype(view.dtype(x)) != qtype:
        return [f"{where}: dequantizes {np.dtype(view.dtype(x)).name}, not {qtype.name} "
                f"(its zero point's type)"]
    return []


def _bias_violations(view: GraphView, n: gs.Node, where: str) -> list[str]:
    """A DQ read as the bias (input 2) of a Conv or Gemm."""
    if n.op != DEQUANTIZE:
        return []
    return [f"{where}: quantizes the bias of {c.name} (TensorRT quantizes bias itself)"
            for c, i in view.consumers(n.outputs[0])
            if (view.vocab.is_(c, "conv") or view.vocab.is_(c, "gemm")) and i == 2]


def _block_violations(where: str, n: gs.Node, s: np.ndarray, shape) -> list[str]:
    """Blocked (INT4) scales: the input's rank, and a block size that divides the blocked axis
    (TRT_RULES C3, C5)."""
    block, ax = int(n.attrs["block_size"]), int(n.attrs.get("axis", 1))
    if not shape or s.ndim != len(shape):
        return [f"{where}: blocked scales must have the input's rank"]
    k = shape[ax % len(shape)]
    if isinstance(k, int) and (block <= 0 or k % block):
        return [f"{where}: block size {block} does not divide axis {ax} of size {k}"]
    if isinstance(k, int) and s.shape[ax % len(shape)] != k // block:
        return [f"{where}: {s.shape[ax % len(shape)]} scale blocks for axis {ax} of size {k} in blocks of {block}"]
    return []
