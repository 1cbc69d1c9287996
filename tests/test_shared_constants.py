"""Equal small constants merged in the session copy of a large written model
(qdqgraph.execution.shared_constants): fewer initializers for onnxruntime to open, the same outputs."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import motifs
import qdqgraph
from qdqgraph.execution import runtime
from qdqgraph.execution.shared_constants import share_equal_constants


def _written():
    m = motifs.residual_add(c=16)
    return qdqgraph.quantize(m, motifs.sample_data(m)).model, m


def test_the_written_models_repeated_zero_points_become_one_and_compute_the_same():
    model, float_model = _written()
    merged = onnx.ModelProto()
    merged.CopyFrom(model)
    zeros = [t.name for t in model.graph.initializer if t.dims == [] and not numpy_helper.to_array(t).any()
             and t.data_type == TensorProto.INT8]
    assert len(zeros) > 2                          # each Q and DQ its own zero point
    dropped = share_equal_constants(merged)
    assert dropped >= len(zeros) - 1
    assert len(merged.graph.initializer) == len(model.graph.initializer) - dropped
    left = [t.name for t in merged.graph.initializer if t.name in zeros]
    assert len(left) == 1
    names = {t.name for t in merged.graph.initializer}
    assert all(i in names or any(i in n.output for n in merged.graph.node) or i in {v.name for v in merged.graph.input}
               for n in merged.graph.node for i in n.input if i)
    onnx.checker.check_model(merged)
    a = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    b = ort.InferenceSession(merged.SerializeToString(), providers=["CPUExecutionProvider"])
    data = motifs.sample_data(float_model, n=3)
    for i in range(3):
        feed = {k: v[i] for k, v in data.items()}
        for x, y in zip(a.run(None, feed), b.run(None, feed)):
            assert np.array_equal(x, y)


def _consts_model(values, graph_input=None):
    """y = x + c0 + c1 + ...; each c an initializer of its own."""
    inits, nodes, prev = [], [], "x"
    for k, v in enumerate(values):
        inits.append(numpy_helper.from_array(v, f"c{k}"))
        nodes.append(helper.make_node("Add", [prev, f"c{k}"], [f"s{k}"]))
        prev = f"s{k}"
    nodes.append(helper.make_node("Identity", [prev], ["y"]))
    ins = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])]
    if graph_input is not None:
        ins.append(helper.make_tensor_value_info(graph_input, TensorProto.FLOAT, [2]))
    g = helper.make_graph(nodes, "g", ins, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_only_equal_type_shape_and_bytes_merge_and_inputs_stay():
    f = np.float32
    m = _consts_model([np.array([1, 2], f), np.array([1, 2], f), np.array([2, 1], f), np.array([1, 2], f),
                       np.array([1, 2], f)], graph_input="c4")
    assert share_equal_constants(m) == 2           # c1 and c3 read c0; c2 differs; c4 is an input
    assert [t.name for t in m.graph.initializer] == ["c0", "c2", "c4"]
    assert [n.input[1] for n in m.graph.node[:5]] == ["c0", "c0", "c2", "c0", "c4"]
    x = np.array([0.5, -1], f)
    got = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    one, two = np.array([1, 2], f), np.array([2, 1], f)
    assert np.array_equal(got, x + one + one + two + one + one)


def test_a_large_constant_or_a_graph_with_bodies_is_left():
    big = np.zeros(64, np.float32)                 # 256 bytes: a weight, not compared
    m = _consts_model([big, big.copy()])
    assert share_equal_constants(m) == 0
    body = helper.make_graph([helper.make_node("Identity", ["c0"], ["o"])], "body", [],
                             [helper.make_tensor_value_info("o", TensorProto.FLOAT, [2])])
    m = _consts_model([np.ones(2, np.float32), np.ones(2, np.float32)])
    m.graph.node.append(helper.make_node("If", ["cond"], ["z"], then_branch=body, else_branch=body))
    assert share_equal_constants(m) == 0


def test_the_widened_session_of_a_large_graph_merges_them(monkeypatch):
    """runtime.session on a graph it counts as large (the written model widened to float32, no
    graph optimizations) opens the merged copy, and computes what the model as written does."""
    model, float_model = _written()
    seen = []
    real = runtime.share_equal_constants
    monkeypatch.setattr(runtime, "share_equal_constants", lambda m: seen.append(real(m)) or seen[-1])
    monkeypatch.setattr(runtime, "LARGE_GRAPH_NODES", 0)
    sess = runtime.session(model, purpose="comparison", widen=True)
    assert seen and seen[0] > 0
    monkeypatch.setattr(runtime, "share_equal_constants", lambda m: 0)
    plain = runtime.session(model, purpose="comparison", widen=True)
    data = motifs.sample_data(float_model, n=3)
    for i in range(3):
        feed = {k: v[i] for k, v in data.items()}
        for x, y in zip(sess.run(None, feed), plain.run(None, feed)):
            assert np.array_equal(x, y)
