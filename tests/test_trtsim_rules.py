"""Simulator rules (rules/tensorrt/*.toml): every rule id has a positive case (it fires on the node)
and a negative one (it does not, and the reason says why), on tiny Q/DQ graphs built here."""
import numpy as np
import pytest

import motifs
from qdqgraph import trtsim
from qdqgraph.errors import QdqError
from qdqgraph.trtsim.rules import load_sim_rules

S1, S2 = 0.05, 0.07        # two different activation scales


class QG(motifs.G):
    """motifs.G plus Q/DQ: activations per-tensor, weights per-channel (float Q/DQ or INT8 + DQ)."""

    def qdq(self, x, name, scale=S1):
        s = self.const(f"{name}.s", np.array(scale, np.float32))
        z = self.const(f"{name}.z", np.array(0, np.int8))
        q = self.node("QuantizeLinear", [x, s, z], name=f"{name}_q")
        return self.node("DequantizeLinear", [q, s, z], name=f"{name}_dq")

    def qweight(self, name, shape, mode="qdq", axis=0):
        w = (self.rng.standard_normal(shape) * 0.3).astype(np.float32)
        if mode == "float":
            return self.const(f"{name}.w", w)
        amax = np.abs(w).max(axis=tuple(d for d in range(w.ndim) if d != axis))
        scale = (amax / 127).astype(np.float32)
        s = self.const(f"{name}.ws", scale)
        z = self.const(f"{name}.wz", np.zeros(scale.shape, np.int8))
        if mode == "int8":
            shaped = scale.reshape([-1 if d == axis else 1 for d in range(w.ndim)])
            src = self.const(f"{name}.w8", np.clip(np.rint(w / shaped), -128, 127).astype(np.int8))
        else:
            src = self.node("QuantizeLinear", [self.const(f"{name}.w", w), s, z], name=f"{name}.w_q", axis=axis)
        return self.node("DequantizeLinear", [src, s, z], name=f"{name}.w_dq", axis=axis)

    def qconv(self, x, name, cin=8, cout=8, mode="qdq", **attrs):
        return self.node("Conv", [x, self.qweight(name, (cout, cin, 1, 1), mode)], name=name, kernel_shape=[1, 1], **attrs)

    def head(self, x, name="head", cin=8):
        """A final quantized conv that reads x through its own Q/DQ."""
        self.node("Conv", [self.qdq(x, f"{name}_in"), self.qweight(name, (8, cin, 1, 1))], ["y"], name=name,
                  kernel_shape=[1, 1])
        self.output("y")
        return self.model(13)


def sim(model):
    return trtsim.simulate(model)


# ---------------------------------------------------------------------------- graphs

def conv_chain(weights="qdq", act="Relu", bn=False):
    """x -> Q/DQ -> c1 [-> bn] [-> act] -> Q/DQ(h) -> head"""
    g = QG("conv_chain")
    y = g.qconv(g.qdq(g.input("x", ["n", 8, 4, 4]), "x"), "c1", mode=weights)
    if bn:
        y = g.bn(y, 8, "bn")
    if act:
        y = g.node(act, [y], name="act")
    g.node("Conv", [g.qdq(y, "h"), g.qweight("head", (8, 8, 1, 1))], ["y"], name="head", kernel_shape=[1, 1])
    g.output("y")
    return g.model(13)


def conv_fanout(first="Relu"):
    """c1's output feeds `first` and a Sigmoid: nothing can fuse into c1."""
    g = QG("conv_fanout")
    y = g.qconv(g.qdq(g.input("x", ["n", 8, 4, 4]), "x"), "c1")
    a = g.bn(y, 8, "first") if first == "BatchNormalization" else g.node(first, [y], name="first")
    g.node("Sigmoid", [y], ["y2"], name="other")
    g.output("y2")
    return g.head(a)


def swish(with_mul=True):
    g = QG("swish")
    c = g.qconv(g.qdq(g.input("x", ["n", 8, 4, 4]), "x"), "c1")
    s = g.node("Sigmoid", [c], name="sig")
    y = g.node("Mul", [c, s], name="silu") if with_mul else s
    return g.head(y)


