"""The conditions placement rules may name in `when` (CONDITIONS, a closed registry).

Each is `cond(ctx, node, arg) -> Match` over a GraphView of the float graph (`ctx.graph`) and the
plan so far (`ctx.plan`, read by stage-2 rules): `hit(note, **captures)` or `miss(reason)`, the
reason being the answer to "why was this node not quantized by that rule".
"""
from __future__ import annotations

import re
from collections import deque

import numpy as np
import onnx_graphsurgeon as gs

from ..graph import attention
from ..errors import QdqError
from ..graph.pointwise import region_source
from ..rulebook.match import Conditions, hit, miss
from ..graph.view import GraphView

CONDITIONS = Conditions("placement")

# ONNX attribute defaults that conditions compare against.
_ATTR_DEFAULTS = {"group": 1, "transA": 0, "transB": 0}


def _inp(node: gs.Node, i: int):
    return node.inputs[i] if i < len(node.inputs) and node.inputs[i].name != "" else None


@CONDITIONS.register("op_type")
def c_op_type(ctx, node, arg):
    ok = node.op == arg
    return hit() if ok else miss(f"op is {node.op}, not {arg}")


def _float_activation(ctx, t, label):
    v = ctx.graph
    if t is None:
        return miss(f"{label} is missing")
    if v.is_constant(t):
        return miss(f"{label} '{t.name}' is a constant")
    if v.dtype(t) is None:
        return miss(f"{label} '{t.name}' has no known type (shape inference could not type it)")
    if not v.is_float(t):
        return miss(f"{label} '{t.name}' is {np.dtype(v.dtype(t)).name}, not float (integer tensors are never quantized)")
    if t.name in v.integer_derived and not exact_zero_one(v, t):
        return miss(f"{label} '{t.name}' is on an integer path (from '{v.integer_derived[t.name]}')")
    return hit()


def exact_zero_one(v: GraphView, t: gs.Tensor) -> bool:
    """A Cast from bool (a one-hot or mask) holds only 0 and 1, which INT8 represents exactly
    (amax 1: 1 -> 127): quantizing it loses nothing and lets its consumer run INT8."""
    p = v.producer(t)
    if p is None or not v.vocab.is_(p, "cast") or not p.inputs:
        return False
    d = v.dtype(p.inputs[0])
    return d is not None and np.dtype(d) == np.bool_


@CONDITIONS.register("float_input")
def c_float_input(ctx, node, arg):
    i = int(arg)
    return _float_activation(ctx, _inp(node, i), f"input {i}")


@CONDITIONS.register("all_inputs_float")
def c_all_inputs_float(ctx, node, arg):
    for i, t in enumerate(node.inputs):
        m = _float_activation(ctx, t if t.name else None, f"input {i}")
        if not m:
            return m
    return hit()


@CONDITIONS.register("constant_weight")
def c_constant_weight(ctx, node, arg):
    i = int(arg)
    t = _inp(node, i)
    if t is None:
        return miss(f"input {i} is missing")
    val = ctx.graph.constant_value(t)
    if val is None:
        return miss(f"input {i} '{t.name}' is not a constant weight")
    if not np.issubdtype(val.dtype, np.floating):
        return miss(f"input {i} '{t.name}' is {val.dtype}, not a float weight")
    return hit()


@CONDITIONS.register("weight_rank")
def c_weight_rank(ctx, node, arg):
    i, rank = (int(x) for x in arg.split("="))
    t = _inp(node, i)
    val = ctx.graph.constant_value(t) if t is not None else None
    got = None if val is None else val.ndim
    return hit() if got == rank else miss(f"input {i} has rank {got}, not {rank}")


_ATTR = re.compile(r"^(\w+)(=|!=|>|<)(-?\d+)$")


@CONDITIONS.register("attr")
def c_attr(ctx, node, arg):
    m = _ATTR.match(arg)
    if not m:
        raise ValueError(f"bad attr condition {arg!r}")
    name, op, val = m.group(1), m.group(2), int(m.group(3))
    got = node.attrs.get(name, _ATTR_DEFAULTS.get(name))
    ok = {"=": got == val, "!=": got != val, ">": got is not None and got > val,
          "<": got is not None and got < val}[op]
    return hit() if ok else miss(f"{name} is {got}, rule needs {name}{op}{val}")


@CONDITIONS.register("is_weighted")
def c_is_weighted(ctx, node, arg):
    ok = ctx.graph.vocab.is_(node, "weighted")
    return hit() if ok else miss(f"{node.op} is not a weighted op")


