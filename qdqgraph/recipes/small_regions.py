"""P14: after placement, the INT8 regions too small to pay for their reformats go back to float
(the [[region]] rule of rules/placement.toml).

The plan is simulated with unit scales, so the choice does not depend on the calibration data and
a calibration cache made for a plan matches it. A region's quantized nodes are returned to float
only as a whole, and the smaller plan is kept only when its prediction has fewer standalone
reformats inside the network. A plan whose prediction runs no layer in INT8 at all (its Q/DQ would be
standalone reformats and nothing else: residual Adds around tiny float convs) goes back to float whole.
"""
from __future__ import annotations

from dataclasses import replace

import onnx_graphsurgeon as gs

from ..precisions.formats import label
from ..ops import DEQUANTIZE, QUANTIZE
from ..passes.insert import Insertion, insert_qdq, planned_insertions
from ..trtsim import SimReport, simulate
from ..trtsim.ir import DQ, Q, QParams, SimGraph, SNode, STensor
from ..trtsim.flops import node_flops
from ..trtsim.regions import Region, costly_regions
from ..trtsim.rules import load_sim_rules
from ..trtsim.simulate import simulate_graph
from ..graph.view import GraphView
from ..placement.plan import Plan, Selection
from ..placement.planner import plan_placement
from ..placement.ruleset import RegionRule, RuleSet


def predict(graph: gs.Graph, plan: Plan, target: str = "tensorrt") -> SimReport:
    """The simulator's prediction for `plan` on `graph` (which is not changed), every activation
    at amax 1. The Q/DQ that insertion would write are added to the simulator's own copy of the
    graph, with the same names and parameters, instead of to a copy of `graph`; its quantized
    weights have their type and shape, not their values (planned_insertions' shapes_only)."""
    view = GraphView(graph)
    insertions = planned_insertions(graph, plan, {rep: 1.0 for rep in plan.groups()}, view=view, shapes_only=True)
    g = SimGraph.from_gs(graph)
    if any(name not in g.nodes for ins in insertions for name, _ in ins.site.edges):
        copy = graph.copy()               # nodes without unique names: insert for real, then read
        insert_qdq(copy, plan, {rep: 1.0 for rep in plan.groups()})
        return simulate(copy, target=target)
    for ins in insertions:
        _add(g, ins)
    return simulate_graph(g, load_sim_rules(target=target))


def _add(g: SimGraph, ins: Insertion) -> None:
    """Add one insertion's Q/DQ to the simulator's graph, as reading the written model would."""
    shape = tuple(ins.shape) if ins.shape is not None else None
    for name, value in ((ins.scale_name, ins.scale), (ins.zero_point_name, ins.zero_point)):
        g.tensors[name] = STensor(name, value.dtype, tuple(value.shape), value)
    if ins.stored is not None:
        g.tensors[ins.source] = STensor(ins.source, ins.stored.dtype, tuple(ins.stored.shape), ins.stored)
    qp = None
    attrs = {"axis": int(ins.axis)} if ins.axis is not None else {}
    src = ins.source
    if ins.q is not None:
        name, out = ins.q
        g.tensors[out] = STensor(out, ins.zero_point.dtype, shape)
        qp = QParams(ins.scale, ins.zero_point, ins.axis if ins.scale.size > 1 else None, owner=name)
        g.add(SNode(name, QUANTIZE, [src, ins.scale_name, ins.zero_point_name], [out], dict(attrs), Q, qp,
                    origin=[name]))
        g.onnx_names[name] = QUANTIZE
        src = out
    name, out = ins.dq
    g.tensors[out] = STensor(out, ins.dtype, shape)
    g.add(SNode(name, DEQUANTIZE, [src, ins.scale_name, ins.zero_point_name], [out], dict(attrs), DQ,
                QParams(ins.scale, ins.zero_point, ins.axis if ins.scale.size > 1 else None, owner=name),
                origin=[name]))
    g.onnx_names[name] = DEQUANTIZE
    for node, index in ins.site.edges:
        g.set_input(g.nodes[node], index, out)