def hardswish(escape=False):
    """c1 -> x * Clip(x + 3, 0, 6) / 6 (HardSwish as exporters write it out) -> Q/DQ -> head;
    with `escape`, the Clip output also leaves the region (two outputs: no single PointWise)."""
    g = QG("hardswish")
    c = g.qconv(g.qdq(g.input("x", ["n", 8, 4, 4]), "x"), "c1")
    a = g.node("Add", [c, g.const("three", np.array(3, np.float32))], name="hs_add")
    k = g.node("Clip", [a, g.const("lo", np.array(0, np.float32)), g.const("hi", np.array(6, np.float32))], name="hs_clip")
    m = g.node("Mul", [c, k], name="hs_mul")
    y = g.node("Div", [m, g.const("six", np.array(6, np.float32))], name="hs_div")
    if escape:
        g.node("Sigmoid", [k], ["y2"], name="escape")
        g.output("y2")
    return g.head(y)


def conv_mul_activation():
    g = QG("conv_mul")
    c = g.qconv(g.qdq(g.input("x", ["n", 8, 4, 4]), "x"), "c1")
    return g.head(g.node("Mul", [c, g.input("x2", ["n", 8, 4, 4])], name="mul"))


def matmul_bias():
    g = QG("matmul_bias")
    x = g.qdq(g.input("x", ["n", 16]), "x")
    y = g.node("MatMul", [x, g.qweight("fc", (16, 8), axis=1)], name="fc")
    g.node("Add", [y, g.const("fc.b", np.zeros(8, np.float32))], ["y"], name="bias")
    g.output("y")
    return g.model(13)


def conv_scale():
    g = QG("conv_scale")
    c = g.qconv(g.qdq(g.input("x", ["n", 8, 4, 4]), "x"), "c1")
    return g.head(g.node("Mul", [c, g.const("k", np.full((1, 8, 1, 1), 0.5, np.float32))], name="scale"))


def residual(quant_skip=True, tail="head", broadcast=False):
    """stem -> relu -> {c1 -> relu -> c2, skip} -> Add -> relu -> tail (skip: through c1's Q/DQ, or float)"""
    g = QG("residual")
    stem = g.node("Relu", [g.qconv(g.qdq(g.input("x", ["n", 8, 4, 4]), "x"), "stem")], name="stem_relu")
    s = g.qdq(stem, "s")
    a = g.node("Relu", [g.qconv(s, "c1")], name="r1")
    a = g.qconv(g.qdq(a, "a"), "c2")
    skip = s if quant_skip else stem
    if broadcast:
        skip = g.node("GlobalAveragePool", [skip], name="gap_skip")
    r = g.node("Relu", [g.node("Add", [a, skip], name="add")], name="r2")
    if tail == "gap":
        g.node("GlobalAveragePool", [r], ["y"], name="gap")
        g.output("y")
        return g.model(13)
    return g.head(r, "head")


def pool(act=True, fanout=False):
    """c1 [-> relu] -> MaxPool -> Q/DQ -> head"""
    g = QG("pool")
    y = g.qconv(g.qdq(g.input("x", ["n", 8, 4, 4]), "x"), "c1")
    if act:
        y = g.node("Relu", [y], name="relu")
    p = g.node("MaxPool", [y], name="pool", kernel_shape=[2, 2], strides=[2, 2])
    if fanout:
        g.node("Sigmoid", [p], ["y2"], name="other")
        g.output("y2")
    return g.head(p)


def concat(from_inputs=False):
    g = QG("concat")
    if from_inputs:
        a, b = g.input("xa", ["n", 8, 4, 4]), g.input("xb", ["n", 8, 4, 4])
    else:
        x = g.qdq(g.input("x", ["n", 8, 4, 4]), "x")
        a = g.node("Relu", [g.qconv(x, "ca")], name="ra")
        b = g.node("Relu", [g.qconv(x, "cb")], name="rb")
    c = g.node("Concat", [a, b], name="concat", axis=1)
    return g.head(c, cin=16)


def concat_float():
    g = QG("concat_float")
    x = g.qdq(g.input("x", ["n", 8, 4, 4]), "x")
    a = g.node("Relu", [g.qconv(x, "ca")], name="ra")
    b = g.node("Relu", [g.qconv(x, "cb")], name="rb")
    g.node("Softmax", [g.node("Concat", [a, b], name="concat", axis=1)], ["y"], name="softmax", axis=1)
    g.output("y")
    return g.model(13)


