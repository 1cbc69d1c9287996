"""onnxruntime's default session computes what TensorRT does on qdqgraph's output: a quantized conv's
bias is written as an Add (onnxruntime's WeightBiasQuantization would turn it into an INT32 bias whose
FP16 scale loses it), and a weight scale FP16 cannot hold is handled by requantizing the weight."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import motifs
import qdqgraph


def small_scale_conv():
    """x -> Conv(w, b) -> Relu -> Conv: the first conv's weights and input are small, so the product of
    their scales underflows in FP16 (as on BN-folded layers of real models)."""
    rng = np.random.default_rng(0)
    w1 = (rng.standard_normal((16, 8, 3, 3)) * 1e-3).astype(np.float32)
    b1 = (rng.standard_normal(16) * 1e-2 + 0.5).astype(np.float32)
    w2 = rng.standard_normal((8, 16, 1, 1)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2"], ["y"], name="conv2")]
    g = helper.make_graph(nodes, "small", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8, 8, 8])],
                          [numpy_helper.from_array(a, n) for a, n in ((w1, "w1"), (b1, "b1"), (w2, "w2"))])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def sqnr(a, b):
    noise = float(((a.astype(np.float64) - b) ** 2).sum())
    return float("inf") if noise == 0 else 10 * np.log10(float((a.astype(np.float64) ** 2).sum()) / noise)


def both_sessions(model, x):
    default = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return default.run(None, {"x": x})[0], qdqgraph.session(model).run(None, {"x": x})[0]


def test_the_default_session_computes_what_the_deployment_session_does(monkeypatch):
    m = small_scale_conv()
    rng = np.random.default_rng(1)
    data = {"x": (rng.standard_normal((16, 8, 8, 8)) * 1e-2).astype(np.float32)}
    out = qdqgraph.quantize(m, data).model
    assert not any(n.op_type == "Conv" and len(n.input) == 3 and n.input[2] for n in out.graph.node)
    assert any(n.op_type == "Add" and n.name == "conv1_bias" for n in out.graph.node)
    default, kept = both_sessions(out, data["x"][:4])
    assert sqnr(kept, default) >= 40
    # the model as written before: the bias on the conv, where onnxruntime's rewrite takes it
    from qdqgraph import writing
    from qdqgraph.passes.base import result
    monkeypatch.setattr(writing, "bias_to_add", lambda g: result("bias_to_add", False, moved=[]))
    old = qdqgraph.quantize(m, data).model
    default, kept = both_sessions(old, data["x"][:4])
    assert sqnr(kept, default) < 20


def test_bias_as_add_changes_no_number_and_no_prediction():
    m = motifs.residual_add()
    data = motifs.sample_data(m)
    r = qdqgraph.quantize(m, data)
    moved = next(p for p in r.report.passes if p.name == "bias_to_add")
    assert moved.count("moved") >= 1
    s = qdqgraph.trtsim.simulate(r.model)
    assert s.summary["reformats_inside"] == 0 and s.summary["int8_flops_share"] == 1.0


def test_a_weight_scale_fp16_cannot_hold_requantizes_the_weight_instead_of_growing_it():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((16, 16, 3, 3)).astype(np.float32)
    w[3] *= 1e-7                                     # a channel of weights near 1e-7: scale ~1e-9 < FP16's least
    g = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
                           helper.make_node("Relu", ["c"], ["y"], name="relu")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 16, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 16, 8, 8])],
                          [numpy_helper.from_array(w, "w")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    x = rng.standard_normal((8, 16, 8, 8)).astype(np.float32)
    r = qdqgraph.quantize(m, {"x": x})
    islands = next(p for p in r.report.passes if p.name == "float_islands")
    assert len(islands["rescaled_weights"]) == 1
    float_out = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x[:2]})[0]
    q_out = qdqgraph.session(r.model).run(None, {"x": x[:2]})[0]
    # the tiny channel stays tiny: before, its scale was clamped up to 6e-5 and its outputs grew ~1e5 times
    assert float(np.abs(q_out[:, 3]).max()) < 1e-3
    assert sqnr(float_out, q_out) > 30


def test_the_speed_lines_stripped_copy_names_no_tensor_twice(tmp_path, capfd):
    """insert strips a copy of its output for the FP16 estimate; folding the bias Adds back must not
    give two tensors one name (graphsurgeon then prints a warning block per conv)."""
    from qdqgraph.cli import main
    m = motifs.residual_add()
    onnx.save(m, tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", **motifs.sample_data(m))
    assert main(["insert", str(tmp_path / "m.onnx"), "--calib", str(tmp_path / "d.npz"), "-o",
                 str(tmp_path / "o.onnx")]) == 0
    out, err = capfd.readouterr()
    assert "share the same name" not in out + err and "speed:" in out


def test_a_session_its_fusions_break_is_made_again_with_the_qdq_as_written(monkeypatch):
    """A Q/DQ file onnxruntime fails to open at its higher optimization levels (another tool's
    output under the exact INT8 setting: "Attempt to replace the existing tensor") is opened at the
    basic level, which computes the Q/DQ as written; where that fails too, the first failure is
    what the user reads (a failure of another kind is not retried: tests/test_ort_versions.py)."""
    from qdqgraph.errors import QdqError
    from qdqgraph.execution import runtime
    m = small_scale_conv()
    real = ort.InferenceSession
    levels = []

    def fussy(source, opts, **kw):
        levels.append(opts.graph_optimization_level)
        if opts.graph_optimization_level != ort.GraphOptimizationLevel.ORT_ENABLE_BASIC:
            raise RuntimeError("Attempt to replace the existing tensor")
        return real(source, opts, **kw)
    monkeypatch.setattr(runtime.ort, "InferenceSession", fussy)
    sess = runtime.session(m)
    assert levels == [ort.GraphOptimizationLevel.ORT_ENABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_BASIC]
    x = np.ones((1, 8, 8, 8), np.float32)
    assert sess.run(None, {"x": x})[0].shape == (1, 8, 8, 8)

    def broken(source, opts, **kw):
        levels.append(opts.graph_optimization_level)
        raise RuntimeError("Attempt to replace the existing tensor (first)"
                           if opts.graph_optimization_level != ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
                           else "second failure")
    monkeypatch.setattr(runtime.ort, "InferenceSession", broken)
    levels.clear()
    with pytest.raises(QdqError, match=r"existing tensor \(first\)"):
        runtime.session(m)
    assert len(levels) == 2


def test_a_model_onnxruntime_cannot_open_gets_a_hint_for_what_it_was_opened_for():
    """--calib-cache stands in for the calibration run only: `compare` or the accuracy check of a
    model onnxruntime refuses does not send the user to it."""
    from qdqgraph.errors import QdqError
    from qdqgraph.execution import runtime
    g = helper.make_graph([helper.make_node("NoSuchOp", ["x"], ["y"], name="n")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(QdqError) as comparing:
        runtime.session(m, purpose="comparison")
    assert "for comparison" in str(comparing.value) and "--calib-cache" not in str(comparing.value)
    with pytest.raises(QdqError) as calibrating:
        runtime.session(m, purpose="calibration")
    assert "--calib-cache" in str(calibrating.value)
