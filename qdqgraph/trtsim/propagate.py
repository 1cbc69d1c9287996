"""Steps 1-4 of the simulation order (TRT_RULES.md section 2): fold weights, merge equal Q/DQs, move
Q backward and DQ forward over commuting ops to a bounded fixpoint, then cancel or requantize the
DQ -> Q pairs that are left. Every rewrite is a rule of rules/tensorrt/propagation.toml."""
from __future__ import annotations

import heapq

from ..ops import DEQUANTIZE
from ..rulebook.match import Context
from .conditions import evaluate, holds
from .ir import DQ, OP, Q, REQUANT, SimGraph, SNode
from .rules import SimRuleSet
from .trace import Trace


class FixpointExceeded(RuntimeError):
    """Propagation kept rewriting past its bound: a rule set that loops (a bug, never a hang)."""


def default_bound(g: SimGraph) -> int:
    # Each op turns INT8 at most once (q_backward/dq_forward require `not_int8`) and every merge
    # removes a node, so the rewrites are bounded by a small multiple of the node count.
    return 4 * len(g.nodes) + 32


# ---------------------------------------------------------------------------- step 1

def _fold_constant_ops(g: SimGraph) -> list[str]:
    """Ops whose inputs are all constants (e.g. Transpose of a weight) are folded at build time.
    One pass in topological order: an op fed by folded ops sees their outputs as constants.
    Returns their names."""
    folded = []
    for n in list(g.order()):
        if n.role != OP or not n.inputs or not all(t == "" or g.is_const(t) for t in n.inputs):
            continue
        weight_of = [w for t in n.inputs if t for w in g.tensors[t].weight_of]
        for o in n.outputs:
            if not o:
                continue
            if o not in g.tensors:
                g.add_tensor(o)
            t = g.tensors[o]
            t.weight_of = weight_of + ([n.name] if weight_of else [])
            t.folded_from = [n.name]
        folded += n.origin
        g.remove(n)
    return folded


def eliminate_no_ops(g: SimGraph, rules: SimRuleSet, trace: Trace) -> list[tuple[list[str], str]]:
    """Step 0: ops that compute nothing at inference go; their consumers read their input.
    Returns the eliminated node groups with the rule that removed them."""
    eliminated = []
    ctx = Context(g)
    for node in [n for n in g.order() if n.role == OP and n.inputs and n.inputs[0]]:
        for rule in rules.for_op("eliminate", g.vocab, node.op):   # a rule of another op class says nothing
            m = holds(ctx, rule, node)
            ok, why = m.ok, m.reason
            if not ok:
                trace.miss(node.origin, rule.id, why)
                continue
            g.replace_uses(node.outputs[0], node.inputs[0])
            g.remove(node)
            eliminated.append((list(node.origin), rule.id))
            trace.fired(rule.id, node.origin, f"{node.name} ({node.op}) removed")
            break
    return eliminated


def fold_weights(g: SimGraph, rules: SimRuleSet, trace: Trace) -> list[str]:
    """Step 1: weight Q/DQ become INT8 weights; then ops on constants fold. Returns the folded ops."""
    for dq in [n for n in g.order() if n.role == DQ]:
        ctx = Context(g)
        fired = None
        for rule in rules.for_action("fold_weight"):   # all are evaluated, so each says why it did not fire
            m = evaluate(ctx, rule, dq)
            ok, why = m.ok, m.reason
            if not ok:
                trace.miss(dq.origin, rule.id, why)
            elif fired is None:
                fired = rule
        for rule in [fired] if fired else []:
            src = g.producer(dq.inputs[0])
            names = (src.origin if src is not None and src.role == Q else []) + dq.origin
            out = g.tensors[dq.outputs[0]]
            const = g.tensors[src.inputs[0]] if src is not None and src.role == Q else g.tensors[dq.inputs[0]]
            out.value, out.weight_of = const.value, names
            g.remove(dq)
            if src is not None and src.role == Q and not g.consumers(src.outputs[0]):
                g.remove(src)
            trace.fired(rule.id, names, f"weight {const.name} -> INT8 weight {out.name}")
    return _fold_constant_ops(g)


