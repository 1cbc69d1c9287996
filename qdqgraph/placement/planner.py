"""Placement: which input edges get Q/DQ, decided by the rules in rules/placement.toml.

`plan_placement(graph, ruleset)` is pure: it reads the graph and returns a `Plan` of quant sites
(tensor, kind, axis, rule id, the consumer edges it feeds) and a decision per node (quantized by
rule X, or skipped by rule Y because ...). The conditions that rules may name live in CONDITIONS,
a closed registry: a rule file cannot run code.
"""
from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs

from ..ops import nearest_resize
from .ruleset import Rule, RuleSet, load_ruleset
from ..trtsim.conditions import MAX_REGION
from ..view import GraphView

# ONNX attribute defaults that conditions compare against.
_ATTR_DEFAULTS = {"group": 1, "transA": 0, "transB": 0}


@dataclass
class Site:
    """One tensor that gets a Q->DQ (activation) or an INT8 copy + DQ (weight)."""

    tensor: str
    kind: str                       # "activation" | "weight"
    rule: str
    axis: int | None = None         # weights: per-channel axis; None = per-tensor
    edges: list[tuple[str, int]] = field(default_factory=list)  # (consumer node name, input index)
    group: str | None = None        # tensors with the same group share one scale
    exact_amax: float | None = None # a range known from the graph (a one-hot: 1.0), not calibrated


@dataclass
class Decision:
    node: str
    op: str
    quantized: bool
    rule: str | None
    reason: str


@dataclass
class Plan:
    sites: dict[str, Site] = field(default_factory=dict)
    decisions: dict[str, Decision] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def activation_sites(self) -> list[Site]:
        return [s for s in self.sites.values() if s.kind == "activation"]

    def weight_sites(self) -> list[Site]:
        return [s for s in self.sites.values() if s.kind == "weight"]

    def groups(self) -> dict[str, list[str]]:
        """Scale-sharing groups: representative -> member tensors (every activation site is in one)."""
        out: dict[str, list[str]] = {}
        for s in self.activation_sites():
            out.setdefault(s.group or s.tensor, []).append(s.tensor)
        return out

    def quantized_edges(self) -> set[tuple[str, int]]:
        return {e for s in self.sites.values() for e in s.edges}


# ---------------------------------------------------------------------------- conditions

class Ctx:
    """What conditions see: the graph view, the plan so far (stage 2), and the node's captures."""

    def __init__(self, view: GraphView, plan: Plan):
        self.view = view
        self.plan = plan


def _cond(captures=()):
    def wrap(fn):
        fn.captures = tuple(captures)
        return fn
    return wrap


def _inp(node: gs.Node, i: int):
    return node.inputs[i] if i < len(node.inputs) and node.inputs[i].name != "" else None


@_cond()
def c_op_type(ctx, node, arg):
    ok = node.op == arg
    return ok, "" if ok else f"op is {node.op}, not {arg}", {}


def _float_activation(ctx, t, label):
    v = ctx.view
    if t is None:
        return False, f"{label} is missing"
    if v.is_constant(t):
        return False, f"{label} '{t.name}' is a constant"
    if v.dtype(t) is None:
        return False, f"{label} '{t.name}' has no known type (shape inference could not type it)"
    if not v.is_float(t):
        return False, f"{label} '{t.name}' is {np.dtype(v.dtype(t)).name}, not float (integer tensors are never quantized)"
    if t.name in v.integer_derived and not _exact_zero_one(v, t):
        return False, f"{label} '{t.name}' is on an integer path (from '{v.integer_derived[t.name]}')"
    return True, ""


def _exact_zero_one(v: GraphView, t: gs.Tensor) -> bool:
    """A Cast from bool (a one-hot or mask) holds only 0 and 1, which INT8 represents exactly
    (amax 1: 1 -> 127): quantizing it loses nothing and lets its consumer run INT8."""
    p = v.producer(t)
    if p is None or not v.vocab.is_(p, "cast") or not p.inputs:
        return False
    d = v.dtype(p.inputs[0])
    return d is not None and np.dtype(d) == np.bool_


