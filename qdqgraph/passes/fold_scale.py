"""Fold a multiply by a constant scalar into the linear layer that makes its input.

Attention blocks often scale the queries and the keys by d^-1/4 after splitting the heads
(MatMul -> bias Add -> Reshape -> Transpose -> Mul). TensorRT moves a Q up over data movement (R2)
and takes it into a weighted layer's epilogue (F2), but not over that Mul: the Q in front of the
attention then runs as a standalone reformat (F6), two per layer. A scalar commutes with the
reshapes, the transpose, the bias and the matrix product, so it folds into the layer's weights and
bias and the Mul goes away; the model computes the same function.

`producer_path` is the walk back from a tensor to the linear layer whose output columns become its
last axis; the output-aware pass folds per-channel smoothing along the same path.
"""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from ..graph import io
from ..graph.view import GraphView
from .base import PassResult, result
from .registry import QDQ_SOUND, declare

MAX_PATH = 8


def _single_use(view: GraphView, t: gs.Tensor) -> bool:
    """Does one node read `t`'s values (others may read its shape)?"""
    values = [c for c, _ in view.consumers(t) if not view.vocab.is_(c, "shape_of")]
    return len(values) == 1 and not view.is_graph_output(t) and not view.used_in_subgraph(t)


def producer_path(view: GraphView, t: gs.Tensor, limit: int = MAX_PATH):
    """(node, index of its constant weight, the weight's output-column axis, [bias constants]) of
    the layer whose output columns become `t`'s last axis through single-use ops of class `layout`,
    bias Adds and the right operand of MatMuls of two activations: a MatMul/Gemm with a constant
    2-D weight, or a Mul by a constant vector over the last axis (the gamma of a LayerNorm written
    out as ops); None when there is none. The column order through reshapes is not proved here:
    callers that scale per channel prove it (passes/fold_columns) or check it."""
    return _walk(view, t, limit)[0]


def path_tensors(view: GraphView, t: gs.Tensor, limit: int = MAX_PATH) -> list[str]:
    """The tensors producer_path walks over from `t` back to its layer's output, `t` first: a
    per-channel scale folded into that layer reaches every one of them. [] where there is no path."""
    layer, names = _walk(view, t, limit)
    return names if layer is not None else []


def _walk(view: GraphView, t: gs.Tensor, limit: int):
    """(producer_path's answer or None, the names of the tensors walked over, `t` first)."""
    biases: list[gs.Tensor] = []
    names: list[str] = []
    cur = t
    for _ in range(limit):
        names.append(cur.name)
        p = view.producer(cur)
        if p is None:
            return None, names
        layer, nxt = _path_step(view, p, biases)
        if nxt is None:
            return layer, names
        if not _single_use(view, nxt):
            return None, names
        cur = nxt
    return None, names


def _path_step(view: GraphView, p: gs.Node, biases: list[gs.Tensor]):
    """One step of producer_path back over the op `p`, adding the bias constants it passes to `biases`:
    (the layer found, None), (None, the tensor to go on from), or (None, None) where no layer is found."""
    if view.vocab.is_(p, "matmul") or view.vocab.is_(p, "gemm"):
        return _gemm_step(view, p, biases)
    if view.vocab.is_(p, "mul") and len(p.inputs) == 2:
        return _vector_mul_layer(view, p, biases), None
    if view.vocab.is_(p, "layout"):
        return None, p.inputs[0]
    if view.vocab.is_(p, "add"):
        return None, _bias_add_input(view, p, biases)
    return None, None


def _gemm_step(view: GraphView, p: gs.Node, biases: list[gs.Tensor]):
    """producer_path over a MatMul/Gemm: the layer when its weight is a constant 2-D matrix, else the
    right operand of a MatMul of two activations (out[..., j] = A @ B[..., j])."""
    k = k_axis(view, p)
    if k is not None:
        return _gemm_layer(view, p, k, biases), None
    if not view.vocab.is_(p, "matmul") or any(view.is_constant(x) for x in p.inputs[:2]):
        return None, None
    return None, p.inputs[1]


def _gemm_layer(view: GraphView, p: gs.Node, k: int, biases: list[gs.Tensor]):
    """The path's end at a MatMul/Gemm with a constant weight (reduction axis `k`), with a Gemm's
    bias among the biases; None when that bias is not a constant."""
    if view.vocab.is_(p, "gemm") and len(p.inputs) > 2 and p.inputs[2] is not None and p.inputs[2].name:
        if view.constant_value(p.inputs[2]) is None:
            return None
        biases.append(p.inputs[2])
    return p, 1, 1 - k, biases


