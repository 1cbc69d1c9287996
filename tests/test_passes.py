"""Cleaning passes, insertion invariants, strip(insert(m)) == clean(m), determinism, accuracy bound."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest

import motifs
import qdqgraph
from qdqgraph.graph import io
from qdqgraph.passes.batchnorm import fold_batchnorm
from qdqgraph.passes.check import qdq_violations
from qdqgraph.passes.constants import fold_constants
from qdqgraph.passes.no_ops import remove_no_ops
from qdqgraph.passes.strip import strip_qdq
from qdqgraph.prepare import clean
from qdqgraph.testing.render import render


def run(model: onnx.ModelProto, feed: dict) -> list:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feed)


def first_sample(data):
    return {k: v[0] for k, v in data.items()}


def cos(a, b):
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))


def test_fold_batchnorm_keeps_outputs():
    for make in (motifs.conv_bn_relu,):
        m = make()
        data = motifs.sample_data(m)
        loaded = io.load(m)
        res = fold_batchnorm(loaded.graph)
        assert res["folded"] == ["bn"] and res["kept"] == []
        assert "BatchNormalization" not in render(loaded.graph)
        out = io.to_model(loaded)
        np.testing.assert_allclose(run(out, first_sample(data))[0], run(m, first_sample(data))[0], rtol=1e-4, atol=1e-5)


def no_op_model(training=False, mask_out=False):
    """conv -> Identity -> relu -> Dropout -> conv -> Identity (graph output y, and a second output z)."""
    g = motifs.G("no_ops")
    y = g.conv(g.input("x", [1, 4, 8, 8]), 4, 4, "c1")
    y = g.node("Relu", [g.node("Identity", [y], name="id1")], name="act")
    outs = ["drop_out", "mask"] if mask_out else None
    y = g.node("Dropout", [y, g.const("ratio", np.array(0.5, np.float32)), g.const("train", np.array(training))],
               outs, name="drop")
    if mask_out:
        y = y[0]
        g.node("Cast", ["mask"], ["z"], to=onnx.TensorProto.FLOAT, name="cast")
        g.output("z")
    g.node("Identity", [g.conv(y, 4, 4, "c2")], ["y"], name="id_out")
    g.output("y")
    return g.model(13)


def test_remove_no_ops_keeps_outputs_and_graph_output_names():
    m = no_op_model()
    loaded = io.load(m)
    res = remove_no_ops(loaded.graph)
    assert res["removed"] == ["id1", "drop"]                       # id_out makes graph output y: kept
    ops = [n.op for n in loaded.graph.nodes]
    assert ops.count("Identity") == 1 and "Dropout" not in ops
    assert [t.name for t in loaded.graph.outputs] == ["y"]
    x = {"x": np.random.default_rng(0).standard_normal((1, 4, 8, 8)).astype(np.float32)}
    np.testing.assert_allclose(run(io.to_model(loaded), x)[0], run(m, x)[0], rtol=1e-6)


@pytest.mark.parametrize("kw", [{"training": True}, {"mask_out": True}])
def test_remove_no_ops_keeps_a_dropout_that_is_not_one(kw):
    loaded = io.load(no_op_model(**kw))
    assert remove_no_ops(loaded.graph)["removed"] == ["id1"]
    assert "Dropout" in [n.op for n in loaded.graph.nodes]


def test_clean_removes_the_identity_that_split_conv_from_relu():
    from qdqgraph.report import InsertReport
    report = InsertReport()
    loaded = io.load(no_op_model())
    report.add(clean(loaded))
    assert report.no_ops_removed == 2
    conv = next(n for n in loaded.graph.nodes if n.name == "c1")
    assert [c.op for c in conv.outputs[0].outputs] == ["Relu"]


@pytest.mark.parametrize("op", ["ConvTranspose", "Gemm"])
def test_fold_batchnorm_convtranspose_and_gemm(op):
    g = motifs.G("bn_" + op)
    if op == "Gemm":
        x = g.input("x", ["n", 64])
        y = g.node("Gemm", [x, g.weight("w", (32, 64)), g.weight("b", (32,))], name="fc", transB=1, alpha=0.5)
    else:
        x = g.input("x", ["n", 16, 4, 4])
        y = g.node("ConvTranspose", [x, g.weight("w", (16, 8, 2, 2))], name="up", kernel_shape=[2, 2],
                   strides=[2, 2], group=2)
    g.bn(y, 32 if op == "Gemm" else 16, "bn")
    g.outputs.append(onnx.helper.make_tensor_value_info("bn_out", onnx.TensorProto.FLOAT, None))
    m = g.model()
    loaded = io.load(m)
    assert fold_batchnorm(loaded.graph)["folded"] == ["bn"]
    feed = first_sample(motifs.sample_data(m))
    np.testing.assert_allclose(run(io.to_model(loaded), feed)[0], run(m, feed)[0], rtol=1e-4, atol=1e-4)


def test_batchnorm_without_conv_is_kept_with_reason():
    g = motifs.G("bn_alone")
    x = g.input("x", ["n", 16, 4, 4])
    g.node("Relu", [x], name="relu")
    g.bn("relu_out", 16, "bn")
    g.output("bn_out")
    res = fold_batchnorm(io.load(g.model()).graph)
    assert res["folded"] == [] and len(res["kept"]) == 1
    assert "comes from Relu" in res["kept"][0][1]


def test_fold_constants_turns_constant_nodes_into_weights():
    loaded = io.load(motifs.paddle_constants())
    res = fold_constants(loaded.graph)
    assert res["folded"] == 2 and res["constant_nodes_left"] == []
    assert "Transpose" not in render(loaded.graph) and "Constant(" not in render(loaded.graph)


@pytest.mark.parametrize("name", sorted(motifs.ALL))
def test_insert_invariants_and_runs(name):
    m = motifs.ALL[name]()
    data = motifs.sample_data(m)
    result = qdqgraph.quantize(m, data)
    onnx.checker.check_model(result.model, full_check=True)
    assert qdq_violations(io.load(result.model).graph) == []
    q = run(result.model, first_sample(data))
    f = run(m, first_sample(data))
    assert len(q) == len(f)
    for a, b in zip(q, f):
        assert a.shape == b.shape and np.all(np.isfinite(a))
        # the int8 model stays close to float (bound set loosely by 8-bit scales on random weights)
        assert cos(a, b) > 0.95, (name, cos(a, b))


@pytest.mark.parametrize("precision", ["int8", "fp8"])
@pytest.mark.parametrize("name", ["residual_add", "concat_of_pools", "se_block", "attention", "paddle_constants",
                                  "conv_bn_relu", "integer_path"])
def test_strip_of_insert_equals_clean(name, precision):
    m = motifs.ALL[name]()
    data = motifs.sample_data(m)
    expected = io.load(m, min_opset=19 if precision == "fp8" else 13)
    clean(expected)
    # output-aware smoothing changes weights by design (test_recipes.py): off here
    # the motifs' convs have <= 16 channels, which FP8 leaves in FP16 (F8-conv-shape, advisory): forced in
    forced = (".*",) if precision == "fp8" else ()
    quantized = io.load(qdqgraph.quantize(m, data, weights="qdq", high_precision="fp32", output_aware=False,
                                          precision=precision, include_nodes=forced).model)
    assert strip_qdq(quantized.graph)["removed"] > 0
    # the same nodes with the same connections (a line names a node's inputs and outputs)
    assert sorted(render(quantized.graph).splitlines()) == sorted(render(expected.graph).splitlines())
    feed = first_sample(data)
    for a, b in zip(run(io.to_model(quantized), feed), run(io.to_model(expected), feed)):
        np.testing.assert_array_equal(a, b)
    # with INT8 weights the structure comes back too, the weights dequantized
    q8 = io.load(qdqgraph.quantize(m, data, high_precision="fp32", output_aware=False, precision=precision,
                                   include_nodes=forced).model)
    strip_qdq(q8.graph)
    assert sorted(n.op for n in q8.graph.nodes) == sorted(n.op for n in expected.graph.nodes)


@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("name", ["residual_add", "attention", "integer_path"])
def test_strip_of_insert_is_a_valid_model_in_every_precision(name, precision):
    """The written model's float islands keep their type through strip: a float32 input that fed
    a Q whose DQ was FP16 reaches its FP16 consumer through a Cast, not directly."""
    m = motifs.ALL[name]()
    data = motifs.sample_data(m)
    q = io.load(qdqgraph.quantize(m, data, high_precision=precision).model)
    assert strip_qdq(q.graph)["removed"] > 0
    back = io.to_model(q)
    onnx.checker.check_model(back, full_check=True)
    assert not {"QuantizeLinear", "DequantizeLinear"} & {n.op_type for n in back.graph.node}
    if precision != "bf16":     # onnxruntime's CPU lacks most BF16 kernels
        got = run(back, first_sample(data))
        ref = run(m, first_sample(data))
        assert all(cos(a, b) > 0.99 for a, b in zip(got, ref) if np.issubdtype(a.dtype, np.floating))


def test_insert_is_deterministic():
    m = motifs.residual_add(projection=True)
    data = motifs.sample_data(m)
    a = qdqgraph.quantize(m, data).model.SerializeToString()
    b = qdqgraph.quantize(m, data).model.SerializeToString()
    assert a == b


def test_rule_ids_recorded_on_nodes():
    m = motifs.residual_add()
    model = qdqgraph.quantize(m, motifs.sample_data(m)).model
    rules = {n.name: {p.key: p.value for p in n.metadata_props}.get(io.RULE_KEY) for n in model.graph.node
             if n.op_type in ("QuantizeLinear", "DequantizeLinear")}
    assert rules["stem_relu_out_q"] in ("P6-residual-add", "P1-conv")
    assert rules["conv2.w_dq"] == "P1-conv"
    assert all(rules.values())


def test_zero_range_tensor_gets_safe_scale_and_warning():
    m = motifs.conv_relu()
    data = {"x": np.zeros((4, 2, 16, 8, 8), np.float32)}
    result = qdqgraph.quantize(m, data)
    scale = [t for t in result.model.graph.initializer if t.name == "x_scale"][0]
    v = onnx.numpy_helper.to_array(scale)
    assert np.isfinite(v) and v > 0
    assert any("zero over all calibration samples" in w for w in result.report.warnings)


def test_metadata_props_kept():
    m = motifs.conv_relu()
    p = m.metadata_props.add()
    p.key, p.value = "character", "0\n90\n180\n270"
    out = qdqgraph.quantize(m, motifs.sample_data(m)).model
    assert {q.key: q.value for q in out.metadata_props}["character"] == "0\n90\n180\n270"


def test_opset_raised_to_13():
    m = motifs.conv_relu(opset=11)
    result = qdqgraph.quantize(m, motifs.sample_data(m), high_precision="fp32")
    assert [o.version for o in result.model.opset_import if o.domain in ("", "ai.onnx")] == [13]
    assert result.report.opset_raised_from == 11
    fp16 = qdqgraph.quantize(m, motifs.sample_data(m))            # FP16 Q/DQ scales need opset 19
    assert [o.version for o in fp16.model.opset_import if o.domain in ("", "ai.onnx")] == [19]


def test_bias_correction_removes_the_mean_shift_of_int8_weights():
    """Conv weights with one large outlier per output channel quantize coarsely; with
    --bias-correction the per-channel mean error of the conv output (float input, INT8 weights)
    shrinks, and without calibration data it is refused."""
    from onnx import numpy_helper

    from qdqgraph.errors import QdqError
    m = motifs.conv_relu()
    w = [t for t in m.graph.initializer if t.name == "conv.w"][0]
    arr = numpy_helper.to_array(w).copy()
    arr[:, 0, 0, 0] = 8.0
    arr += 0.05                                   # a mean the rounding error does not average away
    w.CopyFrom(numpy_helper.from_array(arr, "conv.w"))
    rng = np.random.default_rng(3)
    data = {"x": (rng.standard_normal((16, 1, 16, 8, 8)) + 1.0).astype(np.float32)}
    def mean_shift(model):
        g0 = io.load(m).graph
        c0 = [n for n in g0.nodes if n.name == "conv"][0]
        g0.outputs = [c0.outputs[0]]
        g = io.load(model).graph                   # the same tensor: the conv's output, bias added
        g.outputs = [t for n in g.nodes for t in n.outputs if t.name == c0.outputs[0].name]
        out = run(io.to_model(io.Loaded(graph=g, ir_version=8)), {"x": data["x"][0]})[0]
        f = run(io.to_model(io.Loaded(graph=g0, ir_version=8)), {"x": data["x"][0]})[0]
        return float(np.abs((out - f).mean(axis=(0, 2, 3))).mean())

    plain = qdqgraph.quantize(m, data, high_precision="fp32")
    corrected = qdqgraph.quantize(m, data, high_precision="fp32", bias_correction=True)
    assert corrected.report.bias_corrected == 1
    assert mean_shift(corrected.model) < 0.5 * mean_shift(plain.model)
    with pytest.raises(QdqError, match="bias_correction=True measures the mean output shift of the INT8 weights on calibration data, and calib=.random. is not data"):
        qdqgraph.quantize(m, "random", bias_correction=True)


# ------------------------------------------------------------------ declared conditions (passes/registry.py)

def _motif_graphs():
    import motifs
    from qdqgraph.graph import io
    for build in (motifs.conv_bn_relu, motifs.residual_add, motifs.se_block, motifs.attention_block,
                  motifs.layernorm_decomposed, motifs.paddle_constants, motifs.convtranspose, motifs.gemm_transB):
        yield build.__name__, io.load(build()).graph


def test_every_pass_of_the_pipeline_is_declared():
    from qdqgraph.passes.registry import PASSES
    assert {"remove_no_ops", "fold_constants", "fold_batchnorm", "strip_qdq", "insert_qdq", "bias_to_add",
            "fold_scalar_scales", "fix_inputs", "inline_constant_ifs", "float_islands", "smooth",
            "bias_correction", "output_aware"} <= set(PASSES)


def test_declared_fixpoint_passes_change_nothing_the_second_time():
    """A pass declared a fixpoint leaves a graph it does not change again: run twice on each motif
    (and on insert's output), the second run reports changed=False and leaves the same graph."""
    import importlib
    from qdqgraph.passes.registry import PASSES
    for info in PASSES.values():
        if not (info.fixpoint and info.graph_only):
            continue
        module, _, name = info.function.rpartition(".")
        fn = getattr(importlib.import_module(module), name)
        for motif, graph in _motif_graphs():
            fn(graph)
            before = [(n.op, n.name, [t.name for t in n.inputs]) for n in graph.nodes]
            again = fn(graph)
            assert not again.changed, (info.name, motif, again.counts)
            assert [(n.op, n.name, [t.name for t in n.inputs]) for n in graph.nodes] == before, (info.name, motif)


def test_a_pass_that_breaks_what_it_ensures_is_an_invariant_error(monkeypatch):
    from qdqgraph.errors import InvariantError
    from qdqgraph.passes.base import result
    from qdqgraph.passes.registry import NO_QDQ, declare
    import motifs
    from qdqgraph.graph import io
    from qdqgraph.passes.insert import insert_qdq
    from qdqgraph.placement import plan_placement

    @declare("leaves_qdq", ensures=(NO_QDQ,))
    def leaves_qdq(graph):
        return result("leaves_qdq", False)

    loaded = io.load(motifs.conv_relu())
    plan = plan_placement(loaded.graph)
    insert_qdq(loaded.graph, plan, {s.group or s.tensor: 1.0 for s in plan.sites.values()})
    with pytest.raises(InvariantError, match="pass leaves_qdq .* did not ensure 'no QuantizeLinear/DequantizeLinear left'"):
        leaves_qdq(loaded.graph)
    monkeypatch.setenv("QDQGRAPH_CHECK_PASSES", "0")         # users' runs: not checked
    leaves_qdq(loaded.graph)


def test_the_report_knows_no_pass_by_name():
    """report.py reads the passes' own descriptions (passes.registry.describe): no pass name is
    spelled in it, so a new pass touches its own module only."""
    from pathlib import Path
    from qdqgraph.passes.registry import DESCRIPTIONS, PASSES
    source = (Path(qdqgraph.__file__).parent / "report.py").read_text()
    import re
    named = [n for n in set(PASSES) | set(DESCRIPTIONS)
             if re.search(rf"""(?<!get\()["']{n}["']""", source)]       # a dict's key of that name is no pass
    assert named == [] and "_passes(" not in source


def test_a_described_pass_shows_in_the_summary_and_the_json():
    from qdqgraph.passes.base import result
    from qdqgraph.passes.registry import DESCRIPTIONS, describe
    from qdqgraph.report import InsertReport
    describe("made_up_pass", 55, lines=lambda rs, ctx: [f"made up: {len(rs)} run(s) in {ctx.label}"],
             fields={"made_up": lambda rs: sum(r.count("n") for r in rs)})
    try:
        report = InsertReport(config={"precision": "fp8"})
        report.add([result("made_up_pass", True, n=3), result("made_up_pass", True, n=4)])
        assert "made up: 2 run(s) in FP8" in report.summary().splitlines()
        assert report.to_dict()["made_up"] == 7 and report.made_up == 7
    finally:
        del DESCRIPTIONS["made_up_pass"]


@pytest.mark.parametrize("scale, zero_point, bad_scale, bad_zero", [
    (np.float32(0.5), np.int8(0), False, False),
    (np.array([0.5], np.float32), np.array([0], np.int8), False, False),
    (np.float16(0.25), None, False, False),
    (np.float32(0.0), np.int8(0), True, False),
    (np.float32(-1.0), np.int8(0), True, False),
    (np.float32(np.nan), np.int8(0), True, False),
    (np.float64(np.inf), np.int8(0), True, False),
    (np.float32(1e-30), np.int8(3), False, True),
    (np.array([[2.0]], np.float32), np.array([[-1]], np.int8), False, True),
])
def test_qdq_violations_reads_one_value_scales_and_zero_points(scale, zero_point, bad_scale, bad_zero):
    """One-value scales and zero points (read as Python numbers) give what numpy's checks gave."""
    import onnx_graphsurgeon as gs
    x = gs.Variable("x", np.float32, (1, 4))
    q_out = gs.Variable("q", np.int8, (1, 4))
    y = gs.Variable("y", np.float32, (1, 4))
    s = gs.Constant("s", np.asarray(scale))
    ins = [x, s] + ([gs.Constant("z", np.asarray(zero_point))] if zero_point is not None else [])
    nodes = [gs.Node("QuantizeLinear", "q0", inputs=ins, outputs=[q_out]),
             gs.Node("DequantizeLinear", "dq0", inputs=[q_out, *ins[1:]], outputs=[y])]
    found = qdq_violations(gs.Graph(nodes=nodes, inputs=[x], outputs=[y], opset=19))
    assert sum("not finite and > 0" in f for f in found) == (2 if bad_scale else 0), found
    assert sum("zero point is not 0" in f for f in found) == (2 if bad_zero else 0), found
