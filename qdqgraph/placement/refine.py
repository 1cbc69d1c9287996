"""P14: after placement, the INT8 regions too small to pay for their reformats go back to float
(the [[region]] rule of rules/placement.toml).

The plan is simulated with unit scales, so the choice does not depend on the calibration data and
a calibration cache made for a plan matches it. A region's quantized nodes are returned to float
only as a whole, and the smaller plan is kept only when its prediction has fewer standalone
reformats inside the network.
"""
from __future__ import annotations

from dataclasses import replace

import onnx_graphsurgeon as gs

from ..passes.insert import insert_qdq
from .plan import Plan, Selection
from .planner import plan_placement
from .ruleset import RegionRule, RuleSet
from ..trtsim import SimReport, simulate
from ..trtsim.regions import costly_regions


def predict(graph: gs.Graph, plan: Plan) -> SimReport:
    """The simulator's prediction for `plan` on a copy of `graph`, every activation at amax 1."""
    g = graph.copy()
    insert_qdq(g, plan, {rep: 1.0 for rep in plan.groups()})
    return simulate(g)


def region_nodes(report: SimReport, plan: Plan, rule: RegionRule,
                 selection: Selection) -> tuple[tuple[str, str, str], ...]:
    """(node, rule id, why) for the quantized nodes of every region `rule` returns to float;
    nodes the user forces in with --include-node stay."""
    out = []
    for r in costly_regions(report, rule.max_flops_share):
        names = [n for n in r.nodes if n in plan.decisions and plan.decisions[n].quantized]
        if not names or any(selection.includes(n) for n in names):
            continue
        borders = ", ".join(x.name for x in r.inner_reformats)
        why = (f"{rule.id}: its INT8 region holds {100 * r.flops_share:.2f}% of the FLOPs (at most "
               f"{100 * rule.max_flops_share:g}%) and costs {len(r.inner_reformats)} standalone reformat(s) "
               f"inside the network ({borders})")
        out += [(n, rule.id, why) for n in names]
    return tuple(out)


def refine(graph: gs.Graph, plan: Plan, ruleset: RuleSet, selection: Selection) -> Plan:
    """`plan` with its small INT8 regions in float, if that leaves fewer reformats inside the
    network; otherwise `plan` itself."""
    rule = ruleset.region
    if rule is None or rule.max_flops_share <= 0 or not plan.activation_sites():
        return plan
    before = predict(graph, plan)
    nodes = region_nodes(before, plan, rule, selection)
    if not nodes:
        return plan
    smaller = plan_placement(graph, ruleset, replace(selection, region_nodes=nodes))
    after = predict(graph, smaller)
    if after.summary["reformats_inside"] < before.summary["reformats_inside"]:
        return smaller
    return plan

