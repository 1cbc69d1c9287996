"""Render a graph as text, one node a line, for golden tests and for users reading a diff."""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from ..ops import DEQUANTIZE, QUANTIZE


def _tensor(t) -> str:
    if isinstance(t, gs.Constant):
        v = t.values
        return f"{t.name}:{v.dtype}{list(v.shape)}"
    return t.name


def render(graph: gs.Graph, attrs: tuple[str, ...] = ("axis",)) -> str:
    """`Op(in, ...) -> out, ...` per node in topological order; constants as name:dtype[shape]."""
    graph.toposort()
    lines = []
    for n in graph.nodes:
        ins = ", ".join(_tensor(t) if t.name else "" for t in n.inputs)
        outs = ", ".join(t.name for t in n.outputs)
        extra = "".join(f" {k}={n.attrs[k]}" for k in attrs if k in n.attrs)
        lines.append(f"{n.op}({ins}) -> {outs}{extra}")
    return "\n".join(lines)


def scales(graph: gs.Graph) -> dict[str, np.ndarray]:
    """Scale value of every Q/DQ node by node name."""
    return {n.name: n.inputs[1].values for n in graph.nodes
            if n.op in (QUANTIZE, DEQUANTIZE) and isinstance(n.inputs[1], gs.Constant)}