@_cond()
def c_float_input(ctx, node, arg):
    i = int(arg)
    ok, why = _float_activation(ctx, _inp(node, i), f"input {i}")
    return ok, why, {}


@_cond()
def c_all_inputs_float(ctx, node, arg):
    for i, t in enumerate(node.inputs):
        ok, why = _float_activation(ctx, t if t.name else None, f"input {i}")
        if not ok:
            return False, why, {}
    return True, "", {}


@_cond()
def c_constant_weight(ctx, node, arg):
    i = int(arg)
    t = _inp(node, i)
    if t is None:
        return False, f"input {i} is missing", {}
    val = ctx.view.constant_value(t)
    if val is None:
        return False, f"input {i} '{t.name}' is not a constant weight", {}
    if not np.issubdtype(val.dtype, np.floating):
        return False, f"input {i} '{t.name}' is {val.dtype}, not a float weight", {}
    return True, "", {}


@_cond()
def c_weight_rank(ctx, node, arg):
    i, rank = (int(x) for x in arg.split("="))
    t = _inp(node, i)
    val = ctx.view.constant_value(t) if t is not None else None
    got = None if val is None else val.ndim
    return got == rank, "" if got == rank else f"input {i} has rank {got}, not {rank}", {}


_ATTR = re.compile(r"^(\w+)(=|!=|>|<)(-?\d+)$")


@_cond()
def c_attr(ctx, node, arg):
    m = _ATTR.match(arg)
    if not m:
        raise ValueError(f"bad attr condition {arg!r}")
    name, op, val = m.group(1), m.group(2), int(m.group(3))
    got = node.attrs.get(name, _ATTR_DEFAULTS.get(name))
    ok = {"=": got == val, "!=": got != val, ">": got is not None and got > val,
          "<": got is not None and got < val}[op]
    return ok, "" if ok else f"{name} is {got}, rule needs {name}{op}{val}", {}


@_cond()
def c_is_weighted(ctx, node, arg):
    ok = ctx.view.vocab.is_(node, "weighted")
    return ok, "" if ok else f"{node.op} is not a weighted op", {}


@_cond()
def c_feeds_graph_output(ctx, node, arg):
    hit = [o.name for o in node.outputs if ctx.view.is_graph_output(o)]
    return bool(hit), f"its output '{hit[0]}' is a graph output" if hit else "its output is not a graph output", {}


def _static(d):
    return d if isinstance(d, (int, np.integer)) and d >= 0 else None


@_cond()
def c_is_gemv(ctx, node, arg):
    """M or N == 1 for MatMul/Gemm (read from the output shape)."""
    if not (ctx.view.vocab.is_(node, "gemm") or ctx.view.vocab.is_(node, "matmul")):
        return False, "not a GEMM", {}
    shape = ctx.view.shape(node.outputs[0])
    if not shape:
        return False, "output shape unknown", {}
    n = _static(shape[-1])
    m = _static(shape[-2]) if len(shape) >= 2 else 1
    if n == 1 or m == 1:
        return True, f"output shape {list(shape)} has M or N == 1 (GEMV)", {}
    return False, f"output shape {list(shape)} is a GEMM", {}


def _is_first_layer(ctx, node):
    t = node.inputs[0]
    seen = 0
    while t is not None and seen < 8:
        if t.name in ctx.view.inputs:
            return True
        p = ctx.view.producer(t)
        if p is None or not ctx.view.vocab.is_(p, "copy"):
            return False
        t, seen = p.inputs[0], seen + 1
    return False


def _is_plain_conv(ctx, node) -> bool:
    """A Conv (not a ConvTranspose): its weight is [Cout, Cin/g, k...]."""
    return ctx.view.vocab.is_(node, "conv") and not ctx.view.vocab.is_(node, "conv_transpose")


@_cond()
def c_is_single_output_conv(ctx, node, arg):
    """A Conv with one output channel: implicit GEMM with N == 1, so a GEMV (P10), whose INT8 input
    would cost a Q for almost no arithmetic (silero-vad's 128 -> 1 decoder head)."""
    if not _is_plain_conv(ctx, node):
        return False, "not a Conv", {}
    w = ctx.view.constant_value(node.inputs[1]) if len(node.inputs) > 1 else None
    if w is None or w.ndim < 3:
        return False, "weight unknown", {}
    if int(w.shape[0]) != 1:
        return False, f"{int(w.shape[0])} output channels", {}
    return True, "1 output channel (a GEMV per position)", {}


