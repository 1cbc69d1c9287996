"""Scoring a written model: FP16 computed as float32 on large graphs (io.widen_fp16,
runtime.LARGE_GRAPH_NODES), and a model's inputs and outputs read without its weights (io.interface)."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qdqgraph.errors import QdqError
from qdqgraph.execution import runtime
from qdqgraph.graph import io, wire

C = np.linspace(-3, 3, 2048, dtype=np.float32).reshape(2, 1024) / 7      # 4 KB as FP16: read apart


def _island(fp16_input: bool = False) -> onnx.ModelProto:
    """x -> Cast(fp16) -> Add(fp16 weight) -> Mul(fp16 Constant) -> If(body: Relu in fp16) -> Cast(fp32)
    -> y, and a ConstantOfShape with an FP16 value added in."""
    in_type = TensorProto.FLOAT16 if fp16_input else TensorProto.FLOAT
    nodes = [
        helper.make_node("Cast", ["x"], ["xh"], to=TensorProto.FLOAT16),
        helper.make_node("Add", ["xh", "c"], ["a"]),
        helper.make_node("Constant", [], ["k"], value=numpy_helper.from_array(np.array(1.7, np.float16), "k")),
        helper.make_node("Mul", ["a", "k"], ["m"]),
        helper.make_node("Constant", [], ["shape"], value=numpy_helper.from_array(np.array([2, 1024], np.int64), "shape")),
        helper.make_node("ConstantOfShape", ["shape"], ["half"],
                         value=numpy_helper.from_array(np.array([0.5], np.float16), "v")),
        helper.make_node("Add", ["m", "half"], ["s"]),
        helper.make_node("Constant", [], ["cond"], value=numpy_helper.from_array(np.array(True), "cond")),
        helper.make_node("If", ["cond"], ["r"],
                         then_branch=helper.make_graph([helper.make_node("Relu", ["s"], ["t"])], "then", [],
                                                       [helper.make_tensor_value_info("t", TensorProto.FLOAT16, None)]),
                         else_branch=helper.make_graph([helper.make_node("Neg", ["s"], ["e"])], "else", [],
                                                       [helper.make_tensor_value_info("e", TensorProto.FLOAT16, None)])),
        helper.make_node("Cast", ["r"], ["y"], to=TensorProto.FLOAT),
    ]
    g = helper.make_graph(nodes, "island", [helper.make_tensor_value_info("x", in_type, [2, 1024])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 1024])],
                          [numpy_helper.from_array(C.astype(np.float16), "c")],
                          value_info=[helper.make_tensor_value_info(n, TensorProto.FLOAT16, [2, 1024])
                                      for n in ("xh", "a", "m", "s", "r")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _types(model: onnx.ModelProto) -> set[int]:
    found = set()
    for g in [model.graph, *io.subgraphs(model.graph)]:
        found |= {v.type.tensor_type.elem_type for v in [*g.input, *g.output, *g.value_info]}
        found |= {t.data_type for t in g.initializer}
        for n in g.node:
            found |= {a.t.data_type for a in n.attribute if a.type == onnx.AttributeProto.TENSOR}
            found |= {a.i for a in n.attribute if a.name == "to"}
    return found


def test_widened_model_holds_no_fp16_and_computes_the_same_values_in_float32():
    m = _island()
    light, weights = io.split_weights(m)
    assert set(weights) == {"c"}
    widened = io.widen_fp16(light, weights)
    assert TensorProto.FLOAT16 not in _types(light) and widened["c"].dtype == np.float32
    assert weights["c"].dtype == np.float16                      # the caller's arrays are not changed
    onnx.checker.check_model(io.fill_weights(light, widened), full_check=True)
    x = np.random.default_rng(0).standard_normal((2, 1024)).astype(np.float32)
    got = runtime.session(light, weights=widened).run(["y"], {"x": x})[0]
    c, k = C.astype(np.float16).astype(np.float32), np.float32(np.float16(1.7))
    np.testing.assert_array_equal(got, np.maximum((x + c) * k + np.float32(0.5), 0))   # float32 arithmetic
    own = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(["y"], {"x": x})[0]
    np.testing.assert_allclose(own, got, rtol=2e-3, atol=2e-3)                        # FP16 inputs rounded


def test_sessions_widen_only_large_graphs_and_leave_the_model_as_it_is(monkeypatch):
    m = _island()
    out_type = lambda s: s.get_outputs()[0].type                                    # noqa: E731
    m.graph.output[0].type.tensor_type.elem_type = TensorProto.FLOAT16                # an FP16 output shows it
    m.graph.node[-1].attribute[0].i = TensorProto.FLOAT16
    before = m.SerializeToString()
    assert len(m.graph.node) < runtime.LARGE_GRAPH_NODES
    assert out_type(runtime.session(m, widen=True)) == "tensor(float16)"
    level = lambda s: s.get_session_options().graph_optimization_level                  # noqa: E731
    assert level(runtime.session(m, widen=True)) == ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    monkeypatch.setattr(runtime, "LARGE_GRAPH_NODES", 1)
    widened = runtime.session(m, widen=True)
    assert out_type(widened) == "tensor(float)"
    assert level(widened) == ort.GraphOptimizationLevel.ORT_DISABLE_ALL         # the Q/DQ as written
    assert out_type(runtime.session(m)) == "tensor(float16)"
    assert m.SerializeToString() == before
    light, weights = io.split_weights(m)                     # weights apart (the graph_session way)
    assert out_type(runtime.session(light, weights=weights, widen=True)) == "tensor(float)"
    assert light.graph.initializer[0].data_type == TensorProto.FLOAT16


def test_a_model_fed_fp16_is_not_widened(monkeypatch):
    m = _island(fp16_input=True)
    m.graph.node[0].attribute[0].i = TensorProto.FLOAT16
    monkeypatch.setattr(runtime, "LARGE_GRAPH_NODES", 1)
    assert io.has_fp16_inputs(m)
    s = runtime.session(m, widen=True)
    assert s.get_inputs()[0].type == "tensor(float16)"
    assert s.run(["y"], {"x": np.zeros((2, 1024), np.float16)})[0].shape == (2, 1024)


def test_interface_reads_inputs_and_outputs_without_the_weights(tmp_path):
    m = _island()
    m.graph.input.append(helper.make_tensor_value_info("c", TensorProto.FLOAT16, [2, 1024]))   # an old export's way
    path = tmp_path / "m.onnx"
    onnx.save(m, path)
    full = io.load(str(path)).graph
    for face in (io.interface(path), io.interface(m)):
        assert [(t.name, t.dtype, tuple(t.shape)) for t in face.inputs] == \
            [(t.name, t.dtype, tuple(t.shape)) for t in full.inputs if t.name != "c"] == [("x", np.float32, (2, 1024))]
        assert [t.name for t in face.outputs] == ["y"] and not face.nodes
    split = wire.read_split(path, skip=True)
    assert split.model == wire.read_split(path).model and split.raw[0].size == 0
    path.write_bytes(path.read_bytes()[:-5000])                                    # cut inside the weight
    with pytest.raises(QdqError, match="ONNX"):
        io.interface(path)
