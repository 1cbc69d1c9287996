"""Weights dequantized once for onnxruntime's CPU provider, not on every run.

onnxruntime keeps a DequantizeLinear of a constant weight in the graph (its constant folding leaves
Q/DQ alone, so that its fusions can find them) and, where no fusion takes the weight, computes it
again on every run: a written model's FP16 islands take their INT8 weights that way, as does every
Q/DQ graph run without optimizations. MiniLM-L6's written model spent 61 % of a run dequantizing its
36 weights (24 samples: 0.92 of 1.50 s). `fold` computes those nodes once, as onnxruntime does:
(q - zero point) * scale in float32, then rounded once to the scale's type. With an 8-bit weight and
an FP16 scale that product is exact; with a float32 scale it is the one IEEE rounding onnxruntime's
kernel makes. The session must then not prepack the folded weights (a prepacked GEMM adds in another
order than one over a computed weight): `fold`'s caller turns prepacking off, so nothing is folded
where a prepacking kernel reads another constant (a float-island MatMul's FP16 weight), and the
outputs are bit-identical to the model's as written (tests/test_ort_versions.py, on each onnxruntime
the package declares; the zoo's, torchvision's, MiniLM's and Whisper's written models).
"""
from __future__ import annotations

import numpy as np

from ..graph import io, proto
from ..ops import DEQUANTIZE, vocabulary

# Where onnxruntime optimizes the graph, a constant weight changes more than the dequantization:
# - a float32 weight DequantizeLinear it may fuse with its consumer into an integer kernel (DQ ->
#   MatMul -> MatMulIntegerToFloat, DQ -> Conv -> Q -> QLinearConv, its level-2 fusions): folding
#   would swap that integer arithmetic for a float GEMM. An FP16 one it never fuses on the CPU
#   provider (it runs the dequantization, then a Cast).
# - a convolution over a constant weight it runs in its blocked layout (NCHWc) or fuses with a
#   following Add or Mul, adding in another order than over a computed weight: ResNet-18's written
#   model came out different in the last bits (and twice as fast); over a computed one, as before.
# So there only weights that MatMul and Gemm nodes alone read are folded (MiniLM's and Whisper's
# written models compute bit-identical outputs); without optimizations (the widened sessions of
# large graphs, io.widen_fp16) every weight is.
_PLAIN_READERS = ("matmul", "gemm")
_INT8 = (np.dtype(np.int8), np.dtype(np.uint8))
_F16, _F32 = np.dtype(np.float16), np.dtype(np.float32)

# A weight smaller than this is left: dequantizing it costs a run less than folding it costs the
# session (a 10,000-node CNN's 4,000 weights of 2.3 KB: 0.9 s more to open, 0.1 s less for 8 runs).
FOLD_MIN_BYTES = 4096

# The folded weights are new arrays (FP16 twice their INT8 size, float32 four times), and a session
# that copies its weights holds them twice: folding stops where the session's weights would pass
# this many bytes. A large model's memory is kept (the 453 MB encoder, 121 MB written, peaked at
# 884 MB as before instead of 996 MB folding 64 MB of its weights); MiniLM-L6's written model (35
# MB, 21 MB of FP16 weights folded) and smaller ones are dequantized once.
FOLD_SESSION_MAX_BYTES = 64 << 20


def fold(model: proto.ModelProto, weights: dict[str, np.ndarray], float32: bool, optimized: bool = True,
         max_bytes: int | None = None) -> tuple[proto.ModelProto, dict[str, np.ndarray], int]:
    """(model, weights, folded): the DequantizeLinear nodes of `model`'s main graph whose inputs are
    constant 8-bit weights, per-tensor or per-axis, replaced by their float output as an
    initializer, in graph order while the new arrays stay within `max_bytes` (default: what
    keeps the session's weights under FOLD_SESSION_MAX_BYTES). `optimized`: the session optimizes
    the graph, and only weights MatMul and Gemm nodes alone read are folded (see above). `weights` holds the
    data of `model`'s stub initializers (io.split_weights); `float32`: float32 outputs are folded too
    (where the session fuses nothing, see above), else only FP16 ones. `model` and `weights` are
    not changed: where anything is folded, a new model (the stubs' data not copied) and dict come back."""
    g = model.graph
    if max_bytes is None:
        max_bytes = FOLD_SESSION_MAX_BYTES - sum(a.nbytes for a in weights.values())
    if max_bytes <= 0:
        return model, weights, 0
    outputs = {o.name for o in g.output}
    dqs = [(k, node) for k, node in enumerate(g.node) if node.op_type == DEQUANTIZE
           and node.domain in ("", "ai.onnx") and node.output[0] not in outputs]
    if not dqs:                     # a float model's session (calibration): nothing more to look at
        return model, weights, 0
    inits = {t.name: t for t in g.initializer}
    plain = _plain_reads(g) if optimized else None
    found, spent = [], 0
    for k, node in dqs:
        if plain is not None and node.output[0] not in plain:
            continue
        value = _dequantized(node, inits, weights, float32)
        if value is None or spent + value.nbytes > max_bytes:
            continue
        spent += value.nbytes
        found.append((k, value))
    if not found or _prepacks_another(g, {g.node[k].output[0] for k, _ in found}):
        return model, weights, 0
    folded = proto.copy_model(model)       # the stubs are copied, not the arrays behind them
    out = dict(weights)
    done = {k for k, _ in found}
    nodes = [n for k, n in enumerate(folded.graph.node) if k not in done]
    del folded.graph.node[:]
    folded.graph.node.extend(nodes)
    for k, value in found:
        name = model.graph.node[k].output[0]
        if value.nbytes >= io.IN_MEMORY_MIN_BYTES:
            out[name] = value
            folded.graph.initializer.append(io.stub(name, value))
        else:
            folded.graph.initializer.append(proto.tensor(value, name))
    _drop_unused(folded, out)
    return folded, out, len(found)


