"""ResNet graphs with Q/DQ placed and nodes named as in the exports behind the TensorRT oracles
(../shared/oracles/trex): the simulator's tests diff them against the real engines' layers.

- `resnet18(placement)`: torchvision ResNet-18 through NVIDIA pytorch-quantization and the
  legacy `torch.onnx` exporter (or, `float`, without quantization: BN folded, `Conv_0 + Relu_1`). Node names are `<OpType>_<n>` with one counter over every node the
  exporter wrote, the Constant nodes of the quantizers included; those constants are not rebuilt
  (scales are initializers), only their numbers are skipped, so `Conv_9`, `QuantizeLinear_7`,
  `Add_42` ... land where the oracle names them. BatchNormalization is not folded (a Conv whose
  weight passes through Q/DQ is not folded by the exporter): Conv_9, BatchNormalization_10, Relu_11.
  Quantizers per module: an input quantizer is 2 constants + Q + DQ, a weight quantizer 3 + Q + DQ,
  a stand-alone TensorQuantizer (residual, GAP) 4 + Q + DQ; numbers checked against all three
  oracles by the tests.
- `mobilenet_v2_qat(placement)`: torchvision MobileNetV2 the same way (two exports, two counters).
- `resnet50_tf_qat()`: Keras ResNet-50 v1 through NVIDIA's TensorFlow quantization toolkit and
  tf2onnx, BN folded into the convs, node names as in the oracle (weight Qs `QuantLinearNode__622`
  + 4k in model order, the input Q `QuantLinearNode__838`, `resnet50/quant_conv2_block1_1_conv/Conv2D`).

Weights are random (seeded): only shapes and Q/DQ positions matter to the simulator. Quantizers of
one tensor get one scale (they are calibrated on the same data), every tensor its own.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

R18_PLACEMENTS = ("float", "qat", "qat-residual", "qat-residual-qgap")
MBV2_PLACEMENTS = ("qat", "qat-residual")


class _Builder:
    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.scales: dict[str, float] = {}

    def init(self, name, value):
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def weight(self, name, shape):
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else shape[0]
        w = self.rng.standard_normal(shape, dtype=np.float32) * np.float32(np.sqrt(2.0 / fan_in))
        return self.init(name, w)

    def add(self, op, name, inputs, **attrs):
        out = f"{name}:0"
        self.nodes.append(helper.make_node(op, inputs, [out], name=name, **attrs))
        return out

    def act_scale(self, tensor):
        if tensor not in self.scales:
            self.scales[tensor] = float(self.rng.uniform(0.005, 0.05))
        return self.scales[tensor]

    def qdq(self, x, q_name, dq_name, scale=None, axis=None):
        """Q -> DQ of x: per-tensor with the tensor's scale, or per-channel (`scale` an array)."""
        s = np.float32(self.act_scale(x)) if scale is None else scale.astype(np.float32)
        zp = np.zeros(np.shape(s), np.int8)
        sn, zn = self.init(f"{q_name}.scale", s), self.init(f"{q_name}.zero_point", zp)
        attrs = {} if axis is None else {"axis": axis}
        q = self.add("QuantizeLinear", q_name, [x, sn, zn], **attrs)
        return self.add("DequantizeLinear", dq_name, [q, sn, zn], **attrs)

    def weight_qdq(self, w_name, q_name, dq_name, axis=0):
        w = numpy_helper.to_array(next(i for i in self.inits if i.name == w_name))
        amax = np.abs(w).max(axis=tuple(d for d in range(w.ndim) if d != axis))
        return self.qdq(w_name, q_name, dq_name, scale=np.maximum(amax, 1e-8) / 127.0, axis=axis)

    def model(self, name, inputs, outputs, opset=13) -> onnx.ModelProto:
        g = helper.make_graph(self.nodes, name, inputs, outputs, self.inits)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], producer_name="qdqgraph.models")
        m.ir_version = 8
        return m


