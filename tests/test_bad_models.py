"""Strange models: custom-domain ops, checker failures, control flow, dynamic shapes."""
import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import motifs
import qdqgraph
from qdqgraph.graph import io
from qdqgraph.cli import main
from qdqgraph.errors import QdqError
from qdqgraph.passes.check import qdq_violations


def custom_op_model():
    g = motifs.G("custom")
    x = g.input("x", ["n", 16, 8, 8])
    y = g.conv(x, 16, 16, "conv")
    g.nodes.append(helper.make_node("MyOp", [y], ["z"], name="custom", domain="com.example"))
    g.node("Conv", ["z", g.weight("w2", (16, 16, 1, 1))], ["y"], name="conv2", kernel_shape=[1, 1])
    g.outputs.append(helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 16, 8, 8]))
    m = helper.make_model(helper.make_graph(g.nodes, "c", g.inputs, g.outputs, g.inits),
                          opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)])
    m.ir_version = 8
    return m


def test_custom_op_without_library_names_the_op_and_the_fix(tmp_path, capsys):
    p = tmp_path / "c.onnx"
    onnx.save(custom_op_model(), p)
    np.savez(tmp_path / "d.npz", x=np.ones((2, 1, 16, 8, 8), np.float32))
    assert main(["insert", str(p), "--calib", str(tmp_path / "d.npz")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "com.example::MyOp" in err[0] and "--custom-op-library" in err[0]
    assert sorted(x.name for x in tmp_path.iterdir()) == ["c.onnx", "d.npz"]


def test_custom_op_passed_through_with_a_cache(tmp_path):
    m = custom_op_model()
    cache = tmp_path / "c.json"
    cache.write_text(json.dumps({"format": "qdqgraph-calib", "version": 1, "tool_version": "x", "method": "max",
                                 "samples": 1, "tensors": {"x": {"amax": 1.0, "scale": 1 / 127},
                                                           "z": {"amax": 2.0, "scale": 2 / 127}}}))
    r = qdqgraph.quantize(m, calib_cache=cache)
    g = io.load(r.model).graph
    assert [n for n in g.nodes if n.op == "MyOp"][0].domain == "com.example"
    assert r.plan.decisions["conv"].quantized and r.plan.decisions["conv2"].quantized
    assert any("custom op com.example::MyOp" in w for w in r.report.warnings)
    assert qdq_violations(g) == []


def test_model_failing_the_checker(tmp_path, capsys):
    m = motifs.conv_relu()
    m.graph.node[0].input[1] = "does_not_exist"
    p = tmp_path / "bad.onnx"
    onnx.save(m, p)
    assert main(["insert", str(p), "--calib", "random"]) == 2
    err = capsys.readouterr().err
    assert "fails the ONNX checker" in err and err.count("\n") == 1


def test_if_subgraph_left_intact_and_outer_graph_quantized():
    g = motifs.G("with_if")
    x = g.input("x", ["n", 16, 8, 8])
    flag = g.input("flag", [], TensorProto.BOOL)
    c = g.node("Relu", [g.conv(x, 16, 16, "conv")], name="relu")
    then_g = helper.make_graph([helper.make_node("Sigmoid", [c], ["t_out"], name="t_sig")], "then", [],
                              [helper.make_tensor_value_info("t_out", TensorProto.FLOAT, ["n", 16, 8, 8])])
    else_g = helper.make_graph([helper.make_node("Tanh", [c], ["e_out"], name="e_tanh")], "else", [],
                              [helper.make_tensor_value_info("e_out", TensorProto.FLOAT, ["n", 16, 8, 8])])
    g.nodes.append(helper.make_node("If", [flag], ["branch"], name="if", then_branch=then_g, else_branch=else_g))
    g.node("Conv", ["branch", g.weight("w2", (16, 16, 1, 1))], ["y"], name="conv2", kernel_shape=[1, 1])
    g.outputs.append(helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 16, 8, 8]))
    m = helper.make_model(helper.make_graph(g.nodes, "if", g.inputs, g.outputs, g.inits),
                          opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    data = {"x": np.random.default_rng(0).standard_normal((4, 2, 16, 8, 8)).astype(np.float32),
            "flag": np.array([True, False, True, False])}
    r = qdqgraph.quantize(m, data)
    import onnxruntime as ort
    sess = ort.InferenceSession(r.model.SerializeToString())
    ref = ort.InferenceSession(m.SerializeToString())
    for f in (True, False):
        feed = {"x": data["x"][0], "flag": np.array(f)}
        a, b = sess.run(None, feed)[0], ref.run(None, feed)[0]
        assert np.corrcoef(a.ravel(), b.ravel())[0, 1] > 0.99
    body_ops = {n.op_type for n in r.model.graph.node if n.op_type == "If" for a in n.attribute for n in a.g.node}
    assert body_ops <= {"Sigmoid", "Tanh"}
    assert r.plan.decisions["conv"].quantized and r.plan.decisions["conv2"].quantized


def test_dynamic_spatial_dims_with_samples_of_different_shapes(tmp_path):
    g = motifs.G("dyn")
    x = g.input("x", ["n", 16, "h", "w"])
    g.node("Relu", [g.conv(x, 16, 16, "conv")], ["y"], name="relu")
    g.output("y")
    m = g.model()
    rng = np.random.default_rng(0)
    folder = tmp_path / "calib"
    folder.mkdir()
    for k, (h, w) in enumerate([(8, 8), (12, 6), (5, 9)]):
        np.savez(folder / f"{k}.npz", x=rng.standard_normal((2, 1, 16, h, w)).astype(np.float32))
    r = qdqgraph.quantize(m, folder)
    assert r.report.samples == 6
    dims = r.model.graph.input[0].type.tensor_type.shape.dim
    assert [d.dim_param for d in dims] == ["n", "", "h", "w"]


@pytest.mark.parametrize("batch_size", [1, 2])    # at 2, the first-sample run that starts the ranges
def test_non_finite_activation_is_a_clear_error(batch_size):
    g = motifs.G("nan")
    x = g.input("x", ["n", 16, 8, 8])
    lg = g.node("Log", [x], name="log")     # log of negative inputs = NaN
    g.node("Conv", [lg, g.weight("w", (16, 16, 1, 1))], ["y"], name="conv", kernel_shape=[1, 1])
    g.output("y")
    m = g.model()
    with pytest.raises(QdqError, match="NaN or Inf on calibration sample 0"):
        qdqgraph.quantize(m, {"x": -np.ones((2, 1, 16, 8, 8), np.float32)}, batch_size=batch_size)
