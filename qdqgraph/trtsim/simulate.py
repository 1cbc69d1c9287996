"""`simulate(graph)`: the simulation order of TRT_RULES.md section 2 on a copy of the graph, then a
SimReport. The caller's graph is never modified."""
from __future__ import annotations

import os

import numpy as np
import onnx_graphsurgeon as gs

from ..precisions.formats import FOUR_BIT_TYPES, quantized_label

from .conditions import LayerBuild
from .flops import node_flops
from .fuse import Fuser
from .ir import DQ, Q, SimGraph
from .propagate import eliminate_no_ops, fold_weights, pair_up, propagate
from .recorded import dims_of
from .report import Layer, Port, SimReport
from .rules import SimRuleSet, load_sim_rules
from .trace import Trace
from ..graph import io


def as_graph(model) -> gs.Graph:
    """A graphsurgeon graph from a graph, a qdqgraph Loaded, a ModelProto or a path."""
    if isinstance(model, gs.Graph):
        return model
    if hasattr(model, "graph") and isinstance(model.graph, gs.Graph):
        return model.graph
    return io.load(model).graph


def simulate(model, rules: SimRuleSet | None = None, bound: int | None = None, target: str = "tensorrt",
             dims: dict[str, int] | None = None) -> SimReport:
    """Predict how TensorRT (or, with target="tensorrt-rtx", TensorRT for RTX) fuses a Q/DQ graph:
    layers, their precisions, and the reformats. `dims`: see `read`."""
    return simulate_graph(read(model, dims), rules or load_sim_rules(target=target), bound)


def read(model, dims: dict[str, int] | None = None) -> SimGraph:
    """`model` (as `as_graph` takes it) read into the simulator, its symbolic dimensions given the
    values `dims` names (SimGraph.bind: FLOPs and bytes are counted there); by default those a model
    qdqgraph wrote keeps in its metadata (its calibration data's shapes, recorded.DIMS_KEY)."""
    if isinstance(model, (str, os.PathLike)):
        model = io.load(model)
    if dims is None and not isinstance(model, gs.Graph) and hasattr(model, "metadata_props"):
        dims = dims_of(model)
    return SimGraph.from_gs(as_graph(model)).bind(dims)


def simulate_graph(g: SimGraph, rules: SimRuleSet | None = None, bound: int | None = None) -> SimReport:
    """`simulate` on a SimGraph (which it rewrites: pass a fresh one)."""
    rules = rules or load_sim_rules()
    graph_io = _graph_io(g)
    quantized = quantized_types(g)
    int4_readers = _int4_readers(g)
    unused = g.prune()
    trace = Trace()
    no_ops = eliminate_no_ops(g, rules, trace)
    folded = fold_weights(g, rules, trace)
    steps = propagate(g, rules, trace, bound)
    # (node names, rule), or for a buffer (node names, rule, its input tensors, its output tensors)
    eliminated: list[tuple[list[str], str] | tuple[list[str], str, list[str], list[str]]] = [
        *no_ops, *pair_up(g, rules, trace)]
    position = g.position()
    fuser = Fuser(g, rules, trace)
    builds = sorted(fuser.run(), key=lambda b: position[b.anchor.name])
    eliminated += [(b.nodes, b.rule, b.inputs, [b.out]) for b in fuser.buffers]
    layers = [_layer(g, b, trace) for b in builds]
    in_layers = {n for x in layers for n in x.nodes}
    folded = [n for n in folded if n not in in_layers]     # a folded weight's ops are in its layer
    _share_flops(layers)
    return SimReport(
        layers=layers,
        eliminated=_eliminated(eliminated, unused, folded),
        events=[{"rule": e.rule, "nodes": e.nodes, "detail": e.detail} for e in trace.events],
        node_names=set(g.onnx_names),
        graph_inputs=graph_io[0], graph_outputs=graph_io[1],
        steps=steps, misses=trace.misses, final=(g, rules), quantized=quantized,
        int4_weight_layers=sum(1 for x in layers if int4_readers.intersection(x.nodes)),
        shapes={t.name: t.shape for t in g.tensors.values() if t.shape is not None})


def _graph_io(g: SimGraph) -> list[list[tuple]]:
    """(name, dtype, shape) of each graph input and each graph output, before any rewrite."""
    return [[(t, g.tensors[t].dtype, g.tensors[t].shape) if t in g.tensors else (t, None, None) for t in names]
            for names in (g.inputs, g.outputs)]


def _int4_readers(g: SimGraph) -> set[str]:
    """The nodes that read the output of a DQ with a 4-bit zero point."""
    return {c.name for n in g.nodes.values() if n.role == DQ and n.qp is not None
            and n.qp.zero_point is not None and np.dtype(n.qp.zero_point.dtype) in FOUR_BIT_TYPES
            for o in n.outputs for c, _ in g.consumers(o)}


def _share_flops(layers: list[Layer]) -> None:
    """Set each layer's share of the graph's FLOPs (0 when the graph has none)."""
    total = sum(x.flops for x in layers)
    for x in layers:
        x.flops_share = x.flops / total if total else 0.0


def _eliminated(eliminated: list, unused: list[str], folded: list[str]) -> list[dict]:
    """The report's removed groups: those eliminated or buffered, then the unused nodes, then the folded ones."""
    return [_removed(*e) for e in eliminated] + (
        [{"nodes": unused, "rule": "unused"}] if unused else []) + (
        [{"nodes": folded, "rule": "constant"}] if folded else [])


def quantized_types(g: SimGraph) -> str:
    """The quantized types the graph's Q/DQ carry, by their zero points (TRT_RULES C2): "INT8",
    "FP8", "INT4", or several joined by "+" (INT8 when no zero point says otherwise); "" for a
    graph without Q/DQ (no precision to name)."""
    found = set()
    for n in g.nodes.values():
        if n.role not in (Q, DQ):
            continue
        found.add(quantized_label(n.qp.zero_point if n.qp is not None else None))
    return "+".join(sorted(found))


def _layer(g: SimGraph, b: LayerBuild, trace: Trace) -> Layer:
    outs = [o for o in [b.out] + b.extra_outputs if o]
    ops = [g.onnx_names.get(n, "?") for n in b.nodes]
    flops = sum(node_flops(g, m) for m in b.members)
    at_io = b.reformat and (any(g.is_graph_input(t) for t in b.inputs) or any(g.is_graph_output(t) for t in outs))
    return Layer(name=" + ".join(b.nodes), nodes=list(b.nodes), ops=ops, kind=b.kind,
                 inputs=[Port(t, g.precision(t)) for t in b.inputs],
                 outputs=[Port(t, g.precision(t)) for t in outs],
                 reformat=b.reformat, rule=b.rule, flops=flops, at_graph_io=at_io,
                 why=trace.why(b.nodes) if b.reformat else [])


def _removed(nodes, rule, inputs=(), outputs=()) -> dict:
    """A group of ONNX nodes that became no layer; a buffer keeps its tensors (for the ONNX export)."""
    d = {"nodes": list(nodes), "rule": rule}
    if outputs:
        d["inputs"], d["outputs"] = list(inputs), list(outputs)
    return d
