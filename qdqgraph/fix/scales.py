"""Which scale each site of TensorRT's placement gets from a model's own Q/DQ, and what that moved.

For each scale group of the plan (a tensor, or a Concat's inputs and output: P8), in this order:

- the group's own facts: the scale as it was (kept); where members held unequal scales, or one
  tensor several, the largest (merged); a zero point that is not 0 or a type that is not the
  target's (uint8, asymmetric int8, int16) becomes the amax of its representable range,
  max(|qmin - zp|, |qmax - zp|) x scale, and scale = amax / qmax (converted);
- else a scale carried from the nearest tensor with a fact across ops that keep values (op classes
  copy, max_pool, no_op, nearest resize: TRT_RULES R2) (moved);
- else a range the graph fixes (exact_amax), else the group is missing: calibrated from data by
  the caller (added), or refused.

Weights keep their scale, axis and quantized values where they are in the target format already
(kept); others are recomputed from their dequantized values (converted); weights the model left
float get scales from their values (added). Facts on tensors the plan leaves float are dropped,
each with the rule that decided it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from ..precisions.formats import Format
from ..ops import nearest_resize
from ..passes.insert import Known, weight_scales
from ..placement.plan import Plan
from ..graph.view import GraphView
from .facts import Fact, Facts, scale_tolerance
from .planning import floating

KINDS = ("kept", "moved", "merged", "converted", "dropped", "added")
CARRY_DEPTH = 8                 # ops crossed at most when carrying a scale to a site
SAME = 1e-3                     # relative difference under which two scales are one (FP16 rounding)


@dataclass
class Move:
    """What fix did with one tensor's quantization."""

    kind: str                                   # one of KINDS
    tensor: str
    what: str                                   # "activation" | "weight" | "bias"
    detail: str
    source: str | None = None                   # moved/merged: the tensor whose scale it took
    via: list[str] = field(default_factory=list)    # moved: the ops the scale crossed
    amax_before: float | None = None
    amax_after: float | None = None
    consumers_dropped: list[str] = field(default_factory=list)   # "node: why"
    consumers_added: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v not in (None, [])}


@dataclass
class Choice:
    known: dict[str, Known] = field(default_factory=dict)
    moves: list[Move] = field(default_factory=list)
    missing: dict[str, list[str]] = field(default_factory=dict)     # group -> members with no scale

    @property
    def unchanged(self) -> bool:
        """Nothing but kept scales on the edges they had: the model is already as TensorRT wants it."""
        return all(m.kind == "kept" and not m.consumers_dropped and not m.consumers_added for m in self.moves) \
            and not self.missing


def amax_of(f: Fact, fmt: Format) -> tuple[np.ndarray, str | None]:
    """The range a fact represents in `fmt`, and how it was converted (None: already in `fmt`)."""
    s = f.scale.astype(np.float64)
    if f.format() is fmt:
        return s * fmt.qmax, None
    zp = f.zero_point.astype(np.float64)
    if np.issubdtype(f.qtype, np.integer):
        info = np.iinfo(f.qtype)
        lo, hi = float(info.min), float(info.max)
    else:
        lo, hi = -fmt.qmax, fmt.qmax
    z = float(np.max(zp)) if zp.size else 0.0
    how = (f"{np.dtype(f.qtype).name} zero point {z:g} -> {fmt.name} zero point 0: amax = max(|{lo:g} - zp|, "
           f"|{hi:g} - zp|) x scale")
    return np.maximum(np.abs(lo - zp), np.abs(hi - zp)) * s, how


def _scalar(a) -> float:
    return float(np.max(a))


def _preserves(view: GraphView, n) -> bool:
    """Ops whose output values are input values (Q/DQ commute with them: TRT_RULES R2)."""
    v = view.vocab
    return v.is_(n, "copy") or v.is_(n, "max_pool") or v.is_(n, "no_op") or \
        (v.is_(n, "resize") and nearest_resize(n.attrs))


def _data(view: GraphView, n) -> list[int]:
    idx = range(len(n.inputs)) if view.vocab.is_(n, "concat") else range(min(1, len(n.inputs)))
    return [i for i in idx if n.inputs[i].name and not view.is_constant(n.inputs[i]) and view.is_float(n.inputs[i])]


def _neighbours(view: GraphView, t):
    p = view.producer(t)
    if p is not None and _preserves(view, p):
        for i in _data(view, p):
            yield p, p.inputs[i]
    for c, i in view.consumers(t):
        if _preserves(view, c) and i in _data(view, c):
            for o in c.outputs:
                if view.is_float(o):
                    yield c, o


def carry(view: GraphView, tensor: str, have: dict) -> tuple[str, list[str]] | None:
    """(the nearest tensor in `have` across value-keeping ops, the nodes crossed), or None."""
    start = view.tensors[tensor]
    frontier, seen = [(start, [])], {tensor}
    for _ in range(CARRY_DEPTH):
        nxt = []
        for t, via in frontier:
            for n, u in _neighbours(view, t):
                if u.name in seen:
                    continue
                seen.add(u.name)
                if u.name in have:
                    return u.name, via + [n.name]
                nxt.append((u, via + [n.name]))
        frontier = nxt
    return None


