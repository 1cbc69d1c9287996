"""Why a plan quantizes little or nothing, in a line or two, with what to do about it.

When the plan quantizes nothing, or less than LITTLE_INT8 of the weighted FLOPs, the run says why.
On a model with convolutions or GEMMs that is a warning (`warning`): the TensorRT engine would run
them in float, and a user who reads only the exit code would not know; it names the causes found
in the plan's decisions (the skip rules that took the most of them, the ones inside If/Loop
bodies). The notes (`explain`) add, where weighted ops sit inside If branches whose condition comes
from a model input that is constant over the calibration data, the `--fix-input` that would decide
those Ifs and quantize the branch they take.
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import onnx_graphsurgeon as gs

from .plan import Plan
from ..graph.view import GraphView

LITTLE_INT8 = 0.10
MAX_CAUSES = 3


def _little(plan: Plan, summary: dict | None) -> str | None:
    """'nothing', 'only x% of the weighted FLOPs', or None when enough is quantized."""
    share = (summary or {}).get("int8_flops_share")
    quantized = any(d.quantized for d in plan.decisions.values())
    if share is not None and share >= LITTLE_INT8:      # also what If branches quantized (qdqgraph.graph.branches)
        return None
    if quantized and share is None:
        return None
    return "nothing" if not quantized else f"only {100 * (share or 0.0):.1f}% of the weighted FLOPs"


def weighted_ops(graph: gs.Graph) -> tuple[Counter, Counter]:
    """The weighted ops (Conv, Gemm, MatMul, ...) by op type: (in the graph, inside If/Loop bodies that
    hold no quantize node: a branch quantized from its samples is not float compute)."""
    view = GraphView(graph, lazy=True)      # the op types only
    top = Counter(n.op for n in view.nodes if view.vocab.is_(n, "weighted"))
    inside = Counter(n.op for sub in graph.subgraphs(recursive=True) for n in sub.nodes
                     if view.vocab.is_(n, "weighted") and not any(view.vocab.is_(m, "quantize") for m in sub.nodes))
    return top, inside


def causes(graph: gs.Graph, plan: Plan) -> list[str]:
    """Why the weighted ops stay float, most nodes first: the skip decisions that took them, by rule
    and reason, and those inside If/Loop bodies."""
    view = GraphView(graph)
    top, inside = weighted_ops(graph)
    by_node = {n.name: n for n in view.nodes}
    skipped: dict[tuple, Counter] = {}
    for d in plan.decisions.values():
        node = by_node.get(d.node)
        if d.quantized or node is None or not view.vocab.is_(node, "weighted"):
            continue
        skipped.setdefault((d.rule, d.reason), Counter())[d.op] += 1
    found: list[tuple[int, str]] = []
    for (rule, reason), ops in skipped.items():
        what = ", ".join(f"{'every' if n == top[op] else f'{n} of {top[op]}'} {op}" for op, n in sorted(ops.items()))
        why = f"excluded by {reason}" if rule == "user-exclude" else f"skipped by {rule}: {reason}"
        found.append((sum(ops.values()), f"{what} {why}"))
    if inside:
        what = ", ".join(f"{n} {op}" for op, n in sorted(inside.items()))
        found.append((sum(inside.values()), f"compute inside If/Loop branches ({what}), which stay float"))
    decided = {d.node for d in plan.decisions.values()}
    undecided = Counter(n.op for n in view.nodes if view.vocab.is_(n, "weighted") and n.name not in decided)
    if undecided:
        what = ", ".join(f"{n} {op}" for op, n in sorted(undecided.items()))
        found.append((sum(undecided.values()), f"{what} that no placement rule matches (no constant weight)"))
    found.sort(key=lambda x: -x[0])
    return [text for _, text in found[:MAX_CAUSES]]


def warning(graph: gs.Graph, plan: Plan, summary: dict | None, quantized: str = "INT8") -> str | None:
    """The warning for a plan that leaves a model's convolutions and GEMMs float (None otherwise)."""
    what = _little(plan, summary)
    top, inside = weighted_ops(graph)
    if what is None or not (top or inside):
        return None
    share = (summary or {}).get("int8_flops_share")
    if what == "nothing":
        head = "the plan quantizes nothing" + (f" ({quantized} FLOPs {100 * share:.1f}%)" if share is not None else "")
    else:
        head = f"TensorRT would run only {100 * (share or 0.0):.1f}% of the weighted FLOPs in {quantized}"
    ops = ", ".join(f"{n} {op}" for op, n in sorted((top + inside).items()))
    why = "; ".join(causes(graph, plan)) or "no placement rule matched them"
    return f"{head} on a model with {ops}: {why}. The engine runs them in float; --require-int8 PCT makes this an error"


def explain(graph: gs.Graph, plan: Plan, data, summary: dict | None) -> list[str]:
    """Notes for the report (empty when enough is quantized). A model with convolutions or GEMMs
    gets the `warning` instead of the first note."""
    what = _little(plan, summary)
    if what is None:
        return []
    notes = []
    top, inside = weighted_ops(graph)
    reasons = Counter((d.rule, d.reason) for d in plan.decisions.values() if not d.quantized)
    if not (top or inside):
        if reasons:
            (rule, reason), n = reasons.most_common(1)[0]
            notes.append(f"the plan quantizes {what}; most skips ({n}) are {rule}: {reason}")
        else:
            notes.append(f"the plan quantizes {what}: no op here is one qdqgraph quantizes (Conv, Gemm, MatMul "
                         f"with a weight, ...)")
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
    found: set[str] = set()
    stack, seen = [t], set[str]()
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
