"""Float islands in FP16 (insert --high-precision): types, kept-FP32 rules, accuracy against the
float32 Q/DQ model, and the simulator's view of the result."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto

import motifs
import qdqgraph
from qdqgraph.graph import io
from qdqgraph import trtsim
from qdqgraph.execution.evaluate import compare, fp16_within_tolerance
from qdqgraph.passes.precision import RANGE_LIMIT, keep_rules

F16 = TensorProto.FLOAT16


def _types(model: onnx.ModelProto) -> dict[str, int]:
    inferred = onnx.shape_inference.infer_shapes(model)
    out = {i.name: i.data_type for i in model.graph.initializer}
    for v in list(inferred.graph.value_info) + list(model.graph.input) + list(model.graph.output):
        out[v.name] = v.type.tensor_type.elem_type
    return out


def _run(model, feed):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)


@pytest.mark.parametrize("name", sorted(motifs.ALL))
def test_fp16_islands_check_run_and_stay_within_fp16_tolerance(name):
    """Every motif: the FP16-island model passes the checker, runs, keeps its input and output
    types, and stays within FP16 tolerance of the float32 Q/DQ model (qdqgraph.execution.evaluate.fp16_within_tolerance: 40 dB against the FP32 Q/DQ output, or at most 1 dB of SQNR lost against float)."""
    m = motifs.ALL[name]()
    data = motifs.sample_data(m)
    q16 = qdqgraph.quantize(m, data).model
    q32 = qdqgraph.quantize(m, data, high_precision="fp32").model
    onnx.checker.check_model(q16, full_check=True)
    assert [(i.name, i.type.tensor_type.elem_type) for i in q16.graph.input] == \
           [(i.name, i.type.tensor_type.elem_type) for i in m.graph.input]
    assert [(o.name, o.type.tensor_type.elem_type) for o in q16.graph.output] == \
           [(o.name, o.type.tensor_type.elem_type) for o in m.graph.output]
    assert F16 in _types(q16).values(), "nothing became float16"
    c16 = compare(m, q16, calib=data, tensors=False)
    c32 = compare(m, q32, calib=data, tensors=False)
    c = compare(q32, q16, calib=data, tensors=False)
    for a16, a32, a in zip(c16.outputs, c32.outputs, c.outputs):
        assert not np.isnan(a16.sqnr_db), (name, a16)
        assert fp16_within_tolerance(a16.sqnr_db, a32.sqnr_db, a.sqnr_db), (name, a16.sqnr_db, a32.sqnr_db, a.sqnr_db)


def test_scales_and_float_tensors_become_fp16_integers_untouched():
    m = motifs.integer_path()
    q = qdqgraph.quantize(m, motifs.sample_data(m)).model
    types = _types(q)
    for n in q.graph.node:
        if n.op_type == "DequantizeLinear" and n.output[0] not in {o.name for o in q.graph.output}:
            kept = types[n.input[1]] == TensorProto.FLOAT
            assert types[n.input[1]] in (F16, TensorProto.FLOAT)
            assert types[n.output[0]] == (TensorProto.FLOAT if kept else F16)   # DQ output type = scale type
        if n.op_type == "QuantizeLinear":
            assert types[n.input[0]] == types[n.input[1]]                         # Q: scale type = input type
    for name in ("ids", "mask", "eq_out", "ids_unsq_out"):
        assert types[name] in (TensorProto.INT64, TensorProto.BOOL)


def _reduce_model():
    g = motifs.G("reduce")
    x = g.input("x", ["n", 8, 4, 4])
    c = g.node("Relu", [g.conv(x, 8, 8, "conv")], name="relu")
    s = g.node("ReduceSum", [c, g.const("axes", np.array([2, 3], np.int64))], name="rsum", keepdims=1)
    g.node("Mul", [c, s], ["y"], name="scale")
    g.output("y")
    return g.model()


def test_overflowing_reduction_stays_fp32_and_relu_becomes_fp16():
    """H1 positive (ReduceSum kept FP32, with Casts around it) and negative (the Relu beside it is FP16)."""
    m = _reduce_model()
    r = qdqgraph.quantize(m, motifs.sample_data(m))
    kept = {k["node"]: k["rule"] for k in r.report.precision["kept_fp32"]}
    assert kept.get("rsum") == "H1-overflowing-reductions"
    assert "relu" not in kept and "scale" not in kept
    types = _types(r.model)
    assert types["rsum_out"] == TensorProto.FLOAT
    assert any(n.op_type == "Cast" and n.input[0] == "rsum_out" for n in r.model.graph.node)


def test_written_out_layernorm_keeps_its_reductions_fp32_and_its_scale_shift_fp16():
    """H7 positive (mean, centre, square, variance, root and divide FP32) and negative (the gamma Mul
    and beta Add after it, and the GEMMs around it, stay FP16)."""
    m = motifs.layernorm_decomposed()
    r = qdqgraph.quantize(m, motifs.sample_data(m))
    kept = {k["node"]: k["rule"] for k in r.report.precision["kept_fp32"]}
    written_out = ["ln_mean", "ln_sub", "ln_pow", "ln_var", "ln_add_eps", "ln_sqrt", "ln_div"]
    assert all(kept.get(n) == "H7-layernorm-written-out" for n in written_out), kept
    assert "ln_mul" not in kept and "ln_add" not in kept
    types = _types(r.model)
    outs = {n.name: n.output[0] for n in r.model.graph.node}
    assert types[outs["ln_pow"]] == TensorProto.FLOAT and types[outs["ln_mul"]] == F16


def test_large_activation_keeps_its_op_fp32():
    """H5: an op whose output reaches RANGE_LIMIT on the calibration data stays FP32; scaled down
    below the limit, the same op goes FP16."""
    def model(gain):
        g = motifs.G("big")
        x = g.input("x", ["n", 8, 4, 4])
        c = g.node("Relu", [g.conv(x, 8, 8, "conv")], name="relu")
        g.node("Mul", [c, g.const("gain", np.array(gain, np.float32))], ["y"], name="amplify")
        g.output("y")
        return g.model()
    big = qdqgraph.quantize(model(4 * RANGE_LIMIT), motifs.sample_data(model(1.0)))
    small = qdqgraph.quantize(model(1.0), motifs.sample_data(model(1.0)))
    kept_big = {k["node"]: k["rule"] for k in big.report.precision["kept_fp32"]}
    kept_small = {k["node"] for k in small.report.precision["kept_fp32"]}
    assert kept_big.get("amplify", "").startswith("H5-range")
    assert "amplify" not in kept_small


def test_schema_float_only_input_stays_fp32():
    """Resize's `scales` input is float32-only in the ONNX schema: it stays float32 while the data is FP16."""
    g = motifs.G("resize")
    x = g.input("x", ["n", 8, 4, 4])
    c = g.node("Relu", [g.conv(x, 8, 8, "conv")], name="relu")
    g.node("Resize", [c, "", g.const("scales", np.array([1, 1, 2, 2], np.float32))], ["y"], name="up", mode="nearest")
    g.output("y")
    m = g.model()
    q = qdqgraph.quantize(m, motifs.sample_data(m)).model
    onnx.checker.check_model(q, full_check=True)
    resize = [n for n in q.graph.node if n.op_type == "Resize"][0]
    types = _types(q)
    assert types[resize.input[2]] == TensorProto.FLOAT and types[resize.input[0]] == F16