@CONDITIONS.register("feeds_graph_output")
def c_feeds_graph_output(ctx, node, arg):
    found = [o.name for o in node.outputs if ctx.graph.is_graph_output(o)]
    return hit(f"its output '{found[0]}' is a graph output") if found else miss("its output is not a graph output")


def _static(d):
    return d if isinstance(d, (int, np.integer)) and d >= 0 else None


@CONDITIONS.register("is_gemv")
def c_is_gemv(ctx, node, arg):
    """M or N == 1 for MatMul/Gemm (read from the output shape)."""
    if not (ctx.graph.vocab.is_(node, "gemm") or ctx.graph.vocab.is_(node, "matmul")):
        return miss("not a GEMM")
    shape = ctx.graph.shape(node.outputs[0])
    if not shape:
        return miss("output shape unknown")
    n = _static(shape[-1])
    m = _static(shape[-2]) if len(shape) >= 2 else 1
    if n == 1 or m == 1:
        return hit(f"output shape {list(shape)} has M or N == 1 (GEMV)")
    return miss(f"output shape {list(shape)} is a GEMM")


def _is_first_layer(ctx, node):
    t = node.inputs[0]
    seen = 0
    while t is not None and seen < 8:
        if t.name in ctx.graph.inputs:
            return True
        p = ctx.graph.producer(t)
        if p is None or not ctx.graph.vocab.is_(p, "copy"):
            return False
        t, seen = p.inputs[0], seen + 1
    return False


def _is_plain_conv(ctx, node) -> bool:
    """A Conv (not a ConvTranspose): its weight is [Cout, Cin/g, k...]."""
    return ctx.graph.vocab.is_(node, "conv") and not ctx.graph.vocab.is_(node, "conv_transpose")


@CONDITIONS.register("is_single_output_conv")
def c_is_single_output_conv(ctx, node, arg):
    """A Conv with one output channel: implicit GEMM with N == 1, so a GEMV (P10), whose INT8 input
    would cost a Q for almost no arithmetic (silero-vad's 128 -> 1 decoder head)."""
    if not _is_plain_conv(ctx, node):
        return miss("not a Conv")
    w = ctx.graph.constant_value(node.inputs[1]) if len(node.inputs) > 1 else None
    if w is None or w.ndim < 3:
        return miss("weight unknown")
    if int(w.shape[0]) != 1:
        return miss(f"{int(w.shape[0])} output channels")
    return hit("1 output channel (a GEMV per position)")


@CONDITIONS.register("is_tiny_conv")
def c_is_tiny_conv(ctx, node, arg):
    """Convs with < 16 input or output channels, except shapes INT8 kernels handle well (P10)."""
    if not _is_plain_conv(ctx, node):
        return miss("not a Conv")
    w = ctx.graph.constant_value(node.inputs[1]) if len(node.inputs) > 1 else None
    if w is None or w.ndim < 3:
        return miss("weight unknown")
    group = node.attrs.get("group", 1)
    oc, ic = int(w.shape[0]), int(w.shape[1]) * group
    kernel = tuple(int(k) for k in w.shape[2:])
    if ic >= 16 and oc >= 16:
        return miss(f"{ic} in / {oc} out channels")
    if group == 1:
        ok = (oc % 8 == 0 or ic % 8 == 0) and len(set(kernel)) == 1 and (_is_first_layer(ctx, node) or max(ic, oc) >= 16)
    else:
        ok = oc % 8 == 0 and all(k >= 3 for k in kernel)
    if ok:
        return miss(f"{ic} in / {oc} out channels, but the shape suits INT8 kernels")
    return hit(f"{ic} in / {oc} out channels (< 16), kernel {list(kernel)}, group {group}")


@CONDITIONS.register("on_squeeze_branch")
def c_on_squeeze_branch(ctx, node, arg):
    """The op computes on the global pool of a tensor another op also reads, through at most a few
    weighted or pointwise ops: the squeeze and excite convs of a squeeze-excite block (the gate
    multiplies the pooled tensor)."""
    v = ctx.graph
    t = _inp(node, 0)
    for _ in range(6):
        p = v.producer(t) if t is not None else None
        if p is None:
            break
        if v.vocab.is_(p, "avg_pool") or v.vocab.is_(p, "reduce_mean"):
            x = _inp(p, 0)
            readers = [c for c, _ in v.consumers(x)] if x is not None else []
            if len(readers) < 2:
                return miss(f"the pool {p.name} reads '{x.name if x is not None else '?'}', which nothing else reads")
            return hit(f"it computes on {p.name}, a pool of '{x.name}', which {len(readers) - 1} other op(s) also read")
        data = list({i.name: i for i in p.inputs if i.name and not v.is_constant(i)}.values())
        if len(data) == 2:                        # x * sigmoid(x): follow x
            gates = [d for d in data if (q := v.producer(d)) is not None and any(_inp(q, 0) is o for o in data)]
            data = [d for d in data if d not in gates] if len(gates) == 1 else data
        if len(data) != 1 or not any(v.vocab.is_(p, c) for c in ("weighted", "elementwise", "epilogue")):
            break
        t = data[0]
    return miss("no global pool of a shared tensor before it")


