"""Tiny graphs, one factory per motif, built in code with onnx.helper (seeded weights)."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

RNG_SEED = 0


class G:
    """A small graph builder: add nodes and constants, then .model()."""

    def __init__(self, name, seed=RNG_SEED):
        self.name = name
        self.rng = np.random.default_rng(seed)
        self.nodes, self.inits, self.inputs, self.outputs = [], [], [], []

    def input(self, name, shape, dtype=TensorProto.FLOAT):
        self.inputs.append(helper.make_tensor_value_info(name, dtype, shape))
        return name

    def output(self, name, dtype=TensorProto.FLOAT, shape=None):
        self.outputs.append(helper.make_tensor_value_info(name, dtype, shape))
        return name

    def const(self, name, value):
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def weight(self, name, shape, scale=0.3):
        return self.const(name, (self.rng.standard_normal(shape) * scale).astype(np.float32))

    def node(self, op, inputs, outputs=None, name=None, **attrs):
        name = name or f"{op.lower()}{len(self.nodes)}"
        outputs = outputs or [f"{name}_out"]
        self.nodes.append(helper.make_node(op, inputs, outputs, name=name, **attrs))
        return outputs[0] if len(outputs) == 1 else outputs

    def conv(self, x, cin, cout, name, k=3, bias=True, **attrs):
        ins = [x, self.weight(f"{name}.w", (cout, cin // attrs.get("group", 1), k, k))]
        if bias:
            ins.append(self.weight(f"{name}.b", (cout,), 0.1))
        return self.node("Conv", ins, name=name, kernel_shape=[k, k], pads=[k // 2] * 4, **attrs)

    def bn(self, x, c, name):
        r = self.rng
        return self.node("BatchNormalization", [
            x, self.const(f"{name}.s", (1 + 0.2 * r.standard_normal(c)).astype(np.float32)),
            self.const(f"{name}.b", (0.1 * r.standard_normal(c)).astype(np.float32)),
            self.const(f"{name}.m", (0.1 * r.standard_normal(c)).astype(np.float32)),
            self.const(f"{name}.v", (1 + r.random(c)).astype(np.float32))], name=name, epsilon=1e-5)

    def model(self, opset=17):
        g = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, self.inits)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
        m.ir_version = 8
        done = onnx.shape_inference.infer_shapes(m).graph
        inferred = {v.name: v for v in list(done.value_info) + list(done.output)}
        for o in m.graph.output:  # outputs declared without a shape get the inferred one
            if not o.type.tensor_type.HasField("shape") and o.name in inferred:
                o.CopyFrom(inferred[o.name])
        onnx.checker.check_model(m, full_check=True)
        return m


def conv_relu(opset=17, c=16):
    g = G("conv_relu")
    x = g.input("x", ["n", c, 8, 8])
    y = g.conv(x, c, c, "conv")
    g.node("Relu", [y], ["y"], name="relu")
    g.output("y")
    return g.model(opset)


def conv_bn_relu():
    g = G("conv_bn_relu")
    x = g.input("x", ["n", 16, 8, 8])
    y = g.bn(g.conv(x, 16, 32, "conv", bias=False), 32, "bn")
    g.node("Relu", [y], ["y"], name="relu")
    g.output("y")
    return g.model()


def residual_add(projection=False, c=16):
    """conv1 -> relu -> conv2 (+ skip or projection conv) -> add -> relu -> conv3."""
    g = G("residual_add")
    x = g.input("x", ["n", c, 8, 8])
    stem = g.node("Relu", [g.conv(x, c, c, "stem")], name="stem_relu")
    a = g.node("Relu", [g.conv(stem, c, c, "conv1")], name="relu1")
    a = g.conv(a, c, c, "conv2")
    skip = g.conv(stem, c, c, "proj", k=1) if projection else stem
    s = g.node("Add", [a, skip], name="add")
    r = g.node("Relu", [s], name="relu2")
    g.node("Conv", [r, g.weight("head.w", (c, c, 1, 1))], ["y"], name="head", kernel_shape=[1, 1])
    g.output("y")
    return g.model()


def concat_of_pools():
    """Two conv branches pooled and concatenated, then a conv (Inception-like)."""
    g = G("concat_of_pools")
    x = g.input("x", ["n", 16, 8, 8])
    a = g.node("Relu", [g.conv(x, 16, 16, "conv_a")], name="relu_a")
    b = g.node("Relu", [g.conv(x, 16, 16, "conv_b")], name="relu_b")
    pa = g.node("MaxPool", [a], name="pool_a", kernel_shape=[2, 2], strides=[2, 2])
    pb = g.node("AveragePool", [b], name="pool_b", kernel_shape=[2, 2], strides=[2, 2])
    c = g.node("Concat", [pa, pb], name="concat", axis=1)
    g.node("Conv", [c, g.weight("head.w", (16, 32, 1, 1))], ["y"], name="head", kernel_shape=[1, 1])
    g.output("y")
    return g.model()


def se_block(channels=32, squeezed=16, name="se_block"):
    """conv -> relu -> x; gate = HardSigmoid(conv(relu(conv(GAP(x))))); y = x * gate -> conv."""
    g = G(name)
    inp = g.input("x", ["n", 16, 8, 8])
    x = g.node("Relu", [g.conv(inp, 16, channels, "conv")], name="relu")
    p = g.node("GlobalAveragePool", [x], name="gap")
    s = g.node("Relu", [g.conv(p, channels, squeezed, "se_reduce", k=1)], name="se_relu")
    gate = g.node("HardSigmoid", [g.conv(s, squeezed, channels, "se_expand", k=1)], name="se_gate")
    m = g.node("Mul", [x, gate], name="se_mul")
    g.node("Conv", [m, g.weight("head.w", (16, channels, 1, 1))], ["y"], name="head", kernel_shape=[1, 1])
    g.output("y")
    return g.model()


def tiny_se_block():
    """An SE block of a slim network (8 channels, squeezed to 2), as in PP-OCR's mobile classifier."""
    return se_block(channels=8, squeezed=2, name="tiny_se_block")


