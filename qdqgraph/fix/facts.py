"""A Q/DQ model's quantization read as facts, then stripped: which float tensor each consumer read
through which scale, zero point, axis and type.

    facts = read(graph)           # refuses what fix cannot keep (zero/NaN scales, INT4, lone DQs)
    strip(graph, facts)           # the float graph; each fact now names the tensor its consumer reads

A fact is recorded per consumer edge (node, input index) before stripping, so that after
`passes.strip.strip_qdq` bypasses the pair (or turns a weight DQ into a float constant) the edge
names the float tensor the fact belongs to, whatever names the tool gave its Q/DQ tensors.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace

import ml_dtypes
import numpy as np
import onnx_graphsurgeon as gs

from ..graph import io
from ..errors import QdqError
from ..precisions.formats import FP8, INT8, Format
from ..ops import CLIP, DEQUANTIZE
from ..passes.base import PassResult
from ..passes.strip import strip_qdq
from ..graph.view import GraphView

F8 = np.dtype(ml_dtypes.float8_e4m3fn)
INTEGER_TYPES = tuple(np.dtype(t) for t in (np.int8, np.uint8, np.int16, np.uint16))
BIAS_TYPE = np.dtype(np.int32)              # onnxruntime's quantized biases (scale = s_in * s_w)


@dataclass(frozen=True)
class Fact:
    """One DequantizeLinear of the input model (with its QuantizeLinear, if any), as a consumer saw it."""

    dq: str                          # the DQ node
    kind: str                        # "activation" | "weight" (a constant behind the DQ) | "bias" (int32)
    scale: np.ndarray                # as stored (its dtype kept); () for per tensor
    zero_point: np.ndarray           # as stored, zeros of the quantized type where absent
    qtype: np.dtype                  # the quantized type: int8, uint8, int16, uint16, float8e4m3fn, int32
    axis: int | None = None          # per-channel axis (non-negative); None for per tensor
    stored: np.ndarray | None = None # a constant weight's quantized values
    float_weight: bool = False       # a float weight through Q -> DQ (rather than a quantized constant)
    tensor: str = ""                 # the float tensor the consumer reads once stripped

    @property
    def symmetric(self) -> bool:
        return not np.any(self.zero_point.astype(np.float64) != 0)

    def format(self) -> Format | None:
        """The format this fact is already in (INT8 or FP8 with zero point 0), else None."""
        for fmt in (INT8, FP8):
            if self.qtype == fmt.zero_point and self.symmetric:
                return fmt
        return None

    def same_scale(self, other: Fact) -> bool:
        return (self.scale.dtype == other.scale.dtype and self.scale.shape == other.scale.shape
                and bool(np.all(self.scale == other.scale)) and self.qtype == other.qtype
                and self.zero_point.shape == other.zero_point.shape
                and bool(np.all(self.zero_point == other.zero_point)) and self.axis == other.axis)


@dataclass
class Facts:
    """Every fact of a model, by consumer edge, and what reading found."""

    edges: list[tuple[object, int, Fact]] = field(default_factory=list)   # (consumer node or None: graph output, index, fact)
    precision: str = "int8"
    clamps: list[tuple[str, float, float]] = field(default_factory=list)   # (tensor, lo, hi) made Clips
    chained: list[str] = field(default_factory=list)   # DQs read only by another Q (Q -> DQ -> Q -> DQ)
    named: int = 0                   # nodes that got a name (none, or a repeated one)
    qdq_weights: bool = False        # every quantized weight was a float weight through Q -> DQ
    _index: dict | None = field(default=None, repr=False)

    def edges_of(self, tensor: str) -> list[tuple[object, int, Fact]]:
        """The edges whose fact names `tensor` (indexed on first use; `edges` is set whole, never edited)."""
        if self._index is None or self._index[0] is not self.edges:
            index: dict[str, list] = defaultdict(list)
            for e in self.edges:
                index[e[2].tensor].append(e)
            self._index = (self.edges, dict(index))
        return self._index[1].get(tensor, [])

    def by_tensor(self, kind: str | None = None) -> dict[str, list[Fact]]:
        """Stripped tensor -> its distinct facts (one per DQ), in graph order."""
        out: dict[str, list[Fact]] = defaultdict(list)
        for _, _, f in self.edges:
            if (kind is None or f.kind == kind) and all(g.dq != f.dq for g in out[f.tensor]):
                out[f.tensor].append(f)
        return dict(out)

    def counts(self) -> dict:
        kinds = Counter()
        types = Counter()
        for f in {f.dq: f for _, _, f in self.edges}.values():
            kinds[f.kind] += 1
            types[f"{f.kind} {np.dtype(f.qtype).name}{'' if f.symmetric else ' asymmetric'}"] += 1
        return {"activation_dq": kinds["activation"], "weight_dq": kinds["weight"], "bias_dq": kinds["bias"],
                "activation_tensors": len(self.by_tensor("activation")), "types": dict(sorted(types.items())),
                "precision": self.precision, "nodes_named": self.named}


def _constant(view: GraphView, node, index: int, what: str):
    if len(node.inputs) <= index or not node.inputs[index].name:
        return None
    value = view.constant_value(node.inputs[index])
    if value is None:
        raise QdqError(f"{node.op} '{node.name}' has a {what} that is not a constant (TensorRT needs constant "
                       f"scales and zero points, C3)", "export the model with constant Q/DQ parameters")
    return np.asarray(value)


def _check_scale(node, s: np.ndarray) -> None:
    bad = ~np.isfinite(s.astype(np.float64)) | (s.astype(np.float64) <= 0)
    if s.size == 0 or bad.any():
        first = s.reshape(-1)[bad.reshape(-1)][0] if s.size else "nothing"
        raise QdqError(f"{node.op} '{node.name}' has a scale of {first} (every scale must be finite and > 0, "
                       f"TRT_RULES C3): fix keeps a model's scales and cannot keep this one",
                       "re-export or re-calibrate the model, or quantize its float version with `qdqgraph insert`")


def _params(view: GraphView, node) -> tuple[np.ndarray, np.ndarray, np.dtype, int | None]:
    """(scale, zero point, quantized type, axis) of a Q or DQ, checked."""
    if "block_size" in node.attrs:
        raise QdqError(f"{node.op} '{node.name}' is block-quantized (INT4 weights): fix rewrites INT8 and FP8 "
                       f"Q/DQ only", "leave INT4 weight models as they are (qdqgraph report lints them)")
    s = _constant(view, node, 1, "scale")
    if s is None:
        raise QdqError(f"{node.op} '{node.name}' has no scale", "export the model with Q/DQ scales")
    _check_scale(node, s)
    z = _constant(view, node, 2, "zero point")
    if z is None:
        x = node.inputs[0] if node.op == DEQUANTIZE else node.outputs[0]
        qtype = np.dtype(view.dtype(x)) if view.dtype(x) is not None else np.dtype(np.uint8)
        z = np.zeros(s.shape, dtype=qtype)
    qtype = np.dtype(z.dtype)
    if qtype not in INTEGER_TYPES + (F8, BIAS_TYPE):
        raise QdqError(f"{node.op} '{node.name}' quantizes to {qtype.name}: fix rewrites INT8 (and int8/uint8/"
                       f"int16/uint16 zero points, converted) and FP8 E4M3 Q/DQ",
                       "leave this model as it is, or quantize its float version with `qdqgraph insert`")
    axis = None
    if s.size > 1:
        rank = len(view.shape(node.inputs[0]) or ()) or None
        axis = int(node.attrs.get("axis", 1))
        axis = axis % rank if rank else axis
    else:
        s, z = s.reshape(()), z.reshape(())
    return s, z, qtype, axis


def operator_style(view: GraphView) -> list[str]:
    """The op types of operator-style quantization in a graph (QLinearConv, QLinearMatMul, ConvInteger,
    DynamicQuantizeLinear, ...: the `quant` class less QuantizeLinear/DequantizeLinear), sorted."""
    return sorted({n.op for n in view.nodes if view.vocab.is_(n, "quant") and not view.vocab.is_(n, "quantize")
                   and not view.vocab.is_(n, "dequantize")})


def read(graph: gs.Graph) -> Facts:
    """The facts of every DequantizeLinear in `graph` (named first: unnamed nodes get names). A
    QdqError for what fix cannot keep: no Q/DQ at all, operator-style quantization, a scale that is
    0, negative or not finite, INT4, a DQ of a non-constant no Q makes, a Q read by anything but DQs."""
    view = GraphView(graph)
    _check_quantized(view)
    facts = Facts(named=io.name_nodes(graph))
    view = GraphView(graph)
    _check_q_pairs(view)
    for dq in (n for n in view.nodes if view.vocab.is_(n, "dequantize")):
        facts.edges += _edges(view, graph, dq, _read_dq(view, dq), facts)
    facts.precision = _precision(facts)
    weights = [f for _, _, f in facts.edges if f.kind == "weight"]
    facts.qdq_weights = bool(weights) and all(f.float_weight for f in weights)
    return facts


def _check_quantized(view: GraphView) -> None:
    """A QdqError unless the graph is QDQ-quantized: no operator-style quantization, some Q or DQ."""
    other = operator_style(view)
    if other:
        raise QdqError(f"the model holds {', '.join(other)} (operator-style quantization, which TensorRT rejects "
                       f"at import, C1): fix reads QuantizeLinear/DequantizeLinear models",
                       "export it in QDQ format (onnxruntime: quant_format=QuantFormat.QDQ)")
    if not any(view.vocab.is_(n, "dequantize") or view.vocab.is_(n, "quantize") for n in view.nodes):
        raise QdqError("the model holds no QuantizeLinear or DequantizeLinear: there is nothing to fix",
                       "quantize a float model with `qdqgraph insert MODEL --calib DATA`")


def _check_q_pairs(view: GraphView) -> None:
    """A QdqError for the first QuantizeLinear read by anything but DequantizeLinears (or a graph output)."""
    for q in (n for n in view.nodes if view.vocab.is_(n, "quantize")):
        readers = view.consumers(q.outputs[0])
        if view.is_graph_output(q.outputs[0]) or any(not view.vocab.is_(c, "dequantize") for c, _ in readers):
            what = "a graph output" if view.is_graph_output(q.outputs[0]) else \
                next(f"{c.op} '{c.name}'" for c, _ in readers if not view.vocab.is_(c, "dequantize"))
            raise QdqError(f"QuantizeLinear '{q.name}' feeds {what}, not a DequantizeLinear: fix reads Q -> DQ "
                           f"pairs (a model that hands INT8 tensors on cannot be re-placed)",
                           "export the model with a DequantizeLinear after every QuantizeLinear")


def _precision(facts: Facts) -> str:
    """The one precision ("int8" or "fp8") of the non-bias facts, int8 when there are none; a QdqError
    when they mix."""
    kinds = {("fp8" if f.qtype == F8 else "int8") for _, _, f in facts.edges if f.kind != "bias"}
    if len(kinds) > 1:
        raise QdqError("the model holds both INT8 and FP8 Q/DQ: fix rewrites one precision at a time",
                       "quantize its float version with `qdqgraph insert --precision int8` or `fp8`")
    return kinds.pop() if kinds else "int8"


def _edges(view: GraphView, graph: gs.Graph, dq, f: Fact, facts: Facts) -> list[tuple[object, int, Fact]]:
    """The consumer edges of `dq` with its fact. A QuantizeLinear reading it (a Q -> DQ -> Q -> DQ
    chain) is no edge: stripping removes that Q too, and the chain's consumers read through its last
    pair, whose scale is the one they see; such DQs are listed in facts.chained."""
    edges = [(c, i, f) for c, i in view.consumers(dq.outputs[0]) if not view.vocab.is_(c, "quantize")]
    edges += [(None, k, f) for k, o in enumerate(graph.outputs) if o is dq.outputs[0]]
    if len(edges) < len(view.consumers(dq.outputs[0])) + sum(o is dq.outputs[0] for o in graph.outputs):
        facts.chained.append(dq.name)
    return edges


def scale_tolerance(*scales: np.ndarray) -> float:
    """The relative difference under which scales are one range: the rounding of the coarsest scale
    type among them (at least 1e-3). An FP16 or BF16 island holds its own copy of a scale, rounded to
    its type (insert's BF16 output: a Q's scale 0.13379 in BF16, its DQ's 0.13403 in float32, 0.18%
    apart; FP16 rounds at 2^-11, BF16 at 2^-8)."""
    eps = [float(ml_dtypes.finfo(a.dtype).eps) for a in scales if a.dtype.kind in "fV"]
    return max([1e-3, *eps])


def _read_dq(view: GraphView, dq) -> Fact:
    s, z, qtype, axis = _params(view, dq)
    x = dq.inputs[0]
    q = view.producer(x)
    if q is not None and view.vocab.is_(q, "quantize"):
        qs, qz, qqtype, qaxis = _params(view, q)
        if qqtype != qtype or qs.shape != s.shape or qaxis != axis or np.any(qz != z) or \
                not np.allclose(qs.astype(np.float64), s.astype(np.float64), rtol=scale_tolerance(qs, s), atol=0):
            raise QdqError(f"QuantizeLinear '{q.name}' and DequantizeLinear '{dq.name}' have different scales or "
                           f"zero points: the pair is not a quantization fix can keep",
                           "export the model with one scale per Q -> DQ pair")
        weight = view.constant_value(q.inputs[0]) is not None
        kind = "weight" if weight else "activation"
        if kind == "activation" and qtype == BIAS_TYPE:
            raise QdqError(f"QuantizeLinear '{q.name}' quantizes an activation to int32", "quantize activations to int8")
        return Fact(dq.name, kind, s, z, qtype, axis, float_weight=weight)
    value = view.constant_value(x)
    if value is None:
        raise QdqError(f"DequantizeLinear '{dq.name}' reads '{x.name}', which no QuantizeLinear makes (an INT8 "
                       f"model input?): fix reads Q -> DQ pairs and quantized constants",
                       "export the model with float inputs")
    return Fact(dq.name, "bias" if qtype == BIAS_TYPE else "weight", s, z, qtype, axis, stored=np.asarray(value))


def strip(graph: gs.Graph, facts: Facts) -> PassResult:
    """Remove every Q/DQ (qdqgraph.passes.strip), then name on each fact the float tensor its
    consumer reads now."""
    outputs = [(o.name, o.dtype, o.shape) for o in graph.outputs]
    done = strip_qdq(graph)
    _keep_output_names(graph, outputs)
    facts.edges = [(n, i, replace(f, tensor=(n.inputs[i] if n is not None else graph.outputs[i]).name))
                   for n, i, f in facts.edges]
    return done


def _keep_output_names(graph: gs.Graph, before: list) -> None:
    """A graph output that was a DQ's output is now the Q's input: give it the output's name (and
    declared type and shape) back, so the model keeps its interface."""
    inputs = {t.name for t in graph.inputs}
    names = set(graph.tensors())
    for t, (name, dtype, shape) in zip(graph.outputs, before):
        if t.name == name or t.name in inputs or isinstance(t, gs.Constant) or name in names:
            continue
        if sum(o is t for o in graph.outputs) > 1:
            continue
        names.discard(t.name)
        t.name = name
        names.add(name)
        if t.dtype is None:
            t.dtype = dtype
        if t.shape is None:
            t.shape = shape


def one_sided(f: Fact) -> tuple[float, float] | None:
    """(lo, hi) of an integer activation Q whose range starts at 0 (its zero point at its type's
    lowest value): it clamps negative values to 0, a Relu or Clip(0, 6) folded into it (onnxruntime
    removes them before an asymmetric Q whose range covers theirs). A range that ends at 0 is no
    folded activation: a huge negative minimum (an attention mask's -3.4e38) rounds the zero point
    to the top."""
    if f.kind != "activation" or not np.issubdtype(f.qtype, np.integer) or f.scale.size != 1:
        return None
    info = np.iinfo(f.qtype)
    zp, s = float(f.zero_point.reshape(())), float(f.scale.reshape(()))
    lo, hi = s * (info.min - zp), s * (info.max - zp)
    return (lo, hi) if lo >= 0 else None


def clamp_bounds(lo: float, hi: float) -> tuple[float, float | None]:
    """The bounds of a one-sided range worth a Clip: the one at 0 (a Relu's), and the upper only
    where it is a whole number (ReLU6's 6, a Clip's bound): a calibrated maximum is not one, and
    clamping there would cut values the calibration samples did not reach once the Q is gone."""
    whole = hi != 0 and abs(hi - round(hi)) <= 1e-4 * max(1.0, abs(hi))
    return 0.0, (float(round(hi)) if whole else None)


def _may_have_folded(view: GraphView, t) -> bool:
    """Could a Relu or Clip have stood between `t` and its Q? Only after the ops a Relu or ReLU6
    follows (a conv or GEMM, a BatchNormalization, an Add: a bias, a residual, HardSwish's x + 3).
    Elsewhere (a model input, an activation, a sum of squares) a range that starts at 0 is the
    data's, and a Clip would only be a node more."""
    p = view.producer(t)
    return p is not None and any(view.vocab.is_(p, c) for c in ("weighted", "batchnorm", "add"))


def restore_clamps(graph: gs.Graph, facts: Facts) -> None:
    """A one-sided Q (see `one_sided`) becomes symmetric in INT8 and stops clamping; its clamp is
    restored as a Clip to the Q's range on the edges that read through it (the stripped tensor ->
    Clip -> those consumers), and their facts move onto the Clip's output. Recorded in facts.clamps."""
    tensors = graph.tensors()
    names = set(tensors) | {n.name for n in graph.nodes}

    def unique(base: str) -> str:
        name, k = base, 1
        while name in names:
            name, k = f"{base}_{k}", k + 1
        names.add(name)
        return name
    view = GraphView(graph)
    made: dict[tuple[str, str], gs.Variable] = {}
    edges = []
    for n, i, f in facts.edges:
        bounds = one_sided(f) if facts.precision == "int8" else None
        if bounds is None or not _may_have_folded(view, tensors[f.tensor]):
            edges.append((n, i, f))
            continue
        key = (f.tensor, f.dq)
        if key not in made:
            t = tensors[f.tensor]
            dtype = np.dtype(t.dtype) if t.dtype is not None else np.dtype(np.float32)
            out = gs.Variable(unique(f"{t.name}_clamped"), dtype=t.dtype, shape=t.shape)
            kept = clamp_bounds(*bounds)
            lo, hi = (gs.Constant(unique(f"{t.name}_clamp_{k}"), np.asarray(b, dtype=dtype)) if b is not None
                      else gs.Variable.empty() for k, b in zip(("min", "max"), kept))
            graph.nodes.append(gs.Node(CLIP, unique(f"{t.name}_clamp"), inputs=[t, lo, hi], outputs=[out]))
            made[key] = out
            facts.clamps.append((f.tensor, *kept))
        out = made[key]
        if n is not None:
            n.inputs[i] = out
        else:                                      # a graph output keeps its name
            t = graph.outputs[i]
            name = t.name
            t.name, out.name = unique(f"{name}_unclamped"), name
            graph.outputs[i] = out
        edges.append((n, i, replace(f, tensor=out.name)))
    facts.edges = edges
    if made:
        graph.toposort()


def strip_to_float(graph: gs.Graph) -> tuple[PassResult, list[tuple[str, float, float | None]]]:
    """The float model a Q/DQ model approximates (`qdqgraph strip`): every Q/DQ removed as
    `passes.strip.strip_qdq` does, the graph outputs keeping their names, and each clamp a one-sided
    integer Q made (a Relu or ReLU6 that onnxruntime folded into a uint8 range, see `one_sided`)
    written as a Clip, as fix writes it. Returns the strip's result and the clamps (tensor, lo, hi).
    A QdqError for operator-style quantization (QLinearConv, ...), which has no Q/DQ to remove.
    Unlike `read`, it reads leniently: a pair fix could not keep is stripped without a clamp."""
    view = GraphView(graph)
    other = operator_style(view)
    if other:
        raise QdqError(f"the model holds {', '.join(other)} (operator-style quantization): strip removes "
                       f"QuantizeLinear/DequantizeLinear and cannot turn these ops back into float ones",
                       "export the model in QDQ format (onnxruntime: quant_format=QuantFormat.QDQ) and strip "
                       "that, or use the float model it was quantized from")
    facts = Facts()
    for dq in (n for n in view.nodes if view.vocab.is_(n, "dequantize")):
        q = view.producer(dq.inputs[0])
        if q is None or not view.vocab.is_(q, "quantize"):
            continue                                 # a quantized constant: no clamp to keep
        try:
            f = _read_dq(view, dq)
        except QdqError:
            continue
        facts.edges += _edges(view, graph, dq, f, facts)
    done = strip(graph, facts)
    restore_clamps(graph, facts)
    return done, list(facts.clamps)
