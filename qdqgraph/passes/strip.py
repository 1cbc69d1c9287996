"""Remove Q/DQ: the inverse of insert_qdq, for checking and for comparing against float."""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from ..ops import DEQUANTIZE, QUANTIZE
from ..view import GraphView


def _dequantize(view, dq) -> np.ndarray | None:
    q = view.constant_value(dq.inputs[0])
    s = view.constant_value(dq.inputs[1])
    z = view.constant_value(dq.inputs[2]) if len(dq.inputs) > 2 and dq.inputs[2].name else np.zeros_like(s)
    if q is None or s is None:
        return None
    axis = dq.attrs.get("axis", 1)
    if s.ndim == 1 and s.size > 1:
        shape = [-1 if d == (axis % q.ndim) else 1 for d in range(q.ndim)]
        s, z = s.reshape(shape), z.reshape(shape)
    return ((q.astype(np.float32) - z.astype(np.float32)) * s).astype(s.dtype)


def strip_qdq(graph: gs.Graph) -> int:
    """Bypass every Q->DQ pair and turn every constant->DQ into a float constant. Returns the number
    of DequantizeLinear nodes removed. Modifies `graph`."""
    view = GraphView(graph)
    removed = 0
    for dq in [n for n in view.nodes if n.op == DEQUANTIZE]:
        src = dq.inputs[0]
        p = view.producer(src)
        if p is not None and p.op == QUANTIZE:
            replacement = p.inputs[0]
        else:
            value = _dequantize(view, dq)
            if value is None:
                continue
            replacement = gs.Constant(dq.outputs[0].name.removesuffix("_dequantized"), value)
        out = dq.outputs[0]
        for c, i in view.consumers(out):
            c.inputs[i] = replacement
        for k, o in enumerate(graph.outputs):
            if o is out:
                graph.outputs[k] = replacement
        dq.outputs.clear()
        removed += 1
    graph.cleanup(remove_unused_graph_inputs=False).toposort()
    return removed
