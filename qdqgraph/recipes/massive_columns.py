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

from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from ..execution.runtime import float_activations, graph_session
from ..ops import ABS, MATMUL, REDUCE_MAX, REDUCE_SUM
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


class Products:
    """The channel maxima this recipe measures, from a float run made for another (a rider of
    recipes.output_aware.rows): every residual-writing MatMul whose input that run fetches anyway
    has its product's channel maxima computed here, in a small onnxruntime session of those
    products alone, on the samples this recipe's own run would take. (numpy's products, between
    that run's runs, had their threads and onnxruntime's contend for the cores: MiniLM's 96 small
    products took 0.13 s a sample.)

    That run is of the graph before output-aware's smoothing: the maxima are those of the recipe's
    own run up to float32 rounding (the smoothing is exact arithmetic, a division and its product),
    about 1e-6 apart. The columns are chosen by a threshold on them (RATIO), so a ratio within
    MARGIN of it leaves the choice to the recipe's own run (`maxima` returns None), as does a value
    that is not finite: the columns are those that run would choose."""

    def __init__(self, loaded: io.Loaded):
        view = GraphView(loaded.graph)
        self.layers: dict[str, tuple[str, str]] = {}      # node -> (input, output)
        self.weights: dict[str, np.ndarray] = {}
        for n in view.nodes:
            w = _weight(view, n) if view.vocab.is_(n, "matmul") and len(n.inputs) >= 2 else None
            if w is not None and writes_residual(view, n):
                self.layers[n.name] = (n.inputs[0].name, n.outputs[0].name)
                self.weights[n.name] = w
        self.names = sorted({x for x, _ in self.layers.values()})
        self.samples: list[dict[str, tuple[int, np.ndarray]]] = []   # per sample: node -> (rows, maxima)
        self.rows = 0
        self.sess: Any = None
        self.opened = False
        self.computed: list[str] = []               # the nodes the session computes, in its outputs' order

    def add(self, sample: int, n: int, feed: dict, out: dict) -> None:
        if sample != len(self.samples) or len(self.samples) >= SAMPLES or self.rows >= ROWS:
            return
        if not self.opened:
            self._open(out)
        if self.sess is None:
            return
        inputs = {self.layers[name][0] for name in self.computed}
        flat = {x: np.asarray(out[x], dtype=np.float32) for x in inputs}
        got = self.sess.run(None, {f"x:{x}": v.reshape(-1, v.shape[-1]) for x, v in flat.items()})
        here = {}
        for name, cmax, total in zip(self.computed, got[0::2], got[1::2]):
            x = flat[self.layers[name][0]]
            if np.isfinite(total):           # else the own run decides (onnxruntime's max drops NaN)
                here[name] = (int(np.prod(x.shape[:-1])), cmax)
        self.samples.append(here)
        self.rows += min((r for r, _ in here.values()), default=ROWS)
        if len(self.samples) >= SAMPLES or self.rows >= ROWS:
            self.close()

    def _open(self, out: dict) -> None:
        """The session of the products of the layers whose input the run hands out: its weights
        are the graph's arrays, shared (no copy), which it holds until `close`."""
        self.opened = True
        g = gs.Graph(opset=17)
        fed: dict[str, gs.Variable] = {}
        for name, (x, _) in self.layers.items():
            w = self.weights[name]
            v = out.get(x)
            if v is None or np.ndim(v) < 1 or np.shape(v)[-1] != w.shape[0] or not np.size(v):
                continue
            if x not in fed:
                fed[x] = gs.Variable(f"x:{x}", dtype=np.float32, shape=["rows", w.shape[0]])
                g.inputs.append(fed[x])
            k = len(self.computed)
            y = g.layer(op=MATMUL, inputs=[fed[x], gs.Constant(f"w{k}", w)],
                        outputs=[gs.Variable(f"y{k}", dtype=np.float32)])[0]
            a = g.layer(op=ABS, inputs=[y], outputs=[gs.Variable(f"a{k}", dtype=np.float32)])[0]
            g.outputs += [g.layer(op=REDUCE_MAX, inputs=[a], attrs={"axes": [0], "keepdims": 0},
                                  outputs=[gs.Variable(f"max{k}", dtype=np.float32)])[0],
                          g.layer(op=REDUCE_SUM, inputs=[a], attrs={"keepdims": 0},
                                  outputs=[gs.Variable(f"sum{k}", dtype=np.float32)])[0]]
            self.computed.append(name)
        self.weights = {}
        if self.computed:
            self.sess = graph_session(io.Loaded(graph=g), purpose="massive columns", spin=False, share=True)

    def close(self) -> None:
        """No more products to compute: the session (and its copy of the weights) and the weights
        go (output-aware's smoothing replaces the graph's; on DistilBERT they hold 72 MB)."""
        self.sess, self.weights = None, {}

    def maxima(self, found: dict[str, np.ndarray], outputs: dict[str, str],
               available: int) -> dict[str, np.ndarray] | None:
        """{node: its output channels' max |value|} for the candidates `found` (whose outputs are
        `outputs`), over the samples the recipe's own run takes of `available`; None where these
        products do not cover them all, or where a column's ratio is within MARGIN of RATIO."""
        if any(name not in self.layers or self.layers[name][1] != outputs[name] for name in found):
            return None
        cmax: dict[str, np.ndarray] = {}
        rows, taken = 0, 0
        for here in self.samples:
            if any(name not in here for name in found):
                return None
            rows += min(here[name][0] for name in found)
            taken += 1
            for name in found:
                v = here[name][1]
                cmax[name] = v if name not in cmax else np.maximum(cmax[name], v)
            if rows >= ROWS:
                break
        if rows < ROWS and taken < min(SAMPLES, available):
            return None                      # the own run would see more samples than were kept
        return cmax if not any(_near_threshold(v) for v in cmax.values()) else None


MARGIN = 1e-3         # a ratio this close to RATIO (relative) is left to the recipe's own run (Products)


def _near_threshold(cmax: np.ndarray) -> bool:
    med = float(np.median(cmax))
    if med <= 0:
        return True
    return bool(np.any(np.abs(cmax / med - RATIO) <= RATIO * MARGIN))


def choose(loaded: io.Loaded, plan: Plan, data: CalibrationData,
           products: Products | None = None) -> dict[str, tuple[np.ndarray, list[int], float]]:
    """{node: (weight, massive columns, ratio)} of the candidates that have some; the channel
    maxima from `products` where they hold them (see Products), else from a float run."""
    found = candidates(loaded, plan)
    if not found:
        return {}
    nodes = {n.name: n for n in loaded.graph.nodes}
    outputs = {name: nodes[name].outputs[0].name for name in found}
    known = products.maxima(found, outputs, data.count) if products is not None else None
    cmax: dict[str, np.ndarray] = known if known is not None else {}
    rows = 0
    for values in float_activations(loaded, sorted(set(outputs.values())), data, SAMPLES, "massive columns") \
            if known is None else ():
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


def run(loaded: io.Loaded, plan: Plan, data: CalibrationData, products: Products | None = None) -> PassResult:
    return apply(loaded.graph, choose(loaded, plan, data, products))
