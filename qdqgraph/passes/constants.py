"""Fold constant subgraphs, so that weights written as Constant nodes (Paddle) or as
Transpose/Reshape of constants (TensorFlow) become plain constants that placement can quantize."""
from __future__ import annotations

from dataclasses import dataclass, field

import onnx_graphsurgeon as gs

from ..ops import CONSTANT

# Do not fold a subgraph whose result exceeds this (an Expand or Tile can blow up a model).
FOLD_SIZE_LIMIT = 512 << 20


@dataclass
class FoldResult:
    nodes_before: int
    nodes_after: int
    constant_nodes_left: list[str] = field(default_factory=list)

    @property
    def folded(self) -> int:
        return self.nodes_before - self.nodes_after


def fold_constants(graph: gs.Graph) -> FoldResult:
    """Evaluate constant subgraphs (through onnxruntime, via onnx-graphsurgeon) and replace them by
    their values; Constant nodes become initializers. Modifies `graph`; returns what changed."""
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
    return FoldResult(before, len(graph.nodes), left)