def concat_dq(scales=(S1, S1)):
    g = QG("concat_dq")
    a = g.qdq(g.input("xa", ["n", 8, 4, 4]), "a", scales[0])
    b = g.qdq(g.input("xb", ["n", 8, 4, 4]), "b", scales[1])
    g.node("Softmax", [g.node("Concat", [a, b], name="concat", axis=1)], ["y"], name="softmax", axis=1)
    g.output("y")
    return g.model(13)


def gap_flatten_gemm(fc=True):
    g = QG("gap_flatten")
    y = g.node("Relu", [g.qconv(g.qdq(g.input("x", ["n", 8, 4, 4]), "x"), "c1")], name="relu")
    f = g.node("Flatten", [g.node("GlobalAveragePool", [y], name="gap")], name="flat", axis=1)
    if fc:
        g.node("Gemm", [g.qdq(f, "f"), g.qweight("fc", (4, 8)), g.const("fc.b", np.zeros(4, np.float32))], ["y"],
               name="fc", transB=1)
    else:
        g.node("Relu", [f], ["y"], name="after")
    g.output("y")
    return g.model(13)


def pad(mode="reflect"):
    g = QG("pad")
    y = g.node("Relu", [g.qconv(g.qdq(g.input("x", ["n", 8, 4, 4]), "x"), "c1")], name="relu")
    p = g.node("Pad", [y, g.const("pads", np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64))], name="pad", mode=mode)
    return g.head(p)


def resize(mode="nearest", dq_first=False):
    """c1 -> Relu -> Resize(x2) -> Q/DQ -> head (Q backward), or x -> Q/DQ -> Resize -> conv (DQ forward)."""
    g = QG("resize")
    scales = g.const("scales", np.array([1, 1, 2, 2], np.float32))
    if dq_first:
        r = g.node("Resize", [g.qdq(g.input("x", ["n", 8, 4, 4]), "x"), "", scales], name="rs", mode=mode)
        g.node("Conv", [r, g.qweight("c2", (8, 8, 1, 1))], ["y"], name="c2", kernel_shape=[1, 1])
        g.output("y")
        return g.model(13)
    y = g.node("Relu", [g.qconv(g.qdq(g.input("x", ["n", 8, 4, 4]), "x"), "c1")], name="relu")
    return g.head(g.node("Resize", [y, "", scales], name="rs", mode=mode))


def transpose(to_output=False, quantized=True):
    """x (NHWC) -> Q/DQ -> Transpose -> conv, as tf2onnx writes a network input."""
    g = QG("transpose")
    x = g.input("x", ["n", 4, 4, 8])
    x = g.qdq(x, "x") if quantized else g.node("Relu", [x], name="relu")
    if to_output:
        g.node("Transpose", [x], ["y"], name="tr", perm=[0, 3, 1, 2])
        g.output("y")
        return g.model(13)
    t = g.node("Transpose", [x], name="tr", perm=[0, 3, 1, 2])
    if not quantized:
        g.node("Softmax", [t], ["y"], name="softmax", axis=1)
        g.output("y")
        return g.model(13)
    g.node("Conv", [t, g.qweight("c1", (8, 8, 1, 1))], ["y"], name="c1", kernel_shape=[1, 1])
    g.output("y")
    return g.model(13)


def maxpool_dq(to_output=False):
    g = QG("maxpool_dq")
    x = g.qdq(g.input("x", ["n", 8, 4, 4]), "x")
    if to_output:
        g.node("MaxPool", [x], ["y"], name="pool", kernel_shape=[2, 2])
    else:
        p = g.node("MaxPool", [x], name="pool", kernel_shape=[2, 2])
        g.node("Conv", [p, g.qweight("c1", (8, 8, 1, 1))], ["y"], name="c1", kernel_shape=[1, 1])
    g.output("y")
    return g.model(13)


def dq_q(s1=S1, s2=S2):
    """x -> Q(s1) -> DQ(s1) -> Q(s2) -> DQ(s2) -> conv"""
    g = QG("dq_q")
    y = g.qdq(g.qdq(g.input("x", ["n", 8, 4, 4]), "a", s1), "b", s2)
    g.node("Conv", [y, g.qweight("c1", (8, 8, 1, 1))], ["y"], name="c1", kernel_shape=[1, 1])
    g.output("y")
    return g.model(13)


