"""Remove Q/DQ: the inverse of insert_qdq, for checking and for comparing against float."""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from ..graph import proto, io
from .. import api_checks
from ..ops import CAST, DEQUANTIZE, QUANTIZE
from ..graph.view import GraphView
from .base import PassResult, result
from .bias_add import fold_bias_adds
from .registry import NO_QDQ, declare


SHAPES_ONLY_MIN_ELEMENTS = 1024   # with values=False, weights this large keep their shape, not their values


def _dequantize(view, dq, values: bool = True) -> np.ndarray | None:
    q = view.constant_value(dq.inputs[0])
    s = view.constant_value(dq.inputs[1])
    z = view.constant_value(dq.inputs[2]) if len(dq.inputs) > 2 and dq.inputs[2].name else np.zeros_like(s)
    if q is None or s is None:
        return None
    if not values and q.size >= SHAPES_ONLY_MIN_ELEMENTS:     # zeros of its shape and type, in no memory
        return np.broadcast_to(np.zeros((), np.asarray(s).dtype), q.shape)
    axis = dq.attrs.get("axis", 1)
    if "block_size" in dq.attrs:                    # blocked (INT4): each scale covers block_size elements
        block = int(dq.attrs["block_size"])
        s = np.repeat(s, block, axis=axis % q.ndim)
        z = np.repeat(z, block, axis=axis % q.ndim) if z.shape else z
    elif s.ndim == 1 and s.size > 1:
        shape = [-1 if d == (axis % q.ndim) else 1 for d in range(q.ndim)]
        s, z = s.reshape(shape), z.reshape(shape)
    return np.asarray((np.asarray(q, np.float32) - np.asarray(z, np.float32)) * s, dtype=np.asarray(s).dtype)


def _dq_dtype(view, dq):
    """The type a DQ outputs: its scale's (the float islands give FP16 scales to FP16 parts)."""
    scale = view.constant_value(dq.inputs[1])
    return scale.dtype if scale is not None else view.dtype(dq.outputs[0])


def _onnx_type(dtype) -> int | None:
    """The ONNX element type of a graphsurgeon dtype (a numpy dtype, or an ONNX enum for the
    types numpy lacks, such as bfloat16)."""
    if dtype is None:
        return None
    if isinstance(dtype, (int, np.integer)):
        return int(dtype)
    return proto.tensor_dtype(dtype)


def _as_type(graph: gs.Graph, view, t: gs.Tensor, dtype, casts: dict) -> gs.Tensor:
    """`t`, or one shared Cast of it to `dtype` where its type differs (a float32 model input that
    fed a Q whose DQ was FP16: without a Cast the FP16 consumer would read float32)."""
    want, have = _onnx_type(dtype), _onnx_type(view.dtype(t))
    if want is None or have is None or want == have:
        return t
    key = (t.name, want)
    if key not in casts:
        short = proto.dtype_name(want).lower()
        out = gs.Variable(f"{t.name}_as_{short}", dtype=dtype, shape=t.shape)
        graph.nodes.append(gs.Node(CAST, name=f"{t.name}_cast_{short}", inputs=[t], outputs=[out],
                                   attrs={"to": want}))
        casts[key] = out
    return casts[key]


def replace_uses(graph: gs.Graph, view: GraphView, old: gs.Tensor, new: gs.Tensor) -> None:
    """Every reader of `old` (its consumers, and the graph's outputs) reads `new` instead."""
    for c, i in view.consumers(old):
        c.inputs[i] = new
    for k, o in enumerate(graph.outputs):
        if o is old:
            graph.outputs[k] = new


@declare("strip_qdq", ensures=(NO_QDQ,), fixpoint=True, graph_only=True)
def strip_qdq(graph: gs.Graph, values: bool = True) -> PassResult:
    """Bypass every Q->DQ pair and turn every constant->DQ into a float constant. Details: `removed`
    (how many DequantizeLinear nodes went), `casts`. Modifies `graph`. In a model with FP16 islands the result
    keeps their types: where a Q's input and its DQ's output differ in type, a Cast takes the DQ's
    place. `values=False`: the large float constants are read-only zeros of their shape that take
    no memory (for the simulator, which reads shapes: dequantizing a 453 MB encoder's weights to
    predict its FP16 engine set the run's peak)."""
    api_checks.graph(graph, "strip_qdq")
    removed, casts, biases = _strip_graph(graph, values)
    return result("strip_qdq", removed > 0, removed=removed, casts=casts, biases=biases)


def _strip_graph(graph: gs.Graph, values: bool = True) -> tuple[int, int, int]:
    """strip_qdq on `graph` and on the bodies of its If nodes (quantized on their own samples):
    DequantizeLinear nodes removed, Casts added, biases folded back."""
    view = GraphView(graph)
    removed = 0
    casts: dict = {}
    for dq in [n for n in view.nodes if n.op == DEQUANTIZE]:
        src = dq.inputs[0]
        p = view.producer(src)
        if p is not None and p.op == QUANTIZE:
            replacement = _as_type(graph, view, p.inputs[0], _dq_dtype(view, dq), casts)
        else:
            value = _dequantize(view, dq, values)
            if value is None:
                continue
            replacement = gs.Constant(dq.outputs[0].name.removesuffix("_dequantized"), value)
        replace_uses(graph, view, dq.outputs[0], replacement)
        dq.outputs.clear()
        removed += 1
    io.tidy(graph)
    biases = fold_bias_adds(graph) if removed else 0     # insert wrote a quantized conv's bias as an Add
    added = len(casts)
    for node in graph.nodes:
        for body in (v for v in node.attrs.values() if isinstance(v, gs.Graph)):
            r, c, b = _strip_graph(body, values)
            removed, added, biases = removed + r, added + c, biases + b
    return removed, added, biases
