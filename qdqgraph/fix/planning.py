"""TensorRT's placement for a stripped graph, planned as `insert` plans: on a cleaned copy.

`insert` plans a cleaned graph (no-ops removed, constants and BatchNormalization folded:
prepare.clean); `fix` keeps the model's float graph as it is, so it plans a cleaned copy and maps
the plan back by consumer edge: a site quantizes the tensor its consumers read in the real graph.
A constant computed by ops (a reshaped bias) is then no activation to quantize, a Conv -> BN ->
ReLU is one pattern, and the written graph keeps its BatchNormalization nodes.

A graph whose float parts are typed (FP16/BF16 islands, as `insert` writes them) holds a Cast
wherever a Q/DQ converted between float types once stripped (passes.strip), and the rules do not
see through Casts: the copy is also made float32 with its float-to-float Casts bypassed, and a
site lands on the Cast's output where one stands.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx_graphsurgeon as gs

from ..graph import io
from ..recipes.attention_guard import attention_gemms
from ..config import QuantizeConfig
from ..placement.plan import Plan, Site
from ..passes.strip import replace_uses
from ..prepare import clean, plan_for
from ..graph.view import GraphView, is_float_dtype

BF16 = np.dtype(ml_dtypes.bfloat16)


def floating(dtype) -> bool:
    """A float type, bfloat16 included (numpy does not count it)."""
    if dtype is None:
        return False
    try:
        return is_float_dtype(dtype) or np.dtype(dtype) == BF16
    except TypeError:
        return False


def typed(graph: gs.Graph) -> bool:
    """Does the graph hold float tensors of another type than float32?"""
    return any(floating(t.dtype if not isinstance(t, gs.Constant) else t.values.dtype)
               and np.dtype(t.dtype if not isinstance(t, gs.Constant) else t.values.dtype) != np.float32
               for t in graph.tensors().values() if isinstance(t, gs.Constant) or t.dtype is not None)


ATTENTION_KEPT_FLOAT = ("attention: the model holds no Q/DQ on this attention GEMM, so fix keeps it float (insert "
                        "keeps an attention float when INT8 costs it more than 3 dB of output SQNR; "
                        "int8_attention='on' quantizes it)")


def plan(loaded: io.Loaded, config: QuantizeConfig, graph: gs.Graph | None = None,
         held: set[str] | None = None) -> tuple[Plan, list[str]]:
    """`prepare.plan_for` of a cleaned (and, where typed, float32) copy of `graph` (default: the
    loaded graph), mapped back to the loaded graph; with warnings for weights the plan quantizes
    that reach their op through other ops. (fix plans the stripped graph before it writes the
    clamps of folded activations as Clips, so that a Clip never hides a pattern from the rules.)
    `held`: the nodes that read a Q/DQ in the model; an attention GEMM outside it stays float, as
    the model had it (insert's attention check decided so), unless config.int8_attention is "on"
    ("off" floats every attention GEMM, as insert does)."""
    graph = (graph if graph is not None else loaded.graph).copy()
    if typed(graph):
        graph = _as_float32(graph)
    copy = io.Loaded(graph=graph, ir_version=loaded.ir_version)
    clean(copy)
    p = plan_for(copy, config)
    if held is not None and config.int8_attention != "on":
        gemms = attention_gemms(copy.graph, p)
        bare = [n for n in gemms if n not in held] if config.int8_attention == "auto" else gemms
        if bare:
            why = ATTENTION_KEPT_FLOAT if config.int8_attention == "auto" else "attention: --int8-attention off"
            p = plan_for(copy, config, tuple((n, why) for n in bare))
    return _mapped(p, loaded.graph)


def _as_float32(graph: gs.Graph) -> gs.Graph:
    view = GraphView(graph)
    for n in view.nodes:
        if view.vocab.is_(n, "cast") and n.inputs and floating(view.dtype(n.inputs[0])) and \
                floating(view.dtype(n.outputs[0])):
            replace_uses(graph, view, n.outputs[0], n.inputs[0])
            n.outputs.clear()
    io.cleanup(graph)
    for n in graph.nodes:                          # Constant nodes hold their value as an attribute
        value = n.attrs.get("value") if view.vocab.is_(n, "constant") else None
        if isinstance(value, gs.Constant) and floating(value.values.dtype) and value.values.dtype != np.float32:
            n.attrs["value"] = gs.Constant(value.name, value.values.astype(np.float32))
    for t in graph.tensors().values():
        if isinstance(t, gs.Constant):
            if floating(t.values.dtype) and t.values.dtype != np.float32:
                t.values = t.values.astype(np.float32)
        elif floating(t.dtype):
            t.dtype = np.float32
    graph.toposort()
    return graph


def _mapped(p: Plan, graph: gs.Graph) -> tuple[Plan, list[str]]:
    """`p` (made on the cleaned copy) with each site on the tensor its consumers read in `graph`;
    edges into nodes the copy made (an inlined If) are left out, and weight sites whose real input
    is not a constant (a weight through a Transpose or Cast) stay float, with a warning."""
    nodes = {n.name: n for n in graph.nodes}
    view = GraphView(graph)
    reads, warnings = {}, []
    for s in p.sites.values():
        for c, i in s.edges:
            if c in nodes and i < len(nodes[c].inputs):
                reads[(c, i)] = nodes[c].inputs[i]
    group_of = {}
    for s in p.sites.values():
        found = [reads[e].name for e in s.edges if e in reads]
        if found:
            group_of.setdefault(s.group or s.tensor, found[0])
    out = Plan(decisions=dict(p.decisions), notes=list(p.notes))
    for s in p.sites.values():
        by_tensor: dict[str, list] = {}
        for e in s.edges:
            if e in reads:
                by_tensor.setdefault(reads[e].name, []).append(e)
        for tensor, edges in by_tensor.items():
            if s.kind == "weight" and view.constant_value(view.tensors[tensor]) is None:
                warnings.append(f"the weight of {edges[0][0]} reaches it through other ops ({tensor}); it is left "
                                f"float (fold the ops into the weight, then run fix again)")
                continue
            site = out.sites.get(tensor)
            if site is None:
                group = group_of[s.group or s.tensor] if (s.group or len(by_tensor) > 1) else None
                site = out.sites[tensor] = Site(tensor, s.kind, s.rule, s.axis, [], group, s.exact_amax)
            for e in edges:
                out.add_edge(site, e)
    return out, warnings