# ---------------------------------------------------------------------------- step 2

def try_merge(g: SimGraph, rules: SimRuleSet, trace: Trace, node: SNode) -> bool:
    """Merge the Qs (or DQs) on `node`'s input that have its parameters; True if one merged."""
    if node.role not in (Q, DQ):
        return False
    ctx = Context(g)
    for rule in rules.for_op("merge", g.vocab, node.op):
        m = holds(ctx, rule, node)
        ok, why = m.ok, m.reason
        if not ok:
            if sum(1 for c, i in g.consumers(node.inputs[0]) if i == 0 and c.role == node.role) > 1:
                trace.miss(node.origin, rule.id, why)
            continue
        group = [c for c, i in g.consumers(node.inputs[0])
                 if i == 0 and c.role == node.role and c.params.same(node.params)]
        group.sort(key=lambda n: n.key)
        keep, rest = group[0], group[1:]
        for other in rest:
            if g.is_graph_output(other.outputs[0]) and g.is_graph_output(keep.outputs[0]):
                continue  # two graph outputs stay two tensors
            if g.is_graph_output(other.outputs[0]):
                keep, other = other, keep
            g.replace_uses(other.outputs[0], keep.outputs[0])
            keep.origin += [o for o in other.origin if o not in keep.origin]
            g.remove(other)
            trace.fired(rule.id, keep.origin, f"{other.name} merged into {keep.name} on {node.inputs[0]}")
            return True
    return False


# ---------------------------------------------------------------------------- step 3

def _new_q_on(g: SimGraph, like: SNode, tensor: str, name: str) -> SNode:
    out = g.add_tensor(g.fresh(f"{tensor}_q"), like=tensor)
    g.tensors[out].dtype = None
    return g.add(SNode(name, like.op, [tensor] + like.inputs[1:], [out], dict(like.attrs), Q, like.qp,
                       list(like.origin)))


def try_q_backward(g: SimGraph, rules: SimRuleSet, trace: Trace, q: SNode) -> bool:
    """Move the Q `q` (with its equal siblings) above its producer; True if it moved."""
    if q.role != Q:
        return False
    x = g.producer(q.inputs[0])
    if x is None or x.role != OP:
        return False
    candidates = rules.for_op("q_backward", g.vocab, x.op)
    if not candidates:
        trace.miss(q.origin, "R5-a", f"no rule moves a Q above {x.name} ({x.op}): it does not commute with Q")
        return False
    ctx = Context(g)
    for rule in candidates:
        m = holds(ctx, rule, x)
        ok, why = m.ok, m.reason
        if not ok:
            trace.miss(q.origin + [x.name], rule.id, f"not moved above {x.name} ({x.op}): {why}")
            continue
        _move_q_above(g, x, rule.id, trace)
        return True
    return False


def _move_q_above(g: SimGraph, x: SNode, rule_id: str, trace: Trace) -> None:
    """One Q (the first by name) moves onto each activation input of x; the Qs with its parameters
    on x's outputs disappear. Any other consumer (which the R5 guards normally rule out) reads a
    DQ of the now-INT8 output, so a rule file without guards still gives a valid graph."""
    consumers = {c.name: c for o in x.outputs if o for c, _ in g.consumers(o)}
    qs = sorted((c for c in consumers.values() if c.role == Q), key=lambda n: n.key)
    keep = qs[0]
    same = [q for q in qs if q.params.same(keep.params)]
    others = {o: [(c, i) for c, i in g.consumers(o) if c not in same] for o in x.outputs if o}
    origin = []
    for q in same:
        origin += [o for o in q.origin if o not in origin]
        g.replace_uses(q.outputs[0], q.inputs[0])
        g.remove(q)
    for k, (o, rest) in enumerate(others.items()):
        if rest:
            out = g.add_tensor(g.fresh(f"{o}_dq"), like=o)
            g.add(SNode(g.fresh(f"{keep.name}_dq_{k}"), DEQUANTIZE, [o] + keep.inputs[1:], [out],
                        dict(keep.attrs), DQ, keep.qp, [g.fresh(f"{keep.name}_dq_{k}")]))
            g.replace_uses(o, out, only=rest)
    keep.origin = origin
    inputs = []
    for t in g.data_inputs(x):
        if t not in inputs:
            inputs.append(t)
    for k, t in enumerate(inputs):
        name = keep.name if len(inputs) == 1 else g.fresh(f"{keep.name}_clone_{k}")
        new = _new_q_on(g, keep, t, name)
        g.replace_uses(t, new.outputs[0], only=[(x, i) for i, u in enumerate(x.inputs) if u == t])
    x.int8, x.moved_by = True, rule_id
    g.touch()
    trace.fired(rule_id, origin + [x.name], f"{', '.join(q.name for q in same)} moved above {x.name} ({x.op})")


