"""The float islands' opset raise in memory (io.raise_graph_opset, io.refine_shapes) writes the
same model, byte for byte, as converting the exported model and reading it back did."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

import motifs
import qdqgraph
from qdqgraph.graph import io
from qdqgraph.testing.branches import vad_if_calib, vad_if_model


def _reduce_attr_model(opset: int = 13) -> onnx.ModelProto:
    """A layer norm written out as ops at an opset where ReduceMean takes its axes as an attribute
    (an input from opset 18: the converter rewrites those nodes), with a Reshape whose shape the
    cleaning folds to a constant (inference at the new opset then knows what the load did not)."""
    g = motifs.G("reduce_attr")
    x = g.input("x", ["b", 8, 32])
    h = g.node("MatMul", [x, g.weight("w1", (32, 32))], name="fc1")
    mean = g.node("ReduceMean", [h], name="ln_mean", axes=[-1])
    d = g.node("Sub", [h, mean], name="ln_sub")
    var = g.node("ReduceMean", [g.node("Mul", [d, d], name="ln_sq")], name="ln_var", axes=[-1])
    sd = g.node("Sqrt", [g.node("Add", [var, g.const("eps", np.array(1e-5, np.float32))], name="ln_eps")],
                name="ln_sqrt")
    n = g.node("Div", [d, sd], name="ln_div")
    s = g.node("Shape", [n], name="shape")
    r = g.node("Reshape", [n, s], name="reshape")
    m = g.node("MatMul", [r, g.weight("w2", (32, 32))], name="fc2")
    g.node("Relu", [m], ["y"], name="relu")
    g.output("y", shape=["b", 8, 32])
    return g.model(opset=opset)


def _quantize_both(model: onnx.ModelProto, data, monkeypatch) -> tuple[bytes, bytes, dict]:
    got = qdqgraph.quantize(model, data)
    with monkeypatch.context() as m:
        m.setattr(io, "raise_graph_opset", lambda graph, minimum: False)
        old = qdqgraph.quantize(model, data)
    return got.model.SerializeToString(), old.model.SerializeToString(), got.report.profile.to_dict()


CASES = {
    "conv_relu_opset13": lambda: motifs.conv_relu(opset=13),
    "conv_bn_relu": motifs.conv_bn_relu,
    "residual_add": motifs.residual_add,
    "attention_block": motifs.attention_block,
    "layernorm_decomposed": motifs.layernorm_decomposed,
    "integer_path": motifs.integer_path,
    "fpn_upsample": motifs.fpn_upsample,
    "reduce_attr_opset13": lambda: _reduce_attr_model(13),
    "reduce_attr_opset17": lambda: _reduce_attr_model(17),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_in_memory_islands_write_what_the_exported_way_wrote(name, monkeypatch):
    m = CASES[name]()
    data = motifs.sample_data(m)
    new, old, profile = _quantize_both(m, data, monkeypatch)
    assert new == old
    assert "float islands/import" not in profile        # the graph was not read back


def test_a_graph_with_if_bodies_takes_the_exported_way(monkeypatch):
    m = vad_if_model(opset=15)
    calls = []
    real = io.raise_opset
    monkeypatch.setattr(io, "raise_opset", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = qdqgraph.quantize(m, vad_if_calib(8))
    onnx.checker.check_model(got.model, full_check=True)
    assert calls, "a graph with If bodies must go through the exported model"


def test_raise_graph_opset_rewrites_reduce_axes_and_keeps_weights():
    loaded = io.load(_reduce_attr_model(13))
    weights = {n: t.values for n, t in loaded.graph.tensors().items() if hasattr(t, "values")}
    assert io.raise_graph_opset(loaded.graph, 19)
    model = io.to_model(loaded)
    assert io.opset_of(model) == 19
    onnx.checker.check_model(model, full_check=True)
    reduces = [n for n in model.graph.node if n.op_type == "ReduceMean"]
    assert reduces and all(len(n.input) == 2 and "axes" not in [a.name for a in n.attribute] for n in reduces)
    after = loaded.graph.tensors()
    assert all(after[n].values is v for n, v in weights.items() if n in after)      # not copied


@pytest.mark.parametrize("name", ["residual_add", "attention_block", "layernorm_decomposed", "fpn_upsample",
                                  "se_block", "concat_of_pools"])
def test_toposort_orders_as_graphsurgeon_does(name):
    import random
    graph = io.load(motifs.ALL[name]()).graph
    for seed in range(4):
        random.Random(seed).shuffle(graph.nodes)
        theirs, ours = graph.copy(), graph.copy()
        theirs.toposort()
        io.toposort(ours)
        assert [n.name for n in ours.nodes] == [n.name for n in theirs.nodes]
        theirs.toposort()                  # a sorted list: both leave it as it is
        io.toposort(ours)
        assert [n.name for n in ours.nodes] == [n.name for n in theirs.nodes]


def _wiring(graph) -> tuple:
    """The node names in order, each node's tensor names, and each tensor's producers and readers."""
    nodes = [(n.name, [t.name for t in n.inputs], [t.name for t in n.outputs]) for n in graph.nodes]
    tensors = sorted((name, [p.name for p in t.inputs], sorted(c.name for c in t.outputs))
                     for name, t in graph.tensors().items())
    return nodes, tensors, [t.name for t in graph.inputs], [t.name for t in graph.outputs]


@pytest.mark.parametrize("name", ["residual_add", "attention_block", "se_block"])
def test_cleanup_removes_what_graphsurgeon_removes(name):
    """A graph output dropped (its branch dies), a node whose output nothing reads, a producer
    written onto a graph input: io.cleanup leaves the graph graphsurgeon's cleanup leaves."""
    import onnx_graphsurgeon as gs
    graph = io.load(motifs.ALL[name]()).graph
    first = graph.inputs[0]
    dead_out = gs.Variable("dead_out", dtype=np.float32)
    graph.nodes.append(gs.Node("Relu", "dead_relu", inputs=[first], outputs=[dead_out]))
    graph.nodes.append(gs.Node("Identity", "into_input", inputs=[dead_out], outputs=[first]))
    graph.outputs = graph.outputs + [gs.Variable("kept_later", dtype=np.float32)]
    theirs, ours = graph.copy(), graph.copy()
    theirs.cleanup(remove_unused_graph_inputs=False)
    io.cleanup(ours)
    assert _wiring(ours) == _wiring(theirs)
    assert "dead_relu" not in [n.name for n in ours.nodes]
    last = ours.outputs[0]
    ours.outputs = [t for t in ours.outputs if t is not last]
    theirs.outputs = [t for t in theirs.outputs if t.name != last.name]
    n_before = len(ours.nodes)
    theirs.cleanup(remove_unused_graph_inputs=False).toposort()
    io.tidy(ours)
    assert _wiring(ours) == _wiring(theirs) and len(ours.nodes) <= n_before


