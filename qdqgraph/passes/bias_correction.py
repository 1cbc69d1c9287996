"""Empirical bias correction (insert --bias-correction): undo the mean output shift that weight
quantization causes.

For a weighted op y = W x + b whose weight will be stored as INT8, the quantized weight is
W_q = W + E, so E[y_q] - E[y] = E E[x]. With E[x] measured per input channel on calibration
samples (float model), b is replaced by b - E E[x] (a bias is added where there was none). This is
the "empirical bias correction" of data-free quantization (Nagel et al., 2019), for Conv (grouped
too) and Gemm; MatMul has no bias slot and is left alone. It runs on the cleaned float graph before
insertion, with the same per-channel weight scales insertion uses, so E is exactly the error the
INT8 weights will have.
"""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from ..graph import io
from ..samples.data import CalibrationData
from ..placement.plan import Plan, Site
from ..execution.runtime import float_activations
from ..graph.view import GraphView
from .base import PassResult, result
from .insert import quantize_weight, weight_scales
from .registry import declare, describe


def _targets(graph: gs.Graph, plan: Plan) -> list[tuple[gs.Node, Site]]:
    view = GraphView(graph)
    nodes = {n.name: n for n in graph.nodes}
    out: list[tuple[gs.Node, Site]] = []
    for site in plan.weight_sites():
        for name, index in site.edges:
            node = nodes.get(name)
            if node is None or index != 1:
                continue
            if view.vocab.is_(node, "conv") and not view.vocab.is_(node, "conv_transpose"):
                out.append((node, site))
            elif (view.vocab.is_(node, "gemm") and node.attrs.get("alpha", 1.0) == 1.0
                  and node.attrs.get("beta", 1.0) == 1.0 and not node.attrs.get("transA", 0)):
                out.append((node, site))
    return out


def input_means(loaded: io.Loaded, plan: Plan, data: CalibrationData, samples: int = 32) -> dict[str, np.ndarray]:
    """Per-input-channel mean of each corrected node's activation input (axis 1 for Conv, last axis
    for Gemm) over the first `samples` samples of the float model."""
    targets = _targets(loaded.graph, plan)
    names = sorted({n.inputs[0].name for n, _ in targets})
    if not names:
        return {}
    sums: dict[str, np.ndarray] = {}
    seen = 0
    for values in float_activations(loaded, names, data, samples, "bias correction"):
        for name, v in values.items():
            v = v.astype(np.float64)
            m = v.mean(axis=tuple(d for d in range(v.ndim) if d != 1)) if v.ndim > 2 else v.reshape(-1, v.shape[-1]).mean(0)
            sums[name] = sums.get(name, 0) + m
        seen += 1
    return {k: v / max(seen, 1) for k, v in sums.items()}


@declare("bias_correction")
def correct_biases(graph: gs.Graph, plan: Plan, means: dict[str, np.ndarray], known: dict | None = None) -> PassResult:
    """Apply the correction in place; details: `corrected` (node names). `known`: weights whose
    INT8 values are given ({tensor: insert.Known}, learned rounding's): their error is theirs."""
    view = GraphView(graph)
    done = []
    for node, site in _targets(graph, plan):
        mean = means.get(node.inputs[0].name)
        w = view.constant_value(node.inputs[1])
        if mean is None or w is None:
            continue
        given = (known or {}).get(site.tensor)
        scale = weight_scales(w, site.axis) if given is None else np.asarray(given.scale)
        s = scale.reshape([-1 if d == site.axis else 1 for d in range(w.ndim)])
        stored = quantize_weight(w, scale, site.axis) if given is None or given.stored is None else given.stored
        err = stored.astype(np.float64) * s - w.astype(np.float64)
        if not view.vocab.is_(node, "gemm"):
            group = int(node.attrs.get("group", 1))
            o, cg = err.shape[0], err.shape[1]
            per_k = err.reshape(o, cg, -1).sum(axis=2)                  # [O, C/g]
            gi = np.arange(o) // (o // group)
            shift = np.einsum("oc,oc->o", per_k, mean.reshape(group, cg)[gi])
        elif node.attrs.get("transB", 0):
            shift = err @ mean                                          # W [N, K]
        else:
            shift = mean @ err                                          # W [K, N]
        bias = view.constant_value(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2].name else None
        new = (np.zeros(shift.shape) if bias is None else bias.astype(np.float64)) - shift
        const = gs.Constant(f"{node.name}_bias_corrected", new.astype(np.float32))
        if len(node.inputs) > 2:
            node.inputs[2] = const
        else:
            node.inputs.append(const)
        done.append(node.name)
    return result("bias_correction", bool(done), corrected=done)


def _corrected(results) -> int:
    return results[-1].count("corrected") if results else 0


describe("bias_correction", 70, fields={"bias_corrected": _corrected},
         lines=lambda rs, ctx: [f"bias correction: {_corrected(rs)} biases absorb the weight-quantization shift"]
         if _corrected(rs) else [])