def try_dq_forward(g: SimGraph, rules: SimRuleSet, trace: Trace, x: SNode) -> bool:
    """Move the DQs in front of op `x` below it; True if they moved."""
    if x.role != OP or x.int8:
        return False
    producers = [g.producer(t) for t in g.data_inputs(x)]
    dqs = [d for d in producers if d is not None and d.role == DQ]
    if not dqs:
        return False
    ctx = Context(g)
    for rule in rules.for_op("dq_forward", g.vocab, x.op):
        m = holds(ctx, rule, x)
        ok, why = m.ok, m.reason
        if not ok:
            trace.miss([o for d in dqs for o in d.origin] + [x.name], rule.id, f"not moved below {x.name} ({x.op}): {why}")
            continue
        _move_dq_below(g, x, dqs, rule.id, trace)
        return True
    return False


def _move_dq_below(g: SimGraph, x: SNode, dqs: list[SNode], rule_id: str, trace: Trace) -> None:
    dqs = sorted({d.name: d for d in dqs}.values(), key=lambda n: n.key)
    first = dqs[0]
    origin = []
    for d in dqs:
        origin += [o for o in d.origin if o not in origin]
    for i, t in enumerate(list(x.inputs)):
        p = g.producer(t) if t else None
        if p is not None and p.role == DQ:
            g.set_input(x, i, p.inputs[0])
    sole = len(dqs) == 1 and not g.consumers(first.outputs[0]) and not g.is_graph_output(first.outputs[0])
    for d in dqs:
        if not g.consumers(d.outputs[0]) and not g.is_graph_output(d.outputs[0]):
            g.remove(d)
    used = [o for o in x.outputs if o]
    for k, o in enumerate(used):
        raw = g.add_tensor(g.fresh(f"{o}_int8"), like=o)
        g.set_output(x, x.outputs.index(o), raw)
        name = first.name if sole and len(used) == 1 else g.fresh(f"{first.name}_clone_{k}")
        g.add(SNode(name, first.op, [raw] + first.inputs[1:], [o], dict(first.attrs), DQ, first.qp, list(origin)))
    x.int8, x.moved_by = True, rule_id
    g.touch()
    trace.fired(rule_id, origin + [x.name], f"{', '.join(d.name for d in dqs)} moved below {x.name} ({x.op})")


# Rewrites in priority order: a merge anywhere before a Q moved anywhere, before a DQ moved.
_TRIES = (try_merge, try_q_backward, try_dq_forward)


