"""Loading and saving: external data, large models (threshold lowered), atomic writes."""
import numpy as np
import onnx
import pytest

import motifs
import qdqgraph
from qdqgraph.graph import io, proto
from qdqgraph.errors import QdqError


def test_large_model_saved_with_external_data(tmp_path, monkeypatch):
    monkeypatch.setattr(io, "EXTERNAL_DATA_THRESHOLD", 1000)  # stands in for 2 GB
    m = motifs.residual_add()
    result = qdqgraph.quantize(m, motifs.sample_data(m))
    written = io.save(result.model, tmp_path / "big.onnx")
    assert [p.name for p in written] == ["big.onnx", "big.onnx.data"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.onnx", "big.onnx.data"]
    loaded = onnx.load(tmp_path / "big.onnx")
    onnx.checker.check_model(str(tmp_path / "big.onnx"), full_check=True)
    import onnxruntime as ort
    sess = ort.InferenceSession(str(tmp_path / "big.onnx"))
    x = motifs.sample_data(m)["x"][0]
    ref = ort.InferenceSession(result.model.SerializeToString()).run(None, {"x": x})[0]
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], ref)
    assert any(t.data_location == onnx.TensorProto.EXTERNAL for t in onnx.load(tmp_path / "big.onnx", load_external_data=False).graph.initializer)
    del loaded


def test_model_with_external_data_is_read_and_quantized(tmp_path, monkeypatch):
    m = motifs.residual_add()
    src = tmp_path / "ext.onnx"
    onnx.save(m, src, save_as_external_data=True, location="ext.weights", size_threshold=0)
    result = qdqgraph.quantize(src, motifs.sample_data(m))
    assert sum(n.op_type == "DequantizeLinear" for n in result.model.graph.node) == 8
    monkeypatch.setattr(io, "EXTERNAL_DATA_THRESHOLD", 1000)
    out = io.save(result.model, tmp_path / "ext.qdq.onnx", protect=(src, tmp_path / "ext.weights"))
    assert (tmp_path / "ext.weights").exists() and out[1].name == "ext.qdq.onnx.data"


def test_save_never_overwrites_input(tmp_path):
    m = motifs.conv_relu()
    p = tmp_path / "m.onnx"
    onnx.save(m, p)
    before = p.read_bytes()
    with pytest.raises(QdqError, match="refusing to overwrite the input"):
        io.save(m, p, protect=(p,))
    assert p.read_bytes() == before


def test_failed_save_leaves_no_temp(tmp_path, monkeypatch):
    m = motifs.conv_relu()

    def broken(model, f):
        f.write(b"partial")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(io.wire, "write_model", broken)
    with pytest.raises(QdqError, match="no space left"):
        io.save(m, tmp_path / "o.onnx")
    assert list(tmp_path.iterdir()) == []


def test_dynamic_dims_kept_symbolic(tmp_path):
    m = motifs.attention()
    out = qdqgraph.quantize(m, motifs.sample_data(m)).model
    dims = out.graph.input[0].type.tensor_type.shape.dim
    assert dims[0].dim_param == "b" and dims[1].dim_value == 8


@pytest.mark.parametrize("inplace", [False, True])
def test_shape_inference_without_weights_matches_onnx(monkeypatch, inplace):
    """infer_shapes keeps the weights out of onnx's shape inference: the value_info must equal plain
    onnx inference (data propagation through a Shape->Reshape chain included), and the model must
    come back with every initializer, input and output as it was; in place, the caller's model is
    the result, and otherwise it is left untouched."""
    from onnx import TensorProto, helper
    rng = np.random.default_rng(0)
    w = onnx.numpy_helper.from_array(rng.standard_normal((8, 3, 3, 3)).astype(np.float32), "w")    # 864 B
    big = onnx.numpy_helper.from_array(rng.standard_normal((64, 8 * 6 * 6)).astype(np.float32), "big")
    shape = onnx.numpy_helper.from_array(np.array([0, -1], np.int64), "shape")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("Shape", ["r"], ["s"], name="shape_of"),
             helper.make_node("Reshape", ["r", "shape"], ["flat"], name="flatten"),
             helper.make_node("Gemm", ["flat", "big"], ["y"], name="fc", transB=1)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
                           helper.make_tensor_value_info("s", TensorProto.INT64, None)], [w, big, shape])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    monkeypatch.setattr(io, "SHAPES_ONLY_MIN_BYTES", 512)       # both float weights go as inputs
    light, added = io._weights_as_inputs(m)
    assert added == 2 and [t.name for t in light.graph.initializer] == ["shape"]
    ref = onnx.shape_inference.infer_shapes(m, strict_mode=False, data_prop=True)
    before = m.SerializeToString()
    if inplace:
        mine = onnx.ModelProto()
        mine.CopyFrom(m)
        ours = io.infer_shapes(mine, inplace=True)
        assert ours is mine
    else:
        ours = io.infer_shapes(m)
        assert m.SerializeToString() == before
    assert list(ours.graph.node) == list(ref.graph.node)
    assert {v.name: v for v in ours.graph.value_info} == {v.name: v for v in ref.graph.value_info}
    assert list(ours.graph.output) == list(ref.graph.output)
    assert list(ours.graph.input) == list(m.graph.input)
    assert list(ours.graph.initializer) == list(m.graph.initializer)
    dims = {v.name: [d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim] for v in ours.graph.value_info}
    assert dims["flat"] == ["N", 288]