def test_int8_concat_between_qdq_stays_fp32_so_onnxruntime_runs_it():
    """H6 positive: Concat between DQs and a Q stays float32 (TensorRT runs it INT8 anyway)."""
    m = motifs.concat_of_pools()
    r = qdqgraph.quantize(m, motifs.sample_data(m))
    kept = {k["node"]: k["rule"] for k in r.report.precision["kept_fp32"]}
    concat = [n.name for n in r.model.graph.node if n.op_type == "Concat"]
    assert concat and all(kept.get(c) == "H6-int8-concat" for c in concat)
    feed = {k: v[0] for k, v in motifs.sample_data(m).items()}
    assert all(np.isfinite(o).all() for o in _run(r.model, feed))


def test_a_dq_read_by_fp16_and_fp32_ops_gets_a_float32_copy_not_a_cast():
    """relu_a feeds an FP16 conv and an H6 Concat kept FP32: the Concat reads its own float32 DQ
    of the same INT8 tensor. A Cast after the FP16 DQ would leave TensorRT two reformats."""
    g = motifs.G("dq_two_types")
    x = g.input("x", ["n", 16, 8, 8])
    a = g.node("Relu", [g.conv(x, 16, 16, "conv_a")], name="relu_a")
    b = g.node("Relu", [g.conv(x, 16, 16, "conv_b")], name="relu_b")
    g.node("Conv", [a, g.weight("side.w", (16, 16, 1, 1))], ["side"], name="side", kernel_shape=[1, 1])
    g.node("Conv", [g.node("Concat", [a, b], name="cat", axis=1), g.weight("head.w", (16, 32, 1, 1))], ["y"],
           name="head", kernel_shape=[1, 1])
    g.output("side")
    g.output("y")
    m = g.model()
    r = qdqgraph.quantize(m, motifs.sample_data(m))
    onnx.checker.check_model(r.model, full_check=True)
    producers = {o: n for n in r.model.graph.node for o in n.output}
    assert not [n.name for n in r.model.graph.node
                if n.op_type == "Cast" and producers.get(n.input[0]) is not None
                and producers[n.input[0]].op_type == "DequantizeLinear"]
    assert r.report.precision["dq_copies"] == 1
    assert trtsim.simulate(r.model).summary["reformats_inside"] == 0
    ref = qdqgraph.quantize(m, motifs.sample_data(m), high_precision="fp32").model
    feed = {k: v[0] for k, v in motifs.sample_data(m).items()}
    for a16, a32 in zip(_run(r.model, feed), _run(ref, feed)):
        np.testing.assert_allclose(a16, a32, rtol=0.02, atol=0.02 * np.abs(a32).max())


