"""The float bias of a quantized Conv, ConvTranspose or Gemm as an Add after it.

onnxruntime's default session rewrites `DQ(x), DQ(w) -> Conv(.., bias)` with a float bias into an
INT32 bias of scale x_scale * w_scale (its WeightBiasQuantization). With FP16 scales that product
loses most of its digits or underflows, and the session computes something else than the model
(ddddocr's recognizer: 3.8 dB output SQNR between onnxruntime's default session and the same session
with the rewrite off). TensorRT keeps the bias in float. Written as `Conv(..) -> Add(bias)` the rewrite
does not apply, so every onnxruntime session computes what TensorRT does, and TensorRT compiles the
same kernels (the Add joins the convolution's epilogue; checked with TensorRT for RTX, docs/BUILD.md).
"""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from ..ops import ADD, vocabulary
from ..graph.view import GraphView, tensor_map
from .base import PassResult, result
from .registry import declare
from ..graph import io


def _dequantized(view: GraphView, t: gs.Tensor) -> bool:
    p = view.producer(t)
    return p is not None and view.vocab.is_(p, "dequantize")


@declare("bias_to_add", fixpoint=True, graph_only=True)
def bias_to_add(graph: gs.Graph) -> PassResult:
    """Move each constant bias of a Conv/ConvTranspose/Gemm whose activation and weight inputs are
    dequantized into an Add after the op, in place."""
    vocab = vocabulary()
    view = GraphView(graph, vocab, lazy=True)       # asks producers only
    taken = set(tensor_map(graph))
    moved = []
    for node in list(graph.nodes):
        if not (vocab.is_(node, "conv") or vocab.is_(node, "gemm")) or len(node.inputs) < 3:
            continue
        bias = node.inputs[2]
        if not isinstance(bias, gs.Constant) or not all(_dequantized(view, t) for t in node.inputs[:2]):
            continue
        values = np.asarray(bias.values)
        out = node.outputs[0]
        if vocab.is_(node, "conv"):
            dq = view.producer(node.inputs[1])
            assert dq is not None                                    # _dequantized checked it above
            weight = dq.inputs[0]                                    # the DQ's INT8 weight: [C, ..., k...]
            values = values.reshape([1, values.size] + [1] * (len(weight.shape) - 2))
        elif node.attrs.get("alpha", 1.0) != 1.0 or node.attrs.get("beta", 1.0) != 1.0:
            continue                                   # Gemm scaling its bias: left as it is
        before = gs.Variable(_unused(taken, f"{out.name}_before_bias"), dtype=out.dtype, shape=out.shape)
        node.outputs[0] = before
        node.inputs = node.inputs[:2]
        add = gs.Node(ADD, name=f"{node.name}_bias", inputs=[before, gs.Constant(_unused(taken, f"{bias.name}_add"), values)],
                      outputs=[out])
        graph.nodes.append(add)
        moved.append(node.name)
    if moved:
        io.toposort(graph)
    return result("bias_to_add", bool(moved), moved=moved)


def fold_bias_adds(graph: gs.Graph) -> int:
    """The inverse of bias_to_add on a float graph: a Conv/ConvTranspose/Gemm without a bias whose only
    reader is an Add of a constant that varies along the output channels only becomes the op with that
    bias, in place. Returns how many were folded (strip uses it to give back the float graph)."""
    vocab = vocabulary()
    view = GraphView(graph, vocab, lazy=True)       # asks consumers and graph outputs only
    taken = set(tensor_map(graph))
    folded = 0
    for node in list(graph.nodes):
        if not (vocab.is_(node, "conv") or vocab.is_(node, "gemm")) or len(node.inputs) != 2:
            continue
        out = node.outputs[0]
        readers = view.consumers(out)
        if len(readers) != 1 or view.is_graph_output(out):
            continue
        add = readers[0][0]
        if not vocab.is_(add, "add") or len(add.inputs) != 2:
            continue
        const = next((t for t in add.inputs if isinstance(t, gs.Constant)), None)
        if const is None or not any(t is out for t in add.inputs):
            continue
        values = np.asarray(const.values)
        channels = values.size
        if channels < 1 or sum(d != 1 for d in values.shape) > 1:
            continue
        axis = 1 if vocab.is_(node, "conv") else -1
        if values.ndim >= 1 and values.shape[axis if values.ndim > 1 else 0] != channels:
            continue
        node.inputs.append(gs.Constant(_unused(taken, const.name.removesuffix("_add")), values.reshape(-1)))
        node.outputs[0] = add.outputs[0]
        add.outputs.clear()
        folded += 1
    if folded:
        io.tidy(graph)
    return folded


def _unused(taken: set[str], name: str) -> str:
    """`name`, or `name_2`, `name_3`... if a tensor of the graph already has it; recorded as taken."""
    out, k = name, 1
    while out in taken:
        k += 1
        out = f"{name}_{k}"
    taken.add(out)
    return out