def conv_requant(shared=False):
    """c1 -> relu -> Q(s1) -> DQ(s1) -> Q(s2) -> DQ(s2) -> head [and Q(s1) -> DQ -> side conv]"""
    g = QG("conv_requant")
    r = g.node("Relu", [g.qconv(g.qdq(g.input("x", ["n", 8, 4, 4]), "x"), "c1")], name="relu")
    a = g.qdq(r, "a", S1)
    if shared:
        s = g.const("side.s", np.array(S1, np.float32))
        z = g.const("side.z", np.array(0, np.int8))
        side = g.node("DequantizeLinear", ["a_q_out", s, z], name="side_dq")
        g.node("Conv", [side, g.qweight("side", (8, 8, 1, 1))], ["y2"], name="side", kernel_shape=[1, 1])
        g.output("y2")
    return g.head(g.qdq(a, "b", S2), "head")


def two_qs(scales=(S1, S1)):
    g = QG("two_qs")
    x = g.input("x", ["n", 8, 4, 4])
    g.node("Conv", [g.qdq(x, "a", scales[0]), g.qweight("c1", (8, 8, 1, 1))], ["y1"], name="c1", kernel_shape=[1, 1])
    g.node("Conv", [g.qdq(x, "b", scales[1]), g.qweight("c2", (8, 8, 1, 1))], ["y2"], name="c2", kernel_shape=[1, 1])
    g.output("y1"), g.output("y2")
    return g.model(13)


def quantized_op(op="AveragePool", out="q", second="dq", **attrs):
    """c1 -> relu -> Q/DQ -> op [, second input] -> Q/DQ -> head | -> Sigmoid | graph output"""
    g = QG("quantized_op")
    r = g.node("Relu", [g.qconv(g.qdq(g.input("x", ["n", 8, 4, 4]), "x"), "c1")], name="relu")
    ins = [g.qdq(r, "r")]
    if op in ("Add", "Mul"):
        x2 = g.input("x2", ["n", 8, 4, 4])
        ins.append(g.qdq(x2, "x2", S2) if second == "dq" else x2)
    if op == "AveragePool":
        attrs.setdefault("kernel_shape", [2, 2])
    if out == "graph":
        g.node(op, ins, ["y"], name="op", **attrs)
        g.output("y")
        return g.model(13)
    y = g.node(op, ins, name="op", **attrs)
    if out == "sigmoid":
        g.node("Sigmoid", [y], ["y"], name="after")
        g.output("y")
        return g.model(13)
    return g.head(y, cin=1 if attrs.get("axes") == [1] else 8)


def conv_no_op(op="Identity", training=False):
    """x -> Q/DQ -> c1 -> Identity (or Dropout) -> Relu -> Q/DQ(h) -> head, as exporters write it"""
    g = QG("conv_no_op")
    y = g.qconv(g.qdq(g.input("x", ["n", 8, 4, 4]), "x"), "c1")
    extra = [g.const("ratio", np.array(0.5, np.float32)), g.const("train", np.array(training))] if op == "Dropout" else []
    y = g.node(op, [y] + extra, name="noop")
    return g.head(g.node("Relu", [y], name="act"))


# rule id -> (positive: graph factory, node), (negative: graph factory, node, words the reason contains)
def quantized_attention(**options):
    """qdqgraph's own output for the attention motif with a mask (fp32 islands)."""
    import qdqgraph
    m = motifs.attention_block(mask=True)
    options = {"output_aware": False, "int8_attention": "on", **options}
    return qdqgraph.quantize(m, motifs.sample_data(m), high_precision="fp32", **options).model


