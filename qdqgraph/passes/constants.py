"""Fold constant subgraphs, so that weights written as Constant nodes (Paddle) or as
Transpose/Reshape of constants (TensorFlow) become plain constants that placement can quantize."""
from __future__ import annotations

import onnx_graphsurgeon as gs

from ..ops import CONSTANT
from .base import PassResult, result

# Do not fold a subgraph whose result exceeds this (an Expand or Tile can blow up a model).
FOLD_SIZE_LIMIT = 512 << 20


def fold_constants(graph: gs.Graph) -> PassResult:
    """Evaluate constant subgraphs (through onnxruntime, via onnx-graphsurgeon) and replace them by
    their values; Constant nodes become initializers. Modifies `graph`; details: `folded` (how many
    nodes went), `constant_nodes_left`."""
    before = len(graph.nodes)
    graph.toposort()
    log = gs.logger.G_LOGGER
    severity = log.severity
    try:  # graphsurgeon logs each op it cannot evaluate; what stays unfolded is reported instead
        log.severity = log.ERROR
        # flatten_subgraphs=False: inlining If branches broke the outputs of If nodes (silero-vad)
        graph.fold_constants(fold_shapes=True, recurse_subgraphs=True, flatten_subgraphs=False,
                             size_threshold=FOLD_SIZE_LIMIT)
    finally:
        log.severity = severity
    graph.cleanup(remove_unused_graph_inputs=False).toposort()
    left = [n.name for n in graph.nodes if n.op == CONSTANT]
    folded = before - len(graph.nodes)
    return result("fold_constants", folded > 0, folded=folded, constant_nodes_left=left)