@_cond()
def c_is_tiny_conv(ctx, node, arg):
    """Convs with < 16 input or output channels, except shapes INT8 kernels handle well (P10)."""
    if not _is_plain_conv(ctx, node):
        return False, "not a Conv", {}
    w = ctx.view.constant_value(node.inputs[1]) if len(node.inputs) > 1 else None
    if w is None or w.ndim < 3:
        return False, "weight unknown", {}
    group = node.attrs.get("group", 1)
    oc, ic = int(w.shape[0]), int(w.shape[1]) * group
    kernel = tuple(int(k) for k in w.shape[2:])
    if ic >= 16 and oc >= 16:
        return False, f"{ic} in / {oc} out channels", {}
    if group == 1:
        ok = (oc % 8 == 0 or ic % 8 == 0) and len(set(kernel)) == 1 and (_is_first_layer(ctx, node) or max(ic, oc) >= 16)
    else:
        ok = oc % 8 == 0 and all(k >= 3 for k in kernel)
    if ok:
        return False, f"{ic} in / {oc} out channels, but the shape suits INT8 kernels", {}
    return True, f"{ic} in / {oc} out channels (< 16), kernel {list(kernel)}, group {group}", {}


def _region_input(v: GraphView, t: gs.Tensor) -> gs.Tensor | None:
    """The one tensor x that feeds a region of pointwise ops ending in t (their other operands
    constants, every tensor inside used only inside): a decomposed HardSwish x*clip(x+3,0,6)/6 or
    GELU, which TensorRT fuses into one PointWise epilogue (F2). None if t ends no such region."""
    region, stack = {}, [t]
    while stack:
        p = v.producer(stack.pop())
        if p is None or p.name in region:
            continue
        if not (v.vocab.is_(p, "elementwise") or v.vocab.is_(p, "epilogue")) or len(region) >= MAX_REGION:
            return None
        region[p.name] = p
        stack.extend(i for i in p.inputs if i.name and not v.is_constant(i)
                     and (p2 := v.producer(i)) is not None and (v.vocab.is_(p2, "elementwise") or v.vocab.is_(p2, "epilogue")))
    ins = {i.name: i for n in region.values() for i in n.inputs if i.name and not v.is_constant(i)
           and (v.producer(i) is None or v.producer(i).name not in region)}
    if len(region) < 2 or len(ins) != 1:
        return None
    x = next(iter(ins.values()))
    inner = [x] + [o for n in region.values() for o in n.outputs if o is not t]
    if any(c.name not in region for i in inner for c, _ in v.consumers(i)) or any(v.is_graph_output(i) for i in inner):
        return None
    return x


def _backbone(ctx, t: gs.Tensor, limit=6):
    """The Conv at the head of a conv pattern ending in tensor t (Conv[->BN][->Act][->Dropout],
    bias or constant-scale ops allowed, an activation possibly decomposed into pointwise ops),
    each tensor on it used once; else None."""
    v = ctx.view
    for _ in range(limit):
        if len(v.consumers(t)) != 1 or v.is_graph_output(t):
            return None
        p = v.producer(t)
        if p is None:
            return None
        if v.vocab.is_(p, "conv"):
            return p
        nonconst = [i for i in p.inputs if i.name and not v.is_constant(i)]
        passthrough = (v.vocab.is_(p, "batchnorm") or v.vocab.is_(p, "epilogue") or v.vocab.is_(p, "no_op")
                       or ((v.vocab.is_(p, "add") or v.vocab.is_(p, "mul")) and len(nonconst) == 1))
        if passthrough and len(nonconst) == 1:
            t = nonconst[0]
            continue
        x = _region_input(v, t)
        if x is None:
            return None
        p = v.producer(x)
        if p is None:
            return None
        if v.vocab.is_(p, "conv"):
            return p
        t = x if len(v.consumers(x)) == 1 else None
        if t is None:       # x feeds the whole region: step over it to its producer's input
            nonconst = [i for i in p.inputs if i.name and not v.is_constant(i)]
            if not (v.vocab.is_(p, "batchnorm") or v.vocab.is_(p, "epilogue")) or len(nonconst) != 1:
                return None
            t = nonconst[0]
    return None


