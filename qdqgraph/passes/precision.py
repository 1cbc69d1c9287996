"""Float islands to FP16 (or BF16): the parts of a Q/DQ model outside INT8 take the island type.

TensorRT builds explicit-quantization networks strongly typed (always since version 11): every
tensor runs in the type the ONNX gives it, and a DequantizeLinear's output type is its scale's
type (docs/TRT_RULES.md F9, C3). A Q/DQ model whose float parts are float32 therefore runs them in
FP32. This pass retypes them:

- every float32 tensor becomes the island type, Q/DQ scales included (so DQ outputs and Q inputs
  agree), except where rules/precision.toml keeps an op in float32 (reductions that overflow,
  shape arithmetic, subgraphs, ops typed by an attribute), where the ONNX schema allows an input
  or output only in float32, where an op has no schema (custom domains), and on float tensors
  derived only from integers (shape arithmetic done in float);
- the model's inputs and outputs keep their types: a Cast follows each float input and precedes
  each float output;
- where an island tensor meets a float32 slot (or the reverse), one Cast per tensor and type is
  inserted and shared by all such consumers;
- a weight's scale with channels that round to 0 in the island type gets the type's smallest normal
  value there, and those channels' integers are requantized to it (the weight keeps its value);
  an activation scale that would round to 0 or overflow is clamped (and reported), so it stays
  finite and > 0 (its tensor is then all but zero, or beyond any quantized range anyway).

Where calibration data is at hand, `measure_ranges` runs the float32 Q/DQ model on a few samples
(fewer for tensors that settle far below the limit on the first two)
and every op whose float output reaches `RANGE_LIMIT` stays float32 too (rule H5): FP16 overflows
at 65504, and the limit keeps headroom for inputs the samples did not show.

Q/DQ with float16/bfloat16 scales need opset 19; the model is converted first. BF16 islands need
opset 22 (`island_opset`): before it, the schemas of Conv, ConvTranspose, the poolings and most
activations allow float16 but not bfloat16, so at opset 19 those ops would stay float32 behind Casts
on both sides. Where a model cannot be raised to 22, it is raised to 19 and those ops stay float32.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import math

import ml_dtypes
import numpy as np
import onnx_graphsurgeon as gs

from ..calib.histogram import abs_max
from ..graph import io, proto
from ..errors import QdqError
from ..ops import CAST, vocabulary
from ..rulebook.files import bundled, read_toml
from ..execution.runtime import LARGE_GRAPH_NODES, graph_session
from ..graph.view import GraphView
from .base import PassResult, result
from .bounds import below
from .registry import QDQ_SOUND, declare, describe

F32 = np.dtype(np.float32)
ISLAND_TYPES = {"fp16": np.dtype(np.float16), "bf16": np.dtype(ml_dtypes.bfloat16)}
HIGH_PRECISIONS = ("fp16", "bf16", "fp32")
RANGE_LIMIT = 8192.0           # |x| seen in calibration above which an op's output stays float32 (H5)
MIN_OPSET = 19                 # float16/bfloat16 scales on QuantizeLinear/DequantizeLinear
BF16_OPSET = 22                # bfloat16 in Conv, ConvTranspose, pooling and most activations
_ONNX_NAME = {np.dtype(np.float16): "tensor(float16)", np.dtype(ml_dtypes.bfloat16): "tensor(bfloat16)",
              F32: "tensor(float)"}


def island_opset(high_precision: str) -> int:
    """The opset the islands of `high_precision` are written at, at least (see the module doc)."""
    return BF16_OPSET if high_precision == "bf16" else MIN_OPSET


@dataclass(frozen=True)
class KeepRule:
    id: str
    classes: tuple[str, ...]
    why: str
    between_qdq: bool = False      # only where all inputs come from DQs and the output feeds only Qs
    path: tuple[str, ...] = ()     # or: the nodes on a chain of ops (view.path_nodes' steps)


@lru_cache(maxsize=1)
def keep_rules() -> tuple[KeepRule, ...]:
    path = bundled("precision.toml")
    data = read_toml(path)
    vocab = vocabulary()
    out = []
    for r in data.get("keep", []):
        unknown = [c for c in r.get("classes", ()) if not vocab.known(c)]
        if unknown:
            raise QdqError(f"{path}: rule {r['id']} names unknown op classes {unknown}",
                           "use classes of rules/op_classes.toml")
        out.append(KeepRule(r["id"], tuple(r.get("classes", ())), r["why"], bool(r.get("between_qdq", False)),
                            tuple(r.get("path", ()))))
    return tuple(out)


@dataclass
class _Tally:
    """What the retyping did, while it runs (returned as a PassResult)."""
    dtype: str
    retyped: int = 0                                        # float32 tensors now in the island type
    casts: int = 0
    dq_copies: int = 0                                      # float32 DQs added beside FP16 ones
    kept: list[tuple[str, str]] = field(default_factory=list)   # (node, rule id or reason)
    clamped_scales: list[str] = field(default_factory=list)
    rescaled_weights: list[str] = field(default_factory=list)   # weight DQs whose tiny channels were requantized


def _schema(node: gs.Node, opset: int):
    return proto.op_schema(node.op, opset, node.domain or "")


def _allowed(schema, formal_index: int, outputs: bool, dtype: np.dtype) -> bool:
    """Whether the schema lets this input/output slot hold `dtype` (variadic slots repeat the last)."""
    formals = schema.outputs if outputs else schema.inputs
    if not formals:
        return False
    formal = formals[min(formal_index, len(formals) - 1)]
    constraints = {c.type_param_str: c.allowed_type_strs for c in schema.type_constraints}
    allowed = constraints.get(formal.type_str, [formal.type_str])
    return _ONNX_NAME[dtype] in allowed


class _Retyper:
    def __init__(self, graph: gs.Graph, island: np.dtype, opset: int, ranges: dict[str, float]):
        self.graph, self.island, self.opset, self.ranges = graph, island, opset, ranges
        self.view = GraphView(graph)
        self.vocab = self.view.vocab
        self.result = _Tally(dtype=_short(island))
        self.casts: dict[tuple[str, np.dtype], gs.Variable] = {}
        self.own: set[str] = set()                           # the Casts (and DQ copies) this pass adds
        self.names = {n.name for n in graph.nodes}           # node names in use (ONNX wants them unique)
        self._schemas: dict[tuple[str, str], object] = {}    # (op, domain) -> schema at the opset, or None
        self._slots: dict[tuple, bool] = {}                  # (op, domain, slot, outputs) -> island type allowed
        self._by_op: dict[str, tuple[KeepRule, ...]] = {}     # op type -> the keep rules of its classes
        # each DQ's float32 scale as it was, for the DQ copies that feed float32 ops
        self.dq_scale = {n.name: n.inputs[1] for n in graph.nodes
                         if self.vocab.is_(n, "dequantize") and len(n.inputs) > 1}
        self.on_path = {n.name: rule.id for rule in keep_rules() if rule.path
                        for n in self.view.path_nodes(rule.path)}
        self.keep = {n.name: why for n in graph.nodes if (why := self._keep_reason(n))}
        self._keep_qdq_beside_fp32()
        self.result.kept = sorted(self.keep.items())

    # ------------------------------------------------------------------ decisions

    def _keep_reason(self, node: gs.Node) -> str | None:
        float_outputs = [(k, o) for k, o in enumerate(node.outputs) if o.name and self._is_f32(o)]
        for _, o in float_outputs:
            if self.ranges.get(o.name, 0.0) >= RANGE_LIMIT:
                return f"H5-range: |{o.name}| reached {self.ranges[o.name]:.0f} on calibration data"
            if self.view.used_in_subgraph(o):
                return "read inside an If/Loop/Scan body, which stays float32"
        if self.vocab.is_(node, "quantize") or self.vocab.is_(node, "dequantize"):
            # at the model's boundary the float32 side stays float32: the Q or DQ itself is the
            # one conversion, where a Cast would add a second
            boundary = node.inputs[0] if self.vocab.is_(node, "quantize") else node.outputs[0]
            if boundary in self.graph.inputs or boundary in self.graph.outputs:
                return "Q/DQ at a model input or output"
            return None
        if node.name in self.on_path:
            return self.on_path[node.name]
        for rule in self._rules_of(node.op):
            if not rule.between_qdq or self._between_qdq(node):
                return rule.id
        if self._schema(node) is None:
            return "no ONNX schema (custom op)"
        derived = self.view.integer_derived
        for k, o in float_outputs:
            if not self._allows(node, k, True):
                return f"the ONNX schema allows output {k} only in float32"
            if o.name in derived:
                return "integer-derived (shape arithmetic in float)"
        return None

    def _rules_of(self, op: str) -> tuple[KeepRule, ...]:
        """The keep rules, in order, with a class that holds `op` (found once per op type)."""
        found = self._by_op.get(op)
        if found is None:
            found = self._by_op[op] = tuple(r for r in keep_rules() if any(self.vocab.is_(op, c) for c in r.classes))
        return found

    def _between_qdq(self, node: gs.Node) -> bool:
        """Every input comes from a DQ and every output feeds only Qs, possibly through data
        movement (onnxruntime's Q/DQ propagation moves Q and DQ across a Transpose or Reshape
        before it fuses DQ -> Concat -> Q into its QLinearConcat, as TensorRT does, R2)."""
        if any(o in self.graph.outputs for o in node.outputs):
            return False
        ins = [t for t in node.inputs if t.name and not isinstance(t, gs.Constant)]
        outs = list(node.outputs)
        return bool(ins) and bool(outs) and all(self._from_dq(t, 4) for t in ins) and all(self._to_q(t, 4) for t in outs)

    def _from_dq(self, t: gs.Tensor, depth: int) -> bool:
        p = self.view.producer(t)
        if p is None:
            return False
        if self.vocab.is_(p, "dequantize"):
            return True
        data = [x for x in p.inputs if x.name and not isinstance(x, gs.Constant)]
        return (depth > 0 and self.vocab.is_(p, "copy") and not self.vocab.is_(p, "concat") and len(data) == 1
                and self._from_dq(data[0], depth - 1))

    def _to_q(self, t: gs.Tensor, depth: int) -> bool:
        if t in self.graph.outputs:
            return False
        consumers = [c for c, _ in self.view.consumers(t)]
        return bool(consumers) and all(
            self.vocab.is_(c, "quantize") or (depth > 0 and self.vocab.is_(c, "copy") and not self.vocab.is_(c, "concat")
                                            and all(self._to_q(o, depth - 1) for o in c.outputs))
            for c in consumers)

    def _keep_qdq_beside_fp32(self) -> None:
        """A Q whose input is float32 stays float32, and so does a DQ that feeds only float32
        slots: a Cast between a DQ and its consumer, or between a tensor and its Q, would break
        TensorRT's Q/DQ fusions and add a conversion."""
        g = self.graph
        for node in g.nodes:
            if self.vocab.is_(node, "quantize") and node.name not in self.keep:
                x = node.inputs[0]
                p = self.view.producer(x)
                if (p is None and x in g.inputs) or (p is not None and p.name in self.keep):
                    self.keep[node.name] = "its input is float32"
                elif self.ranges.get(x.name, 0.0) >= RANGE_LIMIT:
                    self.keep[node.name] = f"H5-range: |{x.name}| reached {self.ranges[x.name]:.0f} on calibration data"
        for node in g.nodes:
            if self.vocab.is_(node, "dequantize") and node.name not in self.keep:
                uses = [(c, k) for o in node.outputs for c, k in self.view.consumers(o)]
                if uses and all(self.required(c, k) == F32 for c, k in uses):
                    self.keep[node.name] = "feeds only float32 ops"

    def _is_f32(self, t: gs.Tensor) -> bool:
        dt = self.view.dtype(t)
        return dt is not None and np.dtype(dt) == F32

    def required(self, node: gs.Node, slot: int) -> np.dtype:
        """The type `node` wants on input `slot` when that input is float."""
        if node.name in self.keep:
            return F32
        if self._schema(node) is not None and not self._allows(node, slot, False):
            return F32
        return self.island

    def _schema(self, node: gs.Node):
        """The node's schema at the pass's opset (None for a custom op), looked up once per op."""
        key = (node.op, node.domain or "")
        if key not in self._schemas:
            self._schemas[key] = _schema(node, self.opset)
        return self._schemas[key]

    def _allows(self, node: gs.Node, slot: int, outputs: bool) -> bool:
        """`_allowed` for the island type on the node's schema (which it has), once per op and slot."""
        key = (node.op, node.domain or "", slot, outputs)
        if key not in self._slots:
            self._slots[key] = _allowed(self._schema(node), slot, outputs, self.island)
        return self._slots[key]

    # ------------------------------------------------------------------ rewriting

    def run(self) -> _Tally:
        """Retype: what each node produces, the Casts its consumers need, then the outputs' types."""
        produced = self._produced()
        self._cast_inputs(produced)
        self._retype_outputs(produced)
        for k, t in enumerate(list(self.graph.outputs)):
            if produced.get(t.name) == self.island:
                self.graph.outputs[k] = self._output_cast(t)
        return self.result

    def _produced(self) -> dict[str, np.dtype]:
        """The type each float32 tensor will have: the island type, or float32 out of a kept node."""
        produced: dict[str, np.dtype] = {}
        for node in self.graph.nodes:
            island_node = node.name not in self.keep
            for o in node.outputs:
                if o.name and self._is_f32(o):
                    produced[o.name] = self.island if island_node else F32
        return produced

    def _cast_inputs(self, produced: dict[str, np.dtype]) -> None:
        """Each input slot gets the type its node requires: constants retyped, tensors Cast."""
        graph_inputs = {t.name for t in self.graph.inputs}
        for node in list(self.graph.nodes):
            for slot, t in enumerate(node.inputs):
                if not t.name:
                    continue
                if isinstance(t, gs.Constant):
                    if t.values.dtype == F32:
                        self._retype_constant(node, slot, t)
                    continue
                have = produced.get(t.name, F32 if t.name in graph_inputs and self._is_f32(t) else None)
                if have is None or self.vocab.is_(node, "shape_of"):
                    continue                # Shape reads the shape only: a Cast would be a float consumer for nothing
                want = self.required(node, slot)
                if want != have:
                    node.inputs[slot] = self._cast(t, want)

    def _retype_outputs(self, produced: dict[str, np.dtype]) -> None:
        """The island nodes' outputs, float Casts and Constants in the island type."""
        for node in self.graph.nodes:
            if node.name in self.keep or node.name in self.own:
                continue
            if self.vocab.is_(node, "cast") and node.attrs.get("to") == proto.FLOAT:
                node.attrs["to"] = proto.tensor_dtype(self.island)
            if self.vocab.is_(node, "constant") and isinstance(node.attrs.get("value"), gs.Constant):
                value = node.attrs["value"]
                if value.values.dtype == F32:
                    node.attrs["value"] = gs.Constant(value.name, value.values.astype(self.island))
            for o in node.outputs:
                if produced.get(o.name) == self.island:
                    o.dtype = self.island
                    self.result.retyped += 1

    def _retype_constant(self, node: gs.Node, slot: int, t: gs.Constant) -> None:
        want = self.required(node, slot)
        if want == F32:
            return
        values = t.values.astype(want)
        if slot == 1 and self.vocab.is_(node, "dequantize") and isinstance(node.inputs[0], gs.Constant) \
                and "block_size" not in node.attrs and not np.all(np.isfinite(values) & (values > 0)):
            self._rescale_weight(node, t, want)          # a weight's scale FP16 cannot hold: the weight requantized
            return
        if self.vocab.is_(node, "quantize") or self.vocab.is_(node, "dequantize"):
            values = self._safe_scale(t, values) if slot == 1 else values
        key = (t.name, want)
        if key not in self.casts:
            self.casts[key] = gs.Constant(f"{t.name}_{_short(want)}", values)
        node.inputs[slot] = self.casts[key]

    def _rescale_weight(self, node: gs.Node, t: gs.Constant, want: np.dtype) -> None:
        """A weight DQ whose scale (some channels of it) rounds to 0 in the island type: those channels
        take the type's smallest normal value as scale and their integers are requantized to it, so the
        dequantized weight keeps its value (a channel that small rounds to 0 or a few steps) instead of
        growing by the ratio of the two scales. The node gets its own weight and scale constants."""
        old = np.asarray(t.values, np.float32)
        info = ml_dtypes.finfo(want)
        new = np.where(np.isfinite(old.astype(want).astype(np.float32)) & (old.astype(want) > 0), old,
                       np.float32(info.smallest_normal)).astype(np.float32)
        weight = node.inputs[0]
        q = np.asarray(weight.values)
        axis = int(node.attrs.get("axis", 1)) % max(q.ndim, 1) if old.size > 1 else None
        shape = [1] * q.ndim
        if axis is not None:
            shape[axis] = old.size
        ratio = (old / new).reshape(shape) if axis is not None else old / new
        lo, hi = (np.iinfo(q.dtype).min, np.iinfo(q.dtype).max) if np.issubdtype(q.dtype, np.integer) else (None, None)
        requantized = np.round(q.astype(np.float64) * ratio)
        if lo is not None:
            requantized = np.clip(requantized, lo, hi)
        node.inputs[0] = gs.Constant(self._fresh(f"{weight.name}_rescaled"), requantized.astype(q.dtype))
        node.inputs[1] = gs.Constant(self._fresh(f"{t.name}_{_short(want)}"), new.astype(want))
        self.result.rescaled_weights.append(node.name)

    def _safe_scale(self, t: gs.Constant, values: np.ndarray) -> np.ndarray:
        if values.size == 1 and math.isfinite(v := float(values.reshape(-1)[0])) and v > 0:
            return values                   # one scale that fits, as each activation's is (read as a float: exact)
        info = ml_dtypes.finfo(values.dtype)
        bad = ~np.isfinite(values.astype(np.float32)) | (values.astype(np.float32) <= 0)
        if bad.any():
            self.result.clamped_scales.append(t.name)
            src = t.values.astype(np.float32)
            fixed = np.where(src > float(info.max), float(info.max), float(info.smallest_normal))
            values = np.where(bad, fixed, values.astype(np.float32)).astype(values.dtype)
        return values

    def _cast(self, t: gs.Variable, to: np.dtype) -> gs.Variable:
        key = (t.name, to)
        p = self.view.producer(t)
        if key not in self.casts and to == F32 and p is not None and p.name in self.dq_scale:
            # a float32 op reading an FP16 DQ gets its own float32 DQ of the same INT8 tensor: a
            # Cast between a DQ and its consumer would stop TensorRT's Q/DQ fusion (a reformat)
            out = gs.Variable(f"{t.name}_{_short(to)}", dtype=to, shape=t.shape)
            node = gs.Node(p.op, name=self._fresh(f"{p.name}_{_short(to)}"), attrs=dict(p.attrs),
                           inputs=[p.inputs[0], self.dq_scale[p.name], *p.inputs[2:]], outputs=[out])
            self.graph.nodes.append(node)
            self.own.add(node.name)
            self.casts[key] = out
            self.result.dq_copies += 1
        if key not in self.casts:
            out = gs.Variable(f"{t.name}_{_short(to)}", dtype=to, shape=t.shape)
            node = gs.Node(CAST, name=self._fresh(f"{t.name}_to_{_short(to)}"),
                           attrs={"to": proto.tensor_dtype(to)},
                           inputs=[t], outputs=[out])
            self.graph.nodes.append(node)
            self.own.add(node.name)
            self.casts[key] = out
            self.result.casts += 1
        return self.casts[key]

    def _fresh(self, base: str) -> str:
        """`base`, or `base_2`, `base_3`... if a node already has that name (a tensor that is both a
        graph output and read by a float32 op gets two Casts)."""
        name, k = base, 1
        while name in self.names:
            k += 1
            name = f"{base}_{k}"
        self.names.add(name)
        return name

    def _output_cast(self, t: gs.Variable) -> gs.Variable:
        """Keep the graph output's name and float32 type: its producer now writes `<name>_<island>`."""
        name = t.name
        t.name = f"{name}_{_short(self.island)}"
        out = gs.Variable(name, dtype=F32, shape=t.shape)
        self.graph.nodes.append(gs.Node(CAST, name=self._fresh(f"{name}_to_fp32"), attrs={"to": proto.FLOAT},
                                        inputs=[t], outputs=[out]))
        self.result.casts += 1
        return out