def fpn_upsample(mode="nearest"):
    """A feature-pyramid merge: a coarse map feeds its own conv and, upsampled x2, a Concat with a
    fine map (YOLO / PicoDet necks)."""
    g = G("fpn_upsample")
    x = g.input("x", ["n", 16, 8, 8])
    fine = g.node("Relu", [g.conv(x, 16, 16, "fine_conv")], name="fine_relu")
    coarse = g.node("Relu", [g.conv(fine, 16, 16, "down", strides=[2, 2])], name="coarse_relu")
    g.node("Conv", [coarse, g.weight("side.w", (16, 16, 1, 1))], ["side"], name="side", kernel_shape=[1, 1])
    up = g.node("Resize", [coarse, "", g.const("scales", np.array([1, 1, 2, 2], np.float32))], name="up", mode=mode)
    cat = g.node("Concat", [fine, up], name="cat", axis=1)
    g.node("Conv", [cat, g.weight("head.w", (16, 32, 1, 1))], ["y"], name="head", kernel_shape=[1, 1])
    g.output("side")
    g.output("y")
    return g.model()


def hardswish_out(g, x, name):
    """x * Clip(x + 3, 0, 6) / 6: HardSwish as Paddle's and older PyTorch exporters write it out."""
    a = g.node("Add", [x, g.const(f"{name}.three", np.array(3, np.float32))], name=f"{name}_add")
    k = g.node("Clip", [a, g.const(f"{name}.lo", np.array(0, np.float32)),
                        g.const(f"{name}.hi", np.array(6, np.float32))], name=f"{name}_clip")
    return g.node("Div", [g.node("Mul", [x, k], name=f"{name}_mul"), g.const(f"{name}.six", np.array(6, np.float32))],
                  name=f"{name}_div")


def residual_hardswish():
    """Add of two conv branches, each ending in a decomposed HardSwish (a PicoDet neck block)."""
    g = G("residual_hardswish")
    x = g.input("x", ["n", 16, 8, 8])
    stem = hardswish_out(g, g.conv(x, 16, 16, "stem"), "hs0")
    a = hardswish_out(g, g.conv(stem, 16, 16, "conv_a"), "hs1")
    b = hardswish_out(g, g.conv(hardswish_out(g, g.conv(stem, 16, 16, "conv_b1"), "hs2"), 16, 16, "conv_b2"), "hs3")
    s = g.node("Add", [a, b], name="add")
    g.node("Conv", [s, g.weight("head.w", (16, 16, 1, 1))], ["y"], name="head", kernel_shape=[1, 1])
    g.output("y")
    return g.model()