@CONDITIONS.register("fp8_conv_shape")
def c_fp8_conv_shape(ctx, node, arg):
    """A Conv TensorRT's FP8 kernels take: more than 16 input and output channels and a filter of
    at most 32 elements (Model Optimizer's FP8 limits: smaller-channel or larger-filter convs are
    slower in FP8 than in FP16). `arg`: "MIN_CHANNELS/MAX_FILTER", e.g. "16/32"."""
    try:
        min_channels, max_filter = (int(x) for x in arg.split("/"))
    except ValueError:
        raise QdqError(f"fp8_conv_shape takes MIN_CHANNELS/MAX_FILTER, e.g. 16/32, not {arg!r}",
                       "fix the rule file") from None
    if not _is_plain_conv(ctx, node):
        return miss("not a Conv")
    w = ctx.graph.constant_value(node.inputs[1]) if len(node.inputs) > 1 else None
    if w is None or w.ndim < 3:
        return miss("weight unknown")
    oc, ic = int(w.shape[0]), int(w.shape[1]) * node.attrs.get("group", 1)
    area = int(np.prod(w.shape[2:]))
    if oc <= min_channels or ic <= min_channels:
        return miss(f"{ic} in / {oc} out channels (FP8 convolution needs more than {min_channels})")
    if area > max_filter:
        return miss(f"a filter of {area} elements (FP8 convolution takes at most {max_filter})")
    return hit(f"{ic} in / {oc} out channels, filter {area}")


def _backbone(ctx, t: gs.Tensor, limit=6):
    """The Conv at the head of a conv pattern ending in tensor t (Conv[->BN][->Act][->Dropout],
    bias or constant-scale ops allowed, an activation possibly decomposed into pointwise ops),
    each tensor on it used once; else None."""
    v = ctx.graph
    for _ in range(limit):
        if len(v.consumers(t)) != 1 or v.is_graph_output(t):
            return None
        p = v.producer(t)
        if p is None:
            return None
        if v.vocab.is_(p, "conv"):
            return p
        nxt = _passthrough_input(v, p)
        conv, t = (None, nxt) if nxt is not None else _over_activation(v, t)
        if t is None:
            return conv
    return None


def _passthrough_input(v, p: gs.Node) -> gs.Tensor | None:
    """The one activation input of a BN, an epilogue op, a no-op, or an Add/Mul of a constant (ops a
    conv pattern may hold after its Conv); None for another op."""
    nonconst = [i for i in p.inputs if i.name and not v.is_constant(i)]
    passthrough = (v.vocab.is_(p, "batchnorm") or v.vocab.is_(p, "epilogue") or v.vocab.is_(p, "no_op")
                   or ((v.vocab.is_(p, "add") or v.vocab.is_(p, "mul")) and len(nonconst) == 1))
    return nonconst[0] if passthrough and len(nonconst) == 1 else None


def _over_activation(v, t: gs.Tensor):
    """_backbone's step back over a decomposed activation (F2) that ends in `t`: (the Conv that makes
    its input, None), (None, the tensor to go on from), or (None, None) where the pattern ends."""
    x = region_source(v.named(), t.name)
    if x is None:
        return None, None
    x = v.tensors[x]
    p = v.producer(x)
    if p is None:
        return None, None
    if v.vocab.is_(p, "conv"):
        return p, None
    if len(v.consumers(x)) == 1:
        return None, x
    # x feeds the whole region: step over it to its producer's input
    nonconst = [i for i in p.inputs if i.name and not v.is_constant(i)]
    if not (v.vocab.is_(p, "batchnorm") or v.vocab.is_(p, "epilogue")) or len(nonconst) != 1:
        return None, None
    return None, nonconst[0]


def _ancestor_distances(ctx, t: gs.Tensor, limit=4000) -> dict[str, int]:
    dist: dict[str, int] = {}
    q = deque([(t, 0)])
    while q and len(dist) < limit:
        cur, d = q.popleft()
        p = ctx.graph.producer(cur)
        if p is None or p.name in dist:
            continue
        dist[p.name] = d
        for i in p.inputs:
            if i.name and not ctx.graph.is_constant(i):
                q.append((i, d + 1))
    return dist


