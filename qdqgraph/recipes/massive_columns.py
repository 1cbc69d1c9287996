"""Massive output channels of the linear layers that write a transformer's residual stream, found
on the calibration data and computed in float (passes/float_columns.py says how and why).

A candidate is a MatMul with a constant [K, M] weight that the plan quantizes and whose output,
through an optional bias Add, is added to another activation (the residual) that a normalization
(LayerNormalization and its class) reads. Its output channels' largest |value| over the calibration
samples are compared with their median: the channels at RATIO times the median or more are the
massive ones, split off where there are at most MAX_COLUMNS of them (more is not a few outliers
but a wide output, which the INT8 product serves as it is).

Measured on MiniLM-L6 (docs/ACCURACY.md, 2026-11-28): its six FFN output layers have 1 to 3 such
channels (48x to 240x the median; the next largest is 12x), and recomputing them took the token
output from 6.2 to 19.3 dB on held-out sentences (padding positions 4.8 -> 18.6 dB) and the sentence
embedding from 22.1 to 23.2 dB. A threshold of 10x picks the same channels there; 5x picks 18
columns in 12 layers for no further gain on the sentence embedding.
"""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from ..execution.runtime import float_activations
from ..graph import io
from ..graph.view import GraphView
from ..passes.base import PassResult
from ..passes.float_columns import apply
from ..placement.plan import Plan
from ..samples.data import CalibrationData

RATIO = 16.0          # a column this many times the median channel's largest |value| is massive ...
MAX_COLUMNS = 4       # ... and a layer with more of them than this is left as it is
SAMPLES = 8           # calibration samples the channel maxima are taken over, at most (massive
                      # channels show on every input: 8 find the same ones as 24 on MiniLM) ...
ROWS = 4096           # ... and no more than it takes to see this many rows (tokens): Whisper's
                      # encoder (1,500 a sample) stops after 3


def _weight(view: GraphView, node: gs.Node) -> np.ndarray | None:
    w = view.constant_value(node.inputs[1]) if len(node.inputs) > 1 else None
    return None if w is None or w.ndim != 2 else np.asarray(w, dtype=np.float32)


def writes_residual(view: GraphView, node: gs.Node) -> bool:
    """Does the node's output, through at most one Add of a constant (its bias), meet another
    activation in an Add that a normalization reads?"""
    y = node.outputs[0]
    for _ in range(2):
        readers = view.consumers(y)
        if len(readers) != 1 or not view.vocab.is_(readers[0][0], "add") or view.is_graph_output(y):
            return False
        add = readers[0][0]
        other = add.inputs[1 - readers[0][1]] if len(add.inputs) == 2 else None
        if other is None:
            return False
        if not view.is_constant(other):
            return any(view.vocab.is_(n, "layernorm") for n, _ in view.consumers(add.outputs[0]))
        y = add.outputs[0]
    return False


def candidates(loaded: io.Loaded, plan: Plan) -> dict[str, np.ndarray]:
    """{node name: its weight [K, M]} of the quantized MatMuls that write the residual stream."""
    view = GraphView(loaded.graph)
    weights = {s.tensor for s in plan.weight_sites()}
    out = {}
    for n in view.nodes:
        if not view.vocab.is_(n, "matmul") or len(n.inputs) < 2:
            continue
        w = _weight(view, n)
        if w is not None and n.inputs[1].name in weights and writes_residual(view, n):
            out[n.name] = w
    return out


def massive(cmax: np.ndarray) -> tuple[list[int], float]:
    """(the massive columns, the largest one's ratio to the median), no columns where there are
    more than MAX_COLUMNS of them or the median is 0."""
    med = float(np.median(cmax))
    if med <= 0:
        return [], 0.0
    ratio = cmax / med
    cols = [int(c) for c in np.flatnonzero(ratio >= RATIO)]
    return (cols if len(cols) <= MAX_COLUMNS else []), float(ratio.max())


def choose(loaded: io.Loaded, plan: Plan, data: CalibrationData) -> dict[str, tuple[np.ndarray, list[int], float]]:
    """{node: (weight, massive columns, ratio)} of the candidates that have some."""
    found = candidates(loaded, plan)
    if not found:
        return {}
    nodes = {n.name: n for n in loaded.graph.nodes}
    outputs = {name: nodes[name].outputs[0].name for name in found}
    cmax: dict[str, np.ndarray] = {}
    rows = 0
    for values in float_activations(loaded, sorted(set(outputs.values())), data, SAMPLES, "massive columns"):
        rows += min(int(np.prod(np.shape(v)[:-1])) for v in values.values())
        for name, t in outputs.items():
            v = np.abs(np.asarray(values[t], dtype=np.float32))
            v = v.reshape(-1, v.shape[-1]).max(axis=0) if v.size else np.zeros(found[name].shape[1], np.float32)
            cmax[name] = v if name not in cmax else np.maximum(cmax[name], v)
        if rows >= ROWS:
            break
    chosen = {}
    for name, w in found.items():
        if name in cmax and cmax[name].shape[0] == w.shape[1]:
            cols, ratio = massive(cmax[name])
            if cols:
                chosen[name] = (w, cols, ratio)
    return chosen


def run(loaded: io.Loaded, plan: Plan, data: CalibrationData) -> PassResult:
    return apply(loaded.graph, choose(loaded, plan, data))