def silu_conv():
    """conv -> x * sigmoid(x) -> conv: the Mul must stay unquantized (fuses into the epilogue)."""
    g = G("silu_conv")
    inp = g.input("x", ["n", 16, 8, 8])
    c = g.conv(inp, 16, 16, "conv")
    s = g.node("Sigmoid", [c], name="sig")
    m = g.node("Mul", [c, s], name="silu_mul")
    g.node("Conv", [m, g.weight("head.w", (16, 16, 1, 1))], ["y"], name="head", kernel_shape=[1, 1])
    g.output("y")
    return g.model()


def attention(seq=8, hidden=32):
    """Projections (MatMul with constant weights) + attention core + output projection + GELU FFN."""
    g = G("attention")
    x = g.input("x", ["b", seq, hidden])
    q = g.node("MatMul", [x, g.weight("wq", (hidden, hidden))], name="q_proj")
    k = g.node("MatMul", [x, g.weight("wk", (hidden, hidden))], name="k_proj")
    v = g.node("MatMul", [x, g.weight("wv", (hidden, hidden))], name="v_proj")
    kt = g.node("Transpose", [k], name="k_t", perm=[0, 2, 1])
    s = g.node("MatMul", [q, kt], name="qk")
    s = g.node("Div", [s, g.const("sqrt_d", np.array(np.sqrt(hidden), np.float32))], name="scale")
    p = g.node("Softmax", [s], name="softmax", axis=-1)
    a = g.node("MatMul", [p, v], name="pv")
    o = g.node("MatMul", [a, g.weight("wo", (hidden, hidden))], name="o_proj")
    h = g.node("Div", [o, g.const("sqrt2", np.array(np.sqrt(2), np.float32))], name="gelu_div")
    e = g.node("Erf", [h], name="gelu_erf")
    e1 = g.node("Add", [e, g.const("one", np.array(1, np.float32))], name="gelu_add")
    m = g.node("Mul", [o, e1], name="gelu_mul")
    m = g.node("Mul", [m, g.const("half", np.array(0.5, np.float32))], name="gelu_mul2")
    g.node("MatMul", [m, g.weight("w_ffn", (hidden, hidden))], ["y"], name="ffn")
    g.output("y")
    return g.model()


def attention_block(seq=8, hidden=32, heads=2, mask=False, fused_qkv=False, bias=False):
    """A multi-head attention block as exporters write it: Q/K/V projections (separate, or one fused
    MatMul split in three), heads by Reshape/Transpose, scores scaled, then optionally a mask Add
    (from an int64 input, as BERT exports: (1 - mask) * -10000) or a position-bias Add (a constant),
    Softmax, the context GEMM, heads merged, output projection, residual Add."""
    d = hidden // heads
    g = G(f"attention_block{'_mask' if mask else ''}{'_fused' if fused_qkv else ''}{'_bias' if bias else ''}")
    x = g.input("x", ["b", seq, hidden])
    if fused_qkv:
        qkv = g.node("MatMul", [x, g.weight("wqkv", (hidden, 3 * hidden))], name="qkv_proj")
        g.nodes.append(helper.make_node("Split", [qkv, g.const("split3", np.array([hidden] * 3, np.int64))],
                                        ["q", "k", "v"], name="qkv_split", axis=-1))
        q, k, v = "q", "k", "v"
    else:
        q = g.node("MatMul", [x, g.weight("wq", (hidden, hidden))], name="q_proj")
        k = g.node("MatMul", [x, g.weight("wk", (hidden, hidden))], name="k_proj")
        v = g.node("MatMul", [x, g.weight("wv", (hidden, hidden))], name="v_proj")
    shape = g.const("heads_shape", np.array([0, 0, heads, d], np.int64))
    q = g.node("Transpose", [g.node("Reshape", [q, shape], name="q_heads")], name="q_t", perm=[0, 2, 1, 3])
    k = g.node("Transpose", [g.node("Reshape", [k, shape], name="k_heads")], name="k_t", perm=[0, 2, 3, 1])
    v = g.node("Transpose", [g.node("Reshape", [v, shape], name="v_heads")], name="v_t", perm=[0, 2, 1, 3])
    s = g.node("MatMul", [q, k], name="qk")
    s = g.node("Div", [s, g.const("sqrt_d", np.array(np.sqrt(d), np.float32))], name="scale")
    if mask:
        m = g.input("mask", ["b", seq], TensorProto.INT64)
        m = g.node("Cast", [m], name="mask_cast", to=TensorProto.FLOAT)
        m = g.node("Sub", [g.const("one_m", np.array(1, np.float32)), m], name="mask_sub")
        m = g.node("Mul", [m, g.const("neg", np.array(-10000, np.float32))], name="mask_mul")
        m = g.node("Unsqueeze", [m, g.const("axes12", np.array([1, 2], np.int64))], name="mask_unsq")
        s = g.node("Add", [s, m], name="mask_add")
    if bias:
        s = g.node("Add", [s, g.weight("pos_bias", (1, heads, seq, seq), 0.5)], name="bias_add")
    p = g.node("Softmax", [s], name="softmax", axis=-1)
    c = g.node("MatMul", [p, v], name="pv")
    c = g.node("Transpose", [c], name="ctx_t", perm=[0, 2, 1, 3])
    c = g.node("Reshape", [c, g.const("merge_shape", np.array([0, 0, hidden], np.int64))], name="ctx_merge")
    o = g.node("MatMul", [c, g.weight("wo", (hidden, hidden))], name="o_proj")
    g.node("Add", [o, x], ["y"], name="residual")
    g.output("y")
    return g.model()


