"""The simulator's working copy of a graph: plain nodes and tensors that the passes may rewrite.

`SimGraph.from_gs(graph)` copies a graphsurgeon graph (the caller's graph is never touched). Each
node knows its role (an ordinary op, a Q, a DQ, or a requantize the simulator created) and the
ONNX node names it stands for (`origin`: a clone or a merged Q keeps the names of the nodes it came
from). Node order never matters: `order()` is a topological order with ties broken by a natural
sort of node names, so the same graph in any node order gives the same walk.
"""
from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field
from functools import cached_property, lru_cache

import numpy as np
import numpy.typing as npt
import onnx_graphsurgeon as gs

from ..ops import CONSTANT, Vocabulary, vocabulary
from ..graph.view import GraphView, is_bfloat16_dtype, is_float_dtype, subgraph_reads
from .branches import through_branches
import heapq
from ..graph import io

OP, Q, DQ, REQUANT = "op", "q", "dq", "requant"


@lru_cache(maxsize=1 << 20)
def natural_key(name: str) -> tuple:
    """'Conv_9' < 'Conv_10': digits compare as numbers. Cached: the index is rebuilt after every
    rewrite and sorts every consumer list by it. The cache holds every name of a graph of several
    hundred thousand nodes: one that evicts reads a 40,000-node graph's names again on each walk."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


@dataclass(frozen=True)
class QParams:
    """Scale, zero point and axis of a Q or DQ; equal only when identical (R7: exact float32)."""

    scale: np.ndarray | None          # None: not a constant (TensorRT rejects it; never equal)
    zero_point: np.ndarray | None
    axis: int | None                  # None for per-tensor
    owner: str = ""                   # node name, to keep non-constant scales distinct

    def key(self):
        return self._key

    @cached_property
    def _key(self) -> tuple:
        """`key()`, made once (the lint and the merges compare every Q's parameters)."""
        if self.scale is None:
            return ("opaque", self.owner)
        zp = self.zero_point
        zp_key = ("none",) if zp is None else (str(zp.dtype), zp.shape, zp.tobytes())
        return (str(self.scale.dtype), self.scale.shape, self.scale.tobytes(), zp_key, self.axis)

    def same(self, other: "QParams") -> bool:
        return self.key() == other.key()

    @property
    def float_dtype(self):
        return self.scale.dtype if self.scale is not None else np.dtype(np.float32)


@dataclass
class SNode:
    name: str
    op: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict = field(default_factory=dict)
    role: str = OP
    qp: QParams | None = None          # Q, DQ: its parameters; REQUANT: the output parameters
    origin: list[str] = field(default_factory=list)
    int8: bool = False                 # an op that propagation moved into the INT8 region
    moved_by: str | None = None        # the propagation rule that did it
    key: tuple = field(default=(), compare=False, repr=False)   # natural_key(name), set by SimGraph.add

    @property
    def params(self) -> QParams:
        """`qp` of a Q, DQ or requantize node, which always has one."""
        assert self.qp is not None, f"{self.name} ({self.role}) has no Q/DQ parameters"
        return self.qp


@dataclass
class STensor:
    name: str
    dtype: npt.DTypeLike | None = None  # numpy dtype (or an ONNX element type numpy lacks) or None
    shape: tuple | None = None
    value: np.ndarray | None = None    # constants
    weight_of: list[str] = field(default_factory=list)  # folded weight Q/DQ node names (INT8 weight)
    folded_from: list[str] = field(default_factory=list)  # ops folded into this constant

    @property
    def is_const(self) -> bool:
        return self.value is not None or bool(self.weight_of) or bool(self.folded_from)


def _use_key(use: tuple[SNode, int]) -> tuple:
    """The sort key of a consumer edge (node, input index): natural node name, then index."""
    return use[0].key, use[1]


class SimGraph:
    def __init__(self, vocab: Vocabulary | None = None):
        self.vocab = vocab or vocabulary()
        self.nodes: dict[str, SNode] = {}
        self.tensors: dict[str, STensor] = {}
        self.inputs: list[str] = []
        self.outputs: list[str] = []
        self.onnx_names: dict[str, str] = {}   # every ONNX node name of the source graph -> op type
        self._producer: dict[str, SNode] = {}
        self._consumers: dict[str, list[tuple[SNode, int]]] = {}
        self._order: list[SNode] | None = None
        self._position: dict[str, int] | None = None
        self._counter = 0
        self.journal: set[str] | None = None   # tensors touched by edits, while a driver records them
        # op classes the hot queries test, as sets of op types (the vocabulary's, read once)
        self._shape_of = self.vocab.ops_of("shape_of")
        self._pointwise = self.vocab.ops_of("elementwise") | self.vocab.ops_of("epilogue")

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_gs(cls, graph: gs.Graph, vocab: Vocabulary | None = None) -> "SimGraph":
        """Read `graph` into a new SimGraph; the caller's graph is left as it was (its node list is
        sorted for the walk and put back). An If whose condition is not constant is read as the
        branch that runs (trtsim.branches)."""
        graph = through_branches(graph)
        saved = list(graph.nodes)
        try:
            io.toposort(graph, recurse_subgraphs=False)   # GraphView fills dtypes in node order
            view = GraphView(graph, vocab)      # keeps the sorted node list for its walks
            nodes = view.nodes
        finally:
            graph.nodes = saved
        g = cls(view.vocab)
        g.inputs = [t.name for t in graph.inputs]
        g.outputs = [t.name for t in graph.outputs]
        g._read_tensors(view)
        g._read_nodes(nodes)
        g._index_all()
        return g

    def bind(self, dims: dict[str, int] | None) -> "SimGraph":
        """Each symbolic dimension of the tensors' shapes that `dims` names takes its value there
        (io.bound_dims: the calibration data's shapes), so that FLOPs and bytes are counted at those
        shapes, not with an unknown dimension as 1. Returns the graph."""
        if dims:
            for t in self.tensors.values():
                if t.shape is not None and any(isinstance(d, str) for d in t.shape):
                    t.shape = tuple(dims.get(d, d) if isinstance(d, str) else d for d in t.shape)
        return self

    def _read_tensors(self, view: GraphView) -> None:
        """An STensor for every named tensor of `view`: its dtype (GraphView.dtype), shape and, for
        a constant (an initializer or a Constant node's output), its value. The view's lookups,
        inline: `from_gs` reads every tensor of a graph of tens of thousands."""
        tensors = self.tensors
        dtypes = view._dtypes
        for name, t in view.tensors.items():
            if not name:
                continue
            if isinstance(t, gs.Constant):
                value = t.values
                tensors[name] = STensor(name, dtypes.get(name), tuple(value.shape), np.asarray(value))
                continue
            value = view.constant_value(t) if t.inputs and t.inputs[0].op == CONSTANT else None
            tensors[name] = STensor(name, dtypes.get(name), tuple(t.shape) if t.shape is not None else None,
                                    None if value is None else np.asarray(value))

    def _read_nodes(self, nodes: list[gs.Node]) -> None:
        """An SNode for every node (in `nodes` order, a topological one) but the Constant nodes
        that are their value; names made unique; Q and DQ with their parameters."""
        ops = self.vocab.ops_of
        constant, quantize, dequantize = ops("constant"), ops("quantize"), ops("dequantize")
        tensors = self.tensors
        used: set[str] = set()
        for n in nodes:
            op = n.op
            if op in constant and all(tensors[o.name].is_const for o in n.outputs if o.name):
                continue  # a Constant node is its value
            name = n.name or f"{op}({n.outputs[0].name if n.outputs else ''})"
            while name in used:
                name = f"{name}/{n.outputs[0].name if n.outputs else 'x'}"
            used.add(name)
            inputs = [t.name for t in n.inputs]
            # an If/Loop body reads outer tensors by name: implicit inputs, without which their
            # producers would look unused and be pruned (silero-vad lost its encoder that way)
            inputs += [t for t in subgraph_reads(n) if t in tensors and t not in inputs]
            role = Q if op in quantize else DQ if op in dequantize else OP
            node = SNode(name, op, inputs, [t.name for t in n.outputs], dict(n.attrs), role, origin=[name],
                         key=natural_key(name))
            if role != OP:
                node.qp = self._qparams(node)
            self.nodes[name] = node
            self.onnx_names[name] = op

    def _qparams(self, node: SNode) -> QParams:
        scale = self.const(node.inputs[1]) if len(node.inputs) > 1 else None
        zp = self.const(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] else None
        axis = None
        if scale is not None and scale.size > 1:
            axis = int(node.attrs.get("axis", 1))
        return QParams(scale, zp, axis, owner=node.name)

    # ------------------------------------------------------------------ queries

    def const(self, tensor: str):
        t = self.tensors.get(tensor)
        return None if t is None else t.value

    def is_const(self, tensor: str) -> bool:
        t = self.tensors.get(tensor)
        return t is not None and (t.value is not None or bool(t.weight_of) or bool(t.folded_from))   # STensor.is_const

    # ------------------------------------------------------------------ the index
    # producer and consumers of every tensor, kept up to date by every edit below (add, remove,
    # set_input, set_output, replace_uses): a rewrite costs the size of its neighbourhood, not of
    # the graph. Consumer lists are sorted by natural node name, then input index.

    def _note(self, *tensors: str) -> None:
        if self.journal is not None:
            self.journal.update(t for t in tensors if t)

    def _link(self, node: SNode) -> None:
        self._note(*node.inputs, *node.outputs)
        for o in node.outputs:
            if o:
                self._producer[o] = node
        for i, t in enumerate(node.inputs):
            if t:
                self._add_use(t, node, i)

    def _unlink(self, node: SNode) -> None:
        self._note(*node.inputs, *node.outputs)
        for o in node.outputs:
            if o and self._producer.get(o) is node:
                del self._producer[o]
        for i, t in enumerate(node.inputs):
            if t:
                self._drop_use(t, node, i)

    def _index_all(self) -> None:
        """The index of every node at once, as adding them one by one in `self.nodes` order would
        leave it: each consumer list is sorted once, a node of equal sort key (names "x01" and
        "x1") before those added earlier."""
        producer, consumers = self._producer, self._consumers     # local names: every edge of the graph
        for node in self.nodes.values():
            for o in node.outputs:
                if o:
                    producer[o] = node
            for i, t in enumerate(node.inputs):
                if t:
                    uses = consumers.get(t)
                    if uses is None:
                        consumers[t] = [(node, i)]
                    else:
                        uses.append((node, i))
        for uses in consumers.values():
            if len(uses) > 1:
                uses.reverse()
                uses.sort(key=_use_key)
        self.touch()

    def _add_use(self, tensor: str, node: SNode, index: int) -> None:
        uses = self._consumers.setdefault(tensor, [])
        uses.insert(bisect.bisect_left(uses, (node.key, index), key=_use_key), (node, index))

    def _drop_use(self, tensor: str, node: SNode, index: int) -> None:
        uses = self._consumers.get(tensor)
        if not uses:
            return
        for k, (n, i) in enumerate(uses):
            if n is node and i == index:
                del uses[k]
                break
        if not uses:
            del self._consumers[tensor]

    def touch(self):
        """Forget the cached order (the index itself is always current)."""
        self._order = None
        self._position = None

    def check_index(self) -> None:
        """Raise if the incremental index differs from one built from scratch (used by tests)."""
        producer: dict[str, str] = {}
        consumers: dict[str, list[tuple[str, int]]] = {}
        for n in self.nodes.values():
            for o in n.outputs:
                if o:
                    producer[o] = n.name
            for i, t in enumerate(n.inputs):
                if t:
                    consumers.setdefault(t, []).append((n.name, i))
        for lst in consumers.values():
            lst.sort(key=lambda c: (natural_key(c[0]), c[1]))
        got_p = {t: n.name for t, n in self._producer.items()}
        got_c = {t: [(n.name, i) for n, i in lst] for t, lst in self._consumers.items()}
        if got_p != producer or got_c != consumers:
            raise AssertionError("the simulator's producer/consumer index is out of date")

    def producer(self, tensor: str) -> SNode | None:
        return self._producer.get(tensor)

    def consumers(self, tensor: str) -> list[tuple[SNode, int]]:
        return list(self._consumers.get(tensor, ()))

    def data_consumers(self, tensor: str) -> list[tuple[SNode, int]]:
        """Consumers that read the tensor's values: a Shape reads its dimensions only, so it puts no
        precision constraint on the tensor (it still keeps its producer alive)."""
        shape_of = self._shape_of
        return [(c, i) for c, i in self._consumers.get(tensor, ()) if c.op not in shape_of]

    def data_inputs(self, node: SNode) -> list[str]:
        """Inputs that carry activations: float or INT8, not constants, not folded weights (an
        integer shape or index input is not one)."""
        out = []
        tensors = self.tensors
        for t in node.inputs:           # is_const and carries_data, inline: the fuser asks this of every node
            if not t:
                continue
            s = tensors.get(t)
            if s is None:
                out.append(t)
            elif not (s.value is not None or s.weight_of or s.folded_from) and (
                    s.dtype is None or is_float_dtype(s.dtype) or self.is_int8(t)):
                out.append(t)
        return out

    def node_outputs(self, node: SNode) -> list[str]:
        return node.outputs

    def is_qdq(self, node: SNode) -> bool:
        return node.role in (Q, DQ)

    def is_pointwise(self, node: SNode) -> bool:
        """An ordinary elementwise or activation op (qdqgraph.graph.pointwise)."""
        return node.role == OP and node.op in self._pointwise

    def carries_data(self, tensor: str) -> bool:
        t = self.tensors.get(tensor)
        if t is None or t.dtype is None or self.is_int8(tensor):
            return True
        return is_float_dtype(t.dtype)   # BF16 islands carry data too

    def float_constant_inputs(self, node: SNode) -> list[str]:
        return [t for t in node.inputs if t and (s := self.tensors.get(t)) is not None
                and s.value is not None and is_float_dtype(s.value.dtype)]

    def is_int8(self, tensor: str) -> bool:
        """Does the tensor hold INT8 data in the simulated engine?"""
        p = self._producer.get(tensor)
        if p is None:
            t = self.tensors.get(tensor)
            return t is not None and t.dtype is not None and np.dtype(t.dtype) == np.int8
        return p.role in (Q, REQUANT) or (p.role == OP and p.int8)

    def is_float(self, tensor: str) -> bool:
        t = self.tensors.get(tensor)
        return t is not None and is_float_dtype(t.dtype) and not self.is_int8(tensor)

    def float_precision(self, tensor: str) -> str:
        """fp16 or bf16 when the tensor is float16 or bfloat16, else fp32 (strong typing: DQ output
        type = scale type)."""
        t = self.tensors.get(tensor)
        p = self.producer(tensor)
        dtype = t.dtype if t is not None else None
        if p is not None and p.role == DQ and p.qp is not None:
            dtype = p.qp.float_dtype
        if is_bfloat16_dtype(dtype):
            return "bf16"
        return "fp16" if dtype is not None and np.dtype(dtype) == np.float16 else "fp32"

    def precision(self, tensor: str) -> str:
        return "int8" if self.is_int8(tensor) else self.float_precision(tensor)

    def is_graph_output(self, tensor: str) -> bool:
        return tensor in self.outputs

    def is_graph_input(self, tensor: str) -> bool:
        return tensor in self.inputs

    def order(self) -> list[SNode]:
        """Topological order, ties broken by natural node-name order (independent of input order)."""
        if self._order is not None:
            return self._order
        nodes, producer = self.nodes, self._producer    # the index never holds the tensor ""
        indeg: dict[str, int] = {}
        succ: dict[str, list[str]] = {}
        for name, n in nodes.items():
            preds = {src.name for t in n.inputs if (src := producer.get(t)) is not None}
            preds.discard(name)
            indeg[name] = len(preds)
            for p in preds:
                if p in succ:
                    succ[p].append(name)
                else:
                    succ[p] = [name]
        heap = [(nodes[k].key, k) for k, d in indeg.items() if d == 0]
        heapq.heapify(heap)
        out = []
        pop, push = heapq.heappop, heapq.heappush
        while heap:
            _, name = pop(heap)
            out.append(nodes[name])
            for s in succ.get(name, ()):
                d = indeg[s] - 1
                indeg[s] = d
                if d == 0:
                    push(heap, (nodes[s].key, s))
        if len(out) != len(nodes):
            raise ValueError("the graph has a cycle")
        self._order = out
        return out

    def position(self) -> dict[str, int]:
        """Node name -> index in `order()` (cached with it)."""
        if self._position is None:
            self._position = {n.name: k for k, n in enumerate(self.order())}
        return self._position

    def depth(self) -> dict[str, int]:
        """Longest path (in nodes) from the graph inputs to each node."""
        d: dict[str, int] = {}
        for n in self.order():
            preds = [p for t in n.inputs if t and (p := self.producer(t)) is not None]
            d[n.name] = 1 + max((d[p.name] for p in preds), default=0)
        return d

    # ------------------------------------------------------------------ edits

    def prune(self) -> list[str]:
        """Remove nodes whose outputs nothing reads (TensorRT builds no layer for them), round by
        round (a node whose consumers all went is dead in the next round)."""
        removed: list[str] = []

        def dead(n: SNode) -> bool:
            return not any(o and (o in self._consumers or self.is_graph_output(o)) for o in n.outputs)

        candidates = list(self.nodes.values())
        while True:
            position = self.position()
            found = sorted({n.name: n for n in candidates if n.name in self.nodes and dead(n)}.values(),
                           key=lambda n: position[n.name])
            if not found:
                return removed
            candidates = []
            for n in found:
                removed += n.origin
                self.remove(n)
                candidates += [self._producer[t] for t in n.inputs if t and t in self._producer]

    def fresh(self, base: str) -> str:
        name = base
        while name in self.nodes or name in self.tensors:
            self._counter += 1
            name = f"{base}_{self._counter}"
        return name

    def add_tensor(self, name: str, like: str | None = None, dtype: npt.DTypeLike | None = None) -> str:
        src = self.tensors.get(like) if like else None
        self.tensors[name] = STensor(name, dtype if dtype is not None else (src.dtype if src else None),
                                     src.shape if src else None)
        return name

    def add(self, node: SNode) -> SNode:
        assert node.name not in self.nodes, node.name
        node.key = natural_key(node.name)
        self.nodes[node.name] = node
        self._link(node)
        self.touch()
        return node

    def remove(self, node: SNode):
        del self.nodes[node.name]
        self._unlink(node)
        self.touch()

    def set_input(self, node: SNode, index: int, tensor: str) -> None:
        old = node.inputs[index]
        if old == tensor:
            return
        self._note(old, tensor, *node.outputs)
        if old:
            self._drop_use(old, node, index)
        node.inputs[index] = tensor
        if tensor:
            self._add_use(tensor, node, index)
        self.touch()

    def set_output(self, node: SNode, index: int, tensor: str) -> None:
        old = node.outputs[index]
        self._note(old, tensor, *node.inputs)
        if old and self._producer.get(old) is node:
            del self._producer[old]
        node.outputs[index] = tensor
        if tensor:
            self._producer[tensor] = node
        self.touch()

    def replace_uses(self, old: str, new: str, only: list[tuple[SNode, int]] | None = None):
        """Point consumers of tensor `old` (all, or the given edges) at `new`; graph outputs too."""
        edges = self.consumers(old) if only is None else only
        for n, i in edges:
            self.set_input(n, i, new)
        if only is None and old in self.outputs:
            self.outputs = [new if o == old else o for o in self.outputs]
        self.touch()
