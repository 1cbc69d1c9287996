"""io.tidy's look before it works: a graph already clean and sorted is left as it is, and every
graph that is not (a dead node, an order to fix, a name two tensors share, a cycle) still goes
through the cleanup and the sort, which leave what graphsurgeon's leave."""
from __future__ import annotations

import random

import numpy as np
import onnx_graphsurgeon as gs
import pytest

import motifs
from qdqgraph.graph import io

NAMES = ["residual_add", "attention_block", "se_block", "fpn_upsample", "concat_of_pools", "layernorm_decomposed"]


def _layout(graph: gs.Graph) -> tuple:
    nodes = [(n.name, [t.name for t in n.inputs], [t.name for t in n.outputs]) for n in graph.nodes]
    return nodes, [t.name for t in graph.inputs], [t.name for t in graph.outputs]


def _theirs(graph: gs.Graph) -> gs.Graph:
    return graph.copy().cleanup(remove_unused_graph_inputs=False).toposort()


@pytest.mark.parametrize("name", NAMES)
def test_a_tidy_graph_is_seen_as_tidy_and_kept(name):
    graph = io.load(motifs.ALL[name]()).graph
    io.tidy(graph)
    assert io._tidy_already(graph)
    nodes = list(graph.nodes)
    io.tidy(graph)
    assert [id(n) for n in graph.nodes] == [id(n) for n in nodes]
    assert _layout(graph) == _layout(_theirs(graph))


@pytest.mark.parametrize("name", NAMES)
def test_a_shuffled_graph_is_not_tidy_and_is_sorted_as_graphsurgeon_sorts(name):
    graph = io.load(motifs.ALL[name]()).graph
    io.tidy(graph)
    for seed in range(3):
        random.Random(seed).shuffle(graph.nodes)
        if [n.name for n in graph.nodes] == [n.name for n in _theirs(graph).nodes]:
            continue                               # the shuffle happened to give the sorted order
        assert not io._tidy_already(graph)
        want = _layout(_theirs(graph))
        io.tidy(graph)
        assert _layout(graph) == want


@pytest.mark.parametrize("name", NAMES)
def test_a_dead_node_at_the_end_is_not_tidy_and_is_removed(name):
    graph = io.load(motifs.ALL[name]()).graph
    io.tidy(graph)
    dead = gs.Node("Relu", "dead_relu", inputs=[graph.inputs[0]], outputs=[gs.Variable("dead_out", dtype=np.float32)])
    graph.nodes.append(dead)
    assert not io._tidy_already(graph)
    want = _layout(_theirs(graph))
    io.tidy(graph)
    assert _layout(graph) == want and "dead_relu" not in [n.name for n in graph.nodes]


def test_a_dead_chain_whose_head_is_read_is_not_tidy():
    """Every node but the last of a dead chain has a reader: the chain still goes."""
    graph = io.load(motifs.ALL["residual_add"]()).graph
    io.tidy(graph)
    a, b = gs.Variable("dead_a", dtype=np.float32), gs.Variable("dead_b", dtype=np.float32)
    graph.nodes += [gs.Node("Relu", "dead_1", inputs=[graph.inputs[0]], outputs=[a]),
                    gs.Node("Relu", "dead_2", inputs=[a], outputs=[b])]
    assert not io._tidy_already(graph)
    io.tidy(graph)
    assert not {"dead_1", "dead_2"} & {n.name for n in graph.nodes}


def _twins() -> gs.Graph:
    x = gs.Variable("x", dtype=np.float32, shape=[1])
    a, twin, y = gs.Variable("a", dtype=np.float32), gs.Variable("a", dtype=np.float32), gs.Variable("y", dtype=np.float32)
    return gs.Graph(nodes=[gs.Node("Relu", "r1", inputs=[x], outputs=[a]), gs.Node("Relu", "r2", inputs=[x], outputs=[twin]),
                           gs.Node("Add", "add", inputs=[a, twin], outputs=[y])], inputs=[x], outputs=[y])


def test_two_tensors_sharing_a_name_are_left_to_the_cleanup():
    """The cleanup walks back by name: where two tensors share one, it keeps what graphsurgeon's
    keeps (one producer of the name), not every node a walk by identity would reach."""
    graph, theirs = _twins(), _twins()                 # a copy would merge the two tensors
    assert not io._tidy_already(graph)
    theirs.cleanup(remove_unused_graph_inputs=False).toposort()
    io.tidy(graph)
    assert _layout(graph) == _layout(theirs)


def test_a_producer_outside_the_node_list_is_left_to_the_cleanup():
    x, a, y = (gs.Variable(n, dtype=np.float32) for n in ("x", "a", "y"))
    gs.Node("Relu", "gone", inputs=[x], outputs=[a])           # writes `a`, but is not in the graph
    graph = gs.Graph(nodes=[gs.Node("Relu", "r", inputs=[a], outputs=[y])], inputs=[x], outputs=[y])
    assert not io._tidy_already(graph)


def test_a_cycle_is_not_tidy():
    a, b = gs.Variable("a", dtype=np.float32), gs.Variable("b", dtype=np.float32)
    graph = gs.Graph(nodes=[gs.Node("Relu", "r1", inputs=[a], outputs=[b]), gs.Node("Relu", "r2", inputs=[b], outputs=[a])],
                     inputs=[], outputs=[b])
    assert not io._tidy_already(graph)


def test_bodies_are_graphsurgeons_subgraphs_in_its_order():
    from qdqgraph.graph.view import bodies
    from qdqgraph.testing.branches import vad_if_model
    graph = io.load(vad_if_model(opset=15)).graph
    theirs = list(graph.subgraphs(recursive=True))
    assert theirs and [id(g) for g in bodies(graph)] == [id(g) for g in theirs]
    plain = io.load(motifs.ALL["residual_add"]()).graph
    assert bodies(plain) == [] == list(plain.subgraphs(recursive=True))


def test_a_model_holding_quantization_is_refused_by_op_type():
    from qdqgraph.errors import QdqError
    from qdqgraph.prepare import refuse_quantized
    loaded = io.load(motifs.ALL["residual_add"]())
    refuse_quantized(loaded)                           # a float model passes
    x = loaded.graph.inputs[0]
    scale, zp = gs.Constant("s", np.array(0.1, np.float32)), gs.Constant("z", np.array(0, np.int8))
    q = gs.Variable("xq", dtype=np.int8)
    loaded.graph.nodes.append(gs.Node("QuantizeLinear", "q", inputs=[x, scale, zp], outputs=[q]))
    with pytest.raises(QdqError, match="QuantizeLinear"):
        refuse_quantized(loaded)
