"""The closed registry of conditions that simulator rules may name in `when` (CONDITIONS).

A condition is `cond(ctx, node, arg) -> Match` (qdqgraph.rulebook.match); a miss's reason says
why it does not hold (it becomes the answer to "why was this Q/DQ not absorbed?"). `evaluate` checks
a rule's op class, then its conditions in order, and stops at the first that fails.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..graph import attention
from ..precisions.formats import FOUR_BIT_TYPES, ZERO_POINT_TYPES
from ..ops import attr_str, inference_no_op, nearest_resize
from ..graph.pointwise import region_from
from ..graph.view import is_bfloat16_dtype
from ..rulebook.match import Conditions, Context, Match, hit, miss
from ..rulebook.match import op_matches as _op_matches
from .ir import DQ, OP, Q, REQUANT, SimGraph, SNode

CONDITIONS = Conditions("the simulator")


@dataclass
class LayerBuild:
    """A fused layer while it grows (fuse.py fills it; conditions read it)."""

    anchor: SNode
    rule: str
    kind: str
    nodes: list[str] = field(default_factory=list)        # ONNX node names, in fusion order
    members: list[SNode] = field(default_factory=list)    # sim nodes owned by this layer
    inputs: list[str] = field(default_factory=list)       # tensors entering the layer
    out: str = ""                                         # the tensor the layer currently ends in
    has_activation: bool = False
    residual: str | None = None                           # the fused Add's other operand
    residual_dq: SNode | None = None
    out_int8: bool = False
    float_reason: str = ""                                # why the output stayed float
    extra_outputs: list[str] = field(default_factory=list)
    reformat: bool = False

    def absorb(self, node: SNode):
        self.members.append(node)
        for name in node.origin:
            if name not in self.nodes:
                self.nodes.append(name)


def _desc(node: SNode) -> str:
    return f"{node.name} ({node.op})"


# ---------------------------------------------------------------------------- propagation (R2, R5, R6)

@CONDITIONS.register("sole_equal_q_consumers")
def c_sole_equal_q_consumers(ctx, node, arg):
    """Every consumer of every used output is a Q, all with identical parameters (R5-b, R5-c)."""
    g, qs = ctx.graph, []
    for o in node.outputs:
        cons = g.data_consumers(o) if o else []
        for c, _ in cons:
            if c.role != Q:
                return miss(f"output {o} also feeds {_desc(c)}, a float consumer (R5-b)")
            qs.append(c)
    if not qs:
        return miss("its output feeds no Q")
    if any(not q.qp.same(qs[0].qp) for q in qs[1:]):
        return miss(f"the Qs on its output ({', '.join(q.name for q in qs)}) have different scales (R5-c)")
    return hit()


@CONDITIONS.register("outputs_not_graph_outputs")
def c_outputs_not_graph_outputs(ctx, node, arg):
    for o in node.outputs:
        if o and ctx.graph.is_graph_output(o):
            return miss(f"its output {o} is a graph output (R5-d)")
    return hit()


@CONDITIONS.register("inputs_not_graph_inputs")
def c_inputs_not_graph_inputs(ctx, node, arg):
    for t in ctx.graph.data_inputs(node):
        if ctx.graph.is_graph_input(t):
            return miss(f"its input {t} is a graph input (R5-d)")
    return hit()


@CONDITIONS.register("zero_constants")
def c_zero_constants(ctx, node, arg):
    """Float constant operands must be 0, the one value every Q/DQ maps to itself (zero point 0)."""
    for t in ctx.graph.float_constant_inputs(node):
        v = ctx.graph.const(t)
        if v is not None and v.size and (v != 0).any():
            return miss(f"constant operand {t} is not 0, so Q does not commute with it")
    return hit()


@CONDITIONS.register("pad_constant_mode")
def c_pad_constant_mode(ctx, node, arg):
    if not ctx.graph.vocab.is_(node, "pad"):
        return hit()
    mode = node.attrs.get("mode", "constant")
    mode = mode.decode() if isinstance(mode, bytes) else str(mode)
    if mode != "constant":
        return miss(f"Pad mode is {mode}, not constant")
    return hit()


@CONDITIONS.register("resize_nearest")
def c_resize_nearest(ctx, node, arg):
    """Resize (or Upsample) in nearest mode, whose only activation is its data input."""
    if not nearest_resize(node.attrs):
        return miss(f"Resize mode is {attr_str(node.attrs, 'mode', 'nearest')}, not nearest: it computes new values")
    if ctx.graph.data_inputs(node)[1:]:
        return miss("its scales or sizes are not constants")
    return hit()


@CONDITIONS.register("not_int8")
def c_not_int8(ctx, node, arg):
    if node.int8:
        return miss(f"it already runs on INT8 (moved by {node.moved_by})")
    return hit()


@CONDITIONS.register("float_outputs")
def c_float_outputs(ctx, node, arg):
    """Used outputs are all float (MaxPool's Indices output, for one, is not)."""
    for o in node.outputs:
        if o and ctx.graph.consumers(o) and not ctx.graph.is_float(o):
            return miss(f"output {o} is not a float tensor")
    return hit()


@CONDITIONS.register("outputs_not_bf16")
def c_outputs_not_bf16(ctx, node, arg):
    """No used output is bfloat16 (a BF16 island's op)."""
    for o in node.outputs:
        t = ctx.graph.tensors.get(o)
        if o and ctx.graph.consumers(o) and t is not None and is_bfloat16_dtype(t.dtype):
            return miss(f"output {o} is bfloat16")
    return hit()


@CONDITIONS.register("has_data_input")
def c_has_data_input(ctx, node, arg):
    if not ctx.graph.data_inputs(node):
        return miss("it has no activation input")
    return hit()


@CONDITIONS.register("inputs_equal_dq")
def c_inputs_equal_dq(ctx, node, arg):
    """Every activation input comes from a DQ, all with identical parameters (R6, R7)."""
    g, dqs = ctx.graph, []
    for t in g.data_inputs(node):
        p = g.producer(t)
        if p is None or p.role != DQ:
            return miss(f"input {t} is not dequantized")
        dqs.append(p)
    if not dqs:
        return miss("it has no activation input")
    if any(not d.qp.same(dqs[0].qp) for d in dqs[1:]):
        return miss(f"its inputs are dequantized with different scales ({', '.join(d.name for d in dqs)}) (R6, R7)")
    return hit()


# ---------------------------------------------------------------------------- weights, merge, cancel

@CONDITIONS.register("constant_input")
def c_constant_input(ctx, node, arg):
    """Input 0 is a constant of the given kind: "quantized" (INT8, FP8 or INT4) or "float"."""
    t = node.inputs[0]
    v = ctx.graph.const(t)
    if v is None or ctx.graph.tensors[t].weight_of:
        return miss(f"input {t} is not a constant")
    if arg == "quantized" and v.dtype.kind not in "iu" and np.dtype(v.dtype) not in (*ZERO_POINT_TYPES, *FOUR_BIT_TYPES):
        return miss(f"input {t} is a {v.dtype} constant, not a quantized (INT8, FP8, INT4) one")
    if arg == "float" and v.dtype.kind != "f":
        return miss(f"input {t} is a {v.dtype} constant, not a float one")
    return hit()


@CONDITIONS.register("quantized_constant")
def c_quantized_constant(ctx, node, arg):
    """A DQ whose input is Q(float constant) with the same parameters."""
    p = ctx.graph.producer(node.inputs[0])
    if p is None or p.role != Q:
        return miss("its input does not come from a Q")
    m = c_constant_input(ctx, p, "float")
    if not m:
        return miss(f"{p.name}: {m.reason}")
    if not p.qp.same(node.qp):
        return miss(f"{p.name} and {node.name} have different parameters")
    return hit()


@CONDITIONS.register("has_equal_sibling")
def c_has_equal_sibling(ctx, node, arg):
    """Another node of the same role reads the same tensor with identical parameters."""
    t = node.inputs[0]
    for c, i in ctx.graph.consumers(t):
        if c is not node and i == 0 and c.role == node.role and c.qp.same(node.qp):
            return hit()
    return miss(f"no other {node.op} on {t} with the same parameters")


@CONDITIONS.register("input_dequantized")
def c_input_dequantized(ctx, node, arg):
    p = ctx.graph.producer(node.inputs[0])
    if p is None or p.role != DQ:
        return miss(f"its input comes from {_desc(p) if p else 'a graph input'}, not a DQ")
    return hit()


@CONDITIONS.register("same_params_as_input")
def c_same_params_as_input(ctx, node, arg):
    p = ctx.graph.producer(node.inputs[0])
    if p is None or p.qp is None or not p.qp.same(node.qp):
        return miss(f"{p.name if p else 'its input'} and {node.name} have different scales")
    return hit()


# ---------------------------------------------------------------------------- weighted layers (F1)

def _operands(g: SimGraph, node: SNode) -> list[str]:
    """The multiplied operands of a weighted op (input 0 and 1; a bias is not one)."""
    return [t for t in node.inputs[:2] if t]


@CONDITIONS.register("int8_weight")
def c_int8_weight(ctx, node, arg):
    """Every constant operand is an INT8 weight (folded Q/DQ); a MatMul of two activations has none."""
    g = ctx.graph
    for t in _operands(g, node):
        if g.is_const(t) and not g.tensors[t].weight_of:
            return miss(f"weight {t} is float (no Q/DQ on it)")
    return hit()


@CONDITIONS.register("dequantized_inputs")
def c_dequantized_inputs(ctx, node, arg):
    """Every activation operand (weighted ops: inputs 0-1; others: all) comes from a DQ."""
    g = ctx.graph
    ins = [t for t in _operands(g, node) if not g.is_const(t)] if g.vocab.is_(node, "weighted") else g.data_inputs(node)
    if not ins:
        return miss("it has no activation input")
    for t in ins:
        p = g.producer(t)
        if p is None or p.role != DQ:
            return miss(f"input {t} is float (comes from {_desc(p) if p else 'a graph input'}, not a DQ)")
    return hit()


@CONDITIONS.register("pointwise_layer")
def c_pointwise_layer(ctx, node, arg):
    """The layer the node would join is one a generated kernel computes: elementwise math, an
    activation, or a LayerNorm (normalized row by row, then scaled element by element)."""
    layer = ctx.layer
    if layer is None:
        return miss("not reached from a layer")
    if generated_layer(ctx.graph, layer):
        return hit()
    return miss(f"{_desc(layer.anchor)} is not pointwise")


def generated_layer(g, layer: LayerBuild) -> bool:
    """Whether a generated kernel computes `layer`: its anchor is elementwise math, an activation
    or a LayerNorm (`pointwise_layer`), or a Cast of something computed. TensorRT for RTX computes
    magika's one-hot (Reshape, Equal, Cast) and the Q after it in one pointwise kernel
    (__myl_ReshEqlCastMulMinMaxRounConcCast); a Cast of a graph input (through Casts only) folds into
    the Q that follows it, a standalone quantize (ViT-S's input, __myl_CastMulMinMaxRounCastConc).
    An LSTM's gates round the Q after it only where it runs as a loop (`recurrent_loop`)."""
    if g.vocab.is_(layer.anchor, "cast"):
        ins = layer.anchor.inputs
        return bool(ins and ins[0]) and _before_casts(g, ins[0])[0] is not None
    return any(g.vocab.is_(layer.anchor, c) for c in ("elementwise", "epilogue", "layernorm"))


def _before_casts(g, t: str) -> tuple[SNode | None, str | None]:
    """(the op that computes tensor `t`, back through Casts; the tensor it writes): (None, that
    tensor) where the chain starts at a graph input or a constant, (None, None) past 8 Casts."""
    for _ in range(8):
        p = g.producer(t)
        if p is None:
            return None, t
        if not g.vocab.is_(p, "cast"):
            return p, t
        t = p.inputs[0]
    return None, None


@CONDITIONS.register("recurrent_loop")
def c_recurrent_loop(ctx, node, arg):
    """The layer is a recurrent op (class `recurrent`) whose own output the node reads, over more
    than `arg` steps or a step count unknown here (a symbolic sequence length): TensorRT for RTX runs
    it as a loop, whose last gate kernel can round as it writes; a shorter one it unrolls."""
    layer = ctx.layer
    if layer is None:
        return miss("not reached from a layer")
    g, anchor = ctx.graph, layer.anchor
    if not g.vocab.is_(anchor, "recurrent"):
        return miss(f"{_desc(anchor)} is not recurrent")
    if layer.out not in anchor.outputs:
        return miss(f"it reads {layer.out}, not {_desc(anchor)}'s own output")
    t = g.tensors.get(anchor.inputs[0]) if anchor.inputs else None
    steps = t.shape[0] if t is not None and t.shape else None
    if isinstance(steps, (int, np.integer)) and steps <= int(arg):
        return miss(f"{steps} steps: unrolled")
    return hit(f"{steps if isinstance(steps, (int, np.integer)) else 'an unknown number of'} steps: a loop")


@CONDITIONS.register("scales_a_graph_input")
def c_scales_a_graph_input(ctx, node, arg):
    """The layer is a Mul of a graph input (through Casts only) by a constant (a smoothing that no
    producer could take): TensorRT for RTX folds the constant into the scale of the Q after it,
    and that kernel only quantizes (the Whisper tiny.en decoder's encoder_hidden_states:
    __myl_CastMulMinMaxRounCast)."""
    layer = ctx.layer
    if layer is None:
        return miss("not reached from a layer")
    g, anchor = ctx.graph, layer.anchor
    if not g.vocab.is_(anchor, "mul") or any(m is not anchor and not g.vocab.is_(m, "cast") for m in layer.members):
        return miss(f"{_desc(anchor)} is not a Mul alone")
    data = [t for t in anchor.inputs if t and not g.is_const(t)]
    if len(data) != 1:
        return miss(f"{_desc(anchor)} multiplies two activations")
    p, t = _before_casts(g, data[0])
    if p is not None:
        return miss(f"{_desc(p)} computes its input")
    if t is None:
        return miss("a chain of Casts")
    return hit(f"{_desc(anchor)} scales the graph input {t}") if t in g.inputs else miss(f"{t} is a constant")


@CONDITIONS.register("generated_epilogue")
def c_generated_epilogue(ctx, node, arg):
    """The layer needs a generated kernel after its convolution or GEMM, in which a trailing Q can
    round: an op beyond an activation a float kernel applies itself (kernel_activation), such as a
    bias Add, a written-out HardSwish, a SiLU or a residual Add; or, for a quantized layer, its
    activation or its bias (the kernel writes float, and the generated kernel dequantizes, adds the
    bias and applies the activation). A bare GEMM has none: its Q runs alone."""
    layer = ctx.layer
    if layer is None:
        return miss("not reached from a layer")
    g, anchor = ctx.graph, layer.anchor
    dequantized = any(p is not None and p.role == DQ for p in (g.producer(t) for t in anchor.inputs[:1] if t))
    for n in layer.members:
        # a quantized kernel writes float, and its activation runs in the generated kernel that
        # dequantizes (a bias-less INT8 conv or GEMM and its ReLU: __myl_MulCastReluMulMinMaxRounCast)
        if n is anchor or n.role != OP or (g.vocab.is_(n, "kernel_activation") and not dequantized):
            continue
        return hit(f"{_desc(n)} runs in a generated kernel after the {anchor.op}")
    if dequantized and len(anchor.inputs) > 2 and anchor.inputs[2]:
        return hit(f"the quantized {anchor.op}'s bias is added in a generated kernel")
    return miss(f"the {anchor.op} kernel applies its whole epilogue itself")


@CONDITIONS.register("input_shared")
def c_input_shared(ctx, node, arg):
    """The op's dequantized input is read by another op too: the DQ's output has other consumers,
    or the tensor its Q quantizes does (a squeeze-excite block's pool reads the tensor the gate
    multiplies)."""
    g = ctx.graph
    for t in g.data_inputs(node):
        others = [c for c, _ in g.data_consumers(t) if c is not node]
        p = g.producer(t)
        if not others and p is not None and p.role == DQ:
            q = g.producer(p.inputs[0])
            if q is not None and q.role == Q and q.inputs:
                others = [c for c, _ in g.data_consumers(q.inputs[0]) if c is not q]
        if others:
            return hit(f"{t} is also read by {', '.join(_desc(c) for c in others[:2])}")
    return miss("no other op reads its input")


@CONDITIONS.register("q_read_by_gemm")
def c_q_read_by_gemm(ctx, node, arg):
    """The Q after the op is read, through its DQ and data-movement ops only, by GEMMs (MatMul, Gemm),
    none of them a convolution."""
    g = ctx.graph
    outs = [o for o in node.outputs if o]
    qs = [c for c, _ in g.data_consumers(outs[0])] if outs else []
    if len(qs) != 1 or qs[0].role != Q:
        return miss("its output is not quantized once")
    readers, todo, seen = [], [qs[0].outputs[0]], 0
    while todo and seen < 16:
        t, seen = todo.pop(), seen + 1
        for c, _ in g.data_consumers(t):
            if c.role == DQ or g.vocab.is_(c, "copy"):
                todo.extend(o for o in c.outputs if o)
            else:
                readers.append(c)
    if readers and all(g.vocab.is_(c, "gemm") or g.vocab.is_(c, "matmul") for c in readers):
        return hit(f"read by {', '.join(_desc(c) for c in readers[:2])}")
    return miss(f"read by {', '.join(_desc(c) for c in readers[:2]) or 'nothing'}")


@CONDITIONS.register("fed_by_weighted_epilogue")
def c_fed_by_weighted_epilogue(ctx, node, arg):
    """The op's dequantized input is the quantized output of a convolution or GEMM through its
    epilogue (bias, activation, residual Add: elementwise and activation ops only), so that a
    generated kernel after that layer can compute this op too."""
    g = ctx.graph
    ins = g.data_inputs(node)
    dq = g.producer(ins[0]) if ins else None
    q = g.producer(dq.inputs[0]) if dq is not None and dq.role == DQ else None
    if q is None or q.role != Q:
        return miss("its input is not a dequantized Q output")
    first = g.producer(q.inputs[0])
    todo, seen = [first], 0
    while todo and seen < 12:          # back through the epilogue, every operand of a residual Add
        p, seen = todo.pop(), seen + 1
        if p is None:
            continue
        if g.vocab.is_(p, "weighted"):
            return hit(f"{_desc(p)} writes it through its epilogue")
        if g.vocab.is_(p, "elementwise") or g.vocab.is_(p, "epilogue"):
            todo.extend(g.producer(t) for t in g.data_inputs(p) if not g.is_const(t))
    return miss(f"{_desc(first) if first is not None else 'a graph input'} writes it, not a convolution's or GEMM's epilogue")


# ---------------------------------------------------------------------------- epilogues (F2, F3)

@CONDITIONS.register("sole_consumer")
def c_sole_consumer(ctx, node, arg):
    """The node is the only consumer of the tensor the layer ends in, and that is no graph output."""
    g, t = ctx.graph, ctx.tensor
    if t is None:
        return miss("not reached from a layer")
    if g.is_graph_output(t):
        return miss(f"{t} is a graph output")
    others = [c for c, _ in g.data_consumers(t) if c is not node]
    if others:
        return miss(f"{t} also feeds {', '.join(_desc(c) for c in others)}; a layer has one output precision")
    return hit()


@CONDITIONS.register("constant_operand")
def c_constant_operand(ctx, node, arg):
    g = ctx.graph
    data = g.data_inputs(node)
    if len(data) != 1 or len(node.inputs) < 2:
        return miss(f"it has {len(data)} activation inputs, not one and a constant")
    return hit()


@CONDITIONS.register("single_data_input")
def c_single_data_input(ctx, node, arg):
    if len(ctx.graph.data_inputs(node)) != 1:
        return miss("it has more than one activation input")
    return hit()


@CONDITIONS.register("two_activations")
def c_two_activations(ctx, node, arg):
    if len(ctx.graph.data_inputs(node)) != 2:
        return miss("it does not add two activations")
    return hit()


@CONDITIONS.register("preferred_branch")
def c_preferred_branch(ctx, node, arg):
    """Add(a, b) with a conv chain on both sides fuses into the shallower one (TREX resnet18 qat:
    the downsample conv took `Add`, the main branch became its residual)."""
    target = ctx.candidates.get(node.name)
    if target is None:
        return miss("no input comes from a conv chain whose tensors have one consumer each")
    if ctx.layer is None or target != ctx.layer.anchor.name:
        return miss(f"it fuses into {target} instead (the shorter branch); this branch is its residual")
    return hit()


@CONDITIONS.register("no_broadcast")
def c_no_broadcast(ctx, node, arg):
    g = ctx.graph
    shapes = [g.tensors[t].shape for t in g.data_inputs(node) if g.tensors.get(t) is not None]
    if len(shapes) == 2 and all(shapes):
        a, b = shapes
        if len(a) != len(b) or any(x != y for x, y in zip(a[1:], b[1:]) if isinstance(x, int) and isinstance(y, int)):
            return miss(f"broadcasting Add {list(a)} + {list(b)} (only the batch may broadcast)")
    return hit()


@CONDITIONS.register("no_residual_yet")
def c_no_residual_yet(ctx, node, arg):
    if ctx.layer is not None and ctx.layer.residual is not None:
        return miss("the layer already fused one residual Add")
    return hit()


@CONDITIONS.register("after_activation")
def c_after_activation(ctx, node, arg):
    if ctx.layer is None or not ctx.layer.has_activation:
        return miss("no activation between the conv and the pool (ConvActPool needs Conv-Act)")
    return hit()


@CONDITIONS.register("int8_op")
def c_int8_op(ctx, node, arg):
    if not node.int8:
        return miss(f"{node.name} runs in float (propagation did not move Q/DQ across it)")
    return hit()


@CONDITIONS.register("output_int8")
def c_output_int8(ctx, node, arg):
    if ctx.layer is None or not ctx.layer.out_int8:
        why = ctx.layer.float_reason if ctx.layer is not None and ctx.layer.float_reason else "no Q was absorbed"
        return miss(f"the layer's output is float ({why})")
    return hit()


@CONDITIONS.register("layer_int8")
def c_layer_int8(ctx, node, arg):
    """The layer runs INT8: its first input is INT8 (a float-input layer takes no output scale)."""
    layer = ctx.layer
    if layer is None or not layer.inputs or not ctx.graph.is_int8(layer.inputs[0]):
        return miss("the layer runs in float (its input is not dequantized)")
    return hit()


@CONDITIONS.register("residual_int8")
def c_residual_int8(ctx, node, arg):
    """F3: a fused residual Add outputs in the residual's precision, so an INT8 output needs an INT8
    (dequantized) residual."""
    layer = ctx.layer
    if layer is None or layer.residual is None:
        return hit()
    p = ctx.graph.producer(layer.residual)
    if p is None or p.role != DQ:
        return miss(f"the fused residual {layer.residual} is float, so the output is float (F3)")
    return hit()


# ---------------------------------------------------------------------------- non-weighted ops (F4)

@CONDITIONS.register("sole_q_output")
def c_sole_q_output(ctx, node, arg):
    """The op's one output feeds exactly one consumer, a Q (F4: INT8 in needs INT8 out)."""
    g = ctx.graph
    outs = [o for o in node.outputs if o]
    if len(outs) != 1:
        return miss("it has more than one output")
    o = outs[0]
    if g.is_graph_output(o):
        return miss(f"its output {o} is a graph output")
    cons = g.data_consumers(o)
    if len(cons) != 1 or cons[0][0].role != Q:
        names = ", ".join(_desc(c) for c, _ in cons) or "nothing"
        return miss(f"its output feeds {names}, not one Q: a non-weighted op with INT8 inputs needs an INT8 output (F4)")
    return hit()


@CONDITIONS.register("spatial_reduce")
def c_spatial_reduce(ctx, node, arg):
    """ReduceMean over all spatial axes of an NCHW tensor (a global average pool)."""
    g = ctx.graph
    shape = g.tensors[node.inputs[0]].shape if g.tensors.get(node.inputs[0]) else None
    axes = node.attrs.get("axes")
    if axes is None and len(node.inputs) > 1 and node.inputs[1]:
        v = g.const(node.inputs[1])
        axes = None if v is None else [int(a) for a in v.reshape(-1)]
    if shape is None or axes is None:
        return miss("axes or rank unknown")
    rank = len(shape)
    axes = sorted(a % rank for a in axes)
    if rank < 3 or axes != list(range(2, rank)):
        return miss(f"it reduces axes {axes} of a rank-{rank} tensor, not the spatial axes")
    return hit()


@CONDITIONS.register("feeds_fc")
def c_feeds_fc(ctx, node, arg):
    """The reshape's output goes (directly or through one DQ) only into the activation input of a
    fully connected layer (op class in `arg`, e.g. "gemm|matmul")."""
    g = ctx.graph
    classes = arg.split("|") if arg else ["gemm", "matmul"]
    outs = [o for o in node.outputs if o]
    if len(outs) != 1 or g.is_graph_output(outs[0]):
        return miss("its output is not a single internal tensor")
    cons = g.data_consumers(outs[0])
    if len(cons) == 1 and cons[0][0].role == DQ and not g.is_graph_output(cons[0][0].outputs[0]):
        cons = g.data_consumers(cons[0][0].outputs[0])
    if not cons or any(i != 0 or not any(g.vocab.is_(c, k) for k in classes) for c, i in cons) or len(cons) != 1:
        return miss(f"its output does not feed one {'/'.join(classes)} input")
    return hit()


@CONDITIONS.register("swish_pair")
def c_swish_pair(ctx, node, arg):
    """x -> {gate, Mul(x, gate(x))}: SiLU/Swish, fused into the conv as one pointwise epilogue (P9)."""
    g, t = ctx.graph, ctx.tensor
    if t is None or g.is_graph_output(t):
        return miss("not reached from a layer")
    cons = {c.name: c for c, _ in g.consumers(t)}
    gate_out = node.outputs[0]
    muls = [c for c in cons.values() if c is not node and g.vocab.is_(c, "mul")
            and sorted(c.inputs) == sorted([t, gate_out])]
    if len(cons) != 2 or len(muls) != 1:
        return miss(f"{t} does not feed exactly the gate and Mul(x, gate(x))")
    if g.is_graph_output(gate_out) or len(g.consumers(gate_out)) != 1:
        return miss("the gate output is used elsewhere")
    return hit()


def pointwise_region(ctx: Context, t: str) -> tuple[list, str | None, str]:
    """`region_from(ctx.graph, t)`, kept in `ctx.memo` (its nodes are not to be changed)."""
    key = ("pointwise_region", t)
    found = ctx.memo.get(key)
    if found is None:
        found = ctx.memo[key] = region_from(ctx.graph, t)
    return found


@CONDITIONS.register("pointwise_region")
def c_pointwise_region(ctx, node, arg):
    """The node starts a region of >= 2 pointwise ops with one input (the layer's output) and one
    output: TensorRT fuses adjacent pointwise layers into one PointWise op, a generic
    single-in/single-out epilogue (F2)."""
    if ctx.tensor is None or ctx.graph.is_graph_output(ctx.tensor):
        return miss("not reached from a layer")
    nodes, out, why = pointwise_region(ctx, ctx.tensor)
    if out is None:
        return miss(why)
    if len(nodes) < 2:
        return miss("a single pointwise op (the other epilogue rules apply)")
    if node not in nodes:
        return miss(f"{node.name} is not in the pointwise region of {ctx.tensor}")
    return hit()


@CONDITIONS.register("requant")
def c_requant(ctx, node, arg):
    if node.role != REQUANT:
        return miss("not a requantize")
    return hit()


@CONDITIONS.register("inference_no_op")
def c_inference_no_op(ctx, node, arg):
    """Identity, or a Dropout whose mask is unused and whose training_mode is absent or false."""
    g = ctx.graph
    mask_used = len(node.outputs) > 1 and bool(node.outputs[1]) and (
        bool(g.consumers(node.outputs[1])) or g.is_graph_output(node.outputs[1]))
    training = None
    if len(node.inputs) > 2 and node.inputs[2]:
        v = g.const(node.inputs[2])
        training = ... if v is None else v
    if not inference_no_op(g.vocab.is_(node, "dropout"), training, mask_used):
        return miss("a Dropout in training mode, or with its mask used")
    return hit()


@CONDITIONS.register("op_node")
def c_op_node(ctx, node, arg):
    if node.role != OP:
        return miss("a Q/DQ node")
    return hit()


def op_matches(g: SimGraph, rule, node: SNode) -> bool:
    return _op_matches(g.vocab, rule.op, node)


def holds(ctx: Context, rule, node: SNode) -> Match:
    """`evaluate` for a rule whose op class the caller knows to hold `node` (SimRuleSet.for_op):
    its conditions in order, the first failure explains."""
    return CONDITIONS.evaluate(rule.when, ctx, node)


def evaluate(ctx: Context, rule, node: SNode) -> Match:
    """The op class, then each condition in order; the first failure explains."""
    if not op_matches(ctx.graph, rule, node):
        return miss(f"{node.op} is not in op class {rule.op!r}")
    m = CONDITIONS.evaluate(rule.when, ctx, node)
    return hit() if m.ok else m


def attention_block(g: SimGraph, node: SNode):
    """The attention block whose first GEMM is `node`, in the simulator's graph (Q/DQ on the path
    from the Softmax to the second GEMM are part of it), or None."""
    if node.role != OP or not g.vocab.is_(node, "matmul"):
        return None
    return attention.from_scores(g, node)


@CONDITIONS.register("attention_int8")
def c_attention_int8(ctx, node, arg):
    """The node is the first GEMM of an attention block whose four GEMM inputs (q, k, the
    probabilities, v) come from DQs, with the probabilities quantized right after the Softmax."""
    g = ctx.graph
    block = attention_block(g, node)
    if block is None:
        return miss("not the first GEMM of an attention block")
    for gemm, label in ((block.bmm1, "q/k"), (block.bmm2, "probabilities/v")):
        for t in gemm.inputs[:2]:
            p = g.producer(t) if t else None
            if p is None or p.role != DQ:
                return miss(f"the {label} input {t} of {gemm.name} is float, so the fused INT8 attention does not apply")
    after = [c for c, _ in g.consumers(block.softmax.outputs[0])]
    if len(after) != 1 or after[0].role != Q:
        return miss(f"the output of {block.softmax.name} is not quantized right after it")
    return hit()
