"""SmoothQuant-style scale migration (insert --smooth-quant): move activation outliers into weights.

Transformer activations often carry a few channels hundreds of times larger than the rest (LayerNorm
outputs in BERT-like encoders). A per-tensor INT8 scale sized for those channels leaves the others a
handful of levels. For a MatMul or Gemm y = x W with a constant weight, dividing input channel k of x
by s_k and multiplying row k of W by s_k leaves y unchanged in real arithmetic; choosing
s_k = max|x_k|^alpha / max|W_k|^(1 - alpha) (Xiao et al., 2023, SmoothQuant) evens out the
activation channels at the cost of the weight's, which are quantized per output channel and absorb
it better.

TensorRT quantizes activations per tensor only, so the division is an explicit Mul by a constant
vector inserted in front of the smoothed ops (the ops that read one tensor share one s). Only the
inputs that the placement plan quantizes, of MatMul (weight [K, N]) and Gemm (transA=0) with a
constant 2-D weight, are smoothed. max|x_k| is measured on the float model over calibration samples.
"""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from ..graph import io
from ..ops import MUL
from ..samples.data import CalibrationData
from ..placement.plan import Plan
from ..execution.runtime import float_activations
from ..graph.view import GraphView
from .base import PassResult, result
from .channel_scale import MAX_SCALE, k_axis
from .registry import declare, describe

DEFAULT_ALPHA = 0.5


def targets(graph: gs.Graph, plan: Plan) -> dict[str, list[gs.Node]]:
    """Activation tensor -> the MatMul/Gemm nodes that read it as input 0, where the plan quantizes
    both that input and the node's weight."""
    view = GraphView(graph)
    nodes = {n.name: n for n in graph.nodes}
    weighted = {name for s in plan.weight_sites() for name, i in s.edges if i == 1}
    out: dict[str, list[gs.Node]] = {}
    for site in plan.activation_sites():
        for name, index in site.edges:
            node = nodes.get(name)
            if node is None or index != 0 or name not in weighted or k_axis(view, node) is None:
                continue
            if node.inputs[0].name != site.tensor:
                continue
            out.setdefault(site.tensor, []).append(node)
    return out


def conv_targets(graph: gs.Graph, plan: Plan) -> dict[str, list[gs.Node]]:
    """Activation tensor -> the convolutions that read it as input 0, where the plan quantizes both
    that input and the node's weight: Conv (not transposed) of group 1 with a constant float weight
    [O, C, *kernel], every reader of the tensor one of them (of any kernel size: a caller that reads
    the tensor as receptive fields makes each reader's own). Smoothing input channel c divides the
    tensor's axis 1 and multiplies the weights' [:, c] by s_c."""
    view = GraphView(graph)
    nodes = {n.name: n for n in graph.nodes}
    weighted = {name for s in plan.weight_sites() for name, i in s.edges if i == 1}
    out: dict[str, list[gs.Node]] = {}
    for site in plan.activation_sites():
        readers = [nodes.get(name) for name, index in site.edges if index == 0]
        if readers and len(readers) == len(site.edges) and all(_smoothable_conv(view, n, weighted, site.tensor)
                                                               for n in readers):
            out[site.tensor] = [n for n in readers if n is not None]
    return out


def _smoothable_conv(view: GraphView, node: gs.Node | None, weighted: set[str], tensor: str) -> bool:
    if node is None or node.name not in weighted or not view.vocab.is_(node, "conv") or \
            view.vocab.is_(node, "conv_transpose") or int(node.attrs.get("group", 1)) != 1:
        return False
    if not node.inputs or node.inputs[0].name != tensor or len(node.inputs) < 2:
        return False
    w = view.constant_value(node.inputs[1])
    return w is not None and w.ndim >= 3 and np.issubdtype(w.dtype, np.floating)


def channel_ranges(loaded: io.Loaded, tensors: list[str], data: CalibrationData,
                   samples: int = 32) -> dict[str, np.ndarray]:
    """max |x| per last-axis channel of each tensor over the first `samples` samples (float model)."""
    if not tensors:
        return {}
    out: dict[str, np.ndarray] = {}
    for values in float_activations(loaded, tensors, data, samples, "smoothing"):
        for name, v in values.items():
            v = np.abs(np.asarray(v, dtype=np.float32))
            m = v.reshape(-1, v.shape[-1]).max(axis=0) if v.ndim >= 2 else v
            out[name] = m if name not in out else np.maximum(out[name], m)
    return out


@declare("smooth")
def smooth(graph: gs.Graph, found: dict[str, list[gs.Node]], ranges: dict[str, np.ndarray],
           alpha: float = DEFAULT_ALPHA) -> PassResult:
    """Insert Mul(x, 1/s) in front of each group of `found` (from `targets`) and scale the weights'
    rows by s. In place."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    view = GraphView(graph)
    tensors = graph.tensors()
    smoothed: dict[str, list[str]] = {}        # activation tensor -> smoothed nodes
    max_ratio: dict[str, float] = {}           # tensor -> max/median channel range
    for name, nodes in sorted(found.items()):
        ax = ranges.get(name)
        if ax is None:
            continue
        weights = []
        for n in nodes:
            k = k_axis(view, n)
            assert k is not None, f"{n.name} is not a smoothing target (see targets())"
            weights.append((n, k, view.constant(n.inputs[1])))
        if any(w.shape[k] != ax.size for _, k, w in weights):
            continue
        aw = np.max([np.abs(w).max(axis=1 - k) for _, k, w in weights], axis=0)
        ok = (ax > 0) & (aw > 0)
        s = np.ones_like(ax, dtype=np.float64)
        s[ok] = ax[ok].astype(np.float64) ** alpha / aw[ok].astype(np.float64) ** (1.0 - alpha)
        s = np.clip(s, 1.0 / MAX_SCALE, MAX_SCALE)
        x = tensors[name]
        inv = gs.Constant(f"{name}_smooth_scale", (1.0 / s).astype(np.float32))
        xs = gs.Variable(f"{name}_smoothed", dtype=x.dtype, shape=x.shape)
        graph.nodes.append(gs.Node(MUL, f"{name}_smooth", inputs=[x, inv], outputs=[xs]))
        for n, k, w in weights:
            shaped = s.reshape(-1, 1) if k == 0 else s.reshape(1, -1)
            n.inputs[1] = gs.Constant(f"{n.name or n.outputs[0].name}_weight_smoothed",
                                      (w.astype(np.float64) * shaped).astype(w.dtype))
            n.inputs[0] = xs
        smoothed[name] = [n.name for n in nodes]
        med = float(np.median(ax[ax > 0])) if ok.any() else 0.0
        max_ratio[name] = float(ax.max() / med) if med > 0 else 0.0
    if smoothed:
        graph.toposort()
    return result("smooth", bool(smoothed), smoothed=smoothed, max_ratio=max_ratio)


def _smoothed(results) -> dict[str, list[str]]:
    return dict(results[-1]["smoothed"]) if results else {}


def _smooth_lines(results, ctx) -> list[str]:
    smoothed = _smoothed(results)
    if not smoothed:
        return []
    n_weights = sum(len(v) for v in smoothed.values())
    return [f"smoothing: {len(smoothed)} activations migrate their outliers into {n_weights} weights"]


describe("smooth", 50, lines=_smooth_lines, fields={"smoothed": _smoothed})
