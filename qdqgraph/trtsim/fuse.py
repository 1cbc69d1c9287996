"""Steps 5-6 of the simulation order: fuse the propagated graph into layers (rules/tensorrt/fusion.toml)
and turn every Q, DQ or requantize that nothing absorbed into a standalone Reformat.

Fusion runs by benefit: weighted layers first (each grows its epilogue chain: BN, bias,
activation, one residual Add, a trailing Q, ConvActPool, a requantize), then reshapes in front of
FC layers, then DQ -> Op -> Q layers of non-weighted ops, then INT8 data movement, then float
ops. A node belongs to one layer; a DQ may be absorbed by several consumers (TensorRT clones it).
"""
from __future__ import annotations

from collections.abc import Sequence

from ..rulebook.match import Context
from ..graph.pointwise import region_source
from .conditions import LayerBuild, attention_block, evaluate, generated_layer, holds, op_matches, pointwise_region
from .ir import DQ, OP, Q, REQUANT, SimGraph, SNode
from .rules import SimRuleSet
from .trace import Trace

_KINDS = (("conv", "convolution"), ("gemm", "gemm"), ("matmul", "matmul"), ("einsum", "matmul"), ("avg_pool", "pooling"),
          ("max_pool", "pooling"), ("reduce_mean", "pooling"), ("concat", "concat"), ("pad", "padding"),
          ("copy", "shuffle"), ("resize", "resize"), ("elementwise", "elementwise"), ("epilogue", "activation"),
          ("softmax", "softmax"), ("layernorm", "normalization"))


def kind_of(g: SimGraph, node: SNode) -> str:
    if node.role == REQUANT:
        return "requantize"
    if node.role in (Q, DQ):
        return "reformat"
    for cls, kind in _KINDS:
        if g.vocab.is_(node, cls):
            return kind
    return "op"


