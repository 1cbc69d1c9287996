"""Fragile heads: a model output whose own SQNR is far below the other outputs' (a dense regression
head, offsets or box deltas, beside a classification head), and the quantized nodes that feed only
it, nearest the output first, within a small share of the model's FLOPs."""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from ...placement.plan import Plan
from .measure import Fidelity

GAP_DB = 10.0          # fragile: this far below the median of the other outputs' SQNR ...
MAX_FLOPS_SHARE = 0.02  # ... and its head kept float only within this share of the model's FLOPs


def fragile_outputs(fid: Fidelity, below_db: float) -> list[str]:
    """Outputs below `below_db` and GAP_DB under the median of the others, worst first."""
    per = {k: v for k, v in fid.per_output.items() if not np.isnan(v)}
    found = []
    for name, db in per.items():
        others = [v for k, v in per.items() if k != name and np.isfinite(v)]
        if others and db < below_db and db <= float(np.median(others)) - GAP_DB:
            found.append(name)
    return sorted(found, key=lambda n: per[n])


def _reach(graph: gs.Graph, order: list[gs.Node] | None = None) -> dict[int, frozenset[str]]:
    """id(node) -> the graph outputs its results reach (`order`: the nodes in a topological order,
    the graph's own by default)."""
    outs = {t.name for t in graph.outputs}
    reach: dict[int, frozenset[str]] = {}
    for node in reversed(graph.nodes if order is None else order):
        got: set[str] = set()
        for t in node.outputs:
            if t.name in outs:
                got.add(t.name)
            for c in t.outputs:
                got |= reach.get(id(c), frozenset())
        reach[id(node)] = frozenset(got)
    return reach


def head_units(graph: gs.Graph, plan: Plan, output: str, flops: dict[str, float], total: float,
               max_share: float = MAX_FLOPS_SHARE) -> tuple[list[str], float]:
    """The quantized nodes whose results reach `output` and no other output, nearest the output
    first, while their FLOPs stay within `max_share` of `total`. Returns (nodes, their FLOPs share)."""
    graph.toposort()
    reach = _reach(graph)
    mine = [n for n in reversed(graph.nodes) if reach.get(id(n)) == frozenset({output})]
    chosen, spent = [], 0.0
    for n in mine:
        d = plan.decisions.get(n.name)
        if d is None or not d.quantized:
            continue
        f = flops.get(n.name, 0.0)
        if total and (spent + f) / total > max_share:
            break
        chosen.append(n.name)
        spent += f
    return chosen, spent / total if total else 0.0


def may_have_heads(graph: gs.Graph, plan: Plan, flops: dict[str, float], max_share: float = MAX_FLOPS_SHARE) -> bool:
    """Whether `head_units` could find a head for some output: a quantized node whose results reach
    that output alone, within `max_share` of the FLOPs by itself. Without one, no fragile output
    can be helped, and the fragile-heads check has nothing to measure. The graph is not reordered."""
    if len(graph.outputs) < 2:
        return False
    total = sum(flops.values())
    reach = _reach(graph, _topological(graph))
    for n in graph.nodes:
        d = plan.decisions.get(n.name)
        if d is not None and d.quantized and len(reach.get(id(n), ())) == 1 and \
                (not total or flops.get(n.name, 0.0) / total <= max_share):
            return True
    return False


def _topological(graph: gs.Graph) -> list[gs.Node]:
    """The nodes in a topological order (Kahn's), the graph's own list left as it is."""
    nodes = list(graph.nodes)
    member = {id(n) for n in nodes}
    waiting = {id(n): len({id(p) for t in n.inputs for p in t.inputs if id(p) in member}) for n in nodes}
    ready = [n for n in nodes if not waiting[id(n)]]
    order: list[gs.Node] = []
    while ready:
        n = ready.pop()
        order.append(n)
        for c in {id(c): c for t in n.outputs for c in t.outputs if id(c) in member}.values():
            waiting[id(c)] -= 1
            if not waiting[id(c)]:
                ready.append(c)
    return order if len(order) == len(nodes) else nodes
