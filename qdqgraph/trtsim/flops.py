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
    vocab = g.vocab
    if not vocab.is_(node, "weighted"):
        return 0.0

    def shape(t):
        st = g.tensors.get(t) if t else None
        if st is None:
            return None
        if st.value is not None:
            return list(st.value.shape)
        return _dims(st.shape)

    out = shape(node.outputs[0])
    w = shape(node.inputs[1]) if len(node.inputs) > 1 else None
    a = shape(node.inputs[0])
    if vocab.is_(node, "conv"):
        if w is None or len(w) < 3:
            return 0.0
        if vocab.is_(node, "conv_transpose"):
            return 2.0 * math.prod(a) * math.prod(w[1:]) if a else 0.0
        return 2.0 * math.prod(out) * math.prod(w[1:]) if out else 0.0
    w2 = w if w is not None and len(w) >= 2 else None     # a weight shape of two dimensions or more
    if vocab.is_(node, "gemm"):
        ta, tb = node.attrs.get("transA", 0), node.attrs.get("transB", 0)
        k = (w2[1] if tb else w2[0]) if w2 is not None else (a[0] if ta else a[-1]) if a else None
        n = (w2[0] if tb else w2[1]) if w2 is not None else None
        m = (a[1] if ta else a[0]) if a else 1
    else:                                  # MatMul: [..., M, K] x [..., K, N]
        k = w2[-2] if w2 is not None else a[-1] if a else None
        n = w2[-1] if w2 is not None else None
        m = math.prod(a[:-1]) if a else 1
    outputs = math.prod(out) if out else m * n if n else None
    return 2.0 * outputs * k if outputs and k else 0.0