def _prepacks_another(g, folded: set[str]) -> bool:
    """Whether a node of class `prepacked` in graph `g` reads a constant that is not among the
    `folded` weights (an initializer, or what only constants compute: a Cast of an FP16 weight).
    Folding turns the session's prepacking off, and such a node's sums would move: magika's
    float-island MatMul over its FP16 weight did, by 2.4e-4 (see module doc)."""
    vocab = vocabulary()
    const = {t.name for t in g.initializer}
    for node in g.node:
        ins = [n for n in node.input if n]
        if vocab.is_(node.op_type, "prepacked") and any(n in const and n not in folded for n in ins[1:]):
            return True
        if node.op_type != DEQUANTIZE and ins and all(n in const for n in ins):
            const.update(node.output)
    for sub in io.subgraphs(g):           # a body's own constants, and the outer ones it reads
        inner = const | {t.name for t in sub.initializer}
        if any(vocab.is_(node.op_type, "prepacked") and any(n in inner for n in list(node.input)[1:] if n)
               for node in sub.node):
            return True
    return False


def _plain_reads(g) -> set[str]:
    """The tensors of graph `g` that only MatMul and Gemm nodes read (see _PLAIN_READERS)."""
    vocab = vocabulary()
    plain: set[str] = set()
    other: set[str] = set()
    for node in g.node:
        kind = plain if any(vocab.is_(node.op_type, c) for c in _PLAIN_READERS) else other
        kind.update(node.input)
    for sub in io.subgraphs(g):
        other.update(n for node in sub.node for n in node.input)
    return plain - other


def _dequantized(node, inits: dict, weights: dict[str, np.ndarray], float32: bool) -> np.ndarray | None:
    """The output of DequantizeLinear `node` where it is a weight this module folds, else None."""
    found = _operands(node, inits, weights)
    if found is None:
        return None
    q, scale, zero, axis = found
    if q.dtype not in _INT8 or zero.dtype != q.dtype or scale.dtype not in ((_F16, _F32) if float32 else (_F16,)):
        return None
    if scale.size > 1 or scale.ndim == 1:
        axis = axis + q.ndim if axis < 0 else axis
        if scale.ndim != 1 or not 0 <= axis < q.ndim or scale.size != q.shape[axis] or zero.shape != scale.shape:
            return None
        shape = [1] * q.ndim
        shape[axis] = -1
        scale, zero = scale.reshape(shape), zero.reshape(shape)
    exact = (q.astype(np.int32) - zero.astype(np.int32)).astype(np.float32) * scale.astype(np.float32)
    return exact.astype(scale.dtype, copy=False)


def _operands(node, inits: dict, weights: dict[str, np.ndarray]):
    """(weight, scale, zero point, axis) of DequantizeLinear `node` where all are constants this
    process holds and the weight has FOLD_MIN_BYTES, per-tensor or per-axis (not blocked); else None."""
    names = [n for n in node.input if n]
    if len(names) < 2 or any(n not in inits for n in names):
        return None
    q = inits[names[0]]
    if (weights[q.name].nbytes if q.name in weights else io.declared_bytes(q)) < FOLD_MIN_BYTES:
        return None
    attrs = {a.name: proto.attribute_value(a) for a in node.attribute}
    if attrs.get("block_size", 0) or "output_dtype" in attrs:
        return None
    found = [_array(inits[n], weights) for n in names]
    arrays = [a for a in found if a is not None]
    if len(arrays) < len(found):
        return None
    zero = arrays[2] if len(arrays) > 2 else np.zeros((), arrays[0].dtype)
    return arrays[0], arrays[1], zero, int(attrs.get("axis", 1))


def _array(t, weights: dict[str, np.ndarray]) -> np.ndarray | None:
    if t.name in weights:
        return weights[t.name]
    if proto.is_external(t):
        return None                      # data this process does not hold
    return proto.to_array(t)


def _drop_unused(model: proto.ModelProto, weights: dict[str, np.ndarray]) -> None:
    """The initializers only the folded nodes read, dropped from `model` and `weights`."""
    g = model.graph
    # an initializer an older model also lists as a graph input stays: without it the input wants a feed
    used = {n for node in g.node for n in node.input} | {o.name for o in g.output} | {i.name for i in g.input}
    for sub in io.subgraphs(g):           # a body may read an outer weight
        used |= {n for node in sub.node for n in node.input}
    kept = [t for t in g.initializer if t.name in used]
    if len(kept) == len(g.initializer):
        return
    for t in g.initializer:
        if t.name not in used:
            weights.pop(t.name, None)
    del g.initializer[:]
    g.initializer.extend(kept)
