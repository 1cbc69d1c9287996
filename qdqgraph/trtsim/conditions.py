"""The closed registry of conditions that simulator rules may name in `when`.

A condition is `cond(ctx, node, arg) -> (holds, reason)`; the reason says why it does not hold
(it becomes the answer to "why was this Q/DQ not absorbed?"). `evaluate` runs a rule's conditions
in order and stops at the first that fails.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..ops import attr_str, nearest_resize
from .ir import DQ, OP, Q, REQUANT, SimGraph, SNode


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


@dataclass
class Ctx:
    g: SimGraph
    layer: LayerBuild | None = None
    tensor: str | None = None                 # the edge through which the node was reached
    candidates: dict = field(default_factory=dict)   # Add node name -> weighted node it fuses into


def _desc(node: SNode) -> str:
    return f"{node.name} ({node.op})"


# ---------------------------------------------------------------------------- propagation (R2, R5, R6)

def c_sole_equal_q_consumers(ctx, node, arg):
    """Every consumer of every used output is a Q, all with identical parameters (R5-b, R5-c)."""
    g, qs = ctx.g, []
    for o in node.outputs:
        cons = g.data_consumers(o) if o else []
        for c, _ in cons:
            if c.role != Q:
                return False, f"output {o} also feeds {_desc(c)}, a float consumer (R5-b)"
            qs.append(c)
    if not qs:
        return False, "its output feeds no Q"
    if any(not q.qp.same(qs[0].qp) for q in qs[1:]):
        return False, f"the Qs on its output ({', '.join(q.name for q in qs)}) have different scales (R5-c)"
    return True, ""


def c_outputs_not_graph_outputs(ctx, node, arg):
    for o in node.outputs:
        if o and ctx.g.is_graph_output(o):
            return False, f"its output {o} is a graph output (R5-d)"
    return True, ""


def c_inputs_not_graph_inputs(ctx, node, arg):
    for t in ctx.g.data_inputs(node):
        if ctx.g.is_graph_input(t):
            return False, f"its input {t} is a graph input (R5-d)"
    return True, ""


def c_zero_constants(ctx, node, arg):
    """Float constant operands must be 0, the one value every Q/DQ maps to itself (zero point 0)."""
    for t in ctx.g.float_constant_inputs(node):
        v = ctx.g.const(t)
        if v is not None and v.size and (v != 0).any():
            return False, f"constant operand {t} is not 0, so Q does not commute with it"
    return True, ""


def c_pad_constant_mode(ctx, node, arg):
    if not ctx.g.vocab.is_(node, "pad"):
        return True, ""
    mode = node.attrs.get("mode", "constant")
    mode = mode.decode() if isinstance(mode, bytes) else str(mode)
    if mode != "constant":
        return False, f"Pad mode is {mode}, not constant"
    return True, ""


def c_resize_nearest(ctx, node, arg):
    """Resize (or Upsample) in nearest mode, whose only activation is its data input."""
    if not nearest_resize(node.attrs):
        return False, f"Resize mode is {attr_str(node.attrs, 'mode', 'nearest')}, not nearest: it computes new values"
    if ctx.g.data_inputs(node)[1:]:
        return False, "its scales or sizes are not constants"
    return True, ""


def c_not_int8(ctx, node, arg):
    if node.int8:
        return False, f"it already runs on INT8 (moved by {node.moved_by})"
    return True, ""


def c_float_outputs(ctx, node, arg):
    """Used outputs are all float (MaxPool's Indices output, for one, is not)."""
    for o in node.outputs:
        if o and ctx.g.consumers(o) and not ctx.g.is_float(o):
            return False, f"output {o} is not a float tensor"
    return True, ""


def c_has_data_input(ctx, node, arg):
    if not ctx.g.data_inputs(node):
        return False, "it has no activation input"
    return True, ""


def c_inputs_equal_dq(ctx, node, arg):
    """Every activation input comes from a DQ, all with identical parameters (R6, R7)."""
    g, dqs = ctx.g, []
    for t in g.data_inputs(node):
        p = g.producer(t)
        if p is None or p.role != DQ:
            return False, f"input {t} is not dequantized"
        dqs.append(p)
    if not dqs:
        return False, "it has no activation input"
    if any(not d.qp.same(dqs[0].qp) for d in dqs[1:]):
        return False, f"its inputs are dequantized with different scales ({', '.join(d.name for d in dqs)}) (R6, R7)"
    return True, ""


# ---------------------------------------------------------------------------- weights, merge, cancel

def c_constant_input(ctx, node, arg):
    """Input 0 is a constant of the given kind: "int8" or "float"."""
    t = node.inputs[0]
    v = ctx.g.const(t)
    if v is None or ctx.g.tensors[t].weight_of:
        return False, f"input {t} is not a constant"
    if arg == "int8" and v.dtype.kind not in "iu":
        return False, f"input {t} is a {v.dtype} constant, not an integer one"
    if arg == "float" and v.dtype.kind != "f":
        return False, f"input {t} is a {v.dtype} constant, not a float one"
    return True, ""


def c_quantized_constant(ctx, node, arg):
    """A DQ whose input is Q(float constant) with the same parameters."""
    p = ctx.g.producer(node.inputs[0])
    if p is None or p.role != Q:
        return False, "its input does not come from a Q"
    ok, why = c_constant_input(ctx, p, "float")
    if not ok:
        return False, f"{p.name}: {why}"
    if not p.qp.same(node.qp):
        return False, f"{p.name} and {node.name} have different parameters"
    return True, ""


def c_has_equal_sibling(ctx, node, arg):
    """Another node of the same role reads the same tensor with identical parameters."""
    t = node.inputs[0]
    for c, i in ctx.g.consumers(t):
        if c is not node and i == 0 and c.role == node.role and c.qp.same(node.qp):
            return True, ""
    return False, f"no other {node.op} on {t} with the same parameters"


def c_input_dequantized(ctx, node, arg):
    p = ctx.g.producer(node.inputs[0])
    if p is None or p.role != DQ:
        return False, f"its input comes from {_desc(p) if p else 'a graph input'}, not a DQ"
    return True, ""


def c_same_params_as_input(ctx, node, arg):
    p = ctx.g.producer(node.inputs[0])
    if p is None or p.qp is None or not p.qp.same(node.qp):
        return False, f"{p.name if p else 'its input'} and {node.name} have different scales"
    return True, ""


# ---------------------------------------------------------------------------- weighted layers (F1)

def _operands(g: SimGraph, node: SNode) -> list[str]:
    """The multiplied operands of a weighted op (input 0 and 1; a bias is not one)."""
    return [t for t in node.inputs[:2] if t]


def c_int8_weight(ctx, node, arg):
    """Every constant operand is an INT8 weight (folded Q/DQ); a MatMul of two activations has none."""
    g = ctx.g
    for t in _operands(g, node):
        if g.is_const(t) and not g.tensors[t].weight_of:
            return False, f"weight {t} is float (no Q/DQ on it)"
    return True, ""


def c_dequantized_inputs(ctx, node, arg):
    """Every activation operand (weighted ops: inputs 0-1; others: all) comes from a DQ."""
    g = ctx.g
    ins = [t for t in _operands(g, node) if not g.is_const(t)] if g.vocab.is_(node, "weighted") else g.data_inputs(node)
    if not ins:
        return False, "it has no activation input"
    for t in ins:
        p = g.producer(t)
        if p is None or p.role != DQ:
            return False, f"input {t} is float (comes from {_desc(p) if p else 'a graph input'}, not a DQ)"
    return True, ""


# ---------------------------------------------------------------------------- epilogues (F2, F3)

def c_sole_consumer(ctx, node, arg):
    """The node is the only consumer of the tensor the layer ends in, and that is no graph output."""
    g, t = ctx.g, ctx.tensor
    if t is None:
        return False, "not reached from a layer"
    if g.is_graph_output(t):
        return False, f"{t} is a graph output"
    others = [c for c, _ in g.data_consumers(t) if c is not node]
    if others:
        return False, f"{t} also feeds {', '.join(_desc(c) for c in others)}; a layer has one output precision"
    return True, ""


def c_constant_operand(ctx, node, arg):
    g = ctx.g
    data = g.data_inputs(node)
    if len(data) != 1 or len(node.inputs) < 2:
        return False, f"it has {len(data)} activation inputs, not one and a constant"
    return True, ""


def c_single_data_input(ctx, node, arg):
    if len(ctx.g.data_inputs(node)) != 1:
        return False, "it has more than one activation input"
    return True, ""


def c_two_activations(ctx, node, arg):
    if len(ctx.g.data_inputs(node)) != 2:
        return False, "it does not add two activations"
    return True, ""


def c_preferred_branch(ctx, node, arg):
    """Add(a, b) with a conv chain on both sides fuses into the shallower one (TREX resnet18 qat:
    the downsample conv took `Add`, the main branch became its residual)."""
    target = ctx.candidates.get(node.name)
    if target is None:
        return False, "no input comes from a conv chain whose tensors have one consumer each"
    if ctx.layer is None or target != ctx.layer.anchor.name:
        return False, f"it fuses into {target} instead (the shorter branch); this branch is its residual"
    return True, ""


def c_no_broadcast(ctx, node, arg):
    g = ctx.g
    shapes = [g.tensors[t].shape for t in g.data_inputs(node) if g.tensors.get(t) is not None]
    if len(shapes) == 2 and all(shapes):
        a, b = shapes
        if len(a) != len(b) or any(x != y for x, y in zip(a[1:], b[1:]) if isinstance(x, int) and isinstance(y, int)):
            return False, f"broadcasting Add {list(a)} + {list(b)} (only the batch may broadcast)"
    return True, ""


def c_no_residual_yet(ctx, node, arg):
    if ctx.layer is not None and ctx.layer.residual is not None:
        return False, "the layer already fused one residual Add"
    return True, ""


def c_after_activation(ctx, node, arg):
    if ctx.layer is None or not ctx.layer.has_activation:
        return False, "no activation between the conv and the pool (ConvActPool needs Conv-Act)"
    return True, ""


def c_int8_op(ctx, node, arg):
    if not node.int8:
        return False, f"{node.name} runs in float (propagation did not move Q/DQ across it)"
    return True, ""


def c_output_int8(ctx, node, arg):
    if ctx.layer is None or not ctx.layer.out_int8:
        why = ctx.layer.float_reason if ctx.layer is not None and ctx.layer.float_reason else "no Q was absorbed"
        return False, f"the layer's output is float ({why})"
    return True, ""


def c_layer_int8(ctx, node, arg):
    """The layer runs INT8: its first input is INT8 (a float-input layer takes no output scale)."""
    layer = ctx.layer
    if layer is None or not layer.inputs or not ctx.g.is_int8(layer.inputs[0]):
        return False, "the layer runs in float (its input is not dequantized)"
    return True, ""


def c_residual_int8(ctx, node, arg):
    """F3: a fused residual Add outputs in the residual's precision, so an INT8 output needs an INT8
    (dequantized) residual."""
    layer = ctx.layer
    if layer is None or layer.residual is None:
        return True, ""
    p = ctx.g.producer(layer.residual)
    if p is None or p.role != DQ:
        return False, f"the fused residual {layer.residual} is float, so the output is float (F3)"
    return True, ""


# ---------------------------------------------------------------------------- non-weighted ops (F4)

def c_sole_q_output(ctx, node, arg):
    """The op's one output feeds exactly one consumer, a Q (F4: INT8 in needs INT8 out)."""
    g = ctx.g
    outs = [o for o in node.outputs if o]
    if len(outs) != 1:
        return False, "it has more than one output"
    o = outs[0]
    if g.is_graph_output(o):
        return False, f"its output {o} is a graph output"
    cons = g.data_consumers(o)
    if len(cons) != 1 or cons[0][0].role != Q:
        names = ", ".join(_desc(c) for c, _ in cons) or "nothing"
        return False, f"its output feeds {names}, not one Q: a non-weighted op with INT8 inputs needs an INT8 output (F4)"
    return True, ""


def c_spatial_reduce(ctx, node, arg):
    """ReduceMean over all spatial axes of an NCHW tensor (a global average pool)."""
    g = ctx.g
    shape = g.tensors[node.inputs[0]].shape if g.tensors.get(node.inputs[0]) else None
    axes = node.attrs.get("axes")
    if axes is None and len(node.inputs) > 1 and node.inputs[1]:
        v = g.const(node.inputs[1])
        axes = None if v is None else [int(a) for a in v.reshape(-1)]
    if shape is None or axes is None:
        return False, "axes or rank unknown"
    rank = len(shape)
    axes = sorted(a % rank for a in axes)
    if rank < 3 or axes != list(range(2, rank)):
        return False, f"it reduces axes {axes} of a rank-{rank} tensor, not the spatial axes"
    return True, ""


def c_feeds_fc(ctx, node, arg):
    """The reshape's output goes (directly or through one DQ) only into the activation input of a
    fully connected layer (op class in `arg`, e.g. "gemm|matmul")."""
    g = ctx.g
    classes = arg.split("|") if arg else ["gemm", "matmul"]
    outs = [o for o in node.outputs if o]
    if len(outs) != 1 or g.is_graph_output(outs[0]):
        return False, "its output is not a single internal tensor"
    cons = g.data_consumers(outs[0])
    if len(cons) == 1 and cons[0][0].role == DQ and not g.is_graph_output(cons[0][0].outputs[0]):
        cons = g.data_consumers(cons[0][0].outputs[0])
    if not cons or any(i != 0 or not any(g.vocab.is_(c, k) for k in classes) for c, i in cons) or len(cons) != 1:
        return False, f"its output does not feed one {'/'.join(classes)} input"
    return True, ""


def c_swish_pair(ctx, node, arg):
    """x -> {gate, Mul(x, gate(x))}: SiLU/Swish, fused into the conv as one pointwise epilogue (P9)."""
    g, t = ctx.g, ctx.tensor
    if t is None or g.is_graph_output(t):
        return False, "not reached from a layer"
    cons = {c.name: c for c, _ in g.consumers(t)}
    gate_out = node.outputs[0]
    muls = [c for c in cons.values() if c is not node and g.vocab.is_(c, "mul")
            and sorted(c.inputs) == sorted([t, gate_out])]
    if len(cons) != 2 or len(muls) != 1:
        return False, f"{t} does not feed exactly the gate and Mul(x, gate(x))"
    if g.is_graph_output(gate_out) or len(g.consumers(gate_out)) != 1:
        return False, "the gate output is used elsewhere"
    return True, ""


MAX_REGION = 8      # pointwise nodes one generic PointWise epilogue may merge (a bound, not a TensorRT figure)


def pointwise_region(g: SimGraph, t: str) -> tuple[list[SNode], str | None, str]:
    """The pointwise ops fed, directly or through each other, by tensor `t` alone (their other
    operands constants): ([nodes in order], the one tensor leaving the region, reason if none).
    A decomposed HardSwish x*clip(x+3,0,6)/6 or an erf GELU after a conv or MatMul is one."""
    region: dict[str, SNode] = {}
    inside = {t}
    grew = True
    while grew:                          # fixpoint: an op joins once all its activation operands are inside
        grew = False
        for x in sorted(inside):
            for c, _ in g.consumers(x):
                if (c.name in region or c.role != OP
                        or not (g.vocab.is_(c, "elementwise") or g.vocab.is_(c, "epilogue"))
                        or any(d not in inside for d in g.data_inputs(c))):
                    continue
                region[c.name] = c
                inside.update(o for o in c.outputs if o)
                grew = True
                if len(region) > MAX_REGION:
                    return [], None, f"more than {MAX_REGION} pointwise ops"
    leaving = sorted({o for n in region.values() for o in n.outputs
                      if o and (g.is_graph_output(o) or any(c.name not in region for c, _ in g.consumers(o)))})
    if any(c.name not in region for c, _ in g.consumers(t)):
        return [], None, f"{t} also feeds ops outside the pointwise region"
    if len(leaving) != 1:
        return [], None, f"the pointwise region has {len(leaving)} outputs, not one"
    order = g.position()
    return sorted(region.values(), key=lambda n: order[n.name]), leaving[0], ""


def c_pointwise_region(ctx, node, arg):
    """The node starts a region of >= 2 pointwise ops with one input (the layer's output) and one
    output: TensorRT fuses adjacent pointwise layers into one PointWise op, a generic
    single-in/single-out epilogue (F2)."""
    if ctx.tensor is None or ctx.g.is_graph_output(ctx.tensor):
        return False, "not reached from a layer"
    nodes, out, why = pointwise_region(ctx.g, ctx.tensor)
    if out is None:
        return False, why
    if len(nodes) < 2:
        return False, "a single pointwise op (the other epilogue rules apply)"
    if node not in nodes:
        return False, f"{node.name} is not in the pointwise region of {ctx.tensor}"
    return True, ""


def c_requant(ctx, node, arg):
    if node.role != REQUANT:
        return False, "not a requantize"
    return True, ""


def c_inference_no_op(ctx, node, arg):
    """Identity, or a Dropout whose mask is unused and whose training_mode is absent or false."""
    from ..passes.no_ops import inference_no_op
    g = ctx.g
    mask_used = len(node.outputs) > 1 and bool(node.outputs[1]) and (
        bool(g.consumers(node.outputs[1])) or g.is_graph_output(node.outputs[1]))
    training = None
    if len(node.inputs) > 2 and node.inputs[2]:
        v = g.const(node.inputs[2])
        training = ... if v is None else v
    if not inference_no_op(g.vocab.is_(node, "dropout"), training, mask_used):
        return False, "a Dropout in training mode, or with its mask used"
    return True, ""


def c_op_node(ctx, node, arg):
    if node.role != OP:
        return False, "a Q/DQ node"
    return True, ""


CONDITIONS = {
    "pointwise_region": c_pointwise_region,
    "sole_equal_q_consumers": c_sole_equal_q_consumers, "outputs_not_graph_outputs": c_outputs_not_graph_outputs,
    "inputs_not_graph_inputs": c_inputs_not_graph_inputs, "zero_constants": c_zero_constants,
    "pad_constant_mode": c_pad_constant_mode, "not_int8": c_not_int8, "float_outputs": c_float_outputs,
    "has_data_input": c_has_data_input, "inputs_equal_dq": c_inputs_equal_dq,
    "constant_input": c_constant_input, "quantized_constant": c_quantized_constant,
    "has_equal_sibling": c_has_equal_sibling, "input_dequantized": c_input_dequantized,
    "same_params_as_input": c_same_params_as_input, "int8_weight": c_int8_weight,
    "dequantized_inputs": c_dequantized_inputs, "sole_consumer": c_sole_consumer,
    "constant_operand": c_constant_operand, "single_data_input": c_single_data_input,
    "two_activations": c_two_activations, "preferred_branch": c_preferred_branch, "no_broadcast": c_no_broadcast,
    "no_residual_yet": c_no_residual_yet, "after_activation": c_after_activation, "int8_op": c_int8_op,
    "output_int8": c_output_int8, "layer_int8": c_layer_int8, "residual_int8": c_residual_int8, "sole_q_output": c_sole_q_output,
    "spatial_reduce": c_spatial_reduce, "feeds_fc": c_feeds_fc, "swish_pair": c_swish_pair,
    "requant": c_requant, "op_node": c_op_node, "inference_no_op": c_inference_no_op,
    "resize_nearest": c_resize_nearest,
}


def op_matches(g: SimGraph, rule, node: SNode) -> bool:
    return rule.op == "any" or g.vocab.is_(node, rule.op)


def evaluate(ctx: Ctx, rule, node: SNode) -> tuple[bool, str]:
    """(holds, reason): the op class, then each condition in order; the first failure explains."""
    if not op_matches(ctx.g, rule, node):
        return False, f"{node.op} is not in op class {rule.op!r}"
    for cond in rule.when:
        neg = cond.startswith("not ")
        name, _, arg = cond.removeprefix("not ").partition(":")
        ok, why = CONDITIONS[name](ctx, node, arg)
        if neg:
            ok, why = (not ok), (f"{cond[4:]} holds" if ok else "")
        if not ok:
            return False, why
    return True, ""
