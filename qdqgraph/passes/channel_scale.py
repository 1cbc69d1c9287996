"""Per-channel scales folded into a graph without a node where possible: into the weights that read a
tensor, into the LayerNorm or the linear layer that makes it, else a Mul in front of its readers.

The rewriting half shared by the recipes that choose such scales (output-aware smoothing, SmoothQuant,
AWQ): they measure and decide; these functions only change the graph.
"""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from ..ops import MUL
from ..graph.view import GraphView
from .fold_scale import k_axis, path_tensors, producer_path
MAX_SCALE = 1e4            # s is clipped to [1/MAX_SCALE, MAX_SCALE]


def fold_kind(view: GraphView, t: gs.Tensor, readers: set[str]) -> str:
    """Where a smoothing of `t` read by `readers` folds without a node: "layernorm", "producer" or ""."""
    if foldable(view, t, readers):
        return "layernorm"
    if {c.name for c, _ in view.consumers(t)} <= readers and producer_path(view, t) is not None:
        return "producer"
    return ""


def fold_reach(view: GraphView, t: gs.Tensor, kind: str) -> list[str]:
    """The tensors a smoothing of `t` folded as `kind` ("layernorm" or "producer", fold_kind) divides
    per channel: the LayerNorm's output, or every tensor from the producing layer's output to `t`."""
    return [t.name] if kind == "layernorm" else path_tensors(view, t)


def foldable(view: GraphView, t: gs.Tensor, readers: set[str]) -> bool:
    """Is `t` the output of a LayerNormalization with constant scale and bias, read only by
    `readers` (so dividing its scale and bias by s changes nothing else)?"""
    p = view.producer(t)
    if p is None or not view.vocab.is_(p, "layernorm") or view.is_graph_output(t) or view.used_in_subgraph(t):
        return False
    if len(p.inputs) < 3 or view.constant_value(p.inputs[1]) is None or view.constant_value(p.inputs[2]) is None:
        return False
    if p.attrs.get("axis", -1) not in (-1, len(view.shape(t) or [0]) - 1):
        return False
    return {c.name for c, _ in view.consumers(t)} <= readers


def scale_weights(view: GraphView, readers: list[gs.Node], scale: np.ndarray) -> None:
    """Multiply the readers' weight rows (input channels) by `scale`: of a MatMul/Gemm's 2-D weight,
    or axis 1 of a convolution's [O, C, *kernel]."""
    for n in readers:
        w = view.constant(n.inputs[1])
        if w.ndim >= 3:
            shape: tuple[int, ...] = (1, -1) + (1,) * (w.ndim - 2)
        else:
            shape = (-1, 1) if k_axis(view, n) == 0 else (1, -1)
        shaped = scale.reshape(shape)
        _replace(view, n, 1, gs.Constant(f"{n.name or n.outputs[0].name}_weight_smoothed",
                                         (w.astype(np.float64) * shaped).astype(w.dtype)))


def _replace(view: GraphView, node: gs.Node, index: int, new: gs.Constant) -> None:
    """Make `new` input `index` of `node`, in the view too; the constant it replaces leaves the
    view once nothing reads it, so that a collection frees its weights (the view's tensor map
    held every replaced weight of a 453 MB encoder until the pass returned)."""
    old = node.inputs[index]
    name = old.name
    node.inputs[index] = new
    view.tensors[new.name] = new
    if not old.outputs and view.tensors.get(name) is old:
        del view.tensors[name]


def divide(view: GraphView, node: gs.Node, index: int, scale: np.ndarray, axis: int, suffix: str) -> None:
    """Replace constant input `index` of `node` by itself divided by `scale` along `axis` (the last
    axis when the constant is a vector)."""
    old = node.inputs[index]
    v = view.constant(old)
    shape = [1] * max(v.ndim, 1)
    shape[axis if v.ndim > 1 else -1] = -1
    _replace(view, node, index, gs.Constant(f"{old.name}_{suffix}",
                                            (v.astype(np.float64) / scale.reshape(shape)).astype(v.dtype)))


def fold_producer(view: GraphView, t: gs.Tensor, scale: np.ndarray) -> list | None:
    """Divide the producing layer's output columns and biases by `scale`; returns what was divided
    [(node, input index, axis)], or None when the path is gone or shapes do not fit."""
    found = producer_path(view, t)
    if found is None:
        return None
    linear, index, axis, biases = found
    w = view.constant(linear.inputs[index])
    k = scale.size
    if w.ndim == 0 or w.shape[axis] != k or any(view.constant(b).shape[-1:] != (k,) for b in biases):
        return None                    # a broadcast constant would change shape when divided per channel
    divide(view, linear, index, scale, axis, "smoothed")
    undo = [(linear, index, axis)]
    for b in biases:
        for node, _ in view.consumers(b):
            if node is linear or view.vocab.is_(node, "add"):
                k = list(node.inputs).index(b)
                divide(view, node, k, scale, -1, "smoothed")
                undo.append((node, k, -1))
                break
    return undo


def insert_mul(graph: gs.Graph, x: gs.Tensor, readers: list[gs.Node], scale: np.ndarray,
               trailing: int = 0) -> gs.Tensor:
    """A Mul of `x` by 1/`scale` in front of `readers`, the scale running over the axis of `x` that
    has `trailing` axes after it (0: the last; a convolution's input: its spatial axes)."""
    inv = gs.Constant(f"{x.name}_smooth_scale",
                      (1.0 / scale).astype(np.float32).reshape((-1,) + (1,) * trailing))
    xs = gs.Variable(f"{x.name}_smoothed", dtype=x.dtype, shape=x.shape)
    graph.nodes.append(gs.Node(MUL, f"{x.name}_smooth", inputs=[x, inv], outputs=[xs]))
    for n in readers:
        n.inputs[0] = xs
    return xs