CASES = {
    "F10-fused-attention": ((quantized_attention, "qk"),
                            (lambda: quantized_attention(exclude_nodes=["^pv$"]), "qk", "is float, so the fused INT8")),
    "S0-no-op": ((conv_no_op, "noop"), (lambda: conv_no_op("Dropout", training=True), "noop", "training mode")),
    "S1-fold-weight-qdq": ((conv_chain, "c1.w_q"), (lambda: conv_chain("int8"), "c1.w_dq", "not come from a Q")),
    "S1-fold-weight-int8": ((lambda: conv_chain("int8"), "c1.w_dq"), (conv_chain, "c1.w_dq", "is not a constant")),
    "R5c-merge-q": ((two_qs, "b_q"), (lambda: two_qs((S1, S2)), "b_q", "same parameters")),
    "R2-maxpool-q": ((pool, "head_in_q"), (lambda: pool(fanout=True), "head_in_q", "float consumer (R5-b)")),
    "R6-concat-q": ((concat, "head_in_q"), (lambda: concat(from_inputs=True), "head_in_q", "graph input (R5-d)")),
    "R2-copy-q": ((lambda: pad("constant"), "head_in_q"), (pad, "head_in_q", "Pad mode is reflect")),
    "R2-resize-q": ((resize, "head_in_q"), (lambda: resize("linear"), "head_in_q", "not nearest")),
    "R2-resize-dq": ((lambda: resize(dq_first=True), "rs"), (lambda: resize("linear", dq_first=True), "rs", "not nearest")),
    "R2-maxpool-dq": ((maxpool_dq, "pool"), (lambda: maxpool_dq(to_output=True), "pool", "graph output (R5-d)")),
    "R6-concat-dq": ((concat_dq, "concat"), (lambda: concat_dq((S1, S2)), "concat", "different scales")),
    "R2-copy-dq": ((transpose, "tr"), (lambda: transpose(to_output=True), "tr", "graph output (R5-d)")),
    "F5-cancel": ((lambda: dq_q(S1, S1), "b_q"), (dq_q, "b_q", "different scales")),
    "F5-requantize": ((dq_q, "b_q"), (lambda: dq_q(S1, S1), "b_q", "same_params_as_input holds")),
    "F1-weighted-int8": ((conv_chain, "c1"), (lambda: conv_chain("float"), "c1", "is float (no Q/DQ on it)")),
    "F1-weighted-float": ((lambda: conv_chain("float"), "c1"), (conv_chain, "c1", "F1-weighted-int8 layer")),
    "F2-batchnorm": ((lambda: conv_chain(bn=True), "bn"), (lambda: conv_fanout("BatchNormalization"), "first", "also feeds")),
    "F2-bias": ((matmul_bias, "bias"), (residual, "add", "2 activation inputs")),
    "F2-scale": ((conv_scale, "scale"), (conv_mul_activation, "mul", "2 activation inputs")),
    "F2-swish": ((swish, "sig"), (lambda: swish(with_mul=False), "sig", "does not feed exactly the gate")),
    "F2-activation": ((conv_chain, "act"), (conv_fanout, "first", "also feeds")),
    "F2-pointwise-region": ((hardswish, "hs_add"), (lambda: hardswish(escape=True), "hs_add", "2 outputs, not one")),
    "F2-residual-add": ((residual, "add"), (lambda: residual(broadcast=True), "add", "broadcasting Add")),
    "F2-output-q": ((conv_chain, "h_q"), (lambda: residual(quant_skip=False), "head_in_q", "is float, so the output is float (F3)")),
    "F3-residual-dq": ((residual, "s_dq"), (lambda: residual(tail="gap"), "s_dq", "output is float")),
    "F2-conv-act-pool": ((pool, "pool"), (lambda: pool(act=False), "pool", "no activation between")),
    "F5-requant-fuse": ((conv_requant, "b_q"), (lambda: conv_requant(shared=True), "b_q", "also feeds")),
    "F2-fc-reshape": ((gap_flatten_gemm, "flat"), (lambda: gap_flatten_gemm(fc=False), "flat", "does not feed one gemm")),
    "F4-pool": ((quantized_op, "op"), (lambda: quantized_op(out="sigmoid"), "op", "not one Q")),
    "F4-reduce-mean": ((lambda: quantized_op("ReduceMean", axes=[2, 3], keepdims=1), "op"),
                       (lambda: quantized_op("ReduceMean", axes=[1], keepdims=1), "op", "not the spatial axes")),
    "F4-eltwise": ((lambda: quantized_op("Add"), "op"), (lambda: quantized_op("Add", second="float"), "op", "is float")),
    "F4-activation": ((lambda: quantized_op("Sigmoid"), "op"), (lambda: quantized_op("Sigmoid", out="graph"), "op", "graph output")),
    "R6-concat-buffer": ((concat, "concat"), (concat_float, "concat", "runs in float")),
    "R2-int8-data-movement": ((transpose, "tr"), (lambda: transpose(quantized=False), "tr", "runs in float")),
    "F9-float": ((lambda: transpose(quantized=False), "tr"), (conv_chain, "x_q", "a Q/DQ node")),
    "F6-reformat": ((conv_chain, "x_q"), (conv_chain, "h_q", "F1-weighted-int8 layer")),
}