def test_sessions_take_large_weights_from_memory_with_the_same_results():
    """runtime.session hands large initializers to onnxruntime from memory (not serialized): float32,
    float16 and int8 (DQ) weights and an int64 table must give the results of a plain session, also
    after the model object and its copy are gone."""
    import gc

    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from qdqgraph.execution import runtime
    rng = np.random.default_rng(0)
    w32 = rng.standard_normal((64, 64)).astype(np.float32)
    w16 = rng.standard_normal((64, 64)).astype(np.float16)
    w8 = rng.integers(-127, 128, (64, 64)).astype(np.int8)
    table = rng.integers(0, 64, (1024,)).astype(np.int64)
    inits = [numpy_helper.from_array(a, n) for a, n in ((w32, "w32"), (w16, "w16"), (w8, "w8"), (table, "table"),
                                                        (np.array(0.02, np.float32), "s"), (np.array(5, np.int64), "k"))]
    nodes = [helper.make_node("MatMul", ["x", "w32"], ["a"]),
             helper.make_node("Cast", ["a"], ["a16"], to=TensorProto.FLOAT16),
             helper.make_node("MatMul", ["a16", "w16"], ["b16"]),
             helper.make_node("Cast", ["b16"], ["b"], to=TensorProto.FLOAT),
             helper.make_node("DequantizeLinear", ["w8", "s"], ["w8f"]),
             helper.make_node("MatMul", ["b", "w8f"], ["c"]),
             helper.make_node("Gather", ["table", "k"], ["g"]),
             helper.make_node("Cast", ["g"], ["gf"], to=TensorProto.FLOAT),
             helper.make_node("Add", ["c", "gf"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 64])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    light, weights = io.split_weights(m)
    assert set(weights) == {"w32", "w16", "w8", "table"} and light.ByteSize() < 2000
    assert all(len(t.raw_data) == len(m.graph.initializer[i].raw_data) for i, t in enumerate(m.graph.initializer))
    x = rng.standard_normal((2, 64)).astype(np.float32)
    ref = ort.InferenceSession(m.SerializeToString()).run(None, {"x": x})[0]
    sess = runtime.session(m)
    del m, light, weights
    gc.collect()
    for _ in range(3):
        np.testing.assert_array_equal(sess.run(None, {"x": x})[0], ref)


def test_checker_still_sees_a_truncated_weight(tmp_path):
    """The checker runs on a copy without the large weights; their sizes are checked beside it, so a
    truncated weight is still a clear one-line error."""
    from onnx import TensorProto, helper, numpy_helper
    w = numpy_helper.from_array(np.ones((64, 64), np.float32), "w")
    w.raw_data = w.raw_data[:-4]
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(QdqError, match=r"fails the ONNX checker .*tensor name: w\) raw_data size \(16380 bytes\)"):
        io.validate(m)


def test_the_full_check_of_a_written_model_keeps_its_weights_out_and_still_finds_errors(monkeypatch):
    """io.check (full_check, run on every written model) hands the checker a copy without the large
    INT8 weights: no copy of them is serialized, and a truncated weight or a shape inference
    error is still found."""
    from onnx import TensorProto, helper, numpy_helper

    def model(w: np.ndarray, raw_cut: int = 0) -> onnx.ModelProto:
        wq = numpy_helper.from_array(w, "wq")
        if raw_cut:
            wq.raw_data = wq.raw_data[:-raw_cut]
        g = helper.make_graph(
            [helper.make_node("DequantizeLinear", ["wq", "s"], ["wf"], axis=1),
             helper.make_node("MatMul", ["x", "wf"], ["y"])], "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, w.shape[1]])],
            [wq, numpy_helper.from_array(np.full(w.shape[1], 0.01, np.float32), "s")])
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)])

    seen = []
    real = onnx.checker.check_model
    monkeypatch.setattr(onnx.checker, "check_model", lambda m, *a, **k: (seen.append(m), real(m, *a, **k))[1])
    io.check(model(np.ones((64, 128), np.int8)))
    assert not [t.name for t in seen[-1].graph.initializer if t.name == "wq"]     # the checker never saw its bytes
    with pytest.raises(onnx.checker.ValidationError, match=r"tensor name: wq\) raw_data size"):
        io.check(model(np.ones((64, 128), np.int8), raw_cut=4))
    with pytest.raises(proto.CHECK_ERRORS, match="Incompatible dimensions"):
        io.check(model(np.ones((32, 128), np.int8)))          # [1, 64] x [32, 128]: shape inference says no