def test_a_shape_read_neither_casts_nor_splits_the_layer():
    """Shape reads only dimensions: the FP16 model gives it the FP16 tensor as is (no Cast, a float
    consumer for nothing), and the simulator puts no precision constraint on what it reads, so the
    conv before a Shape+Reshape still writes INT8 for the next conv (Paddle's flatten)."""
    g = motifs.G("shape_read")
    x = g.input("x", ["n", 16, 4, 4])
    r = g.node("Relu", [g.conv(x, 16, 16, "conv")], name="relu")
    flat = g.node("Reshape", [r, g.node("Shape", [r], name="shape")], name="reshape")
    g.node("Conv", [flat, g.weight("head.w", (16, 16, 1, 1))], ["y"], name="head", kernel_shape=[1, 1])
    g.output("y")
    m = g.model()
    q = qdqgraph.quantize(m, motifs.sample_data(m)).model
    shape = [n for n in q.graph.node if n.op_type == "Shape"][0]
    assert shape.input[0] == "relu_out" and not [n for n in q.graph.node if n.op_type == "Cast" and n.input[0] == "relu_out"]
    assert trtsim.simulate(q).summary["reformats_inside"] == 0


def test_fp32_leaves_no_float16_and_opset_alone():
    m = motifs.residual_add()
    r = qdqgraph.quantize(m, motifs.sample_data(m), high_precision="fp32")
    assert F16 not in _types(r.model).values()
    assert r.report.precision is None


def test_simulator_reports_float_layers_as_fp16():
    """The FP16-island model's float layers are fp16 in the simulator, fp32 without islands."""
    m = motifs.attention()
    data = motifs.sample_data(m)
    rep16 = trtsim.simulate(io.load(qdqgraph.quantize(m, data).model).graph)
    rep32 = trtsim.simulate(io.load(qdqgraph.quantize(m, data, high_precision="fp32").model).graph)

    def float_precisions(rep):
        return {p.precision for layer in rep.layers if not layer.reformat
                for p in layer.outputs if p.precision != "int8"}
    assert "fp16" in float_precisions(rep16)
    assert "fp16" not in float_precisions(rep32)