def _ancestor_distances(ctx, t: gs.Tensor, limit=4000) -> dict[str, int]:
    dist, q = {}, deque([(t, 0)])
    while q and len(dist) < limit:
        cur, d = q.popleft()
        p = ctx.view.producer(cur)
        if p is None or p.name in dist:
            continue
        dist[p.name] = d
        for i in p.inputs:
            if i.name and not ctx.view.is_constant(i):
                q.append((i, d + 1))
    return dist


@_cond(captures=("skip",))
def c_residual_skip(ctx, node, arg):
    """Add(a, b) with a conv pattern on one side: capture the other side (the skip)."""
    v = ctx.view
    live = [(i, t) for i, t in enumerate(node.inputs) if t.name and not v.is_constant(t)]
    if len(live) != 2:
        return False, "not an Add of two activations", {}
    for i, t in live:
        ok, why = _float_activation(ctx, t, f"input {i}")
        if not ok:
            return False, why, {}
    (ia, a), (ib, b) = live
    sa, sb = v.shape(a), v.shape(b)
    if sa and sb and len(sa) == len(sb) and any(
            x != y for x, y in zip(sa[1:], sb[1:]) if _static(x) is not None and _static(y) is not None):
        return False, f"broadcasting Add {list(sa)} + {list(sb)} does not fuse into a conv epilogue", {}
    ba, bb = _backbone(ctx, a), _backbone(ctx, b)
    if ba is None and bb is None:
        return False, "neither input comes from a conv pattern (Conv[->BN][->Act]) used only here", {}
    if ba is not None and bb is None:
        return True, "", {"skip": ib}
    if bb is not None and ba is None:
        return True, "", {"skip": ia}
    # Both sides are conv patterns: the branch with more nodes since the nearest common ancestor is
    # the main branch and stays float; the shorter one (a projection shortcut) is the skip.
    da, db = _ancestor_distances(ctx, a), _ancestor_distances(ctx, b)
    common = set(da) & set(db)
    if not common:
        return True, "", {"skip": ib}
    lca = min(common, key=lambda n: (da[n] + db[n], n))
    return True, "", {"skip": ia if da[lca] < db[lca] else ib}


def _gate_source(ctx, t, other: gs.Tensor, limit=10):
    """Walk back from a gate tensor: 'se' if it reaches a global pooling, 'self' if it reaches
    `other` (x * sigmoid(x)), else None."""
    v = ctx.view
    for _ in range(limit):
        if t is other:
            return "self"
        p = v.producer(t)
        if p is None:
            return None
        if v.vocab.is_(p, "avg_pool") or p.op in ("ReduceMean",):
            return "se"
        nonconst = [i for i in p.inputs if i.name and not v.is_constant(i)]
        if not nonconst:
            return None
        t = nonconst[0]
    return None


@_cond()
def c_se_gate_mul(ctx, node, arg):
    v = ctx.view
    live = [t for t in node.inputs if t.name and not v.is_constant(t)]
    if len(live) != 2:
        return False, "not a Mul of two activations", {}
    for i, t in enumerate(live):
        ok, why = _float_activation(ctx, t, f"input {i}")
        if not ok:
            return False, why, {}
    for gate, other in ((live[1], live[0]), (live[0], live[1])):
        p = v.producer(gate)
        if p is not None and v.vocab.is_(p, "gate"):
            src = _gate_source(ctx, p.inputs[0], other)
            if src == "se":
                return True, "", {}
            if src == "self":
                return False, "x * gate(x) (SiLU/Swish) fuses into the conv epilogue unquantized", {}
    return False, "no input is a squeeze-excite gate (Sigmoid/HardSigmoid of a pooled branch)", {}