def propagate(g: SimGraph, rules: SimRuleSet, trace: Trace, bound: int | None = None) -> int:
    """Merge, move Q backward, move DQ forward, one rewrite at a time, until nothing changes.
    Returns the number of rewrites; raises FixpointExceeded past `bound` rewrites.

    A worklist per kind of rewrite holds the nodes to try, in graph order; a rewrite puts back the
    nodes within two steps of every tensor it touched (all a rule's conditions look at), so the
    cost grows with the rewrites, not with graph size times rewrites. The fixpoint is then checked
    by one sweep over the whole graph, which also leaves every miss reason as the final graph
    gives it; should the sweep still find a rewrite, the worklists go on from there. Where nothing
    was rewritten (a float graph, or Q/DQ already where TensorRT keeps them) the worklists' one
    try of each node was made on the final graph, in the sweep's order: the sweep is left out."""
    bound = default_bound(g) if bound is None else bound
    steps = 0
    position = dict(g.position())
    queues: list[list] = [[] for _ in _TRIES]
    queued: list[set] = [set() for _ in _TRIES]

    def push(nodes, at: int) -> None:
        for n in nodes:
            p = position.setdefault(n.name, at)
            for k in range(len(_TRIES)):
                if n.name not in queued[k]:
                    queued[k].add(n.name)
                    heapq.heappush(queues[k], (p, n.key, n.name))

    def step(k: int, node: SNode) -> None:
        nonlocal steps
        steps += 1
        if steps > bound:
            raise FixpointExceeded(f"Q/DQ propagation did not settle within {bound} rewrites "
                                   f"(last: {trace.events[-1].rule} {trace.events[-1].detail})")
        push(_near(g, journal), position.get(node.name, 0))
        journal.clear()

    journal: set[str] = set()
    g.journal = journal
    try:
        push(g.order(), 0)
        while True:
            for k, try_ in enumerate(_TRIES):
                fired = None
                while queues[k] and fired is None:
                    _, _, name = heapq.heappop(queues[k])
                    queued[k].discard(name)
                    node = g.nodes.get(name)
                    if node is not None and try_(g, rules, trace, node):
                        fired = node
                if fired is not None:
                    step(k, fired)
                    break
            else:                       # every worklist is empty: confirm on the whole graph
                if steps == 0:
                    # nothing fired: the worklists tried every node once, in graph order, on the
                    # graph as it is now, so the sweep would repeat each try (and each miss) as made
                    return steps
                found = next(((k, n) for k, try_ in enumerate(_TRIES) for n in list(g.order())
                              if n.name in g.nodes and try_(g, rules, trace, n)), None)
                if found is None:
                    return steps
                step(*found)
    finally:
        g.journal = None


def _near(g: SimGraph, tensors: set[str]) -> list[SNode]:
    """The nodes within two steps of the given tensors (producers and consumers, then theirs)."""
    first: dict[str, SNode] = {}
    for t in tensors:
        p = g.producer(t)
        if p is not None:
            first[p.name] = p
        for c, _ in g.consumers(t):
            first[c.name] = c
    out = dict(first)
    for n in first.values():
        for t in n.inputs:
            p = g.producer(t) if t else None
            if p is not None:
                out[p.name] = p
        for o in n.outputs:
            for c, _ in (g.consumers(o) if o else ()):
                out[c.name] = c
    return list(out.values())


# ---------------------------------------------------------------------------- step 4

def pair_up(g: SimGraph, rules: SimRuleSet, trace: Trace) -> list[tuple[list[str], str]]:
    """Cancel DQ(s) -> Q(s); turn DQ(s1) -> Q(s2) into a requantize. Returns the eliminated
    node groups with the rule that removed them."""
    eliminated = []
    ctx = Context(g)
    for q in [n for n in g.order() if n.role == Q]:
        dq = g.producer(q.inputs[0])
        if dq is None or dq.role != DQ:
            continue
        fired = None
        for rule in rules.for_action("cancel") + rules.for_action("requantize"):
            m = evaluate(ctx, rule, q)
            ok, why = m.ok, m.reason
            if not ok:
                trace.miss(q.origin, rule.id, why)
            elif fired is None:
                fired = rule
        for rule in [fired] if fired else []:
            src = dq.inputs[0]
            if rule.action == "cancel":
                g.replace_uses(q.outputs[0], src)
                g.remove(q)
                names = list(q.origin)
                if not g.consumers(dq.outputs[0]) and not g.is_graph_output(dq.outputs[0]):
                    g.remove(dq)
                    names = dq.origin + names
                eliminated.append((names, rule.id))
                trace.fired(rule.id, names, f"{dq.name} -> {q.name} cancelled")
            else:
                g.remove(q)
                g.add(SNode(q.name, "Requantize", [src], list(q.outputs), {}, REQUANT, q.qp, dq.origin + q.origin))
                if not g.consumers(dq.outputs[0]) and not g.is_graph_output(dq.outputs[0]):
                    g.remove(dq)
                trace.fired(rule.id, dq.origin + q.origin, f"{dq.name} -> {q.name} became a requantize")
    return eliminated
