"""The fused graph as ONNX: one node per predicted layer in the custom domain `qdqgraph.trtsim`
(op type = layer kind), with the fused ONNX nodes, precisions and rule as attributes. Netron opens
it; onnx.checker accepts it (custom-domain nodes are not schema-checked). It is a picture of the
engine, not a model that runs: weights are left out."""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

DOMAIN = "qdqgraph.trtsim"
_DTYPES = {"int8": np.int8, "fp16": np.float16, "fp32": np.float32}


def _op_type(kind: str) -> str:
    return "".join(part.capitalize() for part in kind.split("_")) or "Layer"


def to_onnx(report):
    """A ModelProto of the predicted engine (graphsurgeon builds it; no protobuf edits here)."""
    tensors: dict[str, gs.Variable] = {}

    def var(name, precision=None, dtype=None, shape=None):
        if name not in tensors:
            shape = shape if shape is not None else report.shapes.get(name)
            tensors[name] = gs.Variable(name, dtype=dtype if dtype is not None else _DTYPES.get(precision, np.float32),
                                        shape=list(shape) if shape is not None else [])
        return tensors[name]

    inputs = [var(n, dtype=d, shape=s) for n, d, s in report.graph_inputs]
    for n, d, s in report.graph_outputs:
        var(n, dtype=d, shape=s)
    produced = set()
    nodes = []
    for i, x in enumerate(report.layers):
        ins = [var(p.tensor, p.precision) for p in x.inputs]
        outs = [var(p.tensor, p.precision) for p in x.outputs if p.tensor not in produced]
        produced.update(p.tensor for p in x.outputs)
        attrs = {"nodes": x.nodes or [""], "ops": x.ops or [""], "rule": x.rule,
                 "precision_in": [p.precision for p in x.inputs] or [""],
                 "precision_out": [p.precision for p in x.outputs] or [""],
                 "reformat": int(x.reformat), "flops": float(x.flops)}
        if x.reformat and x.why:
            attrs["why"] = [f"{r}: {w}" for r, w in x.why]
        nodes.append(gs.Node(_op_type(x.kind), name=f"L{i}:{x.name}"[:200], domain=DOMAIN,
                             inputs=ins, outputs=outs, attrs=attrs))
    for e in report.eliminated:            # a Concat buffer: no layer, but its tensors stay connected
        if "outputs" in e:
            nodes.append(gs.Node("Buffer", name=f"buffer:{'+'.join(e['nodes'])}"[:200], domain=DOMAIN,
                                 inputs=[var(t, "int8") for t in e["inputs"]],
                                 outputs=[var(t, "int8") for t in e["outputs"]],
                                 attrs={"nodes": e["nodes"], "rule": e["rule"], "layer": 0}))
    outputs = [var(n, dtype=d, shape=s) for n, d, s in report.graph_outputs if n in tensors]
    graph = gs.Graph(nodes=nodes, inputs=inputs, outputs=outputs, name="trtsim", opset=13)
    graph.toposort()
    return gs.export_onnx(graph, do_type_check=False)