def as_dtype(scale: np.ndarray, view: GraphView, tensor: str) -> np.ndarray:
    """The scale in the float type of the tensor it quantizes (a DQ's output type is its scale's)."""
    d = view.dtype(view.tensors[tensor])
    if floating(d) and np.dtype(d) != scale.dtype:
        return scale.astype(np.dtype(d))
    return scale


def why_dropped(plan: Plan, view: GraphView, node, index: int) -> str:
    """Why the plan leaves this consumer edge float."""
    if node is None:
        return "a graph output (TensorRT runs a Q/DQ there as a standalone reformat: R5-d, P10)"
    if view.vocab.is_(node, "weighted") and index == 2:
        return f"the bias of {node.name}: TensorRT quantizes biases itself (P3)"
    d = plan.decisions.get(node.name)
    if d is None:
        return f"{node.op} '{node.name}': no rule quantizes it"
    why = d.reason if d.rule and d.reason.startswith(d.rule) else f"{d.rule or 'no rule'}: {d.reason}"
    if not d.quantized:
        return f"{node.op} '{node.name}' stays float ({why})"
    return f"{node.op} '{node.name}' input {index}: its rule quantizes its other inputs ({why})"


def _edges(facts: Facts, tensor: str) -> dict[tuple[str, int], object]:
    return {(n.name if n is not None else "", i): n for n, i, _ in facts.edges_of(tensor)}


def _consumer_changes(plan: Plan, view: GraphView, facts: Facts, tensor: str, planned: set) -> tuple[list, list]:
    had = _edges(facts, tensor)
    dropped = [f"{name or 'graph output'}: {why_dropped(plan, view, node, i)}" for (name, i), node in had.items()
               if (name, i) not in planned]
    added = sorted(f"{name} input {i}" for name, i in planned - set(had))
    return dropped, added


def choose(view: GraphView, plan: Plan, facts: Facts, fmt: Format) -> Choice:
    """The scales of `plan`'s sites from `facts` (see the module doc); `view` is over the stripped graph."""
    out = Choice()
    act = facts.by_tensor("activation")
    used: set[str] = set()
    for rep, members in sorted(plan.groups().items()):
        own = [(m, f) for m in members for f in act.get(m, [])]
        if own:
            _from_own(out, view, plan, facts, fmt, members, own)
            used.update(m for m, _ in own)
            continue
        found = next(((m, c) for m in members if (c := carry(view, m, act)) is not None), None)
        if found is not None:
            m0, (src, via) = found
            used.add(src)
            best = max(act[src], key=lambda f: _scalar(amax_of(f, fmt)[0]))
            amax, how = amax_of(best, fmt)
            scale = best.scale if how is None else fmt.scale_of(_scalar(amax))
            for m in members:
                out.known[m] = Known(as_dtype(np.asarray(scale).reshape(()), view, m))
                ops = ", ".join(f"{view_op(view, n)} '{n}'" for n in via)
                path = f" across {ops}" if m == m0 else f" (its scale group, through {m0} across {ops})"
                detail = f"takes the scale of {src}{path}" + (f"; converted: {how}" if how else "")
                dropped, added = _consumer_changes(plan, view, facts, m, set(plan.sites[m].edges))
                out.moves.append(Move("moved", m, "activation", detail, src, list(via), None, _scalar(amax),
                                      dropped, added))
            continue
        exact = [plan.sites[m].exact_amax for m in members]
        if all(e is not None for e in exact):
            for m in members:
                out.known[m] = Known(as_dtype(np.asarray(fmt.scale_of(max(exact))).reshape(()), view, m))
                out.moves.append(Move("added", m, "activation", f"range fixed by the graph (amax {max(exact):g})",
                                      amax_after=float(max(exact))))
            continue
        out.missing[rep] = list(members)
    _weights(out, view, plan, facts, fmt)
    _dropped(out, view, plan, facts, fmt, used)
    return out


def view_op(view: GraphView, name: str) -> str:
    return next((n.op for n in view.nodes if n.name == name), "?")