def _short(dtype: np.dtype) -> str:
    return {np.dtype(np.float16): "fp16", np.dtype(ml_dtypes.bfloat16): "bf16", F32: "fp32"}[np.dtype(dtype)]


def measure_ranges(loaded: io.Loaded, data, samples: int = 4, providers=None,
                   known: dict[str, float] | None = None) -> dict[str, float]:
    """max |x| of the float32 tensors of the (Q/DQ) graph `loaded` that could reach RANGE_LIMIT,
    over the first `samples` batches of `data` (a qdqgraph.samples.data.CalibrationData). A tensor
    whose bound (passes.bounds: interval arithmetic from the DequantizeLinear ranges, weights and
    bounded activations; it holds for every input) is below the limit is not run: no sample can
    show it there, so the decisions are those of measuring every tensor. Where every tensor is
    bounded (a quantized CNN whose activations are clipped), no session is made. `known`: ranges
    measured before on another plan of the same model; only the tensors it lacks are run, and
    they are added to it. Its weights reach onnxruntime from memory, not through a serialized copy
    of the model."""
    view = GraphView(loaded.graph)
    bounded = below(view, RANGE_LIMIT)
    known = {} if known is None else known
    names = [t.name for t in view.tensors.values()
             if isinstance(t, gs.Variable) and t.inputs and t.name not in bounded and t.name not in known
             and not view.used_in_subgraph(t) and view.dtype(t) is not None and np.dtype(view.dtype(t)) == F32]
    if not names:
        return known
    sess = graph_session(loaded, providers, purpose="measuring float ranges", outputs=names,
                         optimize=len(loaded.graph.nodes) < LARGE_GRAPH_NODES)
    ranges = dict.fromkeys(names, 0.0)
    seen: dict[str, list[float]] = {n: [] for n in names}      # |x| of each of the first samples
    left = names
    for k, feed in enumerate(data.batches(1)):
        if k >= samples or not left:
            break
        for name, value in zip(left, sess.run(left, feed)):
            m = _abs_max(value) if value.size else 0.0
            ranges[name] = max(ranges[name], m)
            if k < SETTLED_AFTER:
                seen[name].append(m)
        if k + 1 == SETTLED_AFTER:
            left = [n for n in left if not settled(seen[n])]
    known.update(ranges)
    return known


