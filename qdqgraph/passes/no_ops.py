"""Remove ops that compute nothing at inference: Identity, and Dropout outside training mode.

Exporters leave them behind (Paddle's exporter writes an Identity after many biased convolutions).
TensorRT drops them when it builds the engine, but placement sees the graph as exported: an
Identity between a Conv and its activation would hide the Conv -> Relu pair that the placement
rules look for, and a Q/DQ placed on either side of it would stop the fusion. Removing them first
lets placement see the graph that TensorRT will fuse.

Kept: a no-op whose output is a graph output (its name is part of the model's interface), or is
read inside a subgraph (the reference is by name), and a Dropout whose mask is used or whose
training_mode is not a constant false.
"""
from __future__ import annotations

import onnx_graphsurgeon as gs

from ..ops import inference_no_op
from ..graph import io
from ..graph.view import GraphView
from .base import PassResult, result
from .registry import Condition, declare, describe


def _removable(view: GraphView, n: gs.Node) -> bool:
    if not view.vocab.is_(n, "no_op") or not n.inputs or not n.outputs:
        return False
    out = n.outputs[0]
    if view.is_graph_output(out) or view.used_in_subgraph(out):
        return False
    mask_used = len(n.outputs) > 1 and bool(n.outputs[1].name) and (
        bool(view.consumers(n.outputs[1])) or view.is_graph_output(n.outputs[1]))
    training = None
    if len(n.inputs) > 2 and n.inputs[2].name:
        v = view.constant_value(n.inputs[2])
        training = ... if v is None else v
    return inference_no_op(view.vocab.is_(n, "dropout"), training, mask_used)


@declare("remove_no_ops", ensures=(Condition("no removable Identity or Dropout left", lambda g, r: [
    n.name for n in g.nodes if _removable(GraphView(g), n)]),), fixpoint=True, graph_only=True)
def remove_no_ops(graph: gs.Graph) -> PassResult:
    """Rewire every consumer of a removable no-op to the no-op's input. Modifies `graph`; details:
    `removed` (node names)."""
    removed: list[str] = []
    view = GraphView(graph, lazy=True)      # asks consumers, graph outputs and constants only
    for n in list(view.nodes):
        if not _removable(view, n):
            continue
        src, out = n.inputs[0], n.outputs[0]
        for consumer, i in view.consumers(out):
            consumer.inputs[i] = src
        n.inputs.clear()
        n.outputs.clear()
        removed.append(n.name or n.op)
    if removed:
        io.cleanup(graph)
    return result("remove_no_ops", bool(removed), removed=removed)


def _removed(results) -> int:
    return sum(r.count("removed") for r in results)


describe("remove_no_ops", 30, phrase=lambda rs, ctx: (f"{_removed(rs)} Identity/Dropout removed" if _removed(rs) else "", []),
         fields={"no_ops_removed": _removed})
