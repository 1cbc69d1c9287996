"""Inlining If nodes whose condition is constant, and --fix-input, which makes an input constant:
the float function is unchanged, the taken branch is quantized, bad requests are one-line errors."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import motifs
import qdqgraph
from qdqgraph.graph import io
from qdqgraph.cli import main
from qdqgraph.errors import QdqError
from qdqgraph.passes.fix_inputs import parse_fixed
from qdqgraph import QuantizeConfig
from qdqgraph.prepare import clean, plan_for, prepare
from qdqgraph.report import InsertReport


def _branch(name, x, seed, inner_if=None):
    """A subgraph: Relu(Conv(x)) with 32 channels (big enough to be quantized), optionally followed
    by an If of its own."""
    rng = np.random.default_rng(seed)
    w = numpy_helper.from_array((rng.standard_normal((32, 16, 3, 3)) * 0.3).astype(np.float32), f"{name}_w")
    nodes = [helper.make_node("Conv", [x, w.name], [f"{name}_c"], name=f"{name}_conv", kernel_shape=[3, 3],
                              pads=[1, 1, 1, 1]),
             helper.make_node("Relu", [f"{name}_c"], [f"{name}_y"], name=f"{name}_relu")]
    out = f"{name}_y"
    if inner_if is not None:
        nodes.append(inner_if(f"{name}_y"))
        out = nodes[-1].output[0]
    return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)], [w])


def _if_model(condition: str, nested: bool = False):
    """x -> Conv (16 ch) -> If(cond) {then: conv A, else: conv B} -> Conv -> y. `condition`:
    "constant" (Equal of two constants, as exporters leave behind), or "input" (Equal(mode, 1)
    on an int64 input `mode`)."""
    g = motifs.G(f"if_{condition}")
    x = g.input("x", ["n", 16, 8, 8])
    h = g.node("Relu", [g.conv(x, 16, 16, "stem")], name="stem_relu")
    if condition == "input":
        g.input("mode", [], TensorProto.INT64)
        cond = g.node("Equal", ["mode", g.const("one", np.array(1, np.int64))], name="is_one")
    else:
        cond = g.node("Equal", [g.const("a", np.array(3, np.int64)), g.const("b", np.array(3, np.int64))],
                      name="three_is_three")

    then = _branch("then", h, 1)
    if nested:    # the then-branch ends in an If of its own, decided by a constant of the main graph
        g.nodes.append(helper.make_node("Constant", [], ["inner_cond_v"], name="inner_cond_c",
                                        value=numpy_helper.from_array(np.array(False))))
        then = _branch("then", h, 1, inner_if=lambda _: helper.make_node(
            "If", ["inner_cond_v"], ["inner_out"], name="inner_if",
            then_branch=_branch("inner_then", h, 5), else_branch=_branch("inner_else", h, 6)))
    g.nodes.append(helper.make_node("If", [cond], ["picked"], name="pick", then_branch=then,
                                    else_branch=_branch("else", h, 2)))
    g.node("Conv", ["picked", g.weight("head.w", (32, 32, 3, 3))], ["y"], name="head", kernel_shape=[3, 3],
           pads=[1, 1, 1, 1])
    g.output("y")
    return g.model()


def _run(model, feed):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)[0]


def _x(n=2, seed=0):
    return np.random.default_rng(seed).standard_normal((n, 16, 8, 8)).astype(np.float32)


def test_if_with_a_constant_condition_is_inlined_exactly():
    m = _if_model("constant")
    loaded, plan = prepare(m)
    assert not [n for n in loaded.graph.nodes if n.op == "If"]
    np.testing.assert_array_equal(_run(io.to_model(loaded), {"x": _x()}), _run(m, {"x": _x()}))
    d = plan.decisions
    assert d["then_conv"].quantized and "else_conv" not in d     # the taken branch, and only it


def test_inlined_branch_is_quantized_by_insert():
    m = _if_model("constant")
    r = qdqgraph.quantize(m, {"x": _x(8)[:, None]}, high_precision="fp32")
    assert r.report.ifs_inlined == ["pick"]
    producer = {o: n for n in r.model.graph.node for o in n.output}
    conv = next(n for n in r.model.graph.node if n.name == "then_conv")
    assert [producer[i].op_type for i in conv.input[:2]] == ["DequantizeLinear", "DequantizeLinear"]
    onnx.checker.check_model(r.model, full_check=True)


def test_nested_if_is_inlined_in_rounds():
    m = _if_model("constant", nested=True)
    report = InsertReport()
    loaded = io.load(m)
    report.add(clean(loaded))
    plan = plan_for(loaded, QuantizeConfig())
    assert report.ifs_inlined == ["pick", "inner_if"]          # the inner If surfaced in round one
    assert not [n for n in loaded.graph.nodes if n.op == "If"]
    assert plan.decisions["inner_else_conv"].quantized
    np.testing.assert_array_equal(_run(io.to_model(loaded), {"x": _x()}), _run(m, {"x": _x()}))


def test_if_on_an_input_stays_until_the_input_is_fixed():
    m = _if_model("input")
    loaded, _ = prepare(m)
    assert [n.name for n in loaded.graph.nodes if n.op == "If"] == ["pick"]      # not decidable: kept
    for mode in (1, 0):
        fixed, plan = prepare(m, fixed_inputs={"mode": mode})
        assert not [n for n in fixed.graph.nodes if n.op == "If"]
        assert [t.name for t in fixed.graph.inputs] == ["x"]
        want = _run(m, {"x": _x(), "mode": np.array(mode, np.int64)})
        np.testing.assert_array_equal(_run(io.to_model(fixed), {"x": _x()}), want)
        assert ("then_conv" if mode == 1 else "else_conv") in plan.decisions


def test_fixed_input_data_is_ignored_and_the_output_model_lacks_the_input():
    m = _if_model("input")
    data = {"x": _x(8)[:, None], "mode": np.ones((8,), np.int64)}
    r = qdqgraph.quantize(m, data, fixed_inputs={"mode": 1}, high_precision="fp32")
    assert [i.name for i in r.model.graph.input] == ["x"]
    assert r.report.fixed_inputs == {"mode": 1} and "fixed inputs: mode=1" in r.report.summary()
    got = ort.InferenceSession(r.model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": _x()})[0]
    want = _run(m, {"x": _x(), "mode": np.array(1, np.int64)})
    assert np.corrcoef(got.ravel(), want.ravel())[0, 1] > 0.99           # INT8 close to float


@pytest.mark.parametrize("fixed, message", [
    ({"nope": 1}, "not an input of the model"),
    ({"mode": 1.5}, "does not fit the input's type int64"),
    ({"mode": [1, 2]}, "the input has shape []"),
])
def test_bad_fixed_inputs_are_clear_errors(fixed, message):
    with pytest.raises(QdqError, match=message.replace("[", r"\[").replace("]", r"\]")):
        prepare(_if_model("input"), fixed_inputs=fixed)


@pytest.mark.parametrize("spec", ["mode", "=1", "mode=", "mode=one", "mode=1,,2"])
def test_bad_fix_input_spec(spec):
    with pytest.raises(QdqError, match="--fix-input"):
        parse_fixed(spec)


def test_parse_fixed_values():
    assert parse_fixed("sr=16000") == ("sr", [16000])
    assert parse_fixed("s=0.5,2") == ("s", [0.5, 2])


def test_cli_fix_input_errors_in_one_line_and_writes_nothing(tmp_path, capsys):
    p = tmp_path / "m.onnx"
    onnx.save(_if_model("input"), p)
    np.savez(tmp_path / "d.npz", x=_x(4)[:, None], mode=np.ones(4, np.int64))
    out = tmp_path / "q.onnx"
    assert main(["insert", str(p), "--calib", str(tmp_path / "d.npz"), "--fix-input", "rate=1", "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "rate" in err[0] and "inputs are: x, mode" in err[0]
    assert not out.exists()
    assert main(["insert", str(p), "--calib", str(tmp_path / "d.npz"), "--fix-input", "mode=1", "-o", str(out),
                 "--quiet"]) == 0
    assert [i.name for i in onnx.load(out).graph.input] == ["x"]


def test_if_output_that_is_a_model_output_keeps_its_name():
    g = motifs.G("if_out")
    x = g.input("x", [1, 4])
    cond = g.node("Equal", [g.const("a", np.array(1, np.int64)), g.const("b", np.array(1, np.int64))], name="eq")
    then = helper.make_graph([helper.make_node("Relu", [x], ["t"], name="t_relu")], "then", [],
                             [helper.make_tensor_value_info("t", TensorProto.FLOAT, None)])
    other = helper.make_graph([helper.make_node("Neg", [x], ["e"], name="e_neg")], "else", [],
                              [helper.make_tensor_value_info("e", TensorProto.FLOAT, None)])
    g.nodes.append(helper.make_node("If", [cond], ["y"], name="pick", then_branch=then, else_branch=other))
    g.output("y", shape=[1, 4])
    m = g.model()
    loaded, _ = prepare(m)
    out = io.to_model(loaded)
    assert [o.name for o in out.graph.output] == ["y"] and not [n for n in out.graph.node if n.op_type == "If"]
    v = np.array([[-1.0, 2.0, -3.0, 4.0]], np.float32)
    np.testing.assert_array_equal(_run(out, {"x": v}), np.maximum(v, 0))


def test_calibrate_with_fix_input_feeds_insert_from_cache(tmp_path):
    """calibrate --fix-input observes the inlined branch, so insert --calib-cache --fix-input finds
    a range for every tensor it quantizes."""
    p = tmp_path / "m.onnx"
    onnx.save(_if_model("input"), p)
    np.savez(tmp_path / "d.npz", x=_x(4)[:, None], mode=np.zeros(4, np.int64))
    cache = tmp_path / "c.json"
    assert main(["calibrate", str(p), "--calib", str(tmp_path / "d.npz"), "--fix-input", "mode=0",
                 "-o", str(cache), "--quiet"]) == 0
    from qdqgraph.calib.cache import read_json
    ranges = read_json(cache)
    assert {"stem_relu_out", "else_y"} <= set(ranges)      # else_conv's and head's inputs
    out = tmp_path / "q.onnx"
    assert main(["insert", str(p), "--calib-cache", str(cache), "--fix-input", "mode=0", "-o", str(out),
                 "--quiet"]) == 0
    names = {n.name for n in onnx.load(out).graph.node}
    assert "else_conv" in names and "then_conv" not in names


def test_compute_inside_if_branches_is_quantized_without_fix_input():
    """All compute inside If branches decided by an input that calibration holds constant (silero's
    `sr`): the branch the samples take is quantized by default (qdqgraph.graph.branches), the other stays
    float with a note, and no --fix-input is needed; fixing the input still inlines the branch."""
    g = motifs.G("all_in_if")
    g.input("x", ["n", 16, 8, 8])
    g.input("mode", [], TensorProto.INT64)
    cond = g.node("Equal", ["mode", g.const("one", np.array(1, np.int64))], name="is_one")
    g.nodes.append(helper.make_node("If", [cond], ["y"], name="pick", then_branch=_branch("then", "x", 1),
                                    else_branch=_branch("else", "x", 2)))
    g.output("y")
    m = g.model()
    rng = np.random.default_rng(0)
    data = {"x": rng.standard_normal((6, 1, 16, 8, 8)).astype(np.float32), "mode": np.ones(6, np.int64)}
    r = qdqgraph.quantize(m, data)
    text = r.report.summary()
    assert "the plan quantizes nothing" not in text and "--fix-input" not in text
    assert "If node pick: the then-branch is quantized on the 6 calibration samples" in text
    assert "If node pick: the else-branch stays float: no calibration sample takes it" in text
    assert r.report.tensorrt["int8_flops_share"] > 0.5
    # with the input fixed, the taken branch is inlined, quantized, and nothing needs saying
    fixed = qdqgraph.quantize(m, data, fixed_inputs={"mode": 1})
    assert fixed.report.notes == [] and fixed.plan.decisions["then_conv"].quantized
    # an input that varies over the data: both branches, each from its samples
    data["mode"][3] = 0
    both = qdqgraph.quantize(m, data).report.summary()
    assert "then-branch is quantized on the 5" in both and "else-branch is quantized on the 1" in both
