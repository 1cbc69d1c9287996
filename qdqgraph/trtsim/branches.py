"""The simulator sees through If nodes: TensorRT builds both branches of an If whose condition is
known only at run time (a conditional layer), and runs one per inference. The prediction counts the
layers and FLOPs of the branch that will run, inlined into a copy of the graph like a constant If.

Which branch runs is a property of the data, which the simulator does not have. qdqgraph
quantizes a branch from the calibration samples that take it, and leaves float a branch no sample
takes, so the branch holding more quantize nodes is the one the calibration data ran (both are
quantized when the samples took both; then the then-branch counts, as on a tie of two float
branches). A model whose If conditions are constants after cleaning has no If left to choose.
"""
from __future__ import annotations

import onnx_graphsurgeon as gs

from ..ops import Vocabulary, vocabulary
from ..passes.fix_inputs import inline_constant_ifs

MAX_ROUNDS = 8          # nesting depth of Ifs inlined (a branch may hold Ifs of its own)


def _quantize_nodes(graph: gs.Graph, vocab: Vocabulary) -> int:
    return sum(1 for g in (graph, *graph.subgraphs(recursive=True)) for n in g.nodes if vocab.is_(n, "quantize"))


def runs_then(node: gs.Node, vocab: Vocabulary | None = None) -> bool:
    """Whether the simulator follows the then-branch of If `node` (module docstring)."""
    vocab = vocab or vocabulary()
    return _quantize_nodes(node.attrs["then_branch"], vocab) >= _quantize_nodes(node.attrs["else_branch"], vocab)


def through_branches(graph: gs.Graph) -> gs.Graph:
    """`graph` itself when no If is left in it; else a copy with every If replaced by the branch
    that runs (`runs_then`), nested ones included. The caller's graph is not modified."""
    vocab = vocabulary()
    conditional = vocab.ops_of("conditional")
    if not any(n.op in conditional for n in graph.nodes):
        return graph
    copy = graph.copy()
    for _ in range(MAX_ROUNDS):
        if not inline_constant_ifs(copy, choose=lambda n: runs_then(n, vocab)).changed:
            break
    return copy
