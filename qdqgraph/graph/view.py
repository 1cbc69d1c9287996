"""Read-only indexes over a graphsurgeon graph: producers, consumers, constants, dtypes, integer paths.

Placement and the invariant checks ask questions of a `GraphView`; nothing here mutates the graph.
"""
from __future__ import annotations

from functools import cached_property

import ml_dtypes
import numpy as np
import onnx_graphsurgeon as gs

from ..ops import CONSTANT, Vocabulary, vocabulary


_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
_BFLOAT16_CODE = 16          # TensorProto.BFLOAT16, where graphsurgeon keeps the code


def is_bfloat16_dtype(dtype) -> bool:
    """bfloat16, as ml_dtypes' numpy type or as the ONNX type number graphsurgeon may keep."""
    if dtype is None or isinstance(dtype, bool):
        return False
    if isinstance(dtype, (int, np.integer)):
        return int(dtype) == _BFLOAT16_CODE
    try:
        return np.dtype(dtype) == _BFLOAT16
    except TypeError:
        return False  # other onnx-only dtypes have no numpy dtype


_FLOAT_DTYPES: dict = {}     # dtype -> is_float_dtype: numpy's issubdtype costs 20 us a call


def is_float_dtype(dtype) -> bool:
    """float16/32/64 and bfloat16 (BF16 islands compute in it); float8 is a quantized type, not float."""
    try:
        return _FLOAT_DTYPES[dtype]
    except (KeyError, TypeError):           # TypeError: an unhashable value, asked each time
        pass
    found = _is_float_dtype(dtype)
    try:
        if len(_FLOAT_DTYPES) < 4096:
            _FLOAT_DTYPES[dtype] = found
    except TypeError:
        pass
    return found


def _is_float_dtype(dtype) -> bool:
    if is_bfloat16_dtype(dtype):
        return True
    if dtype is None or isinstance(dtype, (bool, int, np.integer)):
        return False
    try:
        return bool(np.issubdtype(np.dtype(dtype), np.floating))
    except TypeError:
        return False  # other onnx-only dtypes have no numpy dtype


def tensor_map(graph: gs.Graph) -> dict[str, gs.Tensor]:
    """`graph.tensors()`: name -> tensor over the graph inputs, each node's inputs then outputs, and
    the graph outputs, in that order, empty (omitted) tensors left out; without graphsurgeon's
    list concatenation per node. Where two distinct tensors share a name, graphsurgeon's own
    builds the map (it warns about them)."""
    found: dict[str, gs.Tensor] = {}
    for group in (graph.inputs, *(t for n in graph.nodes for t in (n.inputs, n.outputs)), graph.outputs):
        for t in group:
            name = t.name
            if not name:
                continue
            have = found.get(name)
            if have is None:
                found[name] = t
            elif have is not t:
                return graph.tensors()
    return found