def _vector_mul_layer(view: GraphView, p: gs.Node, biases: list[gs.Tensor]):
    """The path's end at a Mul by a constant scalar or vector over the last axis; None for another Mul."""
    const = [i for i, x in enumerate(p.inputs) if view.constant_value(x) is not None]
    if len(const) != 1 or view.constant(p.inputs[const[0]]).ndim > 1:
        return None
    return p, const[0], -1, biases


def _bias_add_input(view: GraphView, p: gs.Node, biases: list[gs.Tensor]) -> gs.Tensor | None:
    """The activation input of an Add of one constant (the bias, added to `biases`); None for another Add."""
    const = [x for x in p.inputs if view.is_constant(x)]
    var = [x for x in p.inputs if not view.is_constant(x)]
    if len(const) != 1 or len(var) != 1:
        return None
    biases.append(const[0])
    return var[0]


def _scalar(view: GraphView, node: gs.Node) -> tuple[gs.Tensor, float] | None:
    """(variable input, factor) of a Mul or Div by a constant finite non-zero scalar."""
    if len(node.inputs) != 2:
        return None
    if view.vocab.is_(node, "mul"):
        pairs = [(node.inputs[0], node.inputs[1]), (node.inputs[1], node.inputs[0])]
    elif view.vocab.is_(node, "div"):
        pairs = [(node.inputs[0], node.inputs[1])]
    else:
        return None
    for var, const in pairs:
        c = view.constant_value(const)
        if view.is_constant(var) or c is None or c.size != 1 or not np.issubdtype(c.dtype, np.floating):
            continue
        v = float(c.reshape(-1)[0])
        if not np.isfinite(v) or v == 0.0:
            return None
        return var, (v if view.vocab.is_(node, "mul") else 1.0 / v)
    return None


def _scaled(view: GraphView, owner: gs.Node, t: gs.Tensor, factor: float) -> None:
    v = view.constant(t)
    owner.inputs[list(owner.inputs).index(t)] = gs.Constant(f"{t.name}_scaled",
                                                            (v.astype(np.float64) * factor).astype(v.dtype))


def _feeds_gemms(view: GraphView, t: gs.Tensor, depth: int = 3) -> bool:
    """Is `t` read only by MatMul/Gemm inputs, directly or through ops of class `layout`? (Where
    a Q in front of a GEMM would sit after the Mul; a scale elsewhere, such as on attention scores
    before the Softmax, costs no reformat and is left alone.)"""
    uses = view.consumers(t)
    if not uses or view.is_graph_output(t) or depth < 0:
        return False
    for c, _ in uses:
        if view.vocab.is_(c, "matmul") or view.vocab.is_(c, "gemm"):
            continue
        if not (view.vocab.is_(c, "layout") and all(_feeds_gemms(view, o, depth - 1) for o in c.outputs)):
            return False
    return True


@declare("fold_scalar_scales", ensures=(QDQ_SOUND,), fixpoint=True, graph_only=True)
def fold_scalar_scales(graph: gs.Graph) -> PassResult:
    """Fold every Mul/Div by a constant scalar whose input a linear layer makes and whose output
    GEMMs read (see the module doc). Modifies `graph`; details: `folded` ([Mul, the layer it went
    into])."""
    view = GraphView(graph, lazy=True)      # asks producers, consumers and constants only
    folded: list[tuple[str, str]] = []
    for node in list(view.nodes):
        found = _scalar(view, node)
        if found is None or not _feeds_gemms(view, node.outputs[0]):
            continue
        var, factor = found
        if not _single_use(view, var):
            continue
        path = producer_path(view, var)
        if path is None:
            continue
        linear, k, _, biases = path
        _scaled(view, linear, linear.inputs[k], factor)
        for b in biases:
            owner = linear if b in linear.inputs else next(c for c, _ in view.consumers(b) if view.vocab.is_(c, "add"))
            _scaled(view, owner, b, factor)
        for c, i in view.consumers(node.outputs[0]):
            c.inputs[i] = var
        node.outputs.clear()
        node.inputs.clear()
        folded.append((node.name, linear.name))
    if folded:
        io.cleanup(graph)
    return result("fold_scalar_scales", bool(folded), folded=folded)


def k_axis(view: GraphView, node: gs.Node) -> int | None:
    """Axis of the weight that runs over input channels, or None when the node is not a target."""
    w = view.constant_value(node.inputs[1]) if len(node.inputs) > 1 else None
    if w is None or w.ndim != 2 or not np.issubdtype(w.dtype, np.floating):
        return None
    if view.vocab.is_(node, "matmul"):
        return 0
    if view.vocab.is_(node, "gemm") and not node.attrs.get("transA", 0):
        return 1 if node.attrs.get("transB", 0) else 0
    return None