def region_nodes(regions: list[Region], plan: Plan, rule: RegionRule, selection: Selection,
                 quantized: str = "INT8", at_data=None) -> tuple[tuple[str, str, str], ...]:
    """(node, rule id, why) for the quantized nodes of every region of `regions` (costly_regions of
    the prediction, by `rule`), which `rule` returns to float;
    nodes the user forces in with --include-node stay. `quantized`: the precision's name (INT8, FP8).
    `at_data`: the share of the FLOPs of a list of nodes at the calibration data's shapes
    (`data_shares`), which the reason states beside the declared shapes' where they differ."""
    out = []
    for r in regions:
        names = [n for n in r.nodes if n in plan.decisions and plan.decisions[n].quantized]
        if not names or any(selection.includes(n) for n in names):
            continue
        borders = ", ".join(x.name for x in r.inner_reformats)
        share = f"{100 * r.flops_share:.2f}%"
        data = f"{100 * at_data([n for x in r.layers if x.int8 for n in x.nodes]):.2f}%" if at_data else share
        counted = "" if data == share else (f" counted at the declared shapes, symbolic dimensions as 1 "
                                           f"({data} at the calibration data's shapes),")
        why = (f"its {quantized} region holds {share} of the FLOPs (at most {100 * rule.max_flops_share:g}%)"
               f"{counted} and costs {len(r.inner_reformats)} standalone reformat(s) inside the network ({borders})")
        out += [(n, rule.id, why) for n in names]
    return tuple(out)


def data_shares(graph: gs.Graph, dims: dict[str, int] | None):
    """A function: node names -> their share of the graph's FLOPs with its symbolic dimensions at
    `dims` (the calibration data's shapes); None without dims or FLOPs."""
    if not dims:
        return None
    g = SimGraph.from_gs(graph).bind(dims)
    flops = {name: node_flops(g, n) for name, n in g.nodes.items()}
    total = sum(flops.values())
    if total <= 0:
        return None
    return lambda names: sum(flops.get(n, 0.0) for n in names) / total


NO_INT8 = "the plan runs no layer in "          # then the precision: INT8, FP8


def no_int8_nodes(report: SimReport, plan: Plan, rule: RegionRule, selection: Selection,
                  quantized: str = "INT8") -> tuple[tuple[str, str, str], ...]:
    """(node, rule id, why) for every quantized node when the prediction runs no layer in INT8: its
    Q/DQ would only be standalone reformats (a chain of tiny convs whose residual Adds the rules
    quantize); nodes the user forces in with --include-node stay."""
    s = report.summary
    if s["int8_layers"] or not s["reformats"]:
        return ()
    why = (f"{NO_INT8}{quantized} (its Q/DQ would only be {s['reformats']} standalone "
           f"reformat(s), {s['reformats_inside']} inside the network), so none are written")
    return tuple((n, rule.id, why) for n, d in sorted(plan.decisions.items())
                 if d.quantized and not selection.includes(n))


def refine(graph: gs.Graph, plan: Plan, ruleset: RuleSet, selection: Selection,
           dims: dict[str, int] | None = None) -> Plan:
    """`plan` with its small INT8 regions in float, if that leaves fewer reformats inside the
    network; otherwise `plan` itself. The regions are counted at the declared shapes; `dims` (the
    calibration data's shapes) only adds their share there to the reasons."""
    rule = ruleset.region
    if rule is None or rule.max_flops_share <= 0 or not plan.activation_sites():
        return plan
    before = predict(graph, plan, ruleset.target)
    quantized = label(ruleset.precision)
    regions = costly_regions(before, rule.max_flops_share)
    nodes = region_nodes(regions, plan, rule, selection, quantized, data_shares(graph, dims) if regions else None)
    if not nodes:
        nodes = no_int8_nodes(before, plan, rule, selection, quantized)
        # no INT8 layer: the Q/DQ are reformats and nothing else, whether inside the network or not
        return plan_placement(graph, ruleset, replace(selection, region_nodes=nodes)) if nodes else plan
    smaller = plan_placement(graph, ruleset, replace(selection, region_nodes=nodes))
    after = predict(graph, smaller, ruleset.target)
    if after.summary["reformats_inside"] < before.summary["reformats_inside"]:
        return smaller
    return plan