@CONDITIONS.register("residual_skip", captures=("skip",))
def c_residual_skip(ctx, node, arg):
    """Add(a, b) with a conv pattern on one side: capture the other side (the skip)."""
    v = ctx.graph
    live = [(i, t) for i, t in enumerate(node.inputs) if t.name and not v.is_constant(t)]
    if len(live) != 2:
        return miss("not an Add of two activations")
    for i, t in live:
        m = _float_activation(ctx, t, f"input {i}")
        if not m:
            return m
    (ia, a), (ib, b) = live
    sa, sb = v.shape(a), v.shape(b)
    if sa and sb and len(sa) == len(sb) and any(
            x != y for x, y in zip(sa[1:], sb[1:]) if _static(x) is not None and _static(y) is not None):
        return miss(f"broadcasting Add {list(sa)} + {list(sb)} does not fuse into a conv epilogue")
    ba, bb = _backbone(ctx, a), _backbone(ctx, b)
    if ba is None and bb is None:
        return miss("neither input comes from a conv pattern (Conv[->BN][->Act]) used only here")
    if ba is not None and bb is None:
        return hit(skip=ib)
    if bb is not None and ba is None:
        return hit(skip=ia)
    # Both sides are conv patterns: the branch with more nodes since the nearest common ancestor is
    # the main branch and stays float; the shorter one (a projection shortcut) is the skip.
    da, db = _ancestor_distances(ctx, a), _ancestor_distances(ctx, b)
    common = set(da) & set(db)
    if not common:
        return hit(skip=ib)
    lca = min(common, key=lambda n: (da[n] + db[n], n))
    return hit(skip=ia if da[lca] < db[lca] else ib)


@CONDITIONS.register("residual_branch_quantized")
def c_residual_branch_quantized(ctx, node, arg):
    """The conv at the head of the residual Add's branch (the input that is not its skip) is quantized
    in the plan so far. Stage 1 decides nodes in graph order, so that conv is decided already."""
    found = c_residual_skip(ctx, node, arg)
    if not found:
        return found
    skip = found.captures["skip"]
    v = ctx.graph
    branch = [t for i, t in enumerate(node.inputs) if i != skip and t.name and not v.is_constant(t)]
    conv = _backbone(ctx, branch[0]) if branch else None
    if conv is None:
        return miss("no conv pattern on the branch beside the skip")
    d = ctx.plan.decisions.get(conv.name)
    if d is None or not d.quantized:
        why = f" ({d.rule})" if d is not None else ""
        return miss(f"the conv on the branch beside the skip runs in float{why}, so the Add cannot run in its INT8 "
                    "epilogue and a Q/DQ on the skip would be a standalone reformat (F6)")
    return hit()


def _gate_source(ctx, t, other: gs.Tensor, limit=10):
    """Walk back from a gate tensor: 'se' if it reaches a global pooling, 'self' if it reaches
    `other` (x * sigmoid(x)), else None."""
    v = ctx.graph
    for _ in range(limit):
        if t is other:
            return "self"
        p = v.producer(t)
        if p is None:
            return None
        if v.vocab.is_(p, "avg_pool") or v.vocab.is_(p, "reduce_mean"):
            return "se"
        nonconst = [i for i in p.inputs if i.name and not v.is_constant(i)]
        if not nonconst:
            return None
        t = nonconst[0]
    return None


@CONDITIONS.register("se_gate_mul")
def c_se_gate_mul(ctx, node, arg):
    v = ctx.graph
    live = [t for t in node.inputs if t.name and not v.is_constant(t)]
    if len(live) != 2:
        return miss("not a Mul of two activations")
    for i, t in enumerate(live):
        m = _float_activation(ctx, t, f"input {i}")
        if not m:
            return m
    for gate, other in ((live[1], live[0]), (live[0], live[1])):
        p = v.producer(gate)
        if p is not None and v.vocab.is_(p, "gate"):
            src = _gate_source(ctx, p.inputs[0], other)
            if src == "se":
                return hit()
            if src == "self":
                return miss("x * gate(x) (SiLU/Swish) fuses into the conv epilogue unquantized")
    return miss("no input is a squeeze-excite gate (Sigmoid/HardSigmoid of a pooled branch)")


