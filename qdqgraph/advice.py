"""Why a plan quantizes little or nothing, in a line or two, with what to do about it.

When the plan quantizes nothing, or less than LITTLE_INT8 of the weighted FLOPs, the summary says
why: the most common skip reasons, and, where weighted ops sit inside If branches whose condition
comes from a model input that is constant over the calibration data, the `--fix-input` that would
decide those Ifs and quantize the branch they take.
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import onnx_graphsurgeon as gs

from .placement.plan import Plan
from .view import GraphView

LITTLE_INT8 = 0.10


def explain(graph: gs.Graph, plan: Plan, data, summary: dict | None) -> list[str]:
    """Notes for the report (empty when enough is quantized)."""
    share = (summary or {}).get("int8_flops_share")
    quantized = any(d.quantized for d in plan.decisions.values())
    if quantized and (share is None or share >= LITTLE_INT8):
        return []
    what = "nothing" if not quantized else f"only {100 * share:.1f}% of the weighted FLOPs"
    notes = []
    reasons = Counter((d.rule, d.reason) for d in plan.decisions.values() if not d.quantized)
    if reasons:
        (rule, reason), n = reasons.most_common(1)[0]
        notes.append(f"the plan quantizes {what}; most skips ({n}) are {rule}: {reason}")
    else:
        notes.append(f"the plan quantizes {what}: no op here is one qdqgraph quantizes (Conv, Gemm, MatMul with "
                     f"a weight, ...) outside If/Loop bodies, which stay float")
    notes += _fixable_ifs(graph, data)
    return notes


def _fixable_ifs(graph: gs.Graph, data) -> list[str]:
    """--fix-input suggestions for Ifs whose condition comes from an input that is constant over
    the calibration data and whose branches hold weighted ops."""
    if data is None:
        return []
    view = GraphView(graph)
    inputs = {t.name for t in graph.inputs}
    out = []
    for node in view.nodes:
        if not view.vocab.is_(node, "conditional") or not node.inputs:
            continue
        weighted = sum(1 for sub in node.subgraphs() for n in sub.nodes if view.vocab.is_(n, "weighted"))
        if not weighted:
            continue
        for name in sorted(_input_ancestors(view, node.inputs[0], inputs)):
            value = _constant_over(data, name)
            if value is not None:
                out.append(f"If node {node.name} ({weighted} weighted ops in its branches) is decided by input "
                           f"'{name}', which is {value} on every calibration sample: --fix-input {name}={value} "
                           f"quantizes the branch it takes")
    return out


def _input_ancestors(view: GraphView, t: gs.Tensor, inputs: set[str], limit: int = 64) -> set[str]:
    found, stack, seen = set(), [t], set()
    while stack and len(seen) < limit:
        x = stack.pop()
        if x.name in seen:
            continue
        seen.add(x.name)
        if x.name in inputs:
            found.add(x.name)
            continue
        p = view.producer(x)
        if p is not None:
            stack.extend(i for i in p.inputs if i.name)
    return found


def _constant_over(data, name: str):
    """The value (as text) of input `name` if it is one scalar, the same on every sample."""
    first = None
    for i in range(data.count):
        v = np.asarray(data.sample(i).get(name))
        if v is None or v.size != 1:
            return None
        if first is None:
            first = v
        elif not np.array_equal(v, first):
            return None
    if first is None:
        return None
    x = first.reshape(-1)[0]
    return int(x) if np.issubdtype(first.dtype, np.integer) else float(x)
