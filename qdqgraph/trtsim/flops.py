"""FLOPs of weighted ops from tensor shapes (multiply-adds count 2); every other op counts 0.
Symbolic dimensions count 1. A Gemm or MatMul takes K and N from its weight (second input) where that
shape is known, so a symbolic activation dimension cannot hide them; unknown rows count 1. A conv
needs its shapes."""
from __future__ import annotations

import math

from .ir import SimGraph, SNode


def _dims(shape) -> list[int] | None:
    if shape is None:
        return None
    return [d if isinstance(d, int) and d > 0 else 1 for d in shape]


def node_flops(g: SimGraph, node: SNode) -> float:
    """FLOPs of `node` by its op class (_FLOPS; a MatMul otherwise); 0 outside class `weighted`."""
    if not g.vocab.is_(node, "weighted"):
        return 0.0
    out = _shape(g, node.outputs[0])
    w = _shape(g, node.inputs[1]) if len(node.inputs) > 1 else None
    a = _shape(g, node.inputs[0])
    flops = next((f for op_class, f in _FLOPS if g.vocab.is_(node, op_class)), _matmul_flops)
    return flops(g, node, out, w, a)


def _shape(g: SimGraph, t: str):
    """The shape of tensor `t` (a constant's exact shape, else _dims of the declared one); None unknown."""
    st = g.tensors.get(t) if t else None
    if st is None:
        return None
    if st.value is not None:
        return list(st.value.shape)
    return _dims(st.shape)


def _conv_flops(g: SimGraph, node: SNode, out, w, a) -> float:
    """Conv: 2 x output elements x weight elements per output channel; ConvTranspose counts per input element."""
    if w is None or len(w) < 3:
        return 0.0
    if g.vocab.is_(node, "conv_transpose"):
        return 2.0 * math.prod(a) * math.prod(w[1:]) if a else 0.0
    return 2.0 * math.prod(out) * math.prod(w[1:]) if out else 0.0


def _gemm_flops(g: SimGraph, node: SNode, out, w, a) -> float:
    """Gemm: 2 x M x N x K, K and N from the weight where its shape is known (transA/transB honoured)."""
    w2 = _matrix(w)
    ta, tb = node.attrs.get("transA", 0), node.attrs.get("transB", 0)
    k = (w2[1] if tb else w2[0]) if w2 is not None else (a[0] if ta else a[-1]) if a else None
    n = (w2[0] if tb else w2[1]) if w2 is not None else None
    m = (a[1] if ta else a[0]) if a else 1
    return _gemm_total(out, m, n, k)


def _matmul_flops(g: SimGraph, node: SNode, out, w, a) -> float:
    """MatMul [..., M, K] x [..., K, N]: 2 x M x N x K, K and N from the weight where its shape is known."""
    w2 = _matrix(w)
    k = w2[-2] if w2 is not None else a[-1] if a else None
    n = w2[-1] if w2 is not None else None
    m = math.prod(a[:-1]) if a else 1
    return _gemm_total(out, m, n, k)


def _matrix(w):
    """A weight shape of two dimensions or more, else None."""
    return w if w is not None and len(w) >= 2 else None


def _gemm_total(out, m, n, k) -> float:
    """2 x outputs x K, the outputs counted from the output shape where known, else M x N; 0 when unknown."""
    outputs = math.prod(out) if out else m * n if n else None
    return 2.0 * outputs * k if outputs and k else 0.0


_FLOPS = (("conv", _conv_flops), ("gemm", _gemm_flops))      # op class -> FLOP function; MatMul otherwise
