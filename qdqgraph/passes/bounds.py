"""Bounds on max |x| of a graph's float tensors that hold for every input: interval arithmetic from
the values the graph fixes (constants, DequantizeLinear outputs, bounded activations) forward.

`measure_ranges` (passes.precision) asks which float tensors of a Q/DQ graph could reach
RANGE_LIMIT (rule H5). A tensor whose bound is below it never does, whatever the samples, so it
need not be run: in a quantized CNN every tensor between a DequantizeLinear and the next
QuantizeLinear is bounded by the dequantized input range and the weights' L1 norms, and a
ReLU6 or a Sigmoid resets the bound. A tensor the rules here do not cover (a graph input, an op
not listed, a shape that is not static) is unbounded (inf), so a bound is never smaller than the
truth: the tensor is then measured.

The bounds are computed in float64 and widened by float32's rounding at every op (a dot product
of K terms by K x 2^-23 of itself), so that onnxruntime's float32 arithmetic cannot exceed them.
"""
from __future__ import annotations

import math

import numpy as np
import onnx_graphsurgeon as gs

from ..calib.histogram import abs_max
from ..graph.view import GraphView
from ..ops import vocabulary

INF = math.inf
_ULP = 2.0 ** -23                         # float32's relative rounding step, with a factor 2 to spare

