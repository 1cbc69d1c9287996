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
