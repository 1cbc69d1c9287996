"""Lint a Q/DQ graph for placements that TensorRT rejects or that cost fusion (codes QDQ2xx).

| code   | finding                                                      | rule       |
|--------|--------------------------------------------------------------|------------|
| QDQ201 | Q/DQ between a weighted op and its BN or activation           | P4, F8     |
| QDQ202 | both inputs of a residual Add quantized                       | P6, F8     |
| QDQ203 | unequal scales in a Concat group (inputs and output)          | P8, R6     |
| QDQ204 | Qs on one tensor with unequal scales (they must merge)        | R5-c, R7   |
| QDQ205 | a quantized bias                                              | P3         |
| QDQ206 | per-channel Q/DQ without an explicit axis                     | C3         |
| QDQ207 | non-zero zero point                                           | C2         |
| QDQ208 | non-positive or non-finite scale                              | C3         |
| QDQ209 | a small INT8 region entered or left through a reformat        | P14, F6    |
| QDQ210 | an attention block quantized in part (no fused INT8 attention) | P15, F10   |
| QDQ211 | a quantized attention mask                                     | P15        |
| QDQ212 | FP8 attention whose head size TensorRT's FP8 attention cannot take | C9      |
| QDQ213 | a scale that is not float32, float16 or bfloat16               | C3         |
| QDQ214 | INT4: a block size that does not divide its axis, an INT4 activation, or INT4 weights outside a GEMM | C5, C10 |
| QDQ215 | operator-style quantization (QLinearConv, QLinearMatMul, ConvInteger, ...): TensorRT rejects the model | C1 |
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..ops import vocabulary
from ..precisions.formats import FOUR_BIT_TYPES, FP8
from .conditions import attention_block
from .ir import DQ, OP, Q, SimGraph, SNode
from .regions import costly_regions
from .report import SimReport
from .rules import load_sim_rules
from .simulate import as_graph, read, simulate, simulate_graph


@dataclass(frozen=True)
class Diagnostic:
    code: str
    node: str
    message: str
    fix: str

    def __str__(self):
        return f"{self.code} {self.node}: {self.message} (fix: {self.fix})"


def _qdq_source(g: SimGraph, tensor: str):
    """(Q, DQ) if `tensor` is DQ(Q(x)) or (None, DQ) for DQ(int8), else None."""
    dq = g.producer(tensor)
    if dq is None or dq.role != DQ:
        return None
    q = g.producer(dq.inputs[0])
    return (q if q is not None and q.role == Q else None), dq


def _const_qdq(g: SimGraph, tensor: str) -> bool:
    """Is `tensor` DQ(constant) or DQ(Q(constant))?"""
    src = _qdq_source(g, tensor)
    if src is None:
        return False
    q, dq = src
    return g.is_const(dq.inputs[0]) or (q is not None and g.is_const(q.inputs[0]))


def _conv_pattern(g: SimGraph, tensor: str, limit: int = 4) -> SNode | None:
    """The weighted op at the head of Conv[->bias Add][->BN][->Act] ending in `tensor`, each tensor used once."""
    for _ in range(limit):
        if len(g.consumers(tensor)) != 1:
            return None
        p = g.producer(tensor)
        if p is None or p.role != OP:
            return None
        if g.vocab.is_(p, "weighted"):
            return p
        bias = g.vocab.is_(p, "add") and len(g.data_inputs(p)) == 1       # Add of a constant: the bias
        if not (g.vocab.is_(p, "batchnorm") or g.vocab.is_(p, "epilogue") or bias) or not g.data_inputs(p):
            return None
        tensor = g.data_inputs(p)[0]
    return None


SCALE_TYPES = ("float32", "float16", "bfloat16")
FP8_HEAD_SIZES = (9, 256, 16)      # FP8 attention: 8 < head size <= 256, a multiple of 16 (TRT_RULES C9)


def _zero_point_type(n: SNode) -> np.dtype:
    zp = n.qp.zero_point if n.qp is not None else None
    return np.dtype(zp.dtype) if zp is not None else np.dtype(np.int8)


def _int4_check(g: SimGraph, n: SNode) -> list[Diagnostic]:
    """QDQ214: INT4 is weight-only block quantization for GEMMs (C5, C10)."""
    if _zero_point_type(n) not in FOUR_BIT_TYPES:
        return []
    if n.role == Q:
        return [Diagnostic("QDQ214", n.name, "an INT4 QuantizeLinear: TensorRT's INT4 is for weights only",
                           "quantize activations to INT8 or FP8, or leave them float (C5)")]
    out = []
    block = n.attrs.get("block_size")
    shape = g.tensors[n.inputs[0]].shape if n.inputs[0] in g.tensors else None
    axis = n.attrs.get("axis", 1)
    if block and shape and isinstance(shape[axis % len(shape)], (int, np.integer)) and shape[axis % len(shape)] % block:
        out.append(Diagnostic("QDQ214", n.name, f"block size {block} does not divide axis {axis} of size "
                              f"{shape[axis % len(shape)]}", "choose a block size that divides the reduction axis (C10)"))
    readers = [c for c, _ in g.consumers(n.outputs[0])]
    if any(not (g.vocab.is_(c, "matmul") or g.vocab.is_(c, "gemm")) for c in readers):
        out.append(Diagnostic("QDQ214", n.name, "INT4 weights read by an op other than MatMul/Gemm",
                              "keep INT4 for GEMM weights; use INT8 or FP8 elsewhere (C5)"))
    return out


_DTYPE_NAMES: dict = {}     # dtype -> its name: numpy computes `dtype.name` in Python, 7 us a call


def _dtype_name(dtype: np.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = dtype.name
    return name


def _bad_scales(scale: np.ndarray) -> np.ndarray | None:
    """Where `scale` is non-positive or non-finite; None when it is nowhere (a one-value float
    scale, the common case, is read as a Python float)."""
    if scale.size == 1 and scale.dtype.kind == "f":
        v = float(scale.reshape(-1)[0])
        if math.isfinite(v) and v > 0:
            return None
    bad = ~np.isfinite(scale.astype(np.float64)) | (scale <= 0)
    return bad if bad.any() else None


def _nonzero(zero_point: np.ndarray) -> bool:
    """Does the zero point hold a value other than 0?"""
    if zero_point.size == 1 and zero_point.dtype.kind in "iu":
        return int(zero_point.reshape(-1)[0]) != 0
    return bool(np.any(zero_point.astype(np.float32) != 0))


def _scale_check(n: SNode) -> list[Diagnostic]:
    out = []
    qp = n.params
    if qp.scale is not None:
        bad = _bad_scales(qp.scale)
        if bad is not None:
            out.append(Diagnostic("QDQ208", n.name, f"scale has {int(bad.sum())} non-positive or non-finite "
                                  f"value(s) (e.g. {qp.scale.reshape(-1)[bad.reshape(-1)][0]})",
                                  "scales must be finite and > 0; use 1.0 for an all-zero tensor (C3)"))
        if qp.scale.size > 1 and "axis" not in n.attrs:
            out.append(Diagnostic("QDQ206", n.name, f"per-channel scale ({qp.scale.size} values) without `axis`: "
                                  "TensorRT's parser assumes axis 0, ONNX assumes 1",
                                  "write axis explicitly (C3)"))
    if qp.scale is not None and _dtype_name(qp.scale.dtype) not in SCALE_TYPES:
        out.append(Diagnostic("QDQ213", n.name, f"scale of type {qp.scale.dtype.name}",
                              "write the scale as float32 (or float16/bfloat16 in an FP16/BF16 network) (C3)"))
    if qp.zero_point is not None and _nonzero(qp.zero_point):
        out.append(Diagnostic("QDQ207", n.name, "non-zero zero point: TensorRT only supports symmetric quantization",
                              "use zero point 0 (int8) or omit it (C2)"))
    return out


def region_diagnostics(report: SimReport, region) -> list[Diagnostic]:
    """QDQ209: INT8 regions that hold at most `region.max_flops_share` of the FLOPs (the P14 rule,
    rules/placement.toml [[region]]) and cost standalone reformats inside the network."""
    if region is None or region.max_flops_share <= 0:
        return []
    vocab = vocabulary()
    out = []
    rule = region
    for r in costly_regions(report, rule.max_flops_share):
        weighted = [n for x in r.layers for n, op in zip(x.nodes, x.ops) if vocab.is_(op, "weighted")]
        weighted = weighted or r.layers[0].nodes[:1]
        borders = [x.name for x in r.inner_reformats]
        out.append(Diagnostic("QDQ209", borders[0], f"the INT8 region of {', '.join(weighted)} holds "
                              f"{100 * r.flops_share:.2f}% of the FLOPs but costs {len(borders)} standalone "
                              f"reformat(s) inside the network ({', '.join(borders)})",
                              f"run it in float: remove its Q/DQ ({rule.id}; qdqgraph insert does this)"))
    return out


def lint(model, report: SimReport | None = None, region=None) -> list[Diagnostic]:
    """Diagnostics for a Q/DQ graph (gs.Graph, Loaded, ModelProto or path), in node order; with
    `region` (the P14 rule: `qdqgraph.load_ruleset().region`), then QDQ209 from the simulation
    (`report`, or simulated here)."""
    graph = as_graph(model)
    found = _graph_diagnostics(graph)
    if region is not None:
        found += region_diagnostics(report or simulate(graph), region)
    return found


def simulate_and_lint(model, region=None, target: str = "tensorrt",
                      dims: dict[str, int] | None = None) -> tuple[SimReport, list[Diagnostic]]:
    """`simulate(model, target=target, dims=dims)` and `lint(model, that report, region)`, the graph
    read into the simulator once: its findings are read before the simulation rewrites it."""
    g = read(model, dims)
    found = _diagnostics_of(g)
    report = simulate_graph(g, load_sim_rules(target=target))
    if region is not None:
        found += region_diagnostics(report, region)
    return report, found


def _graph_diagnostics(graph) -> list[Diagnostic]:
    """The QDQ2xx findings read from the graph alone (all but QDQ209), node by node in graph order."""
    return _diagnostics_of(SimGraph.from_gs(graph))


def _diagnostics_of(g: SimGraph) -> list[Diagnostic]:
    """`_graph_diagnostics` of the graph read into the simulator (read, not changed)."""
    out: list[Diagnostic] = []
    for n in g.order():
        out += [d for check in _checks_for(g, n) for d in check(g, n)]
    return out


def _checks_for(g: SimGraph, n: SNode) -> tuple:
    """The checks that apply to `n`, in the order their findings are reported."""
    if n.role == Q:
        return _QDQ_CHECKS + _Q_CHECKS
    if n.role == DQ:
        return _QDQ_CHECKS
    if n.role != OP:
        return ()
    return (_operator_quantization,) if g.vocab.is_(n, "operator_quant") else _OP_CHECKS


def _scale_diagnostics(g: SimGraph, n: SNode) -> list[Diagnostic]:
    """QDQ206/207/208/213: the scale and zero point of a Q or DQ (C2, C3)."""
    return _scale_check(n)


def _unmerged_qs(g: SimGraph, n: SNode) -> list[Diagnostic]:
    """QDQ204: Qs on one tensor with unequal scales, reported at the first of them (R5-c, R7)."""
    qs = [c for c, i in g.consumers(n.inputs[0]) if c.role == Q and i == 0]
    if not (qs and qs[0] is n and len({q.params.key() for q in qs}) > 1):
        return []
    return [Diagnostic("QDQ204", n.name, f"Qs {', '.join(q.name for q in qs)} on tensor {n.inputs[0]} "
                       "have different scales: they cannot merge, so none propagates (R5-c)",
                       "quantize each tensor once (P5) or give the Qs one scale (R7)")]


def _qdq_inside_conv_fusion(g: SimGraph, n: SNode) -> list[Diagnostic]:
    """QDQ201: a Q/DQ between a weighted op (or BN) and the BN or activation it would fuse with (P4, F8)."""
    v = g.vocab
    p = g.producer(n.inputs[0])
    if p is None or p.role != OP or not (v.is_(p, "weighted") or v.is_(p, "batchnorm")):
        return []
    dq_users = [c for dq, _ in g.consumers(n.outputs[0]) if dq.role == DQ
                for c, _ in g.consumers(dq.outputs[0])]
    inner = [c for c in dq_users if c.role == OP and (v.is_(c, "batchnorm") or v.is_(c, "epilogue"))]
    if not inner:
        return []
    return [Diagnostic("QDQ201", n.name, f"Q/DQ between {p.name} ({p.op}) and {inner[0].name} "
                       f"({inner[0].op}) stops TensorRT folding/fusing them into one kernel",
                       "remove it and quantize after the activation (P4)")]


def _operator_quantization(g: SimGraph, n: SNode) -> list[Diagnostic]:
    """QDQ215: an operator-style quantized op (QLinearConv, ConvInteger, ...), which the parser rejects (C1)."""
    return [Diagnostic("QDQ215", n.name, f"{n.op} is operator-style quantization, which TensorRT's ONNX "
                       "parser rejects (C1): no engine can be built from this model",
                       "export the model in QDQ format (onnxruntime: quant_format=QuantFormat.QDQ), or "
                       "quantize its float version with `qdqgraph insert`")]


def _activations(g: SimGraph, n: SNode) -> list[str]:
    """The data inputs of `n` that are not DQ(constant) or DQ(Q(constant))."""
    return [t for t in g.data_inputs(n) if not _const_qdq(g, t)]


def _quantized_conv_branch(g: SimGraph, n: SNode) -> list[Diagnostic]:
    """QDQ202: a residual Add with both inputs quantized, one of them a conv branch (P6, F8)."""
    if not g.vocab.is_(n, "add"):
        return []
    acts = _activations(g, n)
    if len(acts) != 2:
        return []
    srcs = [_qdq_source(g, t) for t in acts]
    if not all(s is not None for s in srcs):
        return []
    conv_side = [s for s in srcs if s[0] is not None and _conv_pattern(g, s[0].inputs[0]) is not None]
    if not conv_side:
        return []
    q = conv_side[0][0]
    return [Diagnostic("QDQ202", n.name, f"both inputs of the residual Add are quantized; the Q/DQ "
                       f"on the conv branch ({q.name}) blocks the Conv + Add fusion",
                       f"remove {q.name} and its DQ: quantize the skip input only (P6)")]


def _unequal_concat_scales(g: SimGraph, n: SNode) -> list[Diagnostic]:
    """QDQ203: a Concat whose quantized inputs and output do not share one scale (P8, R6)."""
    if not g.vocab.is_(n, "concat"):
        return []
    params = {}
    for t in g.data_inputs(n):
        s = _qdq_source(g, t)
        if s is not None:
            params[s[1].name] = s[1].qp
    params.update({c.name: c.qp for c, _ in g.consumers(n.outputs[0]) if c.role == Q})
    if len({p.key() for p in params.values()}) <= 1:
        return []
    return [Diagnostic("QDQ203", n.name, f"the Concat group ({', '.join(sorted(params))}) has unequal "
                       "scales: TensorRT adds requantizes instead of one shared buffer (R6)",
                       "calibrate the inputs and output as one group and share one scale (P8)")]


def _quantized_bias_input(g: SimGraph, n: SNode) -> list[Diagnostic]:
    """QDQ205: the bias input (input 2) of a weighted op read through a DQ (P3)."""
    if not (g.vocab.is_(n, "weighted") and len(n.inputs) > 2 and n.inputs[2]):
        return []
    s = _qdq_source(g, n.inputs[2])
    if s is None:
        return []
    return [Diagnostic("QDQ205", s[1].name, f"the bias of {n.name} is quantized",
                       "keep the bias float: TensorRT quantizes it to INT32 itself (P3)")]


def _quantized_bias_add(g: SimGraph, n: SNode) -> list[Diagnostic]:
    """QDQ205: a quantized constant added to a conv pattern's output as its bias (P3)."""
    if not g.vocab.is_(n, "add"):
        return []
    acts = _activations(g, n)
    biases = [t for t in n.inputs if t and _const_qdq(g, t)]
    if not (biases and len(acts) == 1 and _conv_pattern(g, acts[0]) is not None):
        return []
    bias_dq = g.producer(biases[0])
    assert bias_dq is not None      # _const_qdq: biases[0] is the output of a DQ
    return [Diagnostic("QDQ205", bias_dq.name, f"the bias added by {n.name} is quantized",
                       "keep the bias float: TensorRT quantizes it to INT32 itself (P3)")]


