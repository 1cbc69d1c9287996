"""A built-in example: a small ResNet-style CNN (Conv+BN+ReLU, MaxPool, identity and projection
residual blocks, global average pool, Gemm) with seeded random weights, and calibration data.

`qdqgraph example DIR` writes DIR/tiny_resnet.onnx and DIR/tiny_resnet_calib.npz so that the main
job can be run on a fresh machine without a model of one's own.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


class _Builder:
    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []

    def const(self, name, value):
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def conv_bn(self, x, name, cin, cout, k, stride=1, relu=True):
        w = (self.rng.standard_normal((cout, cin, k, k)) * np.sqrt(2.0 / (cin * k * k))).astype(np.float32)
        self.nodes.append(helper.make_node("Conv", [x, self.const(f"{name}.weight", w)], [f"{name}_conv"],
                                           name=f"{name}/Conv", kernel_shape=[k, k], strides=[stride, stride],
                                           pads=[k // 2] * 4))
        r = self.rng
        self.nodes.append(helper.make_node(
            "BatchNormalization",
            [f"{name}_conv", self.const(f"{name}.bn.scale", (1 + 0.1 * r.standard_normal(cout)).astype(np.float32)),
             self.const(f"{name}.bn.bias", (0.1 * r.standard_normal(cout)).astype(np.float32)),
             self.const(f"{name}.bn.mean", (0.1 * r.standard_normal(cout)).astype(np.float32)),
             self.const(f"{name}.bn.var", (1 + 0.2 * r.random(cout)).astype(np.float32))],
            [f"{name}_bn"], name=f"{name}/BatchNormalization", epsilon=1e-5))
        if not relu:
            return f"{name}_bn"
        self.nodes.append(helper.make_node("Relu", [f"{name}_bn"], [f"{name}_relu"], name=f"{name}/Relu"))
        return f"{name}_relu"

    def block(self, x, name, cin, cout, stride):
        y = self.conv_bn(x, f"{name}.conv1", cin, cout, 3, stride)
        y = self.conv_bn(y, f"{name}.conv2", cout, cout, 3, 1, relu=False)
        skip = x if stride == 1 and cin == cout else self.conv_bn(x, f"{name}.downsample", cin, cout, 1, stride, relu=False)
        self.nodes.append(helper.make_node("Add", [y, skip], [f"{name}_add"], name=f"{name}/Add"))
        self.nodes.append(helper.make_node("Relu", [f"{name}_add"], [f"{name}_out"], name=f"{name}/Relu"))
        return f"{name}_out"


def tiny_resnet(seed: int = 0, classes: int = 10, size: int = 32) -> onnx.ModelProto:
    b = _Builder(seed)
    x = b.conv_bn("input", "stem", 3, 16, 3)
    b.nodes.append(helper.make_node("MaxPool", [x], ["stem_pool"], name="stem/MaxPool",
                                    kernel_shape=[2, 2], strides=[2, 2]))
    x = b.block("stem_pool", "layer1", 16, 16, 1)
    x = b.block(x, "layer2", 16, 32, 2)
    x = b.block(x, "layer3", 32, 64, 2)
    b.nodes.append(helper.make_node("GlobalAveragePool", [x], ["gap"], name="head/GlobalAveragePool"))
    b.nodes.append(helper.make_node("Flatten", ["gap"], ["flat"], name="head/Flatten", axis=1))
    w = (b.rng.standard_normal((classes, 64)) * 0.2).astype(np.float32)
    b.nodes.append(helper.make_node("Gemm", ["flat", b.const("fc.weight", w),
                                             b.const("fc.bias", np.zeros(classes, np.float32))],
                                    ["logits"], name="head/Gemm", transB=1))
    graph = helper.make_graph(
        b.nodes, "tiny_resnet",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, size, size])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", classes])], b.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="qdqgraph-example")
    model.ir_version = 8
    return model


def smooth_images(n: int, size: int = 32, seed: int = 1) -> np.ndarray:
    """n samples [n, 1, 3, size, size] of low-frequency noise, normalised like ImageNet inputs."""
    rng = np.random.default_rng(seed)
    coarse = rng.standard_normal((n, 1, 3, size // 8, size // 8)).astype(np.float32)
    img = coarse.repeat(8, axis=3).repeat(8, axis=4)
    img += 0.3 * rng.standard_normal(img.shape).astype(np.float32)
    return img.astype(np.float32)