def test_every_rule_has_cases():
    ids = set(load_sim_rules().by_id)
    assert ids == set(CASES), f"rules without cases: {ids - set(CASES)}; cases without rules: {set(CASES) - ids}"


@pytest.mark.parametrize("rule_id", sorted(CASES))
def test_rule_positive(rule_id):
    (build, node), _ = CASES[rule_id]
    report = sim(build())
    ok, why = report.explain(rule_id, node)
    assert ok, f"{rule_id} should apply to {node}: {why}\n{report.table()}"


@pytest.mark.parametrize("rule_id", sorted(CASES))
def test_rule_negative(rule_id):
    _, (build, node, words) = CASES[rule_id]
    report = sim(build())
    ok, why = report.explain(rule_id, node)
    assert not ok, f"{rule_id} should not apply to {node}\n{report.table()}"
    assert words in why, f"{rule_id} on {node}: {why!r} does not say {words!r}"


# ---------------------------------------------------------------------------- what the rules change

def test_int8_attention_is_one_layer_with_int8_q_k_v_and_the_mask_as_it_is():
    report = sim(quantized_attention())
    layer = report.layer_of("qk")
    assert layer.kind == "attention" and layer.rule == "F10-fused-attention"
    assert {"qk", "scale", "mask_add", "softmax", "pv"} <= set(layer.nodes)
    assert [p.precision for p in layer.inputs] == ["int8", "int8", "int8", "fp32"]   # q, k, v; the mask
    assert report.summary["reformats_inside"] == 0, report.table()
    # without the probabilities' Q the GEMMs stay apart and the Softmax output is read in float
    partial = sim(quantized_attention(exclude_nodes=["^pv$"]))
    assert partial.layer_of("qk").kind == "matmul" and partial.layer_of("softmax").kind == "softmax"


def test_decomposed_hardswish_fuses_into_the_conv_with_an_int8_output():
    report = sim(hardswish())
    layer = report.layer_of("hs_div")
    assert layer is report.layer_of("c1") and layer.outputs[0].precision == "int8"
    assert report.summary["reformats_inside"] == 0


@pytest.mark.parametrize("op", ["Identity", "Dropout"])
def test_a_no_op_between_conv_and_relu_does_not_stop_the_fusion(op):
    layers = {x.name: x for x in sim(conv_no_op(op)).layers}
    conv = next(x for x in layers.values() if "c1" in x.nodes)
    assert "act" in conv.nodes and "noop" not in conv.nodes, conv.nodes
    assert conv.outputs[0].precision == "int8"
    assert not any("noop" in x.nodes for x in layers.values())


def test_a_dropout_in_training_mode_stays_a_layer_and_splits_conv_from_relu():
    layers = sim(conv_no_op("Dropout", training=True)).layers
    conv = next(x for x in layers if "c1" in x.nodes)
    assert "act" not in conv.nodes


def test_a_nearest_resize_runs_int8_between_two_int8_convs():
    layers = sim(resize()).layers
    rs = next(x for x in layers if x.nodes == ["rs"])
    assert rs.kind == "resize" and rs.inputs[0].precision == rs.outputs[0].precision == "int8"
    assert not [x for x in layers if x.reformat and not x.at_graph_io]


def test_a_float_layer_takes_no_output_scale():
    report = sim(conv_chain("float"))
    assert report.layer_of("h_q").reformat
    assert "runs in float" in dict(report.layer_of("h_q").why)["F2-output-q"]


def test_residual_precision_follows_the_residual():
    """F3: quantized skip -> INT8 in/out and no reformat; float skip -> float out + a Q Reformat."""
    q = sim(residual()).layer_of("add")
    f_report = sim(residual(quant_skip=False))
    f = f_report.layer_of("add")
    assert [p.precision for p in q.inputs] == ["int8", "int8"] and q.outputs[0].precision == "int8"
    assert [p.precision for p in f.inputs] == ["int8", "fp32"] and f.outputs[0].precision == "fp32"
    assert f_report.layer_of("head_in_q").reformat