class GraphView:
    def __init__(self, graph: gs.Graph, vocab: Vocabulary | None = None, *, lazy: bool = False):
        """`lazy`: the name -> tensor map (`tensors`) made when first asked, not now: for a caller
        that never asks it (nor `dtype`, `is_float`, `named`, ... which read it), or asks only
        while the graph is as it was here; 40 ms saved per view on a 26,000-node graph."""
        self.graph = graph
        self.vocab = vocab or vocabulary()
        self.nodes = list(graph.nodes)
        self.outputs = {t.name for t in graph.outputs}
        self.inputs = {t.name for t in graph.inputs}
        self.memo: dict = {}        # what walks over this view found, by the walk's name
        if not lazy:
            self.__dict__["tensors"] = tensor_map(graph)

    @cached_property
    def tensors(self) -> dict[str, gs.Tensor]:
        """name -> tensor (`tensor_map`) of the graph as it was when the view was made (a view
        made with `lazy`: when first asked)."""
        return tensor_map(self.graph)

    # ------------------------------------------------------------------ structure

    def consumers(self, tensor: gs.Tensor) -> list[tuple[gs.Node, int]]:
        """(node, input index) for every use of the tensor in the top-level graph."""
        out = []
        for n in tensor.outputs:
            for i, t in enumerate(n.inputs):
                if t is tensor:
                    out.append((n, i))
        return out

    def producer(self, tensor: gs.Tensor) -> gs.Node | None:
        return tensor.inputs[0] if tensor.inputs else None

    def is_graph_output(self, tensor: gs.Tensor) -> bool:
        return tensor.name in self.outputs

    def used_in_subgraph(self, tensor: gs.Tensor) -> bool:
        return tensor.name in self._subgraph_uses

    @cached_property
    def _subgraph_uses(self) -> set[str]:
        """Names of outer tensors that If/Loop/Scan bodies (at any depth) read implicitly."""
        return {name for n in self.nodes for name in subgraph_reads(n)}

    # ------------------------------------------------------------------ values and types

    def constant_value(self, tensor: gs.Tensor) -> np.ndarray | None:
        """The value of a constant tensor (initializer or Constant node output), else None."""
        if isinstance(tensor, gs.Constant):
            return tensor.values
        p = self.producer(tensor)
        if p is not None and p.op == CONSTANT and "value" in p.attrs and isinstance(p.attrs["value"], gs.Constant):
            return p.attrs["value"].values
        return None

    def constant(self, tensor: gs.Tensor) -> np.ndarray:
        """The value of a tensor the caller knows to be constant (a weight, a bias, a Q/DQ scale)."""
        value = self.constant_value(tensor)
        if value is None:
            raise ValueError(f"tensor {tensor.name!r} is not a constant")
        return value

    def is_constant(self, tensor: gs.Tensor) -> bool:
        return self.constant_value(tensor) is not None

    def dtype(self, tensor: gs.Tensor):
        return self._dtypes.get(tensor.name)

    @cached_property
    def _dtypes(self) -> dict:
        """Declared dtypes, filled in where shape inference left gaps by following same-type ops."""
        d = {}
        for name, t in self.tensors.items():
            if isinstance(t, gs.Constant):
                d[name] = t.values.dtype
            elif t.dtype is not None:
                d[name] = t.dtype
        for n in self.nodes:  # toposorted: inputs are known before outputs
            for o in n.outputs:
                if d.get(o.name) is None and not self.vocab.is_(n, "retypes"):
                    known = [d.get(i.name) for i in n.inputs if d.get(i.name) is not None]
                    if known:
                        d[o.name] = known[0]
        return d

    def is_float(self, tensor: gs.Tensor) -> bool:
        return is_float_dtype(self.dtype(tensor))

    @cached_property
    def integer_derived(self) -> dict[str, str]:
        """Float tensors whose values come only from integer or bool tensors (masks, one-hots,
        position buckets), mapped to the integer tensor they derive from. Weighted ops, pooling and
        other arithmetic on real data end such a path."""
        origin: dict[str, str] = {}
        # If/Loop read outer tensors implicitly; a DQ's output is real data, not an index
        ends = frozenset().union(*(self.vocab.ops_of(c) for c in ("weighted", "avg_pool", "softmax", "control_flow",
                                                                  "dequantize")))
        for n in self.nodes:
            if n.op in ends:
                continue
            sources = []
            real = False
            for i in n.inputs:
                if real:
                    break                   # no path through this node, whatever the other inputs are
                if i.name == "":
                    continue
                value = self.constant_value(i)
                if value is not None:
                    # a float table (Gather's data, a weight) carries real values; scalars and
                    # integer constants (1 - mask, -1e4 * mask, indices) do not
                    if np.issubdtype(value.dtype, np.floating) and value.size > 1:
                        real = True
                    continue
                if not self.is_float(i) and self.dtype(i) is not None:
                    sources.append(i.name)
                elif i.name in origin:
                    sources.append(origin[i.name])
                else:
                    real = True
            if sources and not real:
                for o in n.outputs:
                    if self.is_float(o):
                        origin[o.name] = sources[0]
        return origin

    def shape(self, tensor: gs.Tensor):
        if isinstance(tensor, gs.Constant):
            return tuple(tensor.values.shape)
        return tuple(tensor.shape) if tensor.shape is not None else None

    # ------------------------------------------------------------------ walks

    @cached_property
    def _named(self) -> "NamedView":
        return NamedView(self)

    def named(self) -> "NamedView":
        """This view with tensors named by string, for the walks shared with the simulator
        (qdqgraph.graph.pointwise)."""
        return self._named

    def through(self, tensor: gs.Tensor, cls: str = "copy") -> list[tuple[gs.Node, int]]:
        """Consumers of `tensor`, looking through ops of class `cls` (data movement by default)."""
        out, stack, seen = [], [tensor], set()
        while stack:
            t = stack.pop()
            if t.name in seen:
                continue
            seen.add(t.name)
            for n, i in self.consumers(t):
                if self.vocab.is_(n, cls) and i == 0:
                    stack.extend(n.outputs)
                else:
                    out.append((n, i))
        return out

    def path_nodes(self, steps: tuple[str, ...]) -> list[gs.Node]:
        """The nodes on any chain of nodes, each consuming the previous one's output, that fits
        `steps` ("A|B" alternatives, a trailing "?" makes a step optional), in graph order.

        A node takes the first step, from the one it is offered on, that its op fits, skipping
        only optional steps; a chain is complete once the steps after its last node are all
        optional. Computed over (node, step) states, each visited once: linear in the graph size
        times the number of steps, however many chains there are."""
        parsed = [(frozenset(s.rstrip("?").split("|")), s.endswith("?")) for s in steps]
        last = len(parsed)
        tail_optional = [False] * last          # every step after k is optional
        ok = True
        for k in range(last - 1, -1, -1):
            tail_optional[k] = ok
            ok = ok and parsed[k][1]

        def place(node, k):
            """The step `node` takes when offered step k, or None."""
            while k < last:
                ops_, optional = parsed[k]
                if node.op in ops_:
                    return k
                if not optional:
                    return None
                k += 1
            return None

        ids = {id(n): n for n in self.nodes}
        succ: dict[tuple[int, int], list[tuple[int, int]]] = {}
        start = []
        for n in self.nodes:
            k = place(n, 0)
            if k is not None:
                start.append((id(n), k))
        reached, stack = set(start), list(start)
        while stack:                                  # every state reachable from a start
            state = stack.pop()
            node, k = ids[state[0]], state[1]
            nxt = []
            for o in node.outputs:
                for c, _ in self.consumers(o):
                    j = place(c, k + 1) if id(c) in ids else None
                    if j is not None:
                        nxt.append((id(c), j))
            succ[state] = nxt
            for s in nxt:
                if s not in reached:
                    reached.add(s)
                    stack.append(s)
        pred: dict[tuple[int, int], list] = {}
        for a, nxt in succ.items():
            for b in nxt:
                pred.setdefault(b, []).append(a)
        done = {s for s in reached if tail_optional[s[1]]}   # states where a chain may end
        stack = list(done)
        while stack:                                  # states that lead to a complete chain
            for a in pred.get(stack.pop(), ()):
                if a not in done:
                    done.add(a)
                    stack.append(a)
        on = {s[0] for s in done}
        return [n for n in self.nodes if id(n) in on]