# A tensor far below RANGE_LIMIT on the first samples, and steady across them, is not run on the
# others (onnxruntime computes only what the tensors still asked for need): they would have to
# reach SETTLED_MARGIN times its largest value so far to change the decision, after two samples
# within a factor SETTLED_SPREAD of each other. A tensor that moved between the two (a recurrent
# state that is zero on a stream's first sample) is run on every sample. On the zoo and the
# transformer set (10 models, 564 tensors run on 4 samples) 487 were settled after 2, the largest
# of them grew by 1.56x at most on samples 3 and 4, and no decision changed; Whisper tiny.en's
# encoder (14 tensors, all settled, at most 618) runs 2 samples instead of 4.
SETTLED_AFTER = 2
SETTLED_MARGIN = 8.0
SETTLED_SPREAD = 2.0


def settled(seen: list[float]) -> bool:
    """Whether a tensor whose |x| on each of the first SETTLED_AFTER samples was `seen` is settled
    below the limit (see SETTLED_AFTER)."""
    largest = max(seen)
    return largest * SETTLED_MARGIN < RANGE_LIMIT and largest <= SETTLED_SPREAD * min(seen)


def _abs_max(value: np.ndarray) -> float:
    """max |x| of a float32 array, its NaNs left out (np.nanmax(np.abs(x))): the compiled kernel's
    one pass, without the copy np.abs makes, where no value is NaN. Whisper tiny.en's encoder
    measures 450 MB of attention scores and residuals a sample: over its 4 samples (1.8 s of
    runs) numpy took 0.73 s, the kernel 0.36 s."""
    m = abs_max(value)
    return m if not np.isnan(m) else float(np.nanmax(np.abs(value)))