def _attention_labels(g: SimGraph, block) -> dict[str, bool]:
    """Whether each attention GEMM input (q, k, probabilities, v) is read through a DQ."""
    labels = {}
    for gemm, names in ((block.bmm1, ("q", "k")), (block.bmm2, ("probabilities", "v"))):
        for t, label in zip(gemm.inputs[:2], names if block.bmm2 is not gemm or block.probs_input == 0
                            else names[::-1]):
            p = g.producer(t) if t else None
            labels[label] = p is not None and p.role == DQ
    return labels


def _partial_attention(n: SNode, block, labels: dict[str, bool], softmax_q: list) -> list[Diagnostic]:
    """QDQ210: an attention block quantized on some GEMM inputs or without the Softmax Q (P15, F10)."""
    done = [k for k, v in labels.items() if v]
    if not (done and (len(done) < 4 or not softmax_q)):
        return []
    missing = [k for k, v in labels.items() if not v] + ([] if softmax_q else ["the Softmax output's Q"])
    return [Diagnostic("QDQ210", n.name, f"the attention block {block.bmm1.name} -> {block.softmax.name} -> "
                       f"{block.bmm2.name} is quantized on {', '.join(done)} but not on {', '.join(missing)}: "
                       "TensorRT's fused INT8 attention needs Q/DQ on all four GEMM inputs, so the GEMMs run "
                       "apart with reformats between them (F10)",
                       "quantize q, k, the probabilities (fixed scale 1/127) and v, or none of them (P15)")]