def _from_own(out: Choice, view: GraphView, plan: Plan, facts: Facts, fmt: Format, members, own) -> None:
    ranked = [(_scalar(amax_of(f, fmt)[0]), m, f) for m, f in own]
    top, best_m, best = max(ranked, key=lambda r: r[0])
    _, how = amax_of(best, fmt)
    scale = np.asarray(best.scale if how is None else fmt.scale_of(top))
    if scale.size > 1:                                      # a per-channel activation scale (P11)
        scale = np.asarray(fmt.scale_of(top))
    group = f"the scale group of {', '.join(members)}" if len(members) > 1 else None
    tol = scale_tolerance(*(f.scale for _, f in own))
    for m in members:
        mine = [f for mm, f in own if mm == m]
        dropped, added = _consumer_changes(plan, view, facts, m, set(plan.sites[m].edges))
        amaxes = [_scalar(amax_of(f, fmt)[0]) for f in mine]
        before = max(amaxes, default=None)
        one = bool(mine) and all(_same(a, amaxes[0], tol) for a in amaxes)
        own_how = amax_of(mine[0], fmt)[1] if mine else None
        if mine and mine[0].scale.size > 1:
            own_how = own_how or "a per-channel activation scale -> per tensor (P11: TensorRT takes per-tensor activations)"

        def move(kind, detail, source=None, after=top, m=m, before=before, dropped=dropped, added=added):
            out.moves.append(Move(kind, m, "activation", detail, source, [], before, after, dropped, added))
        if one and own_how is None and _same(amaxes[0], top, tol):    # its own scale, as it is
            final = as_dtype(mine[0].scale.reshape(()), view, m)
            out.known[m] = Known(final)
            if len(mine) > 1:
                move("merged", f"{len(mine)} Q/DQ pairs with one scale -> one shared pair (P5)", after=amaxes[0])
            elif final.dtype != mine[0].scale.dtype:
                move("converted", f"scale cast to {final.dtype.name} (its tensor's type)", after=amaxes[0])
            else:
                move("kept", "scale kept", after=amaxes[0])
            continue
        out.known[m] = Known(as_dtype(scale.reshape(()), view, m))
        if not mine:
            move("moved", f"takes the scale of {best_m} ({group}: one scale, P8/R6)", best_m)
        elif not one:
            move("merged", f"{len(mine)} Q/DQ with unequal scales -> one, the largest (R5-c: Qs on one tensor "
                           f"must merge)", best_m)
        elif not _same(amaxes[0], top, tol):
            move("merged", f"scale of amax {before:.4g} -> {top:.4g}, the largest in {group} (P8: one scale, R6)"
                 + (f"; converted: {how}" if how else ""), best_m)
        else:
            move("converted", own_how)


def _same(a: float, b: float, tol: float = SAME) -> bool:
    """One range: a scale written in FP16 and in FP32 (FP16 rounds at 2^-11) is one scale; `tol`:
    the relative difference allowed (facts.scale_tolerance of the scales compared: wider for BF16)."""
    return abs(a - b) <= tol * max(abs(a), abs(b))


def _weights(out: Choice, view: GraphView, plan: Plan, facts: Facts, fmt: Format) -> None:
    wf = facts.by_tensor("weight")
    for site in sorted(plan.weight_sites(), key=lambda s: s.tensor):
        fs = wf.get(site.tensor, [])
        dropped, added = _consumer_changes(plan, view, facts, site.tensor, set(site.edges)) if fs else ([], [])
        w = view.constant_value(view.tensors[site.tensor])
        computed = Known(np.asarray(weight_scales(w, site.axis, fmt)).astype(w.dtype), site.axis)
        if not fs:
            out.known[site.tensor] = computed
            out.moves.append(Move("added", site.tensor, "weight", "the model left it float: scales from its values "
                                  f"({'per channel, axis ' + str(site.axis) if site.axis is not None else 'per tensor'})"))
            continue
        f = fs[0]
        if f.format() is fmt and (f.axis is None or f.axis == site.axis):
            out.known[site.tensor] = Known(f.scale, f.axis, f.stored)
            out.moves.append(Move("kept", site.tensor, "weight", "scales and quantized values kept" if f.stored is not None
                                  else "scales kept (float weight through Q -> DQ)", consumers_dropped=dropped,
                                  consumers_added=added))
            continue
        why = amax_of(f, fmt)[1] or f"per-channel axis {f.axis} -> {site.axis} (P2: the output-channel axis)"
        out.known[site.tensor] = computed
        out.moves.append(Move("converted", site.tensor, "weight", f"{why}; scales and values recomputed from the "
                              f"dequantized weight", consumers_dropped=dropped, consumers_added=added))


def _dropped(out: Choice, view: GraphView, plan: Plan, facts: Facts, fmt: Format, used: set) -> None:
    sites = set(plan.sites)
    seen = set()
    for _, _, f in facts.edges:
        if f.tensor in seen or f.tensor in sites or (f.kind == "activation" and f.tensor in used):
            continue
        seen.add(f.tensor)
        had = _edges(facts, f.tensor)
        reasons = [why_dropped(plan, view, node, i) for (_, i), node in had.items()]
        more = f" (and {len(reasons) - 1} more consumers)" if len(reasons) > 1 else ""
        amax = _scalar(amax_of(f, fmt)[0]) if f.kind == "activation" else None
        out.moves.append(Move("dropped", f.tensor, f.kind, reasons[0] + more, amax_before=amax,
                              consumers_dropped=reasons if len(reasons) > 1 else []))
