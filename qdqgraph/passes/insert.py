"""Insert Q/DQ at the sites of a placement plan, with scales from calibrated amax values.

`planned_insertions` works out, without touching the graph, every node and tensor insertion will
add (names, scales, INT8 weights); `insert_qdq` applies them to a graphsurgeon graph. The simulator
applies the same list to its own graph to predict a plan (qdqgraph.recipes.small_regions), so the
prediction sees exactly the names and parameters the written model will have.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import onnx_graphsurgeon as gs

from ..precisions.formats import INT8, Format
from ..ops import DEQUANTIZE, QUANTIZE
from ..placement.plan import Plan, Site
from ..graph.view import GraphView, bodies
from .base import PassResult, result
from .registry import OPSET_13, QDQ_SOUND, declare
from ..graph import io

WEIGHT_FORMATS = ("int8", "qdq")


class _Names:
    """Unique names derived from a tensor name."""

    def __init__(self, used: set[str]):
        self.used = used

    def __call__(self, base: str) -> str:
        name, k = base, 1
        while name in self.used:
            name, k = f"{base}_{k}", k + 1
        self.used.add(name)
        return name


def weight_scales(w: np.ndarray, axis: int | None, fmt: Format = INT8) -> np.ndarray:
    """float32 scale(s) for a weight: per channel along `axis`, or one per tensor. max |w| is taken
    as the larger of max(w) and -min(w), the same number without a copy of the weight (a float32
    copy and its absolute value were two passes and two temporaries the size of each weight)."""
    a = np.asarray(w, dtype=np.float32)
    if axis is None:
        return np.asarray(fmt.scale_of(float(max(a.max(), -a.min())) if a.size else 0.0), dtype=np.float32)
    if w.ndim <= 1:
        return fmt.scale_of(np.abs(a))
    others = tuple(d for d in range(w.ndim) if d != axis)
    return fmt.scale_of(np.maximum(a.max(axis=others), -a.min(axis=others)))


def quantize_weight(w: np.ndarray, scale: np.ndarray, axis: int | None, fmt: Format = INT8) -> np.ndarray:
    """Symmetric, round-half-to-even and saturating (as TensorRT's IQuantizeLayer), in `fmt`."""
    s = scale if axis is None else scale.reshape([-1 if d == axis else 1 for d in range(w.ndim)])
    return fmt.quantize(w, s)


@dataclass(frozen=True)
class Known:
    """A site's scale given, not computed (qdqgraph.fix keeps a model's own): written as it is, in
    its own dtype; for a weight, also its axis (None: per tensor) and, when given, its quantized
    values as they are."""

    scale: np.ndarray
    axis: int | None = None
    stored: np.ndarray | None = None


@dataclass(frozen=True)
class Insertion:
    """One site's Q/DQ as insertion will write it."""

    site: Site
    source: str                   # the tensor that is quantized (a weight's quantized copy when stored so)
    stored: np.ndarray | None     # the quantized (INT8 or FP8) weight, when stored quantized
    scale_name: str
    scale: np.ndarray
    zero_point_name: str
    zero_point: np.ndarray
    axis: int | None
    q: tuple[str, str] | None     # (Q node, its quantized output), absent for a stored weight
    dq: tuple[str, str]           # (DQ node, its float output)
    dtype: npt.DTypeLike | None   # the float type of the DQ output
    shape: list | None            # its dimensions (ints, or names of symbolic ones), None when unknown
    zero_range: bool = False      # an activation calibrated to zero: it got the safe scale


def planned_insertions(graph: gs.Graph, plan: Plan, amax: dict[str, float], weights: str = "int8",
                       view: GraphView | None = None, fmt: Format = INT8,
                       known: dict[str, Known] | None = None, shapes_only: bool = False) -> list[Insertion]:
    """What `insert_qdq` will add for `plan` (pure: the graph is read, not changed); a site in
    `known` (by tensor) gets the scale (axis, quantized weight) given there. `shapes_only`: a
    weight stored quantized is a read-only array of zeros of its type and shape that takes no
    memory, not its quantized values (for the simulator, which reads a weight's type and shape:
    quantizing a 4.8 GB encoder's weights to predict its plan took most of P14's 25 s)."""
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {WEIGHT_FORMATS}")
    view = view or GraphView(graph)
    # names are unique across the model: an If branch quantized before (graph/branches) holds Q/DQ of
    # the outer tensors it reads, named as these would be
    names = _Names(set(view.tensors) | {n.name for n in graph.nodes}
                   | {x for g in bodies(graph) for x in (*g.tensors(), *(n.name for n in g.nodes))})
    out = []
    for site in sorted(plan.sites.values(), key=lambda s: s.tensor):
        t = view.tensors[site.tensor]
        base = site.tensor
        stored = None
        zero_range = False
        given = (known or {}).get(site.tensor)
        if site.kind == "activation" and given is not None:
            scale = np.asarray(given.scale)
            zp = np.zeros((), dtype=fmt.zero_point)
            axis, source = None, site.tensor
        elif site.kind == "activation":
            a = amax.get(site.group or site.tensor, amax.get(site.tensor))
            if a is None:
                raise KeyError(f"no calibrated range for tensor {site.tensor!r}")
            zero_range = not (np.isfinite(a) and a > 2.0 ** -24)
            scale = np.array(fmt.scale_of(a), dtype=np.float32)
            zp = np.zeros((), dtype=fmt.zero_point)
            axis, source = None, site.tensor
        else:
            axis = site.axis if given is None else given.axis
            scale = weight_scales(view.constant(t), axis, fmt) if given is None else np.asarray(given.scale)
            zp = np.zeros(scale.shape, dtype=fmt.zero_point)
            source = site.tensor
            if weights == "int8":
                if given is not None and given.stored is not None:
                    stored = given.stored
                elif shapes_only:
                    stored = _shaped(view.constant(t), fmt)
                else:
                    stored = quantize_weight(view.constant(t), scale, axis, fmt)
                source = names(f"{base}_{fmt.name}")
        scale_name, zp_name = names(f"{base}_scale"), names(f"{base}_zero_point")
        q = None
        if site.kind == "activation" or weights == "qdq":
            q_out = names(f"{base}_quantized")
            q = (names(f"{base}_q"), q_out)
        dtype = t.values.dtype if isinstance(t, gs.Constant) else view.dtype(t)
        shape = list(t.values.shape) if isinstance(t, gs.Constant) else t.shape
        dq_out = names(f"{base}_dequantized")
        dq = (names(f"{base}_dq"), dq_out)
        out.append(Insertion(site, source, stored, scale_name, scale, zp_name, zp, axis, q, dq, dtype, shape, zero_range))
    return out


def _shaped(w: np.ndarray, fmt: Format) -> np.ndarray:
    """Zeros of the quantized type in the shape of `w`, in no memory (`planned_insertions`'s
    shapes_only)."""
    return np.broadcast_to(np.zeros((), fmt.zero_point), np.shape(w))


@declare("insert_qdq", requires=(OPSET_13,), ensures=(QDQ_SOUND,))
def insert_qdq(graph: gs.Graph, plan: Plan, amax: dict[str, float], weights: str = "int8",
               fmt: Format = INT8, known: dict[str, Known] | None = None) -> PassResult:
    """Add one Q->DQ per activation site (shared by all its quantized consumers) and a quantized
    weight + DQ (or float weight + Q->DQ with weights="qdq") per weight site, in `fmt` (INT8, FP8). `amax` maps each
    activation tensor (or scale group) to its calibrated range; `known` gives sites their scales as
    they are (see planned_insertions). Modifies `graph`; details:
    `activations`, `weights` (counts), `provenance` (inserted node -> rule id), `zero_range`."""
    view = GraphView(graph)
    nodes = {n.name: n for n in graph.nodes}
    provenance: dict[str, str] = {}
    counts = {"activation": 0, "weight": 0}
    zero_range = []
    for ins in planned_insertions(graph, plan, amax, weights, view, fmt, known):
        site = ins.site
        t = view.tensors[site.tensor]
        src = gs.Constant(ins.source, ins.stored) if ins.stored is not None else t
        s_const = gs.Constant(ins.scale_name, ins.scale)
        z_const = gs.Constant(ins.zero_point_name, ins.zero_point)
        attrs = {"axis": int(ins.axis)} if ins.axis is not None else {}
        dq_in = src
        if ins.q is not None:
            q_out = gs.Variable(ins.q[1], dtype=fmt.zero_point, shape=ins.shape)
            q = gs.Node(QUANTIZE, name=ins.q[0], inputs=[src, s_const, z_const], outputs=[q_out], attrs=dict(attrs))
            graph.nodes.append(q)
            provenance[q.name] = site.rule
            dq_in = q_out
        dq_out = gs.Variable(ins.dq[1], dtype=ins.dtype, shape=ins.shape)
        dq = gs.Node(DEQUANTIZE, name=ins.dq[0], inputs=[dq_in, s_const, z_const], outputs=[dq_out], attrs=dict(attrs))
        graph.nodes.append(dq)
        provenance[dq.name] = site.rule
        for node_name, index in site.edges:
            nodes[node_name].inputs[index] = dq_out
        counts[site.kind] += 1
        if ins.zero_range:
            zero_range.append(site.tensor)
    io.tidy(graph)
    return result("insert_qdq", bool(provenance), activations=counts["activation"], weights=counts["weight"],
                  provenance=provenance, zero_range=zero_range)
