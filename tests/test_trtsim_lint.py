"""The Q/DQ linter: one positive and one negative graph per QDQ2xx code."""
import numpy as np
import pytest

import motifs
import qdqgraph
from qdqgraph import trtsim
from test_trtsim_rules import QG, S1, S2, conv_chain, residual, two_qs


def conv_qdq_bn():
    """conv -> Q/DQ -> BN -> relu: the Q/DQ splits what TensorRT would fuse (P4)."""
    g = QG("conv_qdq_bn")
    c = g.qconv(g.qdq(g.input("x", ["n", 8, 4, 4]), "x"), "c1")
    return g.head(g.node("Relu", [g.bn(g.qdq(c, "mid"), 8, "bn")], name="relu"))


def both_add_inputs_quantized():
    g = QG("both_add")
    stem = g.node("Relu", [g.qconv(g.qdq(g.input("x", ["n", 8, 4, 4]), "x"), "stem")], name="stem_relu")
    s = g.qdq(stem, "s")
    a = g.qconv(g.qdq(g.node("Relu", [g.qconv(s, "c1")], name="r1"), "a"), "c2")
    r = g.node("Relu", [g.node("Add", [g.qdq(a, "conv_side"), s], name="add")], name="r2")
    return g.head(r)


def concat_scales(scales):
    g = QG("concat_scales")
    x = g.qdq(g.input("x", ["n", 8, 4, 4]), "x")
    a = g.qdq(g.node("Relu", [g.qconv(x, "ca")], name="ra"), "a", scales[0])
    b = g.qdq(g.node("Relu", [g.qconv(x, "cb")], name="rb"), "b", scales[1])
    return g.head(g.node("Concat", [a, b], name="concat", axis=1), cin=16)


def quantized_bias(kind, quantized=True):
    g = QG("qbias")
    x = g.qdq(g.input("x", ["n", 8, 4, 4] if kind == "conv" else ["n", 16]), "x")
    b = g.const("b", np.full(8, 0.1, np.float32))
    b = g.qdq(b, "bias") if quantized else b
    if kind == "conv":
        g.node("Conv", [x, g.qweight("c1", (8, 8, 1, 1)), b], ["y"], name="c1", kernel_shape=[1, 1])
    else:
        y = g.node("MatMul", [x, g.qweight("fc", (16, 8), axis=1)], name="fc")
        g.node("Add", [y, b], ["y"], name="biasadd")
    g.output("y")
    return g.model(13)


def weight_dq(axis=True, zero_point=0, scale=None):
    """x -> Q/DQ -> conv with an INT8 weight whose DQ has the given axis / zero point / scale."""
    g = QG("weight_dq")
    x = g.qdq(g.input("x", ["n", 8, 4, 4]), "x")
    w8 = g.const("w8", np.ones((8, 8, 1, 1), np.int8))
    s = g.const("ws", np.full(8, 0.01, np.float32) if scale is None else np.asarray(scale, np.float32))
    z = g.const("wz", np.full(8, zero_point, np.int8))
    w = g.node("DequantizeLinear", [w8, s, z], name="w_dq", **({"axis": 0} if axis else {}))
    g.node("Conv", [x, w], ["y"], name="c1", kernel_shape=[1, 1])
    g.output("y")
    return g.model(13)


def act_scale(scale):
    g = QG("act_scale")
    g.node("Relu", [g.qdq(g.input("x", ["n", 8, 4, 4]), "x", scale)], ["y"], name="relu")
    g.output("y")
    return g.model(13)


def small_region(quantized=True):
    """A 16 -> 64 INT8 conv, a float Softmax and pool, then a 64 -> 8 Gemm (0.02% of the FLOPs),
    INT8 behind its own Q (a standalone reformat) or float."""
    g = QG("small_region")
    x = g.qdq(g.input("x", ["n", 16, 16, 16]), "x")
    c = g.node("Conv", [x, g.qweight("conv", (64, 16, 3, 3))], name="conv", kernel_shape=[3, 3], pads=[1] * 4)
    f = g.node("Flatten", [g.node("GlobalAveragePool", [g.node("Softmax", [c], name="softmax", axis=1)],
                                  name="gap")], name="flat")
    f = g.qdq(f, "head_in") if quantized else f
    g.node("Gemm", [f, g.qweight("head", (8, 64), "qdq" if quantized else "float")], ["y"], name="head", transB=1)
    g.output("y")
    return g.model(13)