class _Legacy(_Builder):
    """Node names from one counter, as the legacy exporter wrote them. A weight quantizer spends
    `weight_numbers` = (before its Q, after its DQ) numbers on nodes that are not rebuilt."""

    def __init__(self, seed, weight_numbers=(3, 0)):
        super().__init__(seed)
        self.n = 0
        self.weight_numbers = weight_numbers

    def name(self, op):
        name = f"{op}_{self.n}"
        self.n += 1
        return name

    def op(self, op, inputs, **attrs):
        return self.add(op, self.name(op), inputs, **attrs)

    def quantizer(self, x, constants):
        self.n += constants
        q = self.name("QuantizeLinear")
        return self.qdq(x, q, self.name("DequantizeLinear"))

    def weight_quantizer(self, w):
        before, after = self.weight_numbers
        self.n += before
        q = self.name("QuantizeLinear")
        out = self.weight_qdq(w, q, self.name("DequantizeLinear"))
        self.n += after
        return out

    def qconv(self, x, prefix, cin, cout, k, stride, pad, group=1):
        xq = self.quantizer(x, 2)
        w = self.weight(f"{prefix}.weight", (cout, cin // group, k, k))
        wq = self.weight_quantizer(w)
        return self.op("Conv", [xq, wq], kernel_shape=[k, k], strides=[stride, stride], pads=[pad] * 4,
                       dilations=[1, 1], group=group)

    def relu6(self, x):
        self.n += 2                          # the Constant nodes of Clip's min and max
        return self.op("Clip", [x, self.init(f"clip{self.n}.min", np.float32(0)), self.init(f"clip{self.n}.max", np.float32(6))])

    def bn(self, x, prefix, c):
        r = self.rng
        ins = [x, self.init(f"{prefix}.weight", (1 + 0.1 * r.standard_normal(c)).astype(np.float32)),
               self.init(f"{prefix}.bias", (0.1 * r.standard_normal(c)).astype(np.float32)),
               self.init(f"{prefix}.running_mean", (0.1 * r.standard_normal(c)).astype(np.float32)),
               self.init(f"{prefix}.running_var", (1 + r.random(c)).astype(np.float32))]
        return self.op("BatchNormalization", ins, epsilon=1e-5, momentum=0.9)


def resnet18(placement: str = "qat", seed: int = 0, batch: int = 1) -> onnx.ModelProto:
    """ResNet-18 as in the TREX oracles: `float` (no Q/DQ, BN folded into the convs: `Conv_0 +
    Relu_1`), `qat` (Q/DQ on inputs and weights of every Conv and the fc Gemm, BN kept),
    `qat-residual` (+ the skip input of every residual Add), `qat-residual-qgap` (+ the global
    average pool's input)."""
    if placement not in R18_PLACEMENTS:
        raise ValueError(f"placement must be one of {R18_PLACEMENTS}")
    quantized = placement != "float"
    residual, qgap = placement in ("qat-residual", "qat-residual-qgap"), placement == "qat-residual-qgap"
    b = _Legacy(seed)

    def conv_bn(y, conv, bn, cin, cout, k, stride, pad):
        if quantized:
            return b.bn(b.qconv(y, conv, cin, cout, k, stride, pad), bn, cout)
        w, bias = b.weight(f"{conv}.weight", (cout, cin, k, k)), b.init(f"{conv}.bias", np.zeros(cout, np.float32))
        return b.op("Conv", [y, w, bias], kernel_shape=[k, k], strides=[stride, stride], pads=[pad] * 4)

    x = "input.1"
    y = b.op("Relu", [conv_bn(x, "conv1", "bn1", 3, 64, 7, 2, 3)])
    y = b.op("MaxPool", [y], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    cin = 64
    for li, (cout, stride) in enumerate(((64, 1), (128, 2), (256, 2), (512, 2)), 1):
        for bi in range(2):
            p = f"layer{li}.{bi}"
            s = stride if bi == 0 else 1
            out = b.op("Relu", [conv_bn(y, f"{p}.conv1", f"{p}.bn1", cin, cout, 3, s, 1)])
            out = conv_bn(out, f"{p}.conv2", f"{p}.bn2", cout, cout, 3, 1, 1)
            identity = y
            if bi == 0 and (s != 1 or cin != cout):
                identity = conv_bn(y, f"{p}.downsample.0", f"{p}.downsample.1", cin, cout, 1, s, 0)
            if residual:
                identity = b.quantizer(identity, 4)
            y = b.op("Relu", [b.op("Add", [out, identity])])
            cin = cout
    if qgap:
        y = b.quantizer(y, 4)
    y = b.op("Flatten", [b.op("GlobalAveragePool", [y])], axis=1)
    w = b.weight("fc.weight", (1000, 512))
    if quantized:
        y, w = b.quantizer(y, 2), b.weight_quantizer(w)
    b.nodes.append(helper.make_node("Gemm", [y, w, b.init("fc.bias", np.zeros(1000, np.float32))], ["output"],
                                    name=b.name("Gemm"), alpha=1.0, beta=1.0, transB=1))
    return b.model(f"resnet18-{placement}", [helper.make_tensor_value_info(x, TensorProto.FLOAT, [batch, 3, 224, 224])],
                   [helper.make_tensor_value_info("output", TensorProto.FLOAT, [batch, 1000])])


def mobilenet_v2_qat(placement: str = "qat", seed: int = 0, batch: int = 1) -> onnx.ModelProto:
    """QAT torchvision MobileNetV2 as in the TREX MobileNetV2 oracles (more/README.md): `qat` (Q/DQ
    on the inputs and weights of every Conv and the classifier Gemm) or `qat-residual` (+ the
    identity input of every residual Add). The two engines came from two exports whose counters
    differ: in `qat` a weight quantizer spends 4 numbers before its Q and 2 after its DQ
    (`QuantizeLinear_8 + Conv_12`), in `qat-residual` 3 and 0 (`QuantizeLinear_7 + Conv_9`), and its
    residual quantizer comes before the block's convs. ReLU6 is Clip with two Constant inputs."""
    if placement not in MBV2_PLACEMENTS:
        raise ValueError(f"placement must be one of {MBV2_PLACEMENTS}")
    residual = placement == "qat-residual"
    b = _Legacy(seed, weight_numbers=(3, 0) if residual else (4, 2))
    x = "input1"

    def conv_bn(y, conv, bn, cin, cout, k, stride, group=1, act=True):
        y = b.bn(b.qconv(y, conv, cin, cout, k, stride, k // 2, group), bn, cout)
        return b.relu6(y) if act else y

    y = conv_bn(x, "features.0.0", "features.0.1", 3, 32, 3, 2)
    cin, idx = 32, 1
    for t, c, n, s in ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2),
                       (6, 320, 1, 1)):
        for i in range(n):
            stride, p = (s if i == 0 else 1), f"features.{idx}.conv"
            use_res = stride == 1 and cin == c
            identity = b.quantizer(y, 4) if residual and use_res else y
            hidden, z, k = cin * t, y, 0
            if t != 1:
                z, k = conv_bn(z, f"{p}.{k}.0", f"{p}.{k}.1", cin, hidden, 1, 1), k + 1
            z, k = conv_bn(z, f"{p}.{k}.0", f"{p}.{k}.1", hidden, hidden, 3, stride, group=hidden), k + 1
            z = conv_bn(z, f"{p}.{k}", f"{p}.{k + 1}", hidden, c, 1, 1, act=False)
            y = b.op("Add", [identity, z]) if use_res else z
            cin, idx = c, idx + 1
    y = conv_bn(y, "features.18.0", "features.18.1", 320, 1280, 1, 1)
    y = b.op("GlobalAveragePool", [y])
    b.n += 6 if residual else 7              # the Shape/Gather/Unsqueeze/Concat of torch.flatten's Reshape
    y = b.op("Flatten", [y], axis=1)
    yq = b.quantizer(y, 2)
    wq = b.weight_quantizer(b.weight("classifier.1.weight", (1000, 1280)))
    b.nodes.append(helper.make_node("Gemm", [yq, wq, b.init("classifier.1.bias", np.zeros(1000, np.float32))],
                                    ["output"], name=b.name("Gemm"), alpha=1.0, beta=1.0, transB=1))
    return b.model(f"mobilenetv2-{placement}", [helper.make_tensor_value_info(x, TensorProto.FLOAT, [batch, 3, 224, 224])],
                   [helper.make_tensor_value_info("output", TensorProto.FLOAT, [batch, 1000])])


class _TF(_Builder):
    def __init__(self, seed):
        super().__init__(seed)
        self.weight_q = 622      # weight Qs of the oracle: QuantLinearNode__622 + 4k in model order
        self.act_q = 2           # activation Q/DQ: names below 622, never in an engine layer name

    def quantizer(self, x):
        q, dq = f"QuantLinearNode__{self.act_q}", f"DequantLinearNode__{self.act_q + 1}"
        self.act_q += 2
        assert self.act_q < 622
        return self.qdq(x, q, dq)

    def qconv(self, x, prefix, node, cin, cout, k, stride, pad, xq=None):
        xq = xq or self.quantizer(x)
        w = self.weight(f"{prefix}/kernel", (cout, cin, k, k))
        n = self.weight_q
        self.weight_q += 4
        wq = self.weight_qdq(w, f"QuantLinearNode__{n}", f"DequantLinearNode__{n + 1}")
        bias = self.init(f"{prefix}/bias", (0.1 * self.rng.standard_normal(cout)).astype(np.float32))
        return self.add("Conv", f"resnet50/{prefix}/{node}", [xq, wq, bias], kernel_shape=[k, k],
                        strides=[stride, stride], pads=[pad] * 4)


def resnet50_tf_qat(seed: int = 0, batch: int = 1) -> onnx.ModelProto:
    """Keras ResNet-50 v1 with the TensorFlow quantization toolkit's default placement (inputs and
    weights of Conv/Dense, the shortcut input of every residual Add, the average pool's input),
    NHWC input with a Pad before the input Q and a Transpose after it, as tf2onnx wrote it."""
    b = _TF(seed)
    x = "input_1"
    y = b.add("Pad", "resnet50/conv1_pad/Pad", [x, b.init("conv1_pad/pads", np.array([0, 3, 3, 0, 0, 3, 3, 0], np.int64))])
    y = b.qdq(y, "QuantLinearNode__838", "DequantLinearNode__839")
    y = b.add("Transpose", "resnet50/quant_conv1_conv/BiasAdd__1121", [y], perm=[0, 3, 1, 2])
    y = b.qconv(None, "quant_conv1_conv", "BiasAdd", 3, 64, 7, 2, 0, xq=y)
    y = b.add("Relu", "resnet50/conv1_relu/Relu", [y])
    y = b.add("Pad", "resnet50/pool1_pad/Pad", [y, b.init("pool1_pad/pads", np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64))])
    y = b.add("MaxPool", "resnet50/pool1_pool/MaxPool", [y], kernel_shape=[3, 3], strides=[2, 2])
    cin = 64
    for stage, (filters, blocks, stride) in enumerate(((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)), 2):
        for blk in range(1, blocks + 1):
            p = f"conv{stage}_block{blk}"
            s = stride if blk == 1 else 1
            if blk == 1:
                shortcut = b.quantizer(b.qconv(y, f"quant_{p}_0_conv", "Conv2D", cin, 4 * filters, 1, s, 0))
            else:
                shortcut = b.quantizer(y)
            z = b.add("Relu", f"resnet50/{p}_1_relu/Relu", [b.qconv(y, f"quant_{p}_1_conv", "Conv2D", cin, filters, 1, s, 0)])
            z = b.add("Relu", f"resnet50/{p}_2_relu/Relu", [b.qconv(z, f"quant_{p}_2_conv", "Conv2D", filters, filters, 3, 1, 1)])
            z = b.qconv(z, f"quant_{p}_3_conv", "Conv2D", filters, 4 * filters, 1, 1, 0)
            y = b.add("Relu", f"resnet50/{p}_out/Relu", [b.add("Add", f"resnet50/quant_{p}_add/add", [shortcut, z])])
            cin = 4 * filters
    y = b.add("ReduceMean", "resnet50/quant_avg_pool/Mean", [b.quantizer(y)], axes=[2, 3], keepdims=0)
    yq = b.quantizer(y)
    w = b.weight("predictions/kernel", (2048, 1000))
    assert b.weight_q == 834
    wq = b.weight_qdq(w, "QuantLinearNode__834", "DequantLinearNode__835", axis=1)
    y = b.add("MatMul", "resnet50/quant_predictions/MatMul", [yq, wq])
    y = b.add("Add", "resnet50/quant_predictions/BiasAdd", [y, b.init("predictions/bias", np.zeros(1000, np.float32))])
    b.nodes.append(helper.make_node("Softmax", [y], ["predictions"], name="resnet50/quant_predictions/Softmax", axis=-1))
    return b.model("resnet50-tf-qat", [helper.make_tensor_value_info(x, TensorProto.FLOAT, [batch, 224, 224, 3])],
                   [helper.make_tensor_value_info("predictions", TensorProto.FLOAT, [batch, 1000])])