class NamedView:
    """A GraphView's structure with tensors named by string (the simulator's convention)."""

    def __init__(self, view: GraphView):
        self.view = view
        self.vocab = view.vocab
        self._position: dict[str, int] | None = None

    def producer(self, t: str):
        tensor = self.view.tensors.get(t)
        return None if tensor is None else self.view.producer(tensor)

    def consumers(self, t: str):
        tensor = self.view.tensors.get(t)
        return [] if tensor is None else self.view.consumers(tensor)

    def data_inputs(self, node) -> list[str]:
        v = self.view
        return [i.name for i in node.inputs
                if i.name and not v.is_constant(i) and (v.dtype(i) is None or v.is_float(i))]

    def node_outputs(self, node) -> list[str]:
        return [o.name for o in node.outputs]

    def is_graph_output(self, t: str) -> bool:
        return t in self.view.outputs

    def is_pointwise(self, node) -> bool:
        return self.view.vocab.is_(node, "elementwise") or self.view.vocab.is_(node, "epilogue")

    def position(self) -> dict[str, int]:
        if self._position is None:
            self._position = {n.name: k for k, n in enumerate(self.view.nodes)}
        return self._position


def bodies(graph: gs.Graph) -> list[gs.Graph]:
    """`list(graph.subgraphs(recursive=True))`: every If/Loop/Scan body under `graph`, nested ones
    included, in graphsurgeon's order; only the nodes with a graph attribute are asked for theirs
    (graphsurgeon's generator per node took 48 ms on a 26,000-node graph that has none)."""
    return [sub for n in graph.nodes if any(isinstance(v, gs.Graph) for v in n.attrs.values())
            for sub in n.subgraphs(recursive=True)]


def subgraph_reads(node: gs.Node) -> list[str]:
    """Names of tensors from outside `node` that its If/Loop/Scan bodies (at any depth) read: an
    implicit input, referred to by name inside the body (may include names of enclosing bodies)."""
    for v in node.attrs.values():   # a plain loop: this runs for every node of every graph read
        if isinstance(v, gs.Graph):
            break
    else:
        return []                   # no body (graphsurgeon's subgraphs() costs 10 us a node to say so)
    names: dict[str, None] = {}

    def scan(sub: gs.Graph) -> None:
        inner = {id(n) for n in sub.nodes}
        own = {t.name for t in sub.inputs}
        for n in sub.nodes:
            for t in n.inputs:
                produced_inside = any(id(p) in inner for p in t.inputs)
                if t.name and not produced_inside and t.name not in own and not isinstance(t, gs.Constant):
                    names[t.name] = None
            for nested in n.subgraphs():
                scan(nested)

    for sub in node.subgraphs():
        scan(sub)
    return list(names)
