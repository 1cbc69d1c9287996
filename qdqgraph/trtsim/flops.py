"""FLOPs of weighted ops from tensor shapes (multiply-adds count 2); every other op counts 0.
Symbolic dimensions count 1; an unknown shape gives 0."""
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
    if out is None or a is None:
        return 0.0
    if vocab.is_(node, "gemm"):
        k = a[0] if node.attrs.get("transA", 0) else a[-1]
        return 2.0 * math.prod(out) * k
    return 2.0 * math.prod(out) * a[-1]    # MatMul: [..., M, K] x [..., K, N]