def test_keep_rules_name_known_classes_and_have_ids():
    rules = keep_rules()
    ids = [r.id for r in rules]
    assert len(ids) == len(set(ids)) and all(r.id[0] == "H" and r.why for r in rules)


def test_cli_high_precision_flag(tmp_path, capsys):
    from qdqgraph.cli import main
    m = motifs.conv_relu()
    src = tmp_path / "m.onnx"
    onnx.save(m, src)
    np.savez(tmp_path / "d.npz", **motifs.sample_data(m))
    assert main(["insert", str(src), "--calib", str(tmp_path / "d.npz"), "-o", str(tmp_path / "a.onnx"),
                 "--verify", "0"]) == 0
    assert "float islands: fp16" in capsys.readouterr().out
    assert main(["insert", str(src), "--calib", str(tmp_path / "d.npz"), "-o", str(tmp_path / "b.onnx"),
                 "--high-precision", "fp32", "--verify", "0"]) == 0
    assert "float islands" not in capsys.readouterr().out
    assert F16 in _types(onnx.load(tmp_path / "a.onnx")).values()
    assert F16 not in _types(onnx.load(tmp_path / "b.onnx")).values()


def test_tensor_that_is_a_graph_output_and_read_by_a_float32_op_gets_uniquely_named_casts():
    """Found by the fuzzer (steps leaky, if_branch; seed 737228294): a LeakyRelu output that is a graph
    output and also read by a Q got two Casts named `<tensor>_to_fp32`; onnxruntime refused the model."""
    import fuzzgraphs
    m = fuzzgraphs.random_model(["leaky", "if_branch"], 737228294, False)
    r = qdqgraph.quantize(m, fuzzgraphs.sample_data(m))
    names = [n.name for n in r.model.graph.node]
    assert len(names) == len(set(names))
    onnx.checker.check_model(r.model, full_check=True)
    assert len(fuzzgraphs.run_ort(r.model, {k: v[0] for k, v in fuzzgraphs.sample_data(m).items()})) == 2


def test_int8_concat_before_a_transpose_stays_fp32_so_onnxruntime_runs_it():
    """H6 through data movement: DQ -> Concat -> Transpose -> Q. onnxruntime moves the Q above the
    Transpose and fuses a QLinearConcat, which takes only float32 scales (found by benchmarks/fuzz.py,
    seed 10: the FP16 model failed to load)."""
    g = motifs.G("concat_transpose")
    x = g.input("x", ["n", 8, 8, 8])
    a = g.node("Relu", [g.conv(x, 8, 8, "conv_a")], name="relu_a")
    b = g.node("Sigmoid", [g.conv(x, 8, 8, "conv_b")], name="sig_b")
    c = g.node("Concat", [a, b], name="cat", axis=1)
    t = g.node("Transpose", [c], name="nhwc", perm=[0, 2, 3, 1])
    g.node("MatMul", [t, g.weight("fc.w", (16, 16))], ["y"], name="fc")
    g.output("y")
    m = g.model()
    r = qdqgraph.quantize(m, motifs.sample_data(m))
    kept = {k["node"]: k["rule"] for k in r.report.precision["kept_fp32"]}
    assert kept.get("cat") == "H6-int8-concat", kept
    feed = {k: v[0] for k, v in motifs.sample_data(m).items()}
    assert all(np.isfinite(o).all() for o in _run(r.model, feed))


class _Feeds:
    def __init__(self, feeds):
        self.feeds = feeds

    def batches(self, n):
        yield from self.feeds