class Bounds:
    """bound of max |x| per tensor name of `view`'s graph (inf where nothing bounds it)."""

    def __init__(self, view: GraphView):
        self.view = view
        self.vocab = vocabulary()
        self.bound: dict[str, float] = {}
        for node in view.nodes:
            if (node.domain or "") not in ("", "ai.onnx"):
                continue
            b = self._node(node)
            if b is not None and math.isfinite(b):
                several = self.vocab.is_(node, "bound_several_outputs")
                for o in (node.outputs if several else node.outputs[:1]):
                    if o.name:
                        self.bound[o.name] = b * (1.0 + 4 * _ULP)

    def of(self, t: gs.Tensor) -> float:
        """The bound of `t` (a constant's own max |x|)."""
        if not t.name:
            return INF
        if t.name in self.bound:
            return self.bound[t.name]
        value = self.view.constant_value(t)
        if value is not None and np.asarray(value).dtype.kind == "f":
            # max |x| in the constant's own type (abs and max are exact: the float64 figure), in
            # one pass for float32: a float64 copy of MiniLM's 47 MB word embeddings took 0.5 s
            a = np.asarray(value)
            return abs_max(a) if a.dtype == np.float32 else float(np.max(np.abs(a))) if a.size else 0.0
        return INF

    # ------------------------------------------------------------------ per op

    def _node(self, node: gs.Node) -> float | None:
        ins, v = node.inputs, self.vocab
        if not ins:
            return None
        if v.is_(node, "bound_same"):
            return self._same(node)
        if v.is_(node, "bound_unit"):
            return 1.0
        if v.is_(node, "bound_max_of"):
            return max(self.of(t) for t in ins if t.name) if any(t.name for t in ins) else None
        if v.is_(node, "bound_sum_of"):
            return sum(self.of(t) for t in ins if t.name)
        if v.is_(node, "dequantize"):
            return self._dequantize(node)
        if v.is_(node, "weighted"):
            return self._linear(node)
        return self._elementwise(node)

    def _same(self, node: gs.Node) -> float:
        b = self.of(node.inputs[0])
        if self.vocab.is_(node, "resize") and node.attrs.get("mode", "nearest") not in ("nearest", "linear"):
            return INF                    # cubic interpolation overshoots its inputs
        if self.vocab.is_(node, "pad") and len(node.inputs) > 2 and node.inputs[2].name:
            return max(b, self.of(node.inputs[2]))
        # a value the op writes itself: Pad's before opset 11, Resize's outside a crop
        for written in ("value", "extrapolation_value"):
            if written in node.attrs and (self.vocab.is_(node, "pad") or self.vocab.is_(node, "resize")):
                b = max(b, abs(float(node.attrs[written])))
        return b

    def _elementwise(self, node: gs.Node) -> float:
        ins, v = node.inputs, self.vocab
        if v.is_(node, "mul"):
            return math.prod(self.of(t) for t in ins) if all(self.of(t) > 0 for t in ins) else 0.0
        if v.is_(node, "div"):
            d = self.view.constant_value(ins[1])
            if d is None or d.size == 0 or not np.all(np.isfinite(d)) or float(np.min(np.abs(d))) == 0.0:
                return INF
            return self.of(ins[0]) / float(np.min(np.abs(np.asarray(d, np.float64))))
        if v.is_(node, "bound_clip"):
            return self._clip(node)
        if v.is_(node, "bound_slope"):
            return self._leaky(node)
        if v.is_(node, "layer_normalization"):
            return self._layernorm(node)
        if v.is_(node, "cast"):
            return self.of(ins[0]) if self.view.is_float(ins[0]) else INF
        if v.is_(node, "sqrt"):
            return math.sqrt(self.of(ins[0]))
        if v.is_(node, "exp"):
            b = self.of(ins[0])
            return math.exp(b) if b < 80 else INF
        return INF

    def _clip(self, node: gs.Node) -> float:
        b = self.of(node.inputs[0])
        lo = self._scalar(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1].name else None
        hi = self._scalar(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2].name else None
        if lo is None and hi is None and "min" in node.attrs and "max" in node.attrs:     # opset < 11
            lo, hi = float(node.attrs["min"]), float(node.attrs["max"])
        if lo is None or hi is None:
            return b
        return min(b, max(abs(lo), abs(hi)))

    def _leaky(self, node: gs.Node) -> float:
        b = self.of(node.inputs[0])
        if self.vocab.is_(node, "leaky_relu"):
            return b * max(1.0, abs(float(node.attrs.get("alpha", 0.01))))
        if self.vocab.is_(node, "elu"):
            return max(b, abs(float(node.attrs.get("alpha", 1.0))))
        return b * max(1.0, self.of(node.inputs[1]))                  # PRelu: its slope

    def _scalar(self, t: gs.Tensor) -> float | None:
        v = self.view.constant_value(t)
        return float(np.asarray(v).reshape(-1)[0]) if v is not None and np.asarray(v).size == 1 else None

    def _dequantize(self, node: gs.Node) -> float:
        """max |q - zero point| x the largest scale (of any channel)."""
        ins = node.inputs
        scale = self.view.constant_value(ins[1]) if len(ins) > 1 else None
        zp = self.view.constant_value(ins[2]) if len(ins) > 2 and ins[2].name else None
        if scale is None:
            return INF
        scale = np.asarray(scale, np.float64)
        one = scale.size == 1 and (zp is None or zp.size == 1)
        if not (math.isfinite(float(scale.reshape(-1)[0])) if one else np.all(np.isfinite(scale))):
            return INF
        qtype = np.dtype(zp.dtype) if zp is not None else np.dtype(np.uint8)
        if qtype.kind not in "iu":
            return INF                    # float8 and the like: the scale alone does not say
        info = np.iinfo(qtype)
        if one:
            # one scale and one zero point (per-tensor, the common case): the same float64
            # arithmetic on Python floats, without numpy's reductions (10 us a call)
            z0 = 0.0 if zp is None else float(np.asarray(zp).reshape(-1)[0])
            return max(abs(info.max - z0), abs(z0 - info.min)) * abs(float(scale.reshape(-1)[0]))
        z = np.asarray(zp, dtype=np.float64) if zp is not None else np.zeros(1)
        reach = float(np.max(np.maximum(np.abs(info.max - z), np.abs(z - info.min))))
        return reach * float(np.max(np.abs(np.asarray(scale, np.float64))))

    def weight(self, t: gs.Tensor) -> np.ndarray | None:
        """The float64 value of a constant float tensor or of a DequantizeLinear of a constant
        (per-tensor or per-axis; blocked scales are left out), else None."""
        value = self.view.constant_value(t)
        if value is not None:
            return np.asarray(value, np.float64) if np.asarray(value).dtype.kind == "f" else None
        p = self.view.producer(t)
        if p is None or not self.vocab.is_(p, "dequantize") or len(p.inputs) < 2 or "block_size" in p.attrs:
            return None
        q, scale = self.view.constant_value(p.inputs[0]), self.view.constant_value(p.inputs[1])
        zp = self.view.constant_value(p.inputs[2]) if len(p.inputs) > 2 and p.inputs[2].name else None
        if q is None or scale is None or np.asarray(q).dtype.kind not in "iu":
            return None
        q = np.asarray(q, np.float64)
        scale = np.asarray(scale, np.float64)
        z = np.zeros(1) if zp is None else np.asarray(zp, np.float64)
        if scale.size > 1:
            axis = int(p.attrs.get("axis", 1)) % q.ndim
            shape = [1] * q.ndim
            shape[axis] = scale.size
            scale, z = scale.reshape(shape), (z.reshape(shape) if z.size > 1 else z)
        return (q - z) * scale

    def _linear(self, node: gs.Node) -> float:
        """Conv, ConvTranspose, MatMul, Gemm: the largest L1 norm of the weights one output sums,
        times the input's bound, plus the largest bias (or: terms x both bounds, for two activations)."""
        ins = node.inputs
        x, w = self.of(ins[0]), self.weight(ins[1]) if len(ins) > 1 else None
        if self.vocab.is_(node, "conv"):
            if w is None or w.ndim < 2:
                return INF
            out_axis = 1 if self.vocab.is_(node, "conv_transpose") else 0
            axes = tuple(k for k in range(w.ndim) if k != out_axis)
            l1, terms = np.sum(np.abs(w), axis=axes), w.size // max(1, w.shape[out_axis])
        elif self.vocab.is_(node, "matmul"):
            return self._matmul(node, x, w)
        else:
            if w is None or w.ndim != 2 or int(node.attrs.get("transA", 0)):
                return INF
            l1 = np.sum(np.abs(w), axis=1 if int(node.attrs.get("transB", 0)) else 0)
            terms = w.shape[1 if int(node.attrs.get("transB", 0)) else 0]
            l1 = l1 * abs(float(node.attrs.get("alpha", 1.0)))
        bias = self.of(ins[2]) if len(ins) > 2 and ins[2].name else 0.0
        if self.vocab.is_(node, "gemm"):
            bias *= abs(float(node.attrs.get("beta", 1.0)))
        return (float(np.max(l1)) * x if l1.size else 0.0) * (1.0 + terms * _ULP) + bias

    def _matmul(self, node: gs.Node, x: float, w: np.ndarray | None) -> float:
        a = self.weight(node.inputs[0])
        p = self.view.producer(node.inputs[0])
        if p is not None and self.vocab.is_(p, "softmax_only"):     # rows of weights >= 0 summing to at most 1: a convex mix
            return self.of(node.inputs[1]) * (1.0 + 2.0 ** -8)        # float32 sums of up to 2^15 terms
        if w is not None and w.ndim >= 2:            # x @ W: column sums of |W|
            return float(np.max(np.sum(np.abs(w), axis=-2))) * x * (1.0 + w.shape[-2] * _ULP)
        if a is not None and a.ndim >= 2:            # A @ x: row sums of |A|
            return float(np.max(np.sum(np.abs(a), axis=-1))) * self.of(node.inputs[1]) * (1.0 + a.shape[-1] * _ULP)
        shape = node.inputs[0].shape
        k = shape[-1] if shape else None
        if not isinstance(k, int) or k <= 0:
            return INF
        return k * x * self.of(node.inputs[1]) * (1.0 + k * _ULP)

    def _layernorm(self, node: gs.Node) -> float:
        """|x - mean| / std <= sqrt(N - 1) over the N normalized values; times the largest scale,
        plus the largest bias."""
        shape = node.inputs[0].shape
        axis = int(node.attrs.get("axis", -1))
        if not shape or not all(isinstance(d, int) and d > 0 for d in shape[axis:]):
            return INF
        n = math.prod(shape[axis:])
        scale = self.of(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1].name else 1.0
        bias = self.of(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2].name else 0.0
        return math.sqrt(max(n - 1, 1)) * scale + bias


def below(view: GraphView, limit: float) -> set[str]:
    """The float tensors of `view`'s graph that can never reach `limit` in magnitude."""
    b = Bounds(view)
    return {name for name, v in b.bound.items() if v < limit}
