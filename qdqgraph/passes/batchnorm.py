"""Fold BatchNormalization into the preceding Conv, ConvTranspose or Gemm.

y = gamma * (x - mean) / sqrt(var + eps) + beta is an affine map per output channel, so it folds
into the weighted op's weights and bias; per-channel weight scales then see the real weights.
"""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from ..graph.view import GraphView
from .base import PassResult, result
from .registry import Condition, declare, describe
from ..graph import io


def _bn_params(view, bn):
    vals = [view.constant_value(t) if t.name else None for t in bn.inputs[1:5]]
    if any(v is None for v in vals):
        return None
    eps = float(bn.attrs.get("epsilon", 1e-5))
    gamma, beta, mean, var = (v.astype(np.float64) for v in vals)
    scale = gamma / np.sqrt(var + eps)
    return scale, beta - mean * scale


def _why_not(view: GraphView, bn: gs.Node):
    if len([o for o in bn.outputs if o.name]) > 1 or bn.attrs.get("training_mode", 0):
        return None, "training mode (more than one output)"
    x = bn.inputs[0]
    prod = view.producer(x)
    if prod is None or not (view.vocab.is_(prod, "conv") or view.vocab.is_(prod, "gemm")):
        return None, f"its input comes from {prod.op if prod else 'a graph input'}, not a Conv, ConvTranspose or Gemm"
    if len(view.consumers(x)) != 1 or view.is_graph_output(x) or view.used_in_subgraph(x):
        return None, f"the output of {prod.name or prod.op} has other consumers"
    if len(prod.inputs) < 2 or view.constant_value(prod.inputs[1]) is None:
        return None, f"the weight of {prod.name or prod.op} is not a constant"
    if len(prod.inputs) > 2 and prod.inputs[2].name and view.constant_value(prod.inputs[2]) is None:
        return None, f"the bias of {prod.name or prod.op} is not a constant"
    if _bn_params(view, bn) is None:
        return None, "its scale, bias, mean or variance is not a constant"
    if view.vocab.is_(prod, "gemm") and (prod.attrs.get("transA", 0) or len(view.shape(x) or (0, 0)) != 2):
        return None, "Gemm with transA or a non-2-D output"
    return prod, ""


def _fold_weights(view, op, w, b, scale, shift):
    """Return (W', b') for the weighted op after the per-output-channel affine map (W' in W's
    dtype's arithmetic, b' in float64)."""
    ws = scale.astype(w.dtype)
    if view.vocab.is_(op, "gemm"):
        alpha, beta_ = float(op.attrs.get("alpha", 1.0)), float(op.attrs.get("beta", 1.0))
        w = w * w.dtype.type(alpha) * (ws[:, None] if op.attrs.get("transB", 0) else ws[None, :])
        b = np.broadcast_to(b * beta_, scale.shape) if b is not None else 0.0
        return w, b * scale + shift
    if view.vocab.is_(op, "conv_transpose"):
        g = int(op.attrs.get("group", 1))
        cin, kg = w.shape[0], w.shape[1]
        s = ws.reshape(g, 1, kg, *([1] * (w.ndim - 2)))
        w = (w.reshape(g, cin // g, kg, *w.shape[2:]) * s).reshape(w.shape)
    else:
        w = w * ws.reshape(-1, *([1] * (w.ndim - 1)))
    b = b if b is not None else 0.0
    return w, b * scale + shift


def _unlisted(graph: gs.Graph, res: PassResult | None) -> list[str]:
    kept = {name for name, _ in res["kept"]} if res is not None else set()
    view = GraphView(graph)
    return [n.name for n in graph.nodes if view.vocab.is_(n, "batchnorm") and n.name not in kept]


@declare("fold_batchnorm", ensures=(Condition("every BatchNormalization left is one the result names as kept", _unlisted),),
         fixpoint=True, graph_only=True)
def fold_batchnorm(graph: gs.Graph) -> PassResult:
    """Fold every BatchNormalization that directly follows a Conv/ConvTranspose/Gemm whose output it
    alone uses. Modifies `graph`; details: `folded` (BN names), `kept` ([BN, why it stayed])."""
    folded: list[str] = []
    kept: list[tuple[str, str]] = []
    io.toposort(graph)
    view = GraphView(graph, lazy=True)      # asks producers, consumers and constants only
    for bn in [n for n in view.nodes if view.vocab.is_(n, "batchnorm")]:
        op, why = _why_not(view, bn)
        if op is None:
            kept.append((bn.name, why))
            continue
        scale, shift = _bn_params(view, bn)
        w_t = op.inputs[1]
        w = view.constant(w_t)           # _why_not checked that the weight and bias are constants
        b_t = op.inputs[2] if len(op.inputs) > 2 and op.inputs[2].name else None
        b = view.constant(b_t).astype(np.float64) if b_t is not None else None
        # float32 weights are scaled in float32 (at most one rounding more than float64, and a
        # fifth of the time on ResNet-50's 25 M weights); the small bias and other dtypes in float64
        wt = np.float32 if w.dtype == np.float32 else np.float64
        new_w, new_b = _fold_weights(view, op, w.astype(wt, copy=False), b, scale, shift)
        base = op.name or op.outputs[0].name
        op.inputs[1] = gs.Constant(f"{base}_weight_bnfolded", new_w.astype(w.dtype))
        bias = gs.Constant(f"{base}_bias_bnfolded", np.asarray(new_b, dtype=w.dtype).reshape(-1))
        if len(op.inputs) > 2:
            op.inputs[2] = bias
        else:
            op.inputs.append(bias)
        if view.vocab.is_(op, "gemm"):
            op.attrs["alpha"] = 1.0
            op.attrs["beta"] = 1.0
        # the weighted op now writes the BN's output tensor; the BN is left dangling for cleanup
        out = bn.outputs[0]
        bn.outputs.clear()
        op.outputs[0] = out
        folded.append(bn.name)
    io.tidy(graph)
    return result("fold_batchnorm", bool(folded), folded=folded, kept=kept)


def _bn_folded(results) -> int:
    return sum(r.count("folded") for r in results)


def _bn_kept(results) -> list[dict]:
    return [{"node": n, "reason": r} for res in results for n, r in res["kept"]]


def _bn_phrase(results, ctx) -> tuple[str, list[str]]:
    kept = _bn_kept(results)
    return (f"{_bn_folded(results)} BatchNormalization folded, {len(kept)} kept",
            [f"  kept {bn['node']}: {bn['reason']}" for bn in kept[:ctx.max_examples]])


describe("fold_batchnorm", 30, phrase=_bn_phrase, fields={"batchnorm_folded": _bn_folded, "batchnorm_kept": _bn_kept})