def attention_model(**options):
    import qdqgraph
    m = motifs.attention_block(mask=True)
    return qdqgraph.quantize(m, motifs.sample_data(m), high_precision="fp32", **options).model


def quantized_mask():
    """qdqgraph's attention output with a Q/DQ put on the mask by hand."""
    import onnx
    from onnx import helper, numpy_helper
    m = attention_model()
    s = numpy_helper.from_array(np.array(S1, np.float32), "m.s")
    z = numpy_helper.from_array(np.array(0, np.int8), "m.z")
    m.graph.initializer.extend([s, z])
    add = next(n for n in m.graph.node if n.name == "mask_add")
    src = add.input[1]
    q = helper.make_node("QuantizeLinear", [src, "m.s", "m.z"], ["mask_q8"], name="mask_q")
    dq = helper.make_node("DequantizeLinear", ["mask_q8", "m.s", "m.z"], ["mask_dq8"], name="mask_dq")
    add.input[1] = "mask_dq8"
    nodes = list(m.graph.node)
    at = nodes.index(add)
    del m.graph.node[:]
    m.graph.node.extend(nodes[:at] + [q, dq] + nodes[at:])
    onnx.checker.check_model(m)
    return m


# code -> (positive graph, node the diagnostic names), negative graph
CASES = {
    "QDQ210": ((lambda: attention_model(exclude_nodes=["^pv$"]), "qk"), attention_model),
    "QDQ211": ((quantized_mask, "mask_dq"), attention_model),
    "QDQ201": ((conv_qdq_bn, "mid_q"), lambda: conv_chain(bn=True)),
    "QDQ202": ((both_add_inputs_quantized, "add"), residual),
    "QDQ203": ((lambda: concat_scales((S1, S2)), "concat"), lambda: concat_scales((S1, S1))),
    "QDQ204": ((lambda: two_qs((S1, S2)), "a_q"), two_qs),
    "QDQ205": ((lambda: quantized_bias("conv"), "bias_dq"), lambda: quantized_bias("conv", quantized=False)),
    "QDQ206": ((lambda: weight_dq(axis=False), "w_dq"), weight_dq),
    "QDQ207": ((lambda: weight_dq(zero_point=3), "w_dq"), weight_dq),
    "QDQ208": ((lambda: act_scale(0.0), "x_q"), lambda: act_scale(S1)),
    "QDQ209": ((small_region, "head_in_q"), lambda: small_region(quantized=False)),
}


REGION = qdqgraph.load_ruleset().region     # QDQ209 reads the P14 rule's share


def test_region_findings_need_the_region_rule():
    (build, _), _ = CASES["QDQ209"]
    assert [d for d in trtsim.lint(build()) if d.code == "QDQ209"] == []


@pytest.mark.parametrize("code", sorted(CASES))
def test_code_positive(code):
    (build, node), _ = CASES[code]
    found = [d for d in trtsim.lint(build(), region=REGION) if d.code == code]
    assert found, f"{code} not reported"
    assert found[0].node == node and found[0].message and found[0].fix


@pytest.mark.parametrize("code", sorted(CASES))
def test_code_negative(code):
    _, build = CASES[code]
    assert [d for d in trtsim.lint(build(), region=REGION) if d.code == code] == []


def test_quantized_bias_add_after_a_matmul():
    assert [d.node for d in trtsim.lint(quantized_bias("matmul")) if d.code == "QDQ205"] == ["bias_dq"]
    assert [d for d in trtsim.lint(quantized_bias("matmul", quantized=False)) if d.code == "QDQ205"] == []


@pytest.mark.parametrize("scale", [-0.1, float("nan"), float("inf")])
def test_every_bad_scale_is_reported(scale):
    assert [d.code for d in trtsim.lint(act_scale(scale))].count("QDQ208") == 2     # its Q and its DQ


def test_codes_are_documented_and_diagnostics_print_their_fix():
    import importlib
    module = importlib.import_module("qdqgraph.trtsim.lint")
    for code in CASES:
        assert f"| {code} |" in module.__doc__
    d = trtsim.lint(conv_qdq_bn())[0]
    assert str(d).startswith("QDQ201 mid_q: ") and "(fix: " in str(d)
