"""Pointwise regions: the walk that placement and the simulator share (written once, here).

TensorRT merges adjacent pointwise layers into one PointWise op, a generic single-input,
single-output epilogue (TRT_RULES.md F2): a HardSwish written out as x*clip(x+3,0,6)/6, or an erf
GELU, after a conv or a MatMul fuses into it. A pointwise region of tensor x is the set of
elementwise/activation ops fed by x alone, directly or through each other (their other operands
constants), with one tensor leaving it.

Both walks take a graph `g` that names tensors by string and offers: `producer(t)`,
`consumers(t)` ([(node, index)]), `data_inputs(node)` (activation inputs), `node_outputs(node)`,
`is_graph_output(t)`, `is_pointwise(node)` and `position()` (node name -> topological index).
The simulator's SimGraph offers them; placement reads a GraphView through `GraphView.named()`.
"""
from __future__ import annotations

MAX_REGION = 8      # pointwise nodes one generic PointWise epilogue may merge (a bound, not a TensorRT figure)


def region_from(g, t: str) -> tuple[list, str | None, str]:
    """The pointwise region fed by tensor `t`: ([its nodes in graph order], the one tensor leaving
    it, "") or ([], None, why there is none)."""
    region: dict[str, object] = {}
    inside = {t}
    todo = [t]
    while todo:                          # an op joins once all its activation operands are inside: it is
        for c, _ in g.consumers(todo.pop()):     # met again as a consumer of the last of them to join
            name = c.name
            if name in region or not g.is_pointwise(c) or any(d not in inside for d in g.data_inputs(c)):
                continue
            region[name] = c
            outs = [o for o in g.node_outputs(c) if o]
            inside.update(outs)
            todo += outs
            if len(region) > MAX_REGION:
                return [], None, f"more than {MAX_REGION} pointwise ops"
    leaving = sorted({o for n in region.values() for o in g.node_outputs(n)
                      if o and (g.is_graph_output(o) or any(c.name not in region for c, _ in g.consumers(o)))})
    if any(c.name not in region for c, _ in g.consumers(t)):
        return [], None, f"{t} also feeds ops outside the pointwise region"
    if len(leaving) != 1:
        return [], None, f"the pointwise region has {len(leaving)} outputs, not one"
    order = g.position()
    return sorted(region.values(), key=lambda n: order[n.name]), leaving[0], ""


def region_source(g, t: str) -> str | None:
    """The tensor x whose pointwise region (of two ops or more) ends in `t`, else None."""
    seen: set[str] = set()
    stack, outside = [t], set()
    while stack:
        p = g.producer(stack.pop())
        if p is None or p.name in seen:
            continue
        if not g.is_pointwise(p) or len(seen) >= MAX_REGION:
            return None
        seen.add(p.name)
        for d in g.data_inputs(p):
            q = g.producer(d)
            if q is not None and g.is_pointwise(q):
                stack.append(d)
            else:
                outside.add(d)
    if len(outside) != 1:
        return None
    x = next(iter(outside))
    nodes, out, _ = region_from(g, x)
    return x if out == t and len(nodes) >= 2 else None
