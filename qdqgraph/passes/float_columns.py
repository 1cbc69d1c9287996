"""Float columns: a few output channels of a linear layer computed in float beside its INT8 product.

Trained transformers write a handful of "massive" channels into their residual stream: on MiniLM
the FFN's second linear layer makes channel 99 reach 222 on some tokens while its median channel
stays under 1 (Bondarenko et al. 2021, Sun et al. 2024). The INT8 product gets those channels
wrong by an amount the other tokens cannot absorb: the error is small against the massive value,
but on tokens where the channel is small (MiniLM's padding positions) the layers after it amplify
it (channel 99's error of layer 0 alone takes the padded positions of the token output from 33 to
5 dB). Here such a layer keeps its INT8 product, unchanged (its input scale is chosen on all of its
outputs), and the chosen columns are recomputed in float from the same input and replace them:

    y = (x W)_int8 * keep + sum_c (sum_k x_k W[k, c]) e_c

as two Einsum nodes, the product [..., K] x [K, C] and its placement [..., C] x [C, M] (no MatMul,
so no placement rule quantizes them: K + M multiply-adds a token per column), then a Mul by `keep`
(1 on every column but the chosen ones) and an Add, which fuse into the GEMM's epilogue. `e_c` is
the unit vector of column c. Einsum is opset 12: an older graph is left as it is.
"""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from ..ops import ADD, EINSUM, MUL
from .base import PassResult, result
from .registry import declare, describe


def split(graph: gs.Graph, node: gs.Node, weight: np.ndarray, columns: list[int]) -> list[gs.Node]:
    """Recompute `columns` of MatMul `node` (constant `weight` [K, M]) in float, replacing them in
    its output; returns the nodes added. The graph needs a toposort afterwards."""
    x, y = node.inputs[0], node.outputs[0]
    base = f"{node.name}_float_columns"
    m = weight.shape[1]
    keep = np.ones(m, dtype=np.float32)
    keep[columns] = 0.0
    place = np.zeros((len(columns), m), dtype=np.float32)
    place[np.arange(len(columns)), columns] = 1.0
    int8 = gs.Variable(f"{y.name}_int8_columns", dtype=y.dtype, shape=y.shape)
    node.outputs[0] = int8
    kept = gs.Variable(f"{base}_kept", dtype=y.dtype, shape=y.shape)
    cols = gs.Variable(f"{base}_values", dtype=x.dtype)
    placed = gs.Variable(f"{base}_placed", dtype=y.dtype, shape=y.shape)
    w = np.ascontiguousarray(weight[:, columns], dtype=np.float32)
    added = [gs.Node(MUL, f"{base}_keep", inputs=[int8, gs.Constant(f"{base}_keep_mask", keep)], outputs=[kept]),
             gs.Node(EINSUM, f"{base}_product", attrs={"equation": "...k,kc->...c"},
                     inputs=[x, gs.Constant(f"{base}_weight", w)], outputs=[cols]),
             gs.Node(EINSUM, f"{base}_place", attrs={"equation": "...c,cm->...m"},
                     inputs=[cols, gs.Constant(f"{base}_unit", place)], outputs=[placed]),
             gs.Node(ADD, f"{base}_add", inputs=[kept, placed], outputs=[y])]
    graph.nodes.extend(added)
    return added


@declare("float_columns")
def apply(graph: gs.Graph, chosen: dict[str, tuple[np.ndarray, list[int], float]]) -> PassResult:
    """Split every node of `chosen` ({node name: (weight [K, M], columns, largest/median)})."""
    nodes = {n.name: n for n in graph.nodes}
    done: dict[str, dict] = {}
    if (graph.opset or 0) < 12:          # Einsum: opset 12
        return result("float_columns", False, layers=done)
    for name, (weight, columns, ratio) in sorted(chosen.items()):
        if name in nodes and columns:
            split(graph, nodes[name], weight, sorted(columns))
            done[name] = {"columns": sorted(int(c) for c in columns), "ratio": round(float(ratio), 1)}
    if done:
        graph.toposort()
    return result("float_columns", bool(done), layers=done)


def _lines(results, ctx) -> list[str]:
    layers = results[-1].details.get("layers") if results else None
    if not layers:
        return []
    cols = sum(len(v["columns"]) for v in layers.values())
    return [f"float columns: {cols} massive output channel(s) of {len(layers)} linear layer(s) writing the "
            f"residual stream recomputed in float (up to {max(v['ratio'] for v in layers.values()):.0f}x the "
            f"median channel)"]


describe("float_columns", 61, lines=_lines, fields={"float_columns": lambda r: r[-1].details["layers"] if r else {}})