@_cond()
def c_se_gate_int8(ctx, node, arg):
    """Stage 2: the conv that computes the SE gate (before its activation and bias Add) is INT8, so a
    Q on the gate fuses into that conv's epilogue; after a float conv it would be a standalone reformat."""
    v = ctx.view
    for gate in [t for t in node.inputs if t.name and not v.is_constant(t)]:
        p = v.producer(gate)
        if p is None or not v.vocab.is_(p, "gate"):
            continue
        t = p.inputs[0]
        for _ in range(4):
            q = v.producer(t)
            if q is None:
                break
            if v.vocab.is_(q, "weighted"):
                d = ctx.plan.decisions.get(q.name)
                if d is not None and d.quantized:
                    return True, "", {}
                return False, (f"the gate's conv {q.name} runs in float, so a Q on the gate would be a "
                               "standalone reformat (F6)"), {}
            live = [i for i in q.inputs if i.name and not v.is_constant(i)]
            if len(live) != 1 or not (v.vocab.is_(q, "epilogue") or v.vocab.is_(q, "batchnorm")
                                      or v.vocab.is_(q, "elementwise")):
                break
            t = live[0]
    return False, "no conv found behind the gate", {}


@_cond()
def c_output_quantized(ctx, node, arg):
    edges = ctx.plan.quantized_edges()
    for c, i in ctx.view.through(node.outputs[0]):
        if (c.name, i) in edges:
            return True, "", {}
    return False, "its output feeds no quantized consumer: without a Q after it, it would run in float (F4)", {}


CONDITIONS = {
    "op_type": c_op_type, "float_input": c_float_input, "all_inputs_float": c_all_inputs_float,
    "constant_weight": c_constant_weight, "weight_rank": c_weight_rank, "attr": c_attr,
    "is_weighted": c_is_weighted, "feeds_graph_output": c_feeds_graph_output, "is_gemv": c_is_gemv,
    "is_tiny_conv": c_is_tiny_conv, "is_single_output_conv": c_is_single_output_conv, "residual_skip": c_residual_skip, "se_gate_mul": c_se_gate_mul,
    "se_gate_int8": c_se_gate_int8, "output_quantized": c_output_quantized,
}


def _evaluate(ctx, rule: Rule, node) -> tuple[bool, str, dict]:
    """(matched, why, captures): on a miss, why the first failing condition failed; on a match,
    what the conditions that explain themselves found (e.g. the channel counts of a tiny conv)."""
    captures, found = {}, []
    for cond in rule.when:
        neg = cond.startswith("not ")
        name, _, arg = cond.removeprefix("not ").partition(":")
        ok, why, caps = CONDITIONS[name](ctx, node, arg)
        if neg:
            ok, why = (not ok), (f"{cond[4:]} holds" if ok else "")
        if not ok:
            return False, why, {}
        if why:
            found.append(why)
        captures.update(caps)
    return True, "; ".join(found), captures


def _op_matches(view, rule: Rule, node) -> bool:
    return rule.op == "any" or view.vocab.is_(node, rule.op)


# ---------------------------------------------------------------------------- the planner

@dataclass(frozen=True)
class Selection:
    """User choices: op types and node-name patterns to exclude, and patterns to force in."""

    exclude_ops: tuple[str, ...] = ()
    exclude_nodes: tuple[str, ...] = ()
    include_nodes: tuple[str, ...] = ()
    float_nodes: tuple[tuple[str, str], ...] = ()   # (exact node name, why): accuracy fallback
    region_nodes: tuple[tuple[str, str, str], ...] = ()   # (exact node name, rule id, why): P14

    def excluded(self, node) -> tuple[str, str] | None:
        """(rule id, why) if the node must stay float: "fallback", the P14 rule's id, or
        "user-exclude"; None otherwise."""
        for name, why in self.float_nodes:
            if node.name == name:
                return "fallback", why
        for name, rid, why in self.region_nodes:
            if node.name == name:
                return rid, why
        if node.op in self.exclude_ops:
            return "user-exclude", f"--exclude-op {node.op}"
        for pat in self.exclude_nodes:
            if re.search(pat, node.name or ""):
                return "user-exclude", f"--exclude-node {pat}"
        return None

    def included(self, node) -> bool:
        return self.includes(node.name or "")

    def includes(self, name: str) -> bool:
        """Does --include-node force the node of this name in?"""
        return any(re.search(p, name) for p in self.include_nodes)


