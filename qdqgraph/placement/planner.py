"""The planner: `plan_placement(graph, ruleset)` decides every Q/DQ site of a cleaned float graph.

Pure: it reads the graph (through a GraphView) and returns a `Plan` of quant sites (tensor, kind,
axis, rule id, the consumer edges it feeds) and a decision per node (quantized by rule X, or
skipped by rule Y because ...). Exclusions are matched first; then the rules of stage 1 in graph
order, and those of stage 2 from the outputs back (they ask whether a node's output feeds a
quantized consumer, so the consumers are decided first).
"""
from __future__ import annotations

from collections.abc import Sequence

import onnx_graphsurgeon as gs

from ..errors import QdqError
from ..ops import nearest_resize
from ..rulebook.match import Context, Match, op_matches
from ..graph.view import GraphView
from .conditions import CONDITIONS, exact_zero_one
from .plan import Decision, Plan, Selection, Site
from .ruleset import Rule, RuleSet, Target, load_ruleset


def _evaluate(ctx: Context, rule: Rule, node) -> Match:
    """Whether the rule's conditions hold for the node: on a miss, why the first failing one
    failed; on a hit, what the conditions that explain themselves found."""
    return CONDITIONS.evaluate(rule.when, ctx, node)


def _op_matches(view: GraphView, rule: Rule, node) -> bool:
    return op_matches(view.vocab, rule.op, node)


def _candidates(view: GraphView, ruleset: RuleSet, node) -> list[Rule]:
    """The rules whose op class holds the node, in file order: found once per op type (the class
    depends on nothing else), kept in the view's memo for this ruleset."""
    cache: tuple[RuleSet, dict[str, list[Rule]]] | None = view.memo.get("rule candidates")
    if cache is None or cache[0] is not ruleset:
        cache = (ruleset, {})
        view.memo["rule candidates"] = cache
    by_op = cache[1]
    found = by_op.get(node.op)
    if found is None:
        found = by_op[node.op] = [r for r in ruleset.rules if _op_matches(view, r, node)]
    return list(found)


def _exclusions(view: GraphView, ruleset: RuleSet, ctx) -> dict[str, tuple[Rule, str]]:
    out: dict[str, tuple[Rule, str]] = {}
    for rule in ruleset.exclusions:
        if rule.path:
            for n in view.path_nodes(rule.path):
                out.setdefault(n.name, (rule, rule.doc))
            continue
        for n in view.nodes:
            if n.name in out or not _op_matches(view, rule, n):
                continue
            m = _evaluate(ctx, rule, n)
            if m:
                out[n.name] = (rule, f"{rule.doc} ({m.reason})" if m.reason else rule.doc)
    return out


def _targets(view: GraphView, rule: Rule, node, captures) -> list[tuple[int, Target]]:
    """(input index, target) for each edge the rule quantizes on `node`. "all" means every float
    activation input (for activation targets) or every float constant (for weights)."""
    out: list[tuple[int, Target]] = []
    for t in rule.quantize:
        if t.input == "all":
            out.extend((i, t) for i, x in enumerate(node.inputs) if x.name and _fits(view, x, t.kind))
            continue
        index = captures[t.input[1:]] if isinstance(t.input, str) else t.input
        if not 0 <= index < len(node.inputs) or not node.inputs[index].name:
            raise QdqError(f"{rule.where}: quantizes input {index} of {node.op} node {node.name or '(no name)'}, "
                           f"which has {len(node.inputs)} inputs", "fix the rule's quantize input (inputs count from 0)")
        if not _fits(view, node.inputs[index], t.kind):
            what = "a float activation" if t.kind == "activation" else "a constant float weight"
            raise QdqError(f"{rule.where}: input {index} of {node.op} node {node.name or '(no name)'} "
                           f"('{node.inputs[index].name}') is not {what}",
                           "add a condition that checks it (float_input:N or constant_weight:N)")
        out.append((index, t))
    return out


def _fits(view: GraphView, t: gs.Tensor, kind: str) -> bool:
    if kind == "weight":
        value = view.constant_value(t)
        return value is not None and value.dtype.kind == "f"
    return not view.is_constant(t) and view.is_float(t)


def _add_site(plan: Plan, view: GraphView, node, index: int, target, rule: Rule):
    t = node.inputs[index]
    if target.kind == "weight" and target.axis is not None:
        rank = view.constant(t).ndim          # _targets: a weight target's input is a constant
        if not -rank <= target.axis < rank:
            raise QdqError(f"{rule.where}: weight axis {target.axis} of '{t.name}' (rank {rank}) on {node.op} node "
                           f"{node.name}", f"use an axis in [0, {rank - 1}] or \"tensor\"")
    site = plan.sites.get(t.name)
    if site is None:
        site = plan.sites[t.name] = Site(t.name, target.kind, rule.id, target.axis)
    elif site.kind == "weight" and site.axis != target.axis:
        plan.notes.append(f"weight '{t.name}' is shared by ops that need different axes; per-tensor scale used")
        site.axis = None
    plan.add_edge(site, (node.name, index))
    if target.amax is not None:
        site.exact_amax = max(site.exact_amax or 0.0, target.amax)
    if target.share_scale == "output":
        rep = plan.sites.get(node.outputs[0].name)
        group = (rep.group if rep else None) or site.group or node.outputs[0].name
        site.group = group
        if rep is not None:
            rep.group = group


