"""Output-aware scales, the rewriting half: apply the smoothing each linear-layer input was given
(recipes/output_aware.py measures and chooses; the module docstring there says how) and return each
chosen tensor's range under the name the plan will see it by.

The smoothing adds no node where it can be folded: into a LayerNormalization's scale and bias
where the LayerNorm output feeds nothing else, or into the output columns (and bias) of the linear
layer that makes the tensor (passes/channel_scale.py). Column order through reshapes is not proved
from shapes: a fold into a producer is checked (the `check` the recipe hands in: one calibration
sample, the tensor must come out divided by s) and undone, for a Mul, where it fails. Elsewhere the
smoothing is a Mul in front of the readers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..graph import io
from ..execution.memory import EVERY_STAGE_BYTES, free_if_large
from ..execution.profile import step
from ..graph.view import GraphView
from .base import PassResult, result
from .channel_scale import divide, fold_producer, fold_reach, insert_mul, scale_weights
from .registry import declare, describe


COLLECT_EVERY = 8      # replaced weights a large model's pass frees at a time (cyclic garbage)


@dataclass
class Choice:
    tensor: str
    nodes: list[str]
    alpha: float
    amax: float                   # the range of the (smoothed) tensor
    error: float                  # relative output error ||E||^2 / ||XW||^2 of the choice
    plain_error: float            # the same without the pass (alpha 0, the tensor's max range... best plain clip)
    folded: str = ""              # "layernorm" or "producer" when the smoothing adds no node
    scale: np.ndarray | None = None
    trailing: int = 0             # the tensor's axes after the one smoothed: 0 for a linear layer's
                                  # input (its last axis), the spatial axes of a convolution's (axis 1)
    pooled: bool = False          # measured where a global max pool reads the layer (recipes/pooled.py)


@declare("output_aware")
def apply(loaded: io.Loaded, choices: list[Choice], first: dict,
          check: Callable[[dict], dict]) -> tuple[PassResult, dict[str, float]]:
    """Smooth as chosen (folded into a LayerNorm or the producing layer, or a Mul in front of the
    readers) and return the range of each chosen tensor under the name the plan will see it by.
    `first`: the tensors with a float value on the first sample (producer folds are checked against
    it); `check(pending)` -> the pending producer folds that failed, to be undone."""
    graph = loaded.graph
    view = GraphView(graph)
    nodes = {n.name: n for n in graph.nodes}
    ranges: dict[str, float] = {}
    done: dict[str, list[str]] = {"layernorm": [], "producer": [], "mul": []}
    pending = {}
    for c in choices:
        x = view.tensors[c.tensor]
        ranges[c.tensor] = c.amax
        if c.scale is None:
            continue
        if c.folded == "layernorm":
            ln = view.producer(x)
            divide(view, ln, 1, c.scale, -1, "smoothed")
            divide(view, ln, 2, c.scale, -1, "smoothed")
            scale_weights(view, [nodes[n] for n in c.nodes], c.scale)
            done["layernorm"].append(c.tensor)
        elif c.folded == "producer" and c.tensor in first:
            undo = fold_producer(view, x, c.scale)
            if undo is not None:
                scale_weights(view, [nodes[n] for n in c.nodes], c.scale)
                pending[c.tensor] = (c, undo)
    free_if_large(loaded)           # the replaced weights are cyclic garbage (graph tensors are cycles)
    # one check for all: a fold that fails makes the folds after it fail too (they are then Muls:
    # correct, at the cost of a reformat each)
    with step("fold check"):
        failed = check(pending)
    for name, (c, undo) in pending.items():
        if name in failed:
            assert c.scale is not None, "only smoothed tensors are pending"
            for node, k, axis in undo:
                divide(view, node, k, 1.0 / c.scale, axis, "unsmoothed")
            scale_weights(view, [nodes[n] for n in c.nodes], 1.0 / c.scale)
        else:
            done["producer"].append(name)
    _multiply(loaded, view, [c for c in choices if c.scale is not None and c.tensor not in done["layernorm"]
                             and c.tensor not in done["producer"]], nodes, ranges, done["mul"])
    return result("output_aware", any(done.values()), tensors={c.tensor: _detail(c) for c in choices},
                  folded=done["layernorm"] + done["producer"], into_producer=done["producer"], multiplied=done["mul"],
                  rescaled=sorted({n for kind in ("layernorm", "producer") for t in done[kind]    # io.RESCALED_KEY
                                   for n in fold_reach(view, view.tensors[t], kind)})), ranges


def _detail(c: Choice) -> dict:
    return {"alpha": c.alpha, "amax": c.amax, "error": c.error, "plain_error": c.plain_error,
            "smoothing": (c.folded or "mul") if c.scale is not None else "none",
            "measured": "pooled maxima" if c.pooled else "rows"}


def _multiply(loaded: io.Loaded, view: GraphView, choices: list[Choice], nodes: dict, ranges: dict,
              done: list[str]) -> None:
    """The smoothing of `choices` as a Mul in front of their readers (ranges renamed to the Mul's
    output); the weights it replaces are freed as it goes on a large model."""
    for c in choices:
        assert c.scale is not None, "only smoothed tensors are multiplied"
        c.folded = ""
        xs = insert_mul(loaded.graph, view.tensors[c.tensor], [nodes[n] for n in c.nodes], c.scale, c.trailing)
        scale_weights(view, [nodes[n] for n in c.nodes], c.scale)
        ranges[xs.name] = ranges.pop(c.tensor)
        done.append(c.tensor)
        if len(done) % COLLECT_EVERY == 0:    # a 453 MB encoder: 71 weights replaced, +420 MB until collected
            free_if_large(loaded, EVERY_STAGE_BYTES)
    if done:
        loaded.graph.toposort()


def _details(results) -> dict | None:
    return results[-1].details if results else None


def _output_aware_lines(results, ctx) -> list[str]:
    oa = _details(results)
    if not oa:
        return []
    t = oa["tensors"]
    n_smoothed = sum(1 for v in t.values() if v["smoothing"] != "none")
    rows = oa.get("rows")
    sampled = (f"; chosen on at most {rows['rows_kept']} rows of each, strided over {rows['rows_seen']} rows of "
               f"{rows['samples']} sample(s)") if rows else ""
    pooled = [name for name, v in t.items() if v.get("measured") == "pooled maxima"]
    at_max = (f"; {len(pooled)} read by a global max pool, measured at the float maxima of their layer's "
              f"output") if pooled else ""
    return [f"output-aware scales: {len(t)} input(s) of linear layers and convolutions, {n_smoothed} smoothed "
            f"({len(oa['folded'])} folded into a LayerNorm or the producing layer, "
            f"{len(oa['multiplied'])} by an inserted Mul){sampled}{at_max}"]


describe("output_aware", 60, lines=_output_aware_lines, fields={"output_aware": _details})