class Fuser:
    def __init__(self, g: SimGraph, rules: SimRuleSet, trace: Trace):
        self.g, self.rules, self.trace = g, rules, trace
        self.owner: dict[str, LayerBuild] = {}
        self.absorbed: dict[str, set] = {}         # DQ name -> consumer edges (node name, index) absorbed
        self.layers: list[LayerBuild] = []
        self.buffers: list[LayerBuild] = []          # ops that became no layer (R6-concat-buffer)
        self.candidates = residual_candidates(g, rules)
        self.memo: dict = {}                         # Context.memo of every rule tried: fusing reads the graph only

    def ctx(self, layer=None, tensor=None) -> Context:
        return Context(self.g, layer=layer, tensor=tensor, candidates=self.candidates, memo=self.memo)

    def first(self, action: str, node: SNode, layer=None, tensor=None, blame: Sequence[str] = ()):
        """The first rule of `action` that holds for `node`; misses are recorded on `blame` nodes
        and the last reason is kept in `self.last_why`."""
        self.last_why = ""
        ctx = None                        # one context for every rule tried (conditions only read it)
        for rule in self._rules_for(action, node):
            if ctx is None:
                ctx = self.ctx(layer, tensor)
            m = holds(ctx, rule, node)        # `evaluate` less its op class check, made by _rules_for
            ok, why = m.ok, m.reason
            if ok:
                return rule
            self.last_why = why
            self.trace.miss(node.origin, rule.id, why)
            if blame:
                self.trace.miss(list(blame), rule.id, f"{node.name} ({node.op}): {why}" if node.role == OP else why)
        return None

    def _rules_for(self, action: str, node: SNode) -> tuple:
        """The rules of `action` whose op class holds `node` (the class depends on the op type only),
        in file order; found once per op type."""
        return self.rules.for_op(action, self.g.vocab, node.op)

    def own(self, layer: LayerBuild, node: SNode, rule_id: str | None = None):
        layer.absorb(node)
        self.owner[node.name] = layer
        self.trace.fired(rule_id or layer.rule, node.origin, f"{node.name} in the layer of {layer.anchor.name}")

    def absorb_dq(self, layer: LayerBuild, dq: SNode, consumer: SNode, rule_id: str | None = None):
        layer.absorb(dq)
        self.trace.fired(rule_id or layer.rule, dq.origin, f"{dq.name} -> {consumer.name} in the layer of {layer.anchor.name}")
        for i, t in enumerate(consumer.inputs):
            if t == dq.outputs[0]:
                self.absorbed.setdefault(dq.name, set()).add((consumer.name, i))

    # ------------------------------------------------------------------ weighted layers

    def weighted(self, node: SNode):
        g = self.g
        producers = [p for t in node.inputs[:2] if t and (p := g.producer(t)) is not None]
        dqs = [d for d in producers if d.role == DQ]
        rule = self.first("weighted", node, blame=[o for d in dqs for o in d.origin])
        if rule is None:
            return
        layer = LayerBuild(node, rule.id, kind_of(g, node))
        int8 = rule.when and "dequantized_inputs" in rule.when
        for t in node.inputs[:2]:
            if not t:
                continue
            p = g.producer(t)
            if g.is_const(t):
                layer.nodes += [w for w in g.tensors[t].weight_of if w not in layer.nodes]
            elif int8 and p is not None and p.role == DQ:
                self.absorb_dq(layer, p, node)
                layer.inputs.append(p.inputs[0])
            else:
                layer.inputs.append(t)
        self.own(layer, node)
        layer.out = node.outputs[0]
        self.epilogue(layer)
        self.output(layer)
        self.layers.append(layer)

    def epilogue(self, layer: LayerBuild):
        g = self.g
        while True:
            t = layer.out
            if g.is_graph_output(t):
                layer.float_reason = f"{t} is a graph output"
                return
            fired = None
            for c in {c.name: c for c, _ in g.consumers(t)}.values():
                if c.role != OP or c.name in self.owner:
                    continue
                rule = self.first("epilogue", c, layer, t)
                if rule is not None:
                    fired = (rule, c)
                    break
            if fired is None:
                return
            rule, c = fired
            data = g.data_inputs(c)
            if len(data) == 2 and g.vocab.is_(c, "add"):
                layer.residual = data[1] if data[0] == t else data[0]
            self.own(layer, c, rule.id)
            layer.out = c.outputs[0]
            if g.vocab.is_(c, "epilogue"):
                layer.has_activation = True
            if rule.when and "swish_pair" in rule.when:
                mul = next(m for m, _ in g.consumers(t) if m is not c)
                self.own(layer, mul, rule.id)
                layer.out = mul.outputs[0]
            if rule.when and "pointwise_region" in rule.when:
                nodes, out, _ = pointwise_region(self.ctx(), t)
                assert out is not None, "pointwise_region held, so the region has one output"
                for n in nodes:
                    if n.name not in self.owner:
                        self.own(layer, n, rule.id)
                layer.out = out
                layer.has_activation = True

    def output(self, layer: LayerBuild):
        """Trailing Q (F2, F3), the residual's precision (F3), then ConvActPool and requantize."""
        g = self.g
        t = layer.out
        qs = [c for c, _ in g.consumers(t) if c.role == Q and c.name not in self.owner]
        for k, q in enumerate(qs):
            rule = self.first("output_q", q, layer, t, blame=q.origin)
            if rule is not None:
                self.own(layer, q, rule.id)
                layer.out, layer.out_int8 = q.outputs[0], True
                for other in qs[k + 1:]:              # further scales of the same tensor, where the kernel writes each
                    more = self.first("extra_output_q", other, layer, t)
                    if more is not None:
                        self.own(layer, other, more.id)
                        layer.extra_outputs.append(other.outputs[0])
                break
            layer.float_reason = f"{q.name}: {self.last_why}"
        if not qs and not layer.float_reason:
            names = ", ".join(c.name for c, _ in g.consumers(t)) or "nothing"
            layer.float_reason = f"{t} feeds {names}, no Q"
        if layer.residual is not None:
            p = g.producer(layer.residual)
            if p is not None and p.role == DQ:
                add = next(c for c in layer.members if layer.residual in c.inputs and c.role == OP and c is not layer.anchor)
                rule = self.first("residual_dq", p, layer, layer.residual, blame=p.origin)
                if rule is not None:
                    self.absorb_dq(layer, p, add, rule.id)
                    layer.inputs.append(p.inputs[0])
                else:
                    layer.inputs.append(layer.residual)
            else:
                layer.inputs.append(layer.residual)
        self.tail(layer)

    def tail(self, layer: LayerBuild):
        """After an INT8 output: ConvActPool, a requantize (each needs to be the only consumer)."""
        g = self.g
        while layer.out_int8 and not g.is_graph_output(layer.out):
            fired = None
            for c in {c.name: c for c, _ in g.consumers(layer.out)}.values():
                if c.name in self.owner:
                    continue
                blame = c.origin if c.role == REQUANT else ()
                rule = (self.first("post_pool", c, layer, layer.out, blame)
                        or self.first("requant_fuse", c, layer, layer.out, blame))
                if rule is not None:
                    fired = (rule, c)
                    break
            if fired is None:
                return
            rule, c = fired
            self.own(layer, c, rule.id)
            layer.out = c.outputs[0]

    # ------------------------------------------------------------------ the other layers

    def fc_reshape(self, node: SNode):
        rule = self.first("fc_reshape", node)
        if rule is None:
            return
        g = self.g
        out = node.outputs[0]
        nxt = g.data_consumers(out)[0][0]
        target = g.data_consumers(nxt.outputs[0])[0][0] if nxt.role == DQ else nxt
        layer = self.owner.get(target.name)
        if layer is None:
            return
        if nxt.role == DQ and nxt.name not in [m.name for m in layer.members]:
            return  # the FC did not take the DQ: the reshape stays on its own
        src = g.data_inputs(node)[0]
        layer.inputs = [src if t == out else t for t in layer.inputs]
        layer.nodes[:0] = [o for o in node.origin if o not in layer.nodes]
        layer.members.append(node)
        self.owner[node.name] = layer
        self.trace.fired(rule.id, node.origin, f"{node.name} in the layer of {layer.anchor.name}")

    def quantized_op(self, node: SNode):
        g = self.g
        producers = [g.producer(t) for t in g.data_inputs(node)]
        dqs = [d for d in producers if d is not None and d.role == DQ]
        qs = [c for o in node.outputs if o for c, _ in g.consumers(o) if c.role == Q]
        rule = self.first("quantized_op", node, blame=[o for d in dqs + qs for o in d.origin])
        if rule is None:
            return False
        layer = LayerBuild(node, rule.id, kind_of(g, node))
        for t in g.data_inputs(node):
            d = g.producer(t)
            assert d is not None, f"{t} has no producer though quantized_op held for {node.name}"
            self.absorb_dq(layer, d, node)
            layer.inputs.append(d.inputs[0])
        self.own(layer, node)
        q = g.data_consumers(node.outputs[0])[0][0]
        self.own(layer, q, rule.id)
        layer.out, layer.out_int8 = q.outputs[0], True
        self.tail(layer)
        self.layers.append(layer)
        return True

    def buffer(self, node: SNode) -> bool:
        """An INT8 op that is no layer at all (a Concat whose inputs write into one buffer)."""
        rule = self.first("buffer", node)
        if rule is None:
            return False
        build = LayerBuild(node, rule.id, "buffer")
        build.inputs = list(dict.fromkeys(self.g.data_inputs(node)))
        self.own(build, node, rule.id)
        build.out = node.outputs[0]
        self.buffers.append(build)
        return True

    def simple(self, node: SNode, action: str):
        g = self.g
        rule = self.first(action, node)
        if rule is None:
            return False
        layer = LayerBuild(node, rule.id, kind_of(g, node))
        layer.inputs = list(dict.fromkeys(g.data_inputs(node)))
        self.own(layer, node)
        outs = [o for o in node.outputs if o]
        layer.out = outs[0] if outs else ""
        layer.extra_outputs = outs[1:]
        layer.out_int8 = node.int8
        if action == "float" and layer.out and self.rules.for_action("float_output_q"):
            for q in [c for c, _ in g.consumers(layer.out) if c.role == Q and c.name not in self.owner]:
                taken = self.first("float_output_q", q, layer, layer.out)
                if taken is not None:
                    self.own(layer, q, taken.id)
                    layer.out, layer.out_int8 = q.outputs[0], True
                    break
        self.layers.append(layer)
        return True

    def reformats(self):
        g = self.g
        rule = self.rules.rule("reformat")
        absorbing = bool(self.rules.for_action("dq_absorbed"))
        rounding = bool(self.rules.for_action("q_absorbed"))
        shared: dict[tuple, LayerBuild] = {}     # (int8 tensor, parameters) -> the Reformat of those DQs
        for n in g.order():
            if self.handled(n, rounding):
                continue
            if n.role == DQ:
                edges = {(c.name, i) for c, i in g.consumers(n.outputs[0]) if not self.is_shape_only(c)}
                left = edges - self.absorbed.get(n.name, set())
                if not left and not g.is_graph_output(n.outputs[0]):
                    continue
                if absorbing and not g.is_graph_output(n.outputs[0]):
                    into = self.first("dq_absorbed", n)
                    if into is not None:
                        self.trace.fired(into.id, n.origin, f"{', '.join(sorted(c for c, _ in left))} "
                                                            "read it as they compute")
                        continue
                for c_name, _ in sorted(left):
                    owner = self.owner.get(c_name)
                    where = f"the {owner.rule} layer of {owner.anchor.name}" if owner else g.nodes[c_name].op
                    self.trace.miss(n.origin, rule.id, f"{c_name} ({where}) reads it in float")
                key = (n.inputs[0], n.qp.key())
                if key in shared:
                    shared[key].absorb(n)
                    shared[key].extra_outputs.append(n.outputs[0])
                    self.owner[n.name] = shared[key]
                    self.trace.fired(rule.id, n.origin, f"{n.name} shares the Reformat of {shared[key].anchor.name}")
                    continue
            elif n.role == Q and g.producer(n.inputs[0]) is None:
                self.trace.miss(n.origin, rule.id, f"its input {n.inputs[0]} is a graph input: a Q on a network "
                                                   "input runs as a standalone Reformat (P12)")
            elif n.role == Q:
                p = g.producer(n.inputs[0])
                owner = self.owner.get(p.name)
                tried = {r.id for r in self.rules.for_action("output_q")} & set(self.trace.misses.get(n.name, {}))
                if not tried:
                    where = f"the {owner.rule} layer of {owner.anchor.name}" if owner else "no layer"
                    self.trace.miss(n.origin, rule.id, f"its producer {p.name} ({p.op}) is in {where}, which "
                                    "takes no output scale (only weighted layers, F2, and DQ -> Op -> Q, F4, do)")
            layer = LayerBuild(n, rule.id, kind_of(g, n))
            layer.inputs = [n.inputs[0]]
            self.own(layer, n)
            layer.out = n.outputs[0]
            layer.out_int8 = n.role in (Q, REQUANT)
            layer.reformat = True
            self.layers.append(layer)
            if n.role == DQ:
                shared[(n.inputs[0], n.qp.key())] = layer

    def handled(self, n: SNode, rounding: bool) -> bool:
        """Whether `reformats` leaves node `n`: not a Q/DQ, in a layer already, or (with a
        `q_absorbed` rule, `rounding`) a Q that `q_into_float` handles."""
        if n.name in self.owner or n.role not in (Q, DQ, REQUANT):
            return True
        return rounding and n.role == Q and self.q_into_float(n)

    def q_into_float(self, q: SNode) -> bool:
        """Whether Q `q` is read only through DQs and those only in generated kernels, where a
        `q_absorbed` rule holds: by float layers, or by an INT8 layer's epilogue (a residual Add),
        never as a convolution's or GEMM's operand nor as a graph output. The compiler then writes
        no INT8 tensor. Where every reader is in such a kernel (a float pointwise layer, an
        epilogue), Q and DQ run inside it (no layer here; an unowned DQ is then absorbed as
        `dq_absorbed` says); else they become one float layer of their own, which rounds and writes
        float."""
        g = self.g
        uses = [c for c, _ in g.consumers(q.outputs[0])]
        if not uses or g.is_graph_output(q.outputs[0]) or any(c.role != DQ for c in uses):
            return False
        found = [self._read_in_generated_kernels(d) for d in uses]
        if None in found or (not all(found) and any(d.name in self.owner for d in uses)):
            return False
        rule = self.first("q_absorbed", q)
        if rule is None:
            return False
        if all(found):
            readers = sorted({c.name for d in uses for c, _ in g.consumers(d.outputs[0])})
            self.trace.fired(rule.id, q.origin, f"{', '.join(readers)} round it as they read (generated kernels)")
            return True
        layer = LayerBuild(q, rule.id, "elementwise")
        layer.inputs = [q.inputs[0]]
        for node in (q, *uses):
            self.own(layer, node)
        layer.out = uses[0].outputs[0]
        layer.extra_outputs = [d.outputs[0] for d in uses[1:]]
        self.layers.append(layer)
        return True

    def _read_in_generated_kernels(self, d: SNode) -> bool | None:
        """For DQ `d` of `q_into_float`: None where it cannot apply (no reader, a graph output, a
        reader that is not an op, or an INT8 layer that takes it as its own kernel's operand);
        True where every reader computes in a generated kernel (a float pointwise layer, or an INT8
        layer's epilogue that absorbed it); False where some reader is another float layer."""
        g = self.g
        found = [(c, i) for c, i in g.consumers(d.outputs[0]) if not self.is_shape_only(c)]
        if not found or g.is_graph_output(d.outputs[0]) or any(c.role != OP for c, _ in found):
            return None
        taken = self.absorbed.get(d.name, set())
        inside = True
        for c, i in found:
            layer = self.owner.get(c.name)
            if (c.name, i) in taken and (layer is None or layer.anchor is c):
                return None                # an INT8 operand of the layer's own kernel
            if (c.name, i) not in taken and (layer is None or not generated_layer(g, layer)):
                inside = False
        return inside

    def is_shape_only(self, node: SNode) -> bool:
        """Ops with no float or INT8 output (Shape, index math): not layers of their own here."""
        return node.role == OP and not any(self.g.carries_data(o) for o in node.outputs if o)

    def attention(self, node: SNode) -> None:
        """One INT8 layer for a whole attention block (F10): its GEMMs, scaling, mask, Softmax and
        the Q/DQ of the probabilities; q, k and v enter as INT8, a mask or bias as it is."""
        g = self.g
        rule = self.first("attention", node)
        if rule is None:
            return
        block = attention_block(g, node)
        layer = LayerBuild(node, rule.id, "attention")
        members = set(id(n) for n in block.nodes)
        dqs = []
        for gemm in (block.bmm1, block.bmm2):
            for t in gemm.inputs[:2]:
                p = g.producer(t)
                if p is not None and p.role == DQ and id(p) not in members:
                    dqs.append((p, gemm))
        for p, gemm in dqs:
            self.absorb_dq(layer, p, gemm)
            layer.inputs.append(p.inputs[0])
        for n in block.nodes:
            self.own(layer, n)
            for t in g.data_inputs(n):            # a mask or a position bias enters as it is
                q = g.producer(t)
                if (q is None or id(q) not in members) and not any(t == d.outputs[0] for d, _ in dqs) \
                        and t not in layer.inputs:
                    layer.inputs.append(t)
        layer.out = block.bmm2.outputs[0]
        self.output(layer)
        self.layers.append(layer)

    def run(self) -> list[LayerBuild]:
        g = self.g
        order = g.order()
        for n in order:
            if n.role == OP and n.name not in self.owner and g.vocab.is_(n, "matmul"):
                self.attention(n)
        for n in order:
            if n.role == OP and n.name not in self.owner and g.vocab.is_(n, "weighted"):
                self.weighted(n)
        for n in reversed(order):
            if n.role == OP and n.name not in self.owner:
                self.fc_reshape(n)
        for n in order:
            if n.role == OP and n.name not in self.owner:
                self.quantized_op(n)
        for n in order:
            if n.role == OP and n.name not in self.owner and n.int8:
                self.buffer(n) or self.simple(n, "int8_copy")
        for n in order:
            if n.role == OP and n.name not in self.owner and not self.is_shape_only(n):
                self.simple(n, "float")
        self.reformats()
        return self.layers