def _fp8_head_size(g: SimGraph, n: SNode, block, labels: dict[str, bool], softmax_q: list) -> list[Diagnostic]:
    """QDQ212: a fully FP8-quantized attention whose head size FP8 attention cannot take (C9)."""
    done = [k for k, v in labels.items() if v]
    if not (len(done) == 4 and softmax_q and _zero_point_type(softmax_q[0]) == FP8.zero_point):
        return []
    shape = g.tensors[block.bmm1.inputs[0]].shape if block.bmm1.inputs[0] in g.tensors else None
    h = shape[-1] if shape else None
    low, high, step = FP8_HEAD_SIZES
    if not isinstance(h, (int, np.integer)) or (low <= h <= high and h % step == 0):
        return []
    return [Diagnostic("QDQ212", n.name, f"FP8 attention with head size {h}: TensorRT's FP8 attention "
                       f"takes 8 < head size <= 256, a multiple of 16, so the GEMMs run apart",
                       "leave this attention's GEMMs in FP16 (rules/fp8.toml F8-attention-head-size)")]


def _quantized_mask(g: SimGraph, block) -> list[Diagnostic]:
    """QDQ211: a mask or bias added to the attention scores read through a DQ from outside the block (P15)."""
    out = []
    members = {id(x) for x in block.nodes}
    for x in block.nodes:
        if x.role != OP or not g.vocab.is_(x, "add"):
            continue
        for t in g.data_inputs(x):
            p = g.producer(t)
            if p is not None and p.role == DQ and id(p) not in members:
                out.append(Diagnostic("QDQ211", p.name, f"the mask or bias {t} added to the attention scores by "
                                      f"{x.name} is quantized", "keep the mask in float (P15)"))
    return out


def _attention_diagnostics(g: SimGraph, n: SNode) -> list[Diagnostic]:
    """QDQ210/QDQ212/QDQ211 for an attention block whose first GEMM is `n`."""
    block = attention_block(g, n)
    if block is None:
        return []
    labels = _attention_labels(g, block)
    softmax_q = [c for c, _ in g.consumers(block.softmax.outputs[0]) if c.role == Q]
    return (_partial_attention(n, block, labels, softmax_q) + _fp8_head_size(g, n, block, labels, softmax_q)
            + _quantized_mask(g, block))


_QDQ_CHECKS = (_scale_diagnostics, _int4_check)          # every Q and DQ
_Q_CHECKS = (_unmerged_qs, _qdq_inside_conv_fusion)      # Qs only
_OP_CHECKS = (_attention_diagnostics, _quantized_conv_branch, _unequal_concat_scales,
              _quantized_bias_input, _quantized_bias_add)