@CONDITIONS.register("se_gate_int8")
def c_se_gate_int8(ctx, node, arg):
    """Stage 2: the conv that computes the SE gate (before its activation and bias Add) is INT8, so a
    Q on the gate fuses into that conv's epilogue; after a float conv it would be a standalone reformat."""
    v = ctx.graph
    for gate in [t for t in node.inputs if t.name and not v.is_constant(t)]:
        p = v.producer(gate)
        if p is None or not v.vocab.is_(p, "gate"):
            continue
        t = p.inputs[0]
        for _ in range(4):
            q = v.producer(t)
            if q is None:
                break
            if v.vocab.is_(q, "weighted"):
                d = ctx.plan.decisions.get(q.name)
                if d is not None and d.quantized:
                    return hit()
                return miss(f"the gate's conv {q.name} runs in float, so a Q on the gate would be a "
                               "standalone reformat (F6)")
            live = [i for i in q.inputs if i.name and not v.is_constant(i)]
            if len(live) != 1 or not (v.vocab.is_(q, "epilogue") or v.vocab.is_(q, "batchnorm")
                                      or v.vocab.is_(q, "elementwise")):
                break
            t = live[0]
    return miss("no conv found behind the gate")


@CONDITIONS.register("output_quantized")
def c_output_quantized(ctx, node, arg):
    for c, i in ctx.graph.through(node.outputs[0]):
        if ctx.plan.is_quantized_edge((c.name, i)):
            return hit()
    return miss("its output feeds no quantized consumer: without a Q after it, it would run in float (F4)")


def _attention(ctx, node):
    """The attention block `node` is a batched GEMM of, cached per view: (block, role) or None."""
    cache = ctx.graph.memo.setdefault("attention", {})
    if node.name not in cache:
        cache[node.name] = attention.of(ctx.graph.named(), node) if ctx.graph.vocab.is_(node, "matmul") else None
    return cache[node.name]


@CONDITIONS.register("attention", captures=("probs", "values"))
def c_attention(ctx, node, arg):
    """The node is the first ("scores": Q x K^T) or second ("context": probabilities x V) batched
    GEMM of an attention block: two MatMuls around a Softmax (qdqgraph.graph.attention); "any": either."""
    found = _attention(ctx, node)
    if found is None:
        return miss("not a batched GEMM of an attention block (MatMul -> ... -> Softmax -> ... -> MatMul)")
    block, role = found
    if arg not in ("any", role):
        return miss(f"it is the {role} GEMM of the attention block, not the {arg} one")
    return hit(f"{role} GEMM of the attention block {block.bmm1.name} -> {block.softmax.name} -> {block.bmm2.name}",
               probs=block.probs_input, values=1 - block.probs_input)


def _attention_length(ctx, node):
    """The attention's sequence length: the Softmax axis of its scores, if static."""
    found = _attention(ctx, node)
    if found is None:
        return None
    sm = found[0].softmax
    shape = ctx.graph.shape(sm.outputs[0]) if sm.outputs else None
    if not shape:
        return None
    axis = sm.attrs.get("axis", -1)
    d = shape[axis] if -len(shape) <= axis < len(shape) else None
    return d if isinstance(d, (int, np.integer)) and d > 0 else None


@CONDITIONS.register("attention_head_size")
def c_attention_head_size(ctx, node, arg):
    """The attention's head size (the reduction length of its first GEMM, q's last dimension) lies in
    LOW-HIGH and is a multiple of STEP: `arg` is "LOW-HIGH/STEP". Not fixed in the model: a hit,
    with the limits in the reason."""
    try:
        span, step = arg.split("/")
        low, high = (int(x) for x in span.split("-"))
        step = int(step)
    except ValueError:
        raise QdqError(f"attention_head_size takes LOW-HIGH/STEP, e.g. 9-256/16, not {arg!r}",
                       "fix the rule file") from None
    found = _attention(ctx, node)
    if found is None:
        return miss("not a batched GEMM of an attention block")
    shape = ctx.graph.shape(found[0].bmm1.inputs[0])
    h = shape[-1] if shape else None
    if not isinstance(h, (int, np.integer)) or h <= 0:
        return hit(f"head size not fixed in the model (the fused attention needs {low}..{high}, a multiple of {step})")
    if not (low <= h <= high and h % step == 0):
        return miss(f"head size {h} is not a multiple of {step} in {low}..{high}")
    return hit(f"head size {h}")


@CONDITIONS.register("attention_length")
def c_attention_length(ctx, node, arg):
    """The attention's sequence length is at most `arg` (or not fixed in the model: then the engine's
    shapes decide, and the note says so)."""
    limit = int(arg)
    n = _attention_length(ctx, node)
    if n is None:
        return hit(f"sequence length not fixed in the model (INT8 attention needs it <= {limit})")
    if n > limit:
        return miss(f"sequence length {n} > {limit}: TensorRT's fused attention covers at most {limit} here")
    return hit(f"sequence length {n}")