def residual_candidates(g: SimGraph, rules: SimRuleSet) -> dict[str, str]:
    """For each Add of two activations: the weighted op it fuses into. A candidate is an input
    reached from a weighted op through epilogue ops (BN, bias, activation), each tensor on the way
    used once. Among two candidates the shallower (shortcut) conv takes the Add; on a tie, the
    later input (TREX resnet18 qat: `downsample Conv_95 + Add_97`, conv2 Conv_84 its residual)."""
    depth = g.depth()
    plain = [r for r in rules.for_action("epilogue") if "two_activations" not in r.when]
    out = {}
    for add in g.order():
        if add.role != OP or not g.vocab.is_(add, "add") or len(g.data_inputs(add)) != 2:
            continue
        found = []
        for idx, t in enumerate(g.data_inputs(add)):
            w = _chain_head(g, plain, add, t)
            if w is not None:
                found.append((depth[w.name], -idx, w.name))
        if found:
            out[add.name] = min(found)[2]
    return out


def _chain_head(g: SimGraph, plain_rules, consumer: SNode, t: str, limit: int = 8) -> SNode | None:
    region_end = False
    for _ in range(limit):
        if g.is_graph_output(t) or (len(g.consumers(t)) != 1 and _swish_parts(g, consumer) is None
                                    and not region_end):
            return None
        p = g.producer(t)
        if p is None or p.role != OP:
            return None
        if g.vocab.is_(p, "weighted"):
            return p
        data = g.data_inputs(p)
        if not data:
            return None
        src, node = data[0], p
        parts = _swish_parts(g, p)
        if parts is not None:
            src, node = parts
        ok = any(evaluate(Context(g, tensor=src), r, node).ok for r in plain_rules if op_matches(g, r, node))
        region_end = False
        if not ok:
            x = region_source(g, t)       # a decomposed activation (HardSwish, GELU) ends here
            if x is None:
                return None
            src, region_end = x, True
        consumer, t = p, src
    return None


def _swish_parts(g: SimGraph, node: SNode):
    """(x, gate node) if `node` is the Mul of x * gate(x), else None."""
    if not g.vocab.is_(node, "mul"):
        return None
    data = g.data_inputs(node)
    if len(data) != 2:
        return None
    for a, b in (data, data[::-1]):
        p = g.producer(b)
        if p is not None and p.role == OP and g.vocab.is_(p, "gate") and p.inputs[:1] == [a]:
            return a, p
    return None
