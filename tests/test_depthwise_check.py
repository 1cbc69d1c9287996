"""Issue 31: a depthwise convolution whose input's small channels sit on a few INT8 steps under a
large folded weight is found by its own output SQNR and returned to float where the outputs gain,
with its off switch; a balanced one stays INT8. And the numpy grouped convolution the check computes
agrees with onnxruntime's."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import qdqgraph
from motifs import G
from qdqgraph.cli import build_parser, main
from qdqgraph.cli.args import config as config_of
from qdqgraph.graph import io
from qdqgraph.recipes import depthwise
from qdqgraph.recipes.conv_math import grouped_conv
from test_fidelity_defaults import sqnr

OFF = dict(equalize="off", bias_correction=False, fragile_heads=False, sqnr_floor=None)


def crushed_depthwise(c=32, spread=1000.0):
    """conv 3x3 -> Relu -> depthwise 3x3 -> Relu -> conv 3x3 (the depthwise conv 1.5% of the
    FLOPs): the first conv's output channel i is
    divided by f_i (f from 1 to `spread`) and the depthwise weight of channel i multiplied by it,
    as a folded BatchNorm leaves them: the function of a balanced network, its depthwise input's
    channels `spread` apart."""
    g = G("crushed_depthwise")
    x = g.input("x", ["n", c, 16, 16])
    f = np.logspace(0, np.log10(spread), c).astype(np.float32)
    w0 = (g.rng.standard_normal((c, c, 3, 3)) * 0.1).astype(np.float32) / f[:, None, None, None]
    y = g.node("Conv", [x, g.const("pre.w", w0), g.const("pre.b", np.full(c, 0.05, np.float32) / f)],
               name="pre", kernel_shape=[3, 3], pads=[1] * 4)
    y = g.node("Relu", [y], name="pre_relu")
    w1 = (g.rng.standard_normal((c, 1, 3, 3)) * 0.3).astype(np.float32) * f[:, None, None, None]
    y = g.node("Conv", [y, g.const("dw.w", w1), g.const("dw.b", np.zeros(c, np.float32))], name="dw",
               kernel_shape=[3, 3], pads=[1] * 4, group=c)
    y = g.node("Relu", [y], name="dw_relu")
    g.node("Conv", [y, g.weight("pw.w", (c, c, 3, 3), 0.1), g.const("pw.b", np.zeros(c, np.float32))], ["y"],
           name="pw", kernel_shape=[3, 3], pads=[1] * 4)
    g.output("y")
    return g.model()


def data_for(c=32, n=16, seed=1):
    return {"x": np.random.default_rng(seed).standard_normal((n, 1, c, 16, 16)).astype(np.float32)}


def dequantized_inputs(model: onnx.ModelProto) -> set[str]:
    """The nodes of a written model that read a DequantizeLinear's output as their first input."""
    dq = {o for n in model.graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    return {n.name for n in model.graph.node if n.op_type != "QuantizeLinear" and n.input and n.input[0] in dq}


def test_a_crushed_depthwise_conv_is_kept_float_and_said_so():
    m, data = crushed_depthwise(), data_for()
    on = qdqgraph.quantize(m, data, **OFF)
    off = qdqgraph.quantize(m, data, **OFF, depthwise_check=False)
    d = on.report.depthwise
    assert d["checked"] == 1 and d["kept_float"] and list(d["candidates"]) == ["dw"], d
    assert d["candidates"]["dw"] < 21.0
    assert "dw" not in dequantized_inputs(on.model) and "dw" in dequantized_inputs(off.model)
    assert {"pre", "pw"} <= dequantized_inputs(on.model)          # the dense convs stay INT8
    assert off.report.depthwise is None
    db_on, db_off = sqnr(on.model, m, data).overall_db, sqnr(off.model, m, data).overall_db
    assert db_on > db_off + 10, (db_on, db_off)
    assert d["floated_db"] > d["all_quantized_db"] + 1.0
    line = [s for s in on.report.summary().splitlines() if s.startswith("kept float: 1 depthwise")]
    assert line and "% of the FLOPs" in line[0], on.report.summary()


def test_no_flops_are_spent_where_the_outputs_are_already_close_to_float(monkeypatch):
    m, data = crushed_depthwise(), data_for()
    monkeypatch.setattr(depthwise, "DEPTHWISE_ENOUGH_DB", -100.0)     # every output counts as close enough
    out = qdqgraph.quantize(m, data, **OFF)
    d = out.report.depthwise
    assert list(d["candidates"]) == ["dw"] and not d["kept_float"], d
    assert "dw" in dequantized_inputs(out.model)
    assert "stay INT8" in out.report.summary() and "already over -100 dB" in out.report.summary()


def test_a_balanced_depthwise_conv_stays_int8():
    m, data = crushed_depthwise(spread=1.0), data_for()
    out = qdqgraph.quantize(m, data, **OFF)
    d = out.report.depthwise
    assert d["checked"] == 1 and "candidates" not in d and d["lowest"]["dw"] > 25.0, d
    assert "dw" in dequantized_inputs(out.model)
    assert "depthwise" not in out.report.summary()


def test_no_check_without_real_data_or_in_weight_only_int4():
    m = crushed_depthwise()
    assert qdqgraph.quantize(m, "random", **OFF).report.depthwise is None


def test_the_cli_switch_reaches_the_config(tmp_path, capsys):
    m, data = crushed_depthwise(), data_for()
    mp, dp = tmp_path / "m.onnx", tmp_path / "calib.npz"
    onnx.save(m, mp)
    np.savez(dp, **data)
    assert config_of(build_parser().parse_args(["insert", str(mp), "--calib", str(dp)])).depthwise_check is True
    args = build_parser().parse_args(["insert", str(mp), "--calib", str(dp), "--depthwise-check", "off"])
    assert config_of(args).depthwise_check is False
    out = tmp_path / "out.onnx"
    assert main(["insert", str(mp), "--calib", str(dp), "-o", str(out), "--verify", "0"]) == 0
    assert "kept float: 1 depthwise convolution(s)" in capsys.readouterr().out
    assert main(["insert", str(mp), "--calib", str(dp), "-o", str(out), "--force", "--verify", "0",
                 "--depthwise-check", "off"]) == 0
    assert "depthwise" not in capsys.readouterr().out
    with pytest.raises(qdqgraph.QdqError, match="depthwise_check"):
        qdqgraph.QuantizeConfig(depthwise_check="sometimes")


@pytest.mark.parametrize("shape,cout,group,attrs", [
    ((2, 8, 9, 11), 8, 8, dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1])),                      # depthwise
    ((1, 8, 10, 10), 16, 8, dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 0, 2, 1])),     # multiplier 2
    ((1, 8, 12, 12), 8, 4, dict(kernel_shape=[5, 5], dilations=[2, 1], pads=[4, 2, 3, 2])),      # 2 per group
    ((1, 4, 11, 12), 4, 4, dict(kernel_shape=[4, 3], strides=[2, 2], auto_pad="SAME_LOWER")),
    ((2, 6, 20), 6, 6, dict(kernel_shape=[5], strides=[3], pads=[2, 2])),                         # 1-D
])
def test_grouped_conv_computes_what_onnxruntime_does(shape, cout, group, attrs):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(np.float32)
    w = rng.standard_normal((cout, shape[1] // group, *attrs["kernel_shape"])).astype(np.float32)
    b = rng.standard_normal(cout).astype(np.float32)
    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], name="c", group=group, **attrs)
    bare = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
                             [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                             [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    want = ort.InferenceSession(helper.make_model(bare, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    want_shape = want.shape
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(want_shape))],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    conv = next(n for n in io.load(model).graph.nodes if n.op == "Conv")
    got = grouped_conv(conv, x, w, b)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    flat = want.reshape(want.shape[0], want.shape[1], -1)
    at = np.sort(rng.choice(flat.shape[2], min(7, flat.shape[2]), replace=False))
    np.testing.assert_allclose(grouped_conv(conv, x, w, b, at), flat[:, :, at], rtol=1e-4, atol=1e-4)