@declare("float_islands", ensures=(QDQ_SOUND,))
def lower_float_islands(graph: gs.Graph, high_precision: str = "fp16", opset: int = MIN_OPSET,
                        ranges: dict[str, float] | None = None) -> PassResult:
    """Retype `graph`'s float islands in place (see the module doc). `opset` must be >= 19;
    `ranges` (from measure_ranges) keeps ops with large outputs in float32."""
    if high_precision not in HIGH_PRECISIONS:
        raise QdqError(f"unknown high precision {high_precision!r}", f"use one of {', '.join(HIGH_PRECISIONS)}")
    if high_precision == "fp32":
        return result("float_islands", False, dtype="fp32", retyped=0, casts=0, dq_copies=0, kept=[],
                      clamped_scales=[], rescaled_weights=[])
    io.toposort(graph)
    t = _Retyper(graph, ISLAND_TYPES[high_precision], opset, ranges or {}).run()
    io.tidy(graph)
    return result("float_islands", t.retyped > 0, dtype=t.dtype, retyped=t.retyped, casts=t.casts,
                  dq_copies=t.dq_copies, kept=t.kept, clamped_scales=t.clamped_scales,
                  rescaled_weights=t.rescaled_weights,
                  warnings=[f"scale {n} does not fit {t.dtype}; clamped to stay finite and > 0"
                            for n in t.clamped_scales])


def _islands(results) -> dict | None:
    if not results:
        return None
    p = results[-1]
    return {"high_precision": p["dtype"], "retyped_tensors": p["retyped"], "casts": p["casts"],
            "dq_copies": p["dq_copies"], "kept_fp32": [{"node": n, "rule": r} for n, r in p["kept"]]}


def _islands_lines(results, ctx) -> list[str]:
    p = _islands(results)
    if not p or p["high_precision"] == "fp32":
        return []
    # onnxruntime's default session rewrites FP8 Q/DQ models into something else (README, Deployment)
    hint = "; in onnxruntime, run it in qdqgraph.session(model) (README, Deployment)" if ctx.precision == "fp8" else ""
    return [f"float islands: {p['high_precision']} ({p['retyped_tensors']} tensors retyped, {p['casts']} "
            f"casts, {len(p['kept_fp32'])} nodes kept fp32){hint}"]


describe("float_islands", 90, lines=_islands_lines, fields={"precision": _islands})