def test_range_run_fetches_a_dq_output_only_when_it_can_reach_the_limit():
    """A DQ's output cannot exceed max|q - zp| x scale: below RANGE_LIMIT it is not fetched (it
    cannot decide H5); a DQ with a scale that can reach the limit is, with its true range."""
    from qdqgraph.passes.precision import measure_ranges

    def qdq(x, scale, name):
        s = onnx.numpy_helper.from_array(np.array(scale, np.float32), name + "_s")
        z = onnx.numpy_helper.from_array(np.array(0, np.int8), name + "_z")
        return [onnx.helper.make_node("QuantizeLinear", [x, s.name, z.name], [name + "_q"], name=name + "_Q"),
                onnx.helper.make_node("DequantizeLinear", [name + "_q", s.name, z.name], [name + "_dq"], name=name + "_DQ"),
                onnx.helper.make_node("Relu", [name + "_dq"], [name + "_y"], name=name + "_relu")], [s, z]
    small, inits_small = qdq("x", 0.01, "small")
    big, inits_big = qdq("x", 2 * RANGE_LIMIT / 127, "big")
    graph = onnx.helper.make_graph(
        small + big, "g", [onnx.helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [onnx.helper.make_tensor_value_info(n, TensorProto.FLOAT, [4]) for n in ("small_y", "big_y")],
        inits_small + inits_big)
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 19)])
    x = np.array([-3e4, 1.0, 2.0, 4e4], np.float32)
    ranges = measure_ranges(io.load(model), _Feeds([{"x": x}]))
    assert "small_dq" not in ranges                   # bound 128 x 0.01 = 1.28: never fetched
    assert "small_y" not in ranges                    # nor the Relu of it (passes.bounds)
    assert ranges["big_y"] == pytest.approx(127 * 2 * RANGE_LIMIT / 127, rel=1e-5)
    big_scale = 2 * RANGE_LIMIT / 127
    assert ranges["big_dq"] == pytest.approx(128 * big_scale, rel=1e-5)     # -3e4 saturates at -128
    assert ranges["big_dq"] >= RANGE_LIMIT


def test_every_precision_has_a_record_and_a_format_or_is_weight_only():
    """rules/precisions.toml is the one list of precisions: the CLI's choices, the default methods,
    the opsets and the placement files all come from it."""
    from qdqgraph.config import DEFAULT_METHODS
    from qdqgraph.precisions.formats import OPSETS, PRECISIONS, activation_format, label
    from qdqgraph.precisions.registry import precision, precisions
    from qdqgraph.rulebook.files import bundled
    assert tuple(precisions()) == PRECISIONS and PRECISIONS[0] == "int8"
    for name, rec in precisions().items():
        assert DEFAULT_METHODS[name] == rec.method and OPSETS[name][0] == rec.opset and label(name) == rec.label
        assert rec.weights_only == (activation_format(name) is None), name
        assert not rec.placement or bundled(rec.placement).is_file(), rec.placement
    assert label(None) == "INT8"
    with pytest.raises(qdqgraph.QdqError, match="unknown precision 'nvfp4'"):
        precision("nvfp4")


def test_a_record_field_the_file_may_leave_out_takes_its_default_and_is_type_checked(tmp_path, monkeypatch):
    """min_scale_values: INT4's blocked scales must hold 2 values to parse in TensorRT (the file says
    so); precisions that do not say take 1; a wrong type is the usual damaged-file error."""
    from qdqgraph.precisions import registry
    assert registry.precision("int4").min_scale_values == 2
    assert registry.precision("int8").min_scale_values == 1
    text = registry.bundled(registry.FILE).read_text().replace("min_scale_values = 2", 'min_scale_values = "2"')
    (tmp_path / registry.FILE).write_text(text)
    monkeypatch.setattr(registry, "bundled", lambda name: tmp_path / name)
    registry.precisions.cache_clear()
    try:
        with pytest.raises(qdqgraph.QdqError, match=r"has a wrong type in \['min_scale_values'\]"):
            registry.precisions()
    finally:
        monkeypatch.undo()
        registry.precisions.cache_clear()


@pytest.mark.parametrize("values", [[1.0, -5.0, 3.0], [1.0, float("nan"), -5.0], [2.0, -float("inf")], [-0.0],
                                    [-3e38, 1e38]])
def test_island_ranges_take_max_abs_as_numpy_does(values):
    """The island ranges' max |x| (the compiled kernel's pass) is np.nanmax(np.abs(x)): NaNs left
    out, infinities kept, on contiguous and strided arrays."""
    from qdqgraph.passes.precision import _abs_max
    x = np.array(values * 50, np.float32).reshape(-1, len(values))
    for a in (x, x[::3], x.T):
        assert _abs_max(a) == float(np.nanmax(np.abs(a)))