def gemm_transB(trans_b=1):
    g = G("gemm")
    x = g.input("x", ["n", 64])
    w = g.weight("fc.w", (32, 64) if trans_b else (64, 32))
    g.node("Gemm", [x, w, g.weight("fc.b", (32,), 0.1)], ["y"], name="fc", transB=trans_b)
    g.output("y")
    return g.model()


def convtranspose(group=1):
    g = G("convtranspose")
    x = g.input("x", ["n", 16, 8, 8])
    w = g.weight("up.w", (16, 32 // group, 2, 2))
    y = g.node("ConvTranspose", [x, w, g.weight("up.b", (32,), 0.1)], name="up",
               kernel_shape=[2, 2], strides=[2, 2], group=group)
    g.node("Relu", [y], ["y"], name="relu")
    g.output("y")
    return g.model()


def integer_path():
    """int64 ids -> Gather embedding; int64 mask -> Cast -> Sub -> Mul -> Add into scores; a one-hot
    (Equal -> Cast) into a MatMul; the ids themselves cast to float into a MatMul. Integer tensors and
    their float derivatives stay unquantized, except a Cast from bool (0/1, exact in INT8)."""
    g = G("integer_path")
    ids = g.input("ids", ["b", 8], TensorProto.INT64)
    mask = g.input("mask", ["b", 8], TensorProto.INT64)
    emb = g.node("Gather", [g.weight("table", (50, 16)), ids], name="embed", axis=0)
    h = g.node("MatMul", [emb, g.weight("w1", (16, 16))], name="dense")
    mf = g.node("Cast", [mask], name="mask_cast", to=TensorProto.FLOAT)
    inv = g.node("Sub", [g.const("one", np.array(1, np.float32)), mf], name="mask_inv")
    bias = g.node("Mul", [inv, g.const("neg", np.array(-1e4, np.float32))], name="mask_bias")
    bias = g.node("Unsqueeze", [bias, g.const("ax", np.array([2], np.int64))], name="mask_unsq")
    s = g.node("Add", [h, bias], name="masked")
    onehot = g.node("Cast", [g.node("Equal", [g.node("Unsqueeze", [ids, g.const("ax2", np.array([2], np.int64))], name="ids_unsq"),
                                               g.const("vocab", np.arange(16, dtype=np.int64))], name="eq")],
                    name="onehot", to=TensorProto.FLOAT)
    oh = g.node("MatMul", [onehot, g.weight("w2", (16, 16))], name="onehot_mm")
    pos = g.node("Cast", [g.node("Unsqueeze", [ids, g.const("ax3", np.array([2], np.int64))], name="ids_unsq2")],
                 name="ids_float", to=TensorProto.FLOAT)
    pm = g.node("MatMul", [pos, g.weight("w_ids", (1, 16))], name="ids_mm")
    y = g.node("Add", [pm, g.node("Add", [s, oh], name="sum0")], name="sum")
    g.node("MatMul", [y, g.weight("w3", (16, 16))], ["y"], name="out_proj")
    g.output("y")
    return g.model()


def tiny_conv():
    """A 4->4 channel 3x3 conv in the middle (excluded) and a 3->16 first layer (kept)."""
    g = G("tiny_conv")
    x = g.input("x", ["n", 3, 8, 8])
    a = g.node("Relu", [g.conv(x, 3, 16, "first")], name="r0")
    b = g.node("Relu", [g.conv(a, 16, 4, "narrow")], name="r1")
    c = g.node("Relu", [g.conv(b, 4, 4, "tiny")], name="r2")
    g.node("Conv", [c, g.weight("head.w", (16, 4, 1, 1))], ["y"], name="head", kernel_shape=[1, 1])
    g.output("y")
    return g.model()


def conv_gemv():
    """A 16 -> 32 conv and a 1x1 32 -> 1 score head (a GEMV per position) before a Sigmoid."""
    g = G("conv_gemv")
    x = g.input("x", ["n", 16, 8, 8])
    a = g.node("Relu", [g.conv(x, 16, 32, "feat")], name="r0")
    s = g.conv(a, 32, 1, "score", k=1)
    g.node("Sigmoid", [s], ["y"], name="prob")
    g.output("y")
    return g.model()


def paddle_constants():
    """Weights as Constant nodes, and a weight written as Transpose(constant) (TensorFlow style)."""
    g = G("paddle_constants")
    x = g.input("x", ["n", 16, 8, 8])
    w = (g.rng.standard_normal((16, 16, 3, 3)) * 0.3).astype(np.float32)
    g.nodes.append(helper.make_node("Constant", [], ["w_const"], name="w_node",
                                    value=numpy_helper.from_array(w, "w_value")))
    y = g.node("Conv", [x, "w_const"], name="conv", kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    y = g.node("Relu", [y], name="relu")
    f = g.node("Flatten", [g.node("GlobalAveragePool", [y], name="gap")], name="flat", axis=1)
    wt = g.node("Transpose", [g.weight("fc_kn", (32, 16))], name="w_transpose", perm=[1, 0])
    g.node("MatMul", [f, wt], ["y"], name="fc")
    g.output("y")
    return g.model()


def layernorm_mlp():
    g = G("layernorm_mlp")
    x = g.input("x", ["b", 8, 32])
    h = g.node("MatMul", [x, g.weight("w1", (32, 32))], name="fc1")
    n = g.node("LayerNormalization", [h, g.const("ln.s", np.ones(32, np.float32)),
                                      g.const("ln.b", np.zeros(32, np.float32))], name="ln", axis=-1)
    g.node("MatMul", [n, g.weight("w2", (32, 32))], ["y"], name="fc2")
    g.output("y")
    return g.model()


def layernorm_decomposed():
    g = G("layernorm_decomposed")
    x = g.input("x", ["b", 8, 32])
    h = g.node("MatMul", [x, g.weight("w1", (32, 32))], name="fc1")
    ax = g.const("axes", np.array([-1], np.int64))
    mean = g.node("ReduceMean", [h, ax], name="ln_mean")
    d = g.node("Sub", [h, mean], name="ln_sub")
    sq = g.node("Pow", [d, g.const("two", np.array(2, np.float32))], name="ln_pow")
    var = g.node("ReduceMean", [sq, ax], name="ln_var")
    ve = g.node("Add", [var, g.const("eps", np.array(1e-5, np.float32))], name="ln_add_eps")
    sd = g.node("Sqrt", [ve], name="ln_sqrt")
    nrm = g.node("Div", [d, sd], name="ln_div")
    sc = g.node("Mul", [nrm, g.weight("ln.g", (32,))], name="ln_mul")
    b = g.node("Add", [sc, g.weight("ln.b", (32,))], name="ln_add")
    g.node("MatMul", [b, g.weight("w2", (32, 32))], ["y"], name="fc2")
    g.output("y")
    return g.model(opset=18)


def gemv():
    g = G("gemv")
    x = g.input("x", [4, 64])
    g.node("MatMul", [x, g.weight("w", (64, 1))], ["y"], name="gemv")
    g.output("y")
    return g.model()


def dynamic_weight_conv():
    g = G("dynamic_weight_conv")
    x = g.input("x", [1, 16, 8, 8])
    w = g.input("w", [16, 16, 3, 3])
    g.node("Conv", [x, w], ["y"], name="conv", kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    g.output("y")
    return g.model()


def pool_output():
    g = G("pool_output")
    x = g.input("x", ["n", 16, 8, 8])
    r = g.node("Relu", [g.conv(x, 16, 16, "conv")], name="relu")
    g.node("GlobalAveragePool", [r], ["y"], name="gap")
    g.output("y")
    return g.model()


def batched_weight():
    g = G("batched_weight")
    x = g.input("x", [2, 8, 32])
    g.node("MatMul", [x, g.weight("w", (2, 32, 16))], ["y"], name="bmm_w")
    g.output("y")
    return g.model()


def bmm():
    g = G("bmm")
    x = g.input("x", ["b", 8, 32])
    a = g.node("MatMul", [x, g.weight("wa", (32, 32))], name="proj_a")
    b = g.node("MatMul", [x, g.weight("wb", (32, 32))], name="proj_b")
    bt = g.node("Transpose", [b], name="b_t", perm=[0, 2, 1])
    s = g.node("MatMul", [a, bt], name="bmm")
    g.node("Relu", [s], ["y"], name="relu")
    g.output("y")
    return g.model()


def pool_float():
    g = G("pool_float")
    x = g.input("x", ["n", 16, 8, 8])
    p = g.node("AveragePool", [g.node("Relu", [x], name="relu")], name="pool", kernel_shape=[2, 2])
    g.node("Sigmoid", [p], ["y"], name="sig")
    g.output("y")
    return g.model()


def concat_float():
    g = G("concat_float")
    x = g.input("x", ["n", 16, 8, 8])
    a = g.node("Relu", [g.conv(x, 16, 16, "conv_a")], name="relu_a")
    b = g.node("Relu", [g.conv(x, 16, 16, "conv_b")], name="relu_b")
    c = g.node("Concat", [a, b], name="concat", axis=1)
    g.node("Softmax", [c], ["y"], name="softmax", axis=1)
    g.output("y")
    return g.model()


def small_head():
    """Two 64-channel 3x3 convs, a channel Softmax (float, P10), then a pooled 64 -> 8 Gemm: the
    Gemm holds under 0.1% of the FLOPs and could only be entered through a standalone Q."""
    g = G("small_head")
    x = g.input("x", ["n", 16, 16, 16])
    a = g.node("Relu", [g.conv(x, 16, 64, "c1")], name="r1")
    b = g.node("Relu", [g.conv(a, 64, 64, "c2")], name="r2")
    p = g.node("Softmax", [b], name="softmax", axis=1)
    f = g.node("Flatten", [g.node("GlobalAveragePool", [p], name="gap")], name="flat")
    g.node("Gemm", [f, g.weight("head.w", (64, 8))], ["y"], name="head")
    g.output("y")
    return g.model()


def sample_data(model: onnx.ModelProto, n=8, seed=1) -> dict:
    """Random calibration samples ([n, *shape], dynamic dims = 2) for every input of a motif: normal
    values in a float input's own type (an FP16 input too), integers 0-15 for any other."""
    rng = np.random.default_rng(seed)
    out = {}
    for i in model.graph.input:
        t = i.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else 2 for d in t.shape.dim]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)
        if dtype.kind == "f":
            out[i.name] = rng.standard_normal([n, *shape]).astype(dtype)
        else:
            out[i.name] = rng.integers(0, 16, [n, *shape]).astype(np.int64)
    return out


ALL = {"conv_relu": conv_relu, "conv_bn_relu": conv_bn_relu, "residual_add": residual_add,
       "concat_of_pools": concat_of_pools, "se_block": se_block, "silu_conv": silu_conv,
       "attention": attention, "gemm_transB": gemm_transB, "convtranspose": convtranspose,
       "integer_path": integer_path, "tiny_conv": tiny_conv, "conv_gemv": conv_gemv, "tiny_se_block": tiny_se_block, "fpn_upsample": fpn_upsample, "residual_hardswish": residual_hardswish, "paddle_constants": paddle_constants,
       "layernorm_mlp": layernorm_mlp, "layernorm_decomposed": layernorm_decomposed, "gemv": gemv,
       "pool_output": pool_output, "batched_weight": batched_weight, "bmm": bmm, "pool_float": pool_float,
       "concat_float": concat_float, "residual_projection": lambda: residual_add(projection=True),
       "gemm": lambda: gemm_transB(0), "convtranspose_grouped": lambda: convtranspose(2),
       "dynamic_weight_conv": dynamic_weight_conv, "small_head": small_head,
       "attention_block": attention_block, "attention_mask": lambda: attention_block(mask=True),
       "attention_fused_qkv": lambda: attention_block(fused_qkv=True),
       "attention_bias": lambda: attention_block(bias=True),
       "attention_long": lambda: attention_block(seq=600, hidden=32)}
