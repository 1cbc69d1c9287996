"""Attention blocks, found by their structure: two batched MatMuls around a Softmax.

BMM1 multiplies two activations (queries by transposed keys); its output reaches a Softmax through
at most MAX_SCORE_OPS ops of class `attention_scores` (scaling, mask and position-bias adds,
casts, reshapes), each reading the chain with one input; the Softmax's output reaches BMM2 as one
of its activation inputs through ops of class `attention_probs`. No exact chain is required, so a
relative-position bias, a mask applied with Where, a scale on the queries before BMM1, or a Cast
around the Softmax are all found (TRANSFORMERS.md: an encoder with a position bias was missed by
an exact-chain detector).

Placement (rules P15-attention-*), the simulator (the fused-MHA fusion rule) and the linter read
graphs of their own kinds; all go through the name-keyed interface of qdqgraph.graph.pointwise
(`producer`, `consumers`, `node_outputs`, `is_graph_output`) plus `vocab` and, for the simulator,
`is_qdq(node)`: in a Q/DQ graph the Q -> DQ pair on the probabilities sits on the BMM2 path.
"""
from __future__ import annotations

from dataclasses import dataclass, field

MAX_SCORE_OPS = 8
MAX_PROB_OPS = 6


@dataclass
class Attention:
    bmm1: object
    softmax: object
    bmm2: object
    probs_input: int                 # which input of BMM2 the probabilities arrive on
    nodes: list = field(default_factory=list)    # every node from BMM1 to BMM2, in order


def _is(g, node, cls: str) -> bool:
    return g.vocab.is_(node, cls)


def _skip_qdq(g, node) -> bool:
    is_qdq = getattr(g, "is_qdq", None)
    return bool(is_qdq and is_qdq(node))


def _single_next(g, t: str, allowed: str, limit: int, stop: str):
    """From tensor t, follow single-consumer ops of class `allowed` (and Q/DQ where the graph has
    them) to the first node of class `stop`. Returns (stop node, input index, nodes passed)."""
    passed: list = []                # the graph's nodes (graphsurgeon or simulator)
    for _ in range(limit + 1):
        if g.is_graph_output(t):
            return None
        uses = g.consumers(t)
        if len(uses) != 1:
            return None
        node, index = uses[0]
        if _is(g, node, stop):
            return node, index, passed
        if not (_is(g, node, allowed) or _skip_qdq(g, node)):
            return None
        outs = [o for o in g.node_outputs(node) if o]
        if not outs:
            return None
        passed.append(node)
        t = outs[0]
    return None


def _single_prev(g, t: str, allowed: str, limit: int, stop: str):
    """From tensor t back through producers of class `allowed` (trying each activation input of
    an op with several, such as the Add of a mask) to a node of class `stop`. Returns
    (stop node, nodes passed) for the first path found, or None."""
    node = g.producer(t)
    if node is None:
        return None
    if _is(g, node, stop):
        return node, []
    if limit <= 0 or not (_is(g, node, allowed) or _skip_qdq(g, node)):
        return None
    for src in g.data_inputs(node):
        found = _single_prev(g, src, allowed, limit - 1, stop)
        if found is not None:
            return found[0], [node, *found[1]]
    return None


def from_scores(g, bmm1) -> Attention | None:
    """The attention block whose BMM1 is `bmm1` (a MatMul), or None."""
    outs = [o for o in g.node_outputs(bmm1) if o]
    if not outs:
        return None
    found = _single_next(g, outs[0], "attention_scores", MAX_SCORE_OPS, "softmax")
    if found is None:
        return None
    softmax, _, score_ops = found
    p = [o for o in g.node_outputs(softmax) if o]
    nxt = _single_next(g, p[0], "attention_probs", MAX_PROB_OPS, "matmul") if p else None
    if nxt is None:
        return None
    bmm2, index, prob_ops = nxt
    if bmm2 is bmm1:
        return None
    return Attention(bmm1, softmax, bmm2, index, [bmm1, *score_ops, softmax, *prob_ops, bmm2])


def from_context(g, bmm2, index: int | None = None) -> Attention | None:
    """The attention block whose BMM2 is `bmm2` (probabilities on input `index`, or on whichever
    input leads back to a Softmax), or None."""
    ins = list(getattr(bmm2, "inputs", []))
    names = [x if isinstance(x, str) else x.name for x in ins]
    for k in ([index] if index is not None else range(min(2, len(names)))):
        back = _single_prev(g, names[k], "attention_probs", MAX_PROB_OPS, "softmax") if k < len(names) else None
        if back is None:
            continue
        softmax, _ = back
        src = g.data_inputs(softmax)
        first = _single_prev(g, src[0], "attention_scores", MAX_SCORE_OPS, "matmul") if src else None
        if first is None:
            continue
        found = from_scores(g, first[0])
        if found is not None and found.bmm2 is bmm2 and found.probs_input == k:
            return found
    return None


def of(g, matmul) -> tuple[Attention, str] | None:
    """(block, "scores" | "context") for a MatMul that is BMM1 or BMM2 of an attention block."""
    a = from_scores(g, matmul)
    if a is not None:
        return a, "scores"
    a = from_context(g, matmul)
    if a is not None:
        return a, "context"
    return None