def test_tensor_map_is_graphsurgeons_map():
    import onnx_graphsurgeon as gs
    from qdqgraph.graph.view import tensor_map
    graph = io.load(motifs.ALL["attention_block"]()).graph
    assert list(tensor_map(graph).items()) == list(graph.tensors().items())
    a, b, twin = gs.Variable("a", dtype=np.float32), gs.Variable("b", dtype=np.float32), gs.Variable("a")
    clash = gs.Graph(nodes=[gs.Node("Relu", "r", inputs=[a], outputs=[b]), gs.Node("Relu", "s", inputs=[twin], outputs=[])],
                     inputs=[a], outputs=[b])
    got = tensor_map(clash)                    # two tensors named "a": graphsurgeon's map, the last one kept
    assert got["a"] is twin and list(got) == list(clash.tensors())


def test_toposort_leaves_a_cycle_to_graphsurgeon_which_reports_it():
    import onnx_graphsurgeon as gs
    a, b = gs.Variable("a", dtype=np.float32), gs.Variable("b", dtype=np.float32)
    graph = gs.Graph(nodes=[gs.Node("Relu", "r1", inputs=[a], outputs=[b]), gs.Node("Relu", "r2", inputs=[b], outputs=[a])],
                     inputs=[], outputs=[b])
    with pytest.raises(Exception, match="[Cc]ycle"):
        io.toposort(graph)


def test_raising_a_copy_leaves_the_original_at_its_opset():
    """The fallback's trial deploys a copy of the graph: the copy's raise must not reach the original."""
    loaded = io.load(_reduce_attr_model(13))
    copy = loaded.graph.copy()
    assert io.raise_graph_opset(copy, 19)
    model = io.to_model(loaded)
    assert io.opset_of(model) == 13
    onnx.checker.check_model(model, full_check=True)



def test_refine_shapes_takes_what_inference_adds_and_leaves_what_it_confirms():
    """The shapes inference finds beyond the exported ones (a tensor without one, a symbolic
    dimension it resolves) go into the graph and the model; those it finds as declared change nothing."""
    import onnx_graphsurgeon as gs
    x = gs.Variable("x", dtype=np.float32, shape=[1, 4])
    y = gs.Variable("y", dtype=np.float32, shape=["n", 4])
    z = gs.Variable("z", dtype=np.float32)
    w = gs.Variable("w", dtype=np.float32, shape=[1, 4])
    graph = gs.Graph(nodes=[gs.Node("Relu", "r1", inputs=[x], outputs=[y]), gs.Node("Relu", "r2", inputs=[y], outputs=[z]),
                            gs.Node("Relu", "r3", inputs=[z], outputs=[w])],
                     inputs=[x], outputs=[w], opset=17)
    model = io.to_model(io.Loaded(graph=graph))
    assert io.refine_shapes(graph, model) == ["y", "z"]
    assert list(y.shape) == [1, 4] and list(z.shape) == [1, 4] and list(w.shape) == [1, 4]
    declared = {vi.name: [d.dim_value for d in vi.type.tensor_type.shape.dim] for vi in model.graph.value_info}
    assert declared == {"y": [1, 4], "z": [1, 4]}
    assert io.refine_shapes(graph, io.to_model(io.Loaded(graph=graph))) == []
