"""A model whose compute sits inside If branches chosen by an input, built as voice-activity
exports are: `x` [1, 1, 512] float and `sr` an int64 scalar; `If(Equal(sr, 16000))` runs one of
two whole networks. The then-branch is a Conv1d/Relu stack over `x` (read from the outer scope),
pooled over time, plus a MatMul head on `x` itself; the else-branch is a differently shaped stack
(a strided first conv, other widths) with a Gemm head. Weights of the then-branch live in the main
graph (read by name from the branch, as PyTorch writes them), those of the else-branch inside it.

    model = vad_if_model()
    calib = vad_if_calib(64, sr=(16000,))           # every sample takes the then-branch
    calib = vad_if_calib(64, sr=(16000, 8000))      # half the samples each branch
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

SAMPLES = 512            # the audio window
CLASSES = 2


def _w(rng, shape, scale=None):
    fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else shape[0]
    return (rng.standard_normal(shape) * (scale or np.sqrt(2.0 / fan_in))).astype(np.float32)


def _conv(nodes, inits, rng, x, name, cin, cout, k, stride=1, relu=True):
    w = numpy_helper.from_array(_w(rng, (cout, cin, k)), f"{name}.weight")
    b = numpy_helper.from_array(_w(rng, (cout,), 0.05), f"{name}.bias")
    inits += [w, b]
    nodes.append(helper.make_node("Conv", [x, w.name, b.name], [f"{name}_out"], name=f"{name}/Conv",
                                  kernel_shape=[k], pads=[k // 2, k // 2], strides=[stride]))
    if not relu:
        return f"{name}_out"
    nodes.append(helper.make_node("Relu", [f"{name}_out"], [f"{name}_relu"], name=f"{name}/Relu"))
    return f"{name}_relu"


def _head(nodes, inits, rng, feats, x, name, width, gemm: bool):
    """ReduceMean over time of `feats` [1, width, T] plus a linear map of the raw window `x`,
    then a linear layer to CLASSES logits: [1, CLASSES]."""
    flat = numpy_helper.from_array(np.array([1, SAMPLES], np.int64), f"{name}.flat")
    wx = numpy_helper.from_array(_w(rng, (SAMPLES, width)), f"{name}.wx")
    wo = numpy_helper.from_array(_w(rng, (CLASSES, width) if gemm else (width, CLASSES)), f"{name}.wo")
    bo = numpy_helper.from_array(_w(rng, (CLASSES,), 0.05), f"{name}.bo")
    inits += [flat, wx, wo, bo]
    nodes += [
        helper.make_node("ReduceMean", [feats], [f"{name}_pool"], name=f"{name}/ReduceMean", axes=[2], keepdims=0),
        helper.make_node("Reshape", [x, flat.name], [f"{name}_x2d"], name=f"{name}/Reshape"),
        helper.make_node("MatMul", [f"{name}_x2d", wx.name], [f"{name}_xproj"], name=f"{name}/MatMul_x"),
        helper.make_node("Add", [f"{name}_pool", f"{name}_xproj"], [f"{name}_sum"], name=f"{name}/Add"),
        helper.make_node("Relu", [f"{name}_sum"], [f"{name}_act"], name=f"{name}/Relu"),
    ]
    if gemm:
        nodes.append(helper.make_node("Gemm", [f"{name}_act", wo.name, bo.name], [f"{name}_logits"],
                                      name=f"{name}/Gemm", transB=1))
    else:
        nodes += [helper.make_node("MatMul", [f"{name}_act", wo.name], [f"{name}_mm"], name=f"{name}/MatMul"),
                  helper.make_node("Add", [f"{name}_mm", bo.name], [f"{name}_logits"], name=f"{name}/Add_bias")]
    return f"{name}_logits"


def vad_if_model(seed: int = 0, opset: int = 15) -> onnx.ModelProto:
    """The two-network If model (module docstring); output `prob` [1, CLASSES] = Sigmoid(logits)."""
    rng = np.random.default_rng(seed)
    main_inits: list[onnx.TensorProto] = []

    # then-branch (16 kHz): 1 -> 32 -> 32 -> 32 channels at full rate; weights in the main graph
    t_nodes: list[onnx.NodeProto] = []
    h = _conv(t_nodes, main_inits, rng, "x", "then.conv1", 1, 32, 5)
    h = _conv(t_nodes, main_inits, rng, h, "then.conv2", 32, 32, 3)
    h = _conv(t_nodes, main_inits, rng, h, "then.conv3", 32, 32, 3)
    t_out = _head(t_nodes, main_inits, rng, h, "x", "then.head", 32, gemm=False)
    then_branch = helper.make_graph(t_nodes, "then_16k", [],
                                    [helper.make_tensor_value_info(t_out, TensorProto.FLOAT, [1, CLASSES])])

    # else-branch (8 kHz): a strided first conv, 1 -> 24 -> 48 channels; weights inside the branch
    e_nodes: list[onnx.NodeProto] = []
    e_inits: list[onnx.TensorProto] = []
    h = _conv(e_nodes, e_inits, rng, "x", "else.conv1", 1, 24, 7, stride=2)
    h = _conv(e_nodes, e_inits, rng, h, "else.conv2", 24, 48, 3)
    e_out = _head(e_nodes, e_inits, rng, h, "x", "else.head", 48, gemm=True)
    else_branch = helper.make_graph(e_nodes, "else_8k", [],
                                    [helper.make_tensor_value_info(e_out, TensorProto.FLOAT, [1, CLASSES])],
                                    e_inits)

    main_inits.append(numpy_helper.from_array(np.array(16000, np.int64), "sr_16k"))
    nodes = [
        helper.make_node("Equal", ["sr", "sr_16k"], ["is_16k"], name="/Equal"),
        helper.make_node("If", ["is_16k"], ["logits"], name="/If", then_branch=then_branch, else_branch=else_branch),
        helper.make_node("Sigmoid", ["logits"], ["prob"], name="/Sigmoid"),
    ]
    graph = helper.make_graph(
        nodes, "vad_if",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, SAMPLES]),
         helper.make_tensor_value_info("sr", TensorProto.INT64, [])],
        [helper.make_tensor_value_info("prob", TensorProto.FLOAT, [1, CLASSES])], main_inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def vad_if_calib(samples: int = 64, sr: tuple[int, ...] = (16000,), seed: int = 1) -> dict[str, np.ndarray]:
    """Calibration data: `x` (samples, 1, 1, SAMPLES), a noisy tone per sample, and `sr` cycling
    through the given rates (int64, one scalar per sample)."""
    rng = np.random.default_rng(seed)
    t = np.arange(SAMPLES, dtype=np.float32) / SAMPLES
    freq = rng.uniform(2, 40, (samples, 1))
    x = (0.5 * np.sin(2 * np.pi * freq * t) + 0.1 * rng.standard_normal((samples, SAMPLES))).astype(np.float32)
    rates = np.array([sr[i % len(sr)] for i in range(samples)], np.int64)
    return {"x": x.reshape(samples, 1, 1, SAMPLES), "sr": rates}