def _exclusions(view: GraphView, ruleset: RuleSet, ctx) -> dict[str, tuple[Rule, str]]:
    out: dict[str, tuple[Rule, str]] = {}
    for rule in ruleset.exclusions:
        if rule.path:
            for chain in view.match_path(rule.path):
                for n in chain:
                    out.setdefault(n.name, (rule, rule.doc))
            continue
        for n in view.nodes:
            if n.name in out or not _op_matches(view, rule, n):
                continue
            ok, why, _ = _evaluate(ctx, rule, n)
            if ok:
                out[n.name] = (rule, f"{rule.doc} ({why})" if why else rule.doc)
    return out


def _targets(rule: Rule, node, captures) -> list[tuple[int, object]]:
    out = []
    for t in rule.quantize:
        if t.input == "all":
            out.extend((i, t) for i, x in enumerate(node.inputs) if x.name)
        elif isinstance(t.input, str):
            out.append((captures[t.input[1:]], t))
        else:
            out.append((t.input, t))
    return out


def _add_site(plan: Plan, view: GraphView, node, index: int, target, rule: Rule):
    t = node.inputs[index]
    site = plan.sites.get(t.name)
    if site is None:
        site = plan.sites[t.name] = Site(t.name, target.kind, rule.id, target.axis)
    elif site.kind == "weight" and site.axis != target.axis:
        plan.notes.append(f"weight '{t.name}' is shared by ops that need different axes; per-tensor scale used")
        site.axis = None
    if (node.name, index) not in site.edges:
        site.edges.append((node.name, index))
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


def _merge_groups(plan: Plan, links: list[tuple[str, str]] = ()) -> None:
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


def plan_placement(graph: gs.Graph, ruleset: RuleSet | None = None, selection: Selection = Selection()) -> Plan:
    """Decide every Q/DQ site of a cleaned float graph. Pure: the graph is not changed."""
    ruleset = ruleset or load_ruleset()
    view = GraphView(graph)
    plan = Plan()
    ctx = Ctx(view, plan)
    excluded = _exclusions(view, ruleset, ctx)

    for stage in (1, 2):
        # stage 2 asks whether a node's output feeds a quantized consumer: consumers are decided first
        for node in (view.nodes if stage == 1 else reversed(view.nodes)):
            if node.name in plan.decisions:
                continue
            candidates = [r for r in ruleset.rules if _op_matches(view, r, node)]
            if stage == 1 and node.name in excluded:
                rule, why = excluded[node.name]
                forced = rule.advisory and selection.included(node) and candidates
                if not forced:
                    if candidates or (rule.op not in (None, "any")):
                        plan.decisions[node.name] = Decision(node.name, node.op, False, rule.id, why)
                    continue
            if not candidates:
                continue
            user = selection.excluded(node)
            if user:
                plan.decisions[node.name] = Decision(node.name, node.op, False, *user)
                continue
            near: tuple[str, str] | None = None
            for rule in (r for r in candidates if r.stage == stage):
                ok, why, caps = _evaluate(ctx, rule, node)
                if ok:
                    for index, target in _targets(rule, node, caps):
                        _add_site(plan, view, node, index, target, rule)
                    plan.decisions[node.name] = Decision(node.name, node.op, True, rule.id, rule.doc)
                    break
                near = near or (rule.id, why)
            else:
                if near and not any(r.stage > stage for r in candidates):
                    plan.decisions[node.name] = Decision(node.name, node.op, False, *near)
    _merge_groups(plan, _resize_links(plan, view))
    for site in plan.activation_sites():
        if site.tensor in view.tensors and _exact_zero_one(view, view.tensors[site.tensor]):
            site.exact_amax = 1.0
    return plan


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
        for chain in view.match_path(rule.path):
            if any(n is node for n in chain):
                return True, rule.doc
        return False, f"{node.op} node is on no chain {','.join(rule.path)}"
    if not _op_matches(view, rule, node):
        return False, f"{node.op} is not in op class {rule.op!r}"
    plan = plan_placement(graph, ruleset, selection)
    ok, why, _ = _evaluate(Ctx(view, plan), rule, node)
    return ok, why
