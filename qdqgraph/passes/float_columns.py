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

as elementwise Mul and ReduceSum nodes (no MatMul, so no placement rule quantizes them; they cost
K multiply-adds a token per column, which TensorRT fuses into pointwise kernels). `keep` is 1 on
every column but the chosen ones, `e_c` the unit vector of column c.
"""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from ..ops import ADD, MUL, REDUCE_SUM
from .base import PassResult, result
from .registry import declare, describe


def _reduce_sum(graph: gs.Graph, name: str, x: gs.Tensor, out: gs.Variable) -> gs.Node:
    """ReduceSum over the last axis, kept (axes an input from opset 13, an attribute before)."""
    if (graph.opset or 13) >= 13:
        axes = gs.Constant(f"{name}_axes", np.array([-1], dtype=np.int64))
        return gs.Node(REDUCE_SUM, name, attrs={"keepdims": 1}, inputs=[x, axes], outputs=[out])
    return gs.Node(REDUCE_SUM, name, attrs={"axes": [-1], "keepdims": 1}, inputs=[x], outputs=[out])


def split(graph: gs.Graph, node: gs.Node, weight: np.ndarray, columns: list[int]) -> list[gs.Node]:
    """Recompute `columns` of MatMul `node` (constant `weight` [K, M]) in float, replacing them in
    its output; returns the nodes added. The graph needs a toposort afterwards."""
    x, y = node.inputs[0], node.outputs[0]
    base = f"{node.name}_float_columns"
    m = weight.shape[1]
    keep = np.ones(m, dtype=np.float32)
    keep[columns] = 0.0
    int8 = gs.Variable(f"{y.name}_int8_columns", dtype=y.dtype, shape=y.shape)
    node.outputs[0] = int8
    kept = gs.Variable(f"{base}_kept", dtype=y.dtype, shape=y.shape)
    added = [gs.Node(MUL, f"{base}_keep", inputs=[int8, gs.Constant(f"{base}_keep_mask", keep)], outputs=[kept])]
    total = kept
    for c in columns:
        prod = gs.Variable(f"{base}_{c}_prod", dtype=x.dtype)
        col = gs.Variable(f"{base}_{c}", dtype=x.dtype)
        placed = gs.Variable(f"{base}_{c}_placed", dtype=y.dtype)
        unit = np.zeros(m, dtype=np.float32)
        unit[c] = 1.0
        w = np.ascontiguousarray(weight[:, c], dtype=np.float32)
        added += [gs.Node(MUL, f"{base}_{c}_mul", inputs=[x, gs.Constant(f"{base}_{c}_weight", w)], outputs=[prod]),
                  _reduce_sum(graph, f"{base}_{c}_sum", prod, col),
                  gs.Node(MUL, f"{base}_{c}_place", inputs=[col, gs.Constant(f"{base}_{c}_unit", unit)],
                          outputs=[placed])]
        summed = y if c == columns[-1] else gs.Variable(f"{base}_{c}_sum_out", dtype=y.dtype, shape=y.shape)
        added.append(gs.Node(ADD, f"{base}_{c}_add", inputs=[total, placed], outputs=[summed]))
        total = summed
    graph.nodes.extend(added)
    return added


@declare("float_columns")
def apply(graph: gs.Graph, chosen: dict[str, tuple[np.ndarray, list[int], float]]) -> PassResult:
    """Split every node of `chosen` ({node name: (weight [K, M], columns, largest/median)})."""
    nodes = {n.name: n for n in graph.nodes}
    done = {}
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