def test_shared_scale_concat_has_no_reformat_and_unequal_scales_requantize():
    same = sim(concat())
    assert same.summary["reformats_inside"] == 0
    g = QG("concat_scales")
    x = g.qdq(g.input("x", ["n", 8, 4, 4]), "x")
    a = g.qdq(g.node("Relu", [g.qconv(x, "ca")], name="ra"), "a", S1)
    b = g.qdq(g.node("Relu", [g.qconv(x, "cb")], name="rb"), "b", S2)
    report = sim(g.head(g.node("Concat", [a, b], name="concat", axis=1), cin=16))
    requants = [e for e in report.events if e["rule"] == "F5-requantize"]
    assert requants, report.table()      # one input's DQ(s) -> Q(s_out) differs: a requantize (R6)


def test_rule_file_errors_name_file_line_and_rule(tmp_path):
    f = tmp_path / "x.toml"
    f.write_text('schema = 1\n\n[[rule]]\nid = "X1"\ndoc = "d"\nref = "r"\naction = "epilogue"\nop = "conv"\n'
                 'when = ["no_such"]\n')
    with pytest.raises(QdqError, match=r"x.toml:4 rule X1: unknown condition 'no_such'"):
        load_sim_rules([f])
    for bad, words in (('action = "fly"', "unknown action"), ('op = "no_class"', "unknown op class"),
                       ("extra = 1", "unknown key"), ('doc = ""', "missing doc"), ("when = \"x\"", "list of strings"),
                       ("op = 5", "must be a string")):
        key = bad.split(" ")[0]
        body = {"id": '"X1"', "doc": '"d"', "ref": '"r"', "action": '"epilogue"', "op": '"conv"'}
        body[key] = bad.split(" = ", 1)[1]
        f.write_text("schema = 1\n[[rule]]\n" + "".join(f"{k} = {v}\n" for k, v in body.items()))
        with pytest.raises(QdqError, match=words):
            load_sim_rules([f])


def test_user_rule_file_replaces_a_bundled_rule(tmp_path):
    """A user file turns ConvActPool off by replacing F2-conv-act-pool with an impossible condition."""
    f = tmp_path / "mine.toml"
    f.write_text('schema = 1\n[[rule]]\nid = "F2-conv-act-pool"\ndoc = "off"\nref = "test"\naction = "post_pool"\n'
                 'op = "max_pool"\nwhen = ["requant"]\n')
    rules = load_sim_rules([f])
    assert rules.by_id["F2-conv-act-pool"].doc == "off"
    report = trtsim.simulate(pool(), rules=rules)
    assert report.layer_of("pool").rule == "R2-int8-data-movement"
    assert sim(pool()).layer_of("pool").rule == "F1-weighted-int8"


def test_rules_for_an_op_type_keep_file_order_and_leave_out_other_classes(tmp_path):
    """SimRuleSet.for_op: the rules of an action whose op class holds the op type ("any" holds
    every one), in file order; another op type gets its own answer, not the first one asked."""
    from qdqgraph.ops import vocabulary
    f = tmp_path / "mine.toml"
    f.write_text('schema = 1\n[[rule]]\nid = "U-any"\ndoc = "d"\nref = "r"\naction = "epilogue"\nop = "any"\n'
                 'when = ["requant"]\n')
    rules, vocab = load_sim_rules([f]), vocabulary()
    epilogue = rules.for_action("epilogue")
    relu = rules.for_op("epilogue", vocab, "Relu")
    assert relu == tuple(r for r in epilogue if r.op == "any" or vocab.is_("Relu", r.op))
    assert relu[0].id == "U-any" and "F2-activation" in {r.id for r in relu}
    add = rules.for_op("epilogue", vocab, "Add")
    assert "F2-residual-add" in {r.id for r in add} and "F2-residual-add" not in {r.id for r in relu}
    assert {r.id for r in rules.for_op("epilogue", vocab, "NoSuchOp")} == {"U-any", "F2-pointwise-region"}
    assert rules.for_op("epilogue", vocab, "Relu") is relu          # found once per op type


def test_the_vocabulary_takes_nodes_op_names_and_str_subclasses():
    from qdqgraph.ops import vocabulary
    from qdqgraph.trtsim.ir import SNode
    vocab = vocabulary()
    assert vocab.is_("Conv", "weighted") and vocab.is_(np.str_("Conv"), "weighted")
    assert vocab.is_(SNode("c", "Conv", [], []), "weighted") and not vocab.is_(SNode("r", "Relu", [], []), "weighted")
    with pytest.raises(KeyError, match="unknown op class 'no_class'"):
        vocab.is_("Conv", "no_class")