def _resize_links(plan: Plan, view: GraphView) -> list[tuple[str, str]]:
    """(output, input) of each nearest Resize whose input and output are both quantized: TensorRT
    moves the output's Q above the Resize (R2), where it must equal the input's own Q to merge
    with it (R5-c); otherwise the tensor carries two Qs and the layer before it a reformat."""
    links = []
    for site in plan.activation_sites():
        p = view.producer(view.tensors[site.tensor]) if site.tensor in view.tensors else None
        if p is None or not view.vocab.is_(p, "resize") or not nearest_resize(p.attrs):
            continue
        src = plan.sites.get(p.inputs[0].name)
        if src is not None and src.kind == "activation":
            links.append((site.tensor, src.tensor))
    return links


def _merge_groups(plan: Plan, links: Sequence[tuple[str, str]] = ()) -> None:
    """Concat groups that touch each other (a Concat of Concats) collapse into one scale group, as
    do the two ends of each link."""
    parent: dict[str, str] = {}

    def find(x):
        while parent.get(x, x) != x:
            x = parent[x]
        return x

    def union(a, b):
        a, b = find(a), find(b)
        if a != b:
            parent[max(a, b)] = min(a, b)
    for a, b in links:
        for site in (plan.sites[a], plan.sites[b]):
            site.group = site.group or site.tensor
        union(a, b)
    for s in plan.activation_sites():
        if s.group:
            parent.setdefault(s.tensor, s.tensor)
            union(s.tensor, s.group)
    for s in plan.activation_sites():
        if s.group:
            s.group = find(s.tensor)


def _require_names(nodes) -> None:
    """The plan keys decisions and edges on node names: an empty or repeated one would merge nodes."""
    seen: set[str] = set()
    for n in nodes:
        if not n.name or n.name in seen:
            what = f"a {n.op} node has no name" if not n.name else f"two nodes are named '{n.name}'"
            raise QdqError(f"{what}; placement addresses nodes by their names",
                           "load the model with qdqgraph.load (it names them), or call "
                           "qdqgraph.graph.io.name_nodes(graph) first")
        seen.add(n.name)


def plan_placement(graph: gs.Graph, ruleset: RuleSet | None = None, selection: Selection = Selection()) -> Plan:
    """Decide every Q/DQ site of a cleaned float graph. Pure: the graph is not changed."""
    ruleset = ruleset or load_ruleset()
    view = GraphView(graph)
    _require_names(view.nodes)
    plan = Plan()
    ctx = Context(view, plan)
    excluded = _exclusions(view, ruleset, ctx)

    for stage in (1, 2):
        # stage 2 asks whether a node's output feeds a quantized consumer: consumers are decided first
        for node in (view.nodes if stage == 1 else reversed(view.nodes)):
            if node.name in plan.decisions:
                continue
            _decide(view, plan, ctx, ruleset, selection, excluded, stage, node)
    _merge_groups(plan, _resize_links(plan, view))
    _mark_exact_ranges(plan, view)
    return plan


def _decide(view: GraphView, plan: Plan, ctx: Context, ruleset: RuleSet, selection: Selection,
            excluded: dict[str, tuple[Rule, str]], stage: int, node) -> None:
    """Decide one undecided node at one stage: excluded (by a rule or the user) or left to its rules."""
    candidates = _candidates(view, ruleset, node)
    if stage == 1 and node.name in excluded:
        rule, why = excluded[node.name]
        forced = rule.advisory and selection.included(node) and candidates
        if not forced:
            if candidates or (rule.op not in (None, "any")):
                plan.decisions[node.name] = Decision(node.name, node.op, False, rule.id, why)
            return
    if not candidates:
        return
    user = selection.excluded(node)
    if user:
        plan.decisions[node.name] = Decision(node.name, node.op, False, *user)
        return
    _apply_rules(view, plan, ctx, candidates, stage, node)


def _apply_rules(view: GraphView, plan: Plan, ctx: Context, candidates: list[Rule], stage: int, node) -> None:
    """Quantize the node by the first of this stage's rules that matches, else record the nearest miss."""
    near: tuple[str, str] | None = None
    for rule in (r for r in candidates if r.stage == stage):
        m = _evaluate(ctx, rule, node)
        if m:
            for index, target in _targets(view, rule, node, m.captures):
                _add_site(plan, view, node, index, target, rule)
            plan.decisions[node.name] = Decision(node.name, node.op, True, rule.id, rule.doc)
            break
        near = near or (rule.id, m.reason)
    else:
        if near and not any(r.stage > stage for r in candidates):
            plan.decisions[node.name] = Decision(node.name, node.op, False, *near)


def _mark_exact_ranges(plan: Plan, view: GraphView) -> None:
    """Give activation sites that hold only 0 and 1 (a Cast from bool) the range 1.0, not a calibrated one."""
    for site in plan.activation_sites():
        if site.tensor in view.tensors and exact_zero_one(view, view.tensors[site.tensor]):
            site.exact_amax = 1.0


def explain(graph: gs.Graph, node_name: str, rule_id: str, ruleset: RuleSet | None = None,
            selection: Selection = Selection()) -> tuple[bool, str]:
    """Does rule `rule_id` match node `node_name`, and why (not)? Answers "why wasn't X quantized"
    for one rule, whatever the other rules did. Stage-2 rules see the full plan."""
    ruleset = ruleset or load_ruleset()
    rule = ruleset.by_id.get(rule_id)
    if rule is None:
        raise KeyError(f"no rule {rule_id!r}")
    view = GraphView(graph)
    node = next((n for n in view.nodes if n.name == node_name), None)
    if node is None:
        raise KeyError(f"no node {node_name!r}")
    if rule.path:
        if any(n is node for n in view.path_nodes(rule.path)):
            return True, rule.doc
        return False, f"{node.op} node is on no chain {','.join(rule.path)}"
    if not _op_matches(view, rule, node):
        return False, f"{node.op} is not in op class {rule.op!r}"
    plan = plan_placement(graph, ruleset, selection)
    m = _evaluate(Context(view, plan), rule, node)
    return m.ok, m.reason
