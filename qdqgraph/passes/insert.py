"""Insert Q/DQ at the sites of a placement plan, with scales from calibrated amax values."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs

from ..calib.methods import safe_scale
from ..ops import DEQUANTIZE, QUANTIZE
from ..placement.plan import Plan
from ..view import GraphView

WEIGHT_FORMATS = ("int8", "qdq")


@dataclass
class InsertResult:
    activations: int = 0
    weights: int = 0
    provenance: dict[str, str] = field(default_factory=dict)  # inserted node name -> rule id
    zero_range: list[str] = field(default_factory=list)       # tensors that got the safe scale

    @property
    def changed(self) -> bool:
        return bool(self.activations or self.weights)


class _Names:
    """Unique names derived from a tensor name."""

    def __init__(self, graph: gs.Graph):
        self.used = set(graph.tensors()) | {n.name for n in graph.nodes}

    def __call__(self, base: str) -> str:
        name, k = base, 1
        while name in self.used:
            name, k = f"{base}_{k}", k + 1
        self.used.add(name)
        return name


def weight_scales(w: np.ndarray, axis: int | None) -> np.ndarray:
    """float32 scale(s) for a weight: per channel along `axis`, or one per tensor."""
    a = np.abs(w.astype(np.float32))
    if axis is None:
        return np.asarray(safe_scale(float(a.max()) if a.size else 0.0), dtype=np.float32)
    amax = a.max(axis=tuple(d for d in range(w.ndim) if d != axis)) if w.ndim > 1 else a
    return np.array([safe_scale(float(m)) for m in amax], dtype=np.float32)


def quantize_weight(w: np.ndarray, scale: np.ndarray, axis: int | None) -> np.ndarray:
    """Symmetric int8 with round-half-to-even (as TensorRT's IQuantizeLayer)."""
    s = scale if axis is None else scale.reshape([-1 if d == axis else 1 for d in range(w.ndim)])
    return np.clip(np.rint(w.astype(np.float32) / s), -128, 127).astype(np.int8)


def insert_qdq(graph: gs.Graph, plan: Plan, amax: dict[str, float], weights: str = "int8") -> InsertResult:
    """Add one Q->DQ per activation site (shared by all its quantized consumers) and an INT8
    weight + DQ (or float weight + Q->DQ with weights="qdq") per weight site. `amax` maps each
    activation tensor to its calibrated range. Modifies `graph`."""
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {WEIGHT_FORMATS}")
    view = GraphView(graph)
    nodes = {n.name: n for n in graph.nodes}
    names = _Names(graph)
    result = InsertResult()
    for site in sorted(plan.sites.values(), key=lambda s: s.tensor):
        t = view.tensors[site.tensor]
        base = site.tensor
        if site.kind == "activation":
            a = amax.get(site.group or site.tensor, amax.get(site.tensor))
            if a is None:
                raise KeyError(f"no calibrated range for tensor {site.tensor!r}")
            if not (np.isfinite(a) and a > 2.0 ** -24):
                result.zero_range.append(site.tensor)
            scale = np.array(safe_scale(a), dtype=np.float32)
            zp = np.array(0, dtype=np.int8)
            src, axis = t, None
            q_rule = dq_rule = site.rule
        else:
            w = view.constant_value(t)
            axis = site.axis
            scale = weight_scales(w, axis)
            zp = np.zeros(scale.shape, dtype=np.int8)
            if weights == "int8":
                src = gs.Constant(names(f"{base}_int8"), quantize_weight(w, scale, axis))
            else:
                src = t
            q_rule = dq_rule = site.rule
        s_const = gs.Constant(names(f"{base}_scale"), scale)
        z_const = gs.Constant(names(f"{base}_zero_point"), zp)
        attrs = {"axis": int(axis)} if axis is not None else {}
        if site.kind == "activation" or weights == "qdq":
            q_out = gs.Variable(names(f"{base}_quantized"), dtype=np.int8, shape=t.shape if not isinstance(t, gs.Constant) else list(t.values.shape))
            q = gs.Node(QUANTIZE, name=names(f"{base}_q"), inputs=[src, s_const, z_const], outputs=[q_out], attrs=dict(attrs))
            graph.nodes.append(q)
            result.provenance[q.name] = q_rule
            dq_in = q_out
        else:
            dq_in = src
        dtype = t.values.dtype if isinstance(t, gs.Constant) else view.dtype(t)
        shape = list(t.values.shape) if isinstance(t, gs.Constant) else t.shape
        dq_out = gs.Variable(names(f"{base}_dequantized"), dtype=dtype, shape=shape)
        dq = gs.Node(DEQUANTIZE, name=names(f"{base}_dq"), inputs=[dq_in, s_const, z_const], outputs=[dq_out], attrs=dict(attrs))
        graph.nodes.append(dq)
        result.provenance[dq.name] = dq_rule
        for node_name, index in site.edges:
            nodes[node_name].inputs[index] = dq_out
        if site.kind == "activation":
            result.activations += 1
        else:
            result.weights += 1
    graph.cleanup(remove_unused_graph_inputs=False).toposort()
    return result