def test_graph_sessions_leave_the_graph_as_it_was_and_match_a_plain_export(monkeypatch):
    """graph_session exports the graph with its large constants as stubs and hands the graph's own
    arrays to onnxruntime: the results equal a session over the full export, and every constant of
    the graph keeps its values object."""
    import onnxruntime as ort

    from qdqgraph.execution import runtime
    monkeypatch.setattr(io, "IN_MEMORY_MIN_BYTES", 256)           # the motif's conv weights qualify
    m = motifs.residual_add()
    loaded = io.load(m)
    before = {t.name: t._values for t in loaded.graph.tensors().values() if hasattr(t, "_values")}
    light, weights = io.to_model_and_weights(loaded)
    assert weights and all(a.nbytes >= 256 for a in weights.values())
    assert all(t.data_location == onnx.TensorProto.EXTERNAL for t in light.graph.initializer if t.name in weights)
    after = {t.name: t._values for t in loaded.graph.tensors().values() if hasattr(t, "_values")}
    assert all(after[k] is v for k, v in before.items())
    x = motifs.sample_data(m)["x"][0]
    name = loaded.graph.inputs[0].name
    ref = ort.InferenceSession(io.to_model(loaded).SerializeToString()).run(None, {name: x})
    got = runtime.graph_session(loaded).run(None, {name: x})
    for a, b in zip(got, ref):
        np.testing.assert_array_equal(a, b)


def test_graph_session_with_a_weight_read_inside_an_if_body(monkeypatch):
    """A constant used by a main-graph node and inside an If body: the body's copy keeps its data
    (onnxruntime supplies only the main graph's initializers from memory)."""
    import onnx_graphsurgeon as gs

    from qdqgraph.execution import runtime
    monkeypatch.setattr(io, "IN_MEMORY_MIN_BYTES", 64)
    w = gs.Constant("w", np.arange(64, dtype=np.float32).reshape(8, 8) / 64)
    x = gs.Variable("x", np.float32, [1, 8])
    cond = gs.Variable("cond", np.bool_, [])
    body_out = gs.Variable("b", np.float32, [1, 8])
    then = gs.Graph(nodes=[gs.Node("MatMul", inputs=[x, w], outputs=[body_out])], outputs=[body_out])
    other = gs.Variable("o", np.float32, [1, 8])
    orelse = gs.Graph(nodes=[gs.Node("Relu", inputs=[x], outputs=[other])], outputs=[other])
    y_if = gs.Variable("y_if", np.float32, [1, 8])
    y_mm = gs.Variable("y_mm", np.float32, [1, 8])
    g = gs.Graph(nodes=[gs.Node("If", inputs=[cond], outputs=[y_if], attrs={"then_branch": then, "else_branch": orelse}),
                        gs.Node("MatMul", inputs=[x, w], outputs=[y_mm])],
                 inputs=[x, cond], outputs=[y_if, y_mm], opset=17)
    loaded = io.Loaded(graph=g, ir_version=8)
    model, weights = io.to_model_and_weights(loaded)
    assert "w" in weights
    xv = np.ones((1, 8), np.float32)
    y_if_v, y_mm_v = runtime.graph_session(loaded).run(None, {"x": xv, "cond": np.array(True)})
    np.testing.assert_allclose(y_if_v, xv @ w.values, rtol=1e-6)
    np.testing.assert_allclose(y_mm_v, xv @ w.values, rtol=1e-6)


def test_weights_reach_onnxruntime_from_memory_for_a_model_past_the_proto_limit(monkeypatch):
    """Past protobuf's 2 GB (threshold lowered) the session still takes the weights from memory:
    the light model of stubs is small, so it is not refilled and written to a file."""
    import onnxruntime as ort

    from qdqgraph.execution import runtime
    m = motifs.residual_add()
    light, _ = io.split_weights(m)
    assert io.tensor_bytes(light) < 5000 < io.tensor_bytes(m)
    monkeypatch.setattr(io, "EXTERNAL_DATA_THRESHOLD", 5000)   # stands in for 2 GB

    def refill(*args, **kwargs):
        raise AssertionError("the weights were put back into the proto")
    monkeypatch.setattr(io, "fill_weights", refill)
    sess = runtime.session(m)
    x = motifs.sample_data(m)["x"][0]
    ref = ort.InferenceSession(m.SerializeToString()).run(None, {"x": x})[0]
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], ref)


def test_tensor_bytes_counts_what_the_proto_holds():
    m = motifs.residual_add()
    light, weights = io.split_weights(m)
    held = sum(a.nbytes for a in weights.values())
    assert held > 0 and io.tensor_bytes(light) == io.tensor_bytes(m) - held
