"""Whether a per-channel scale folded into a layer's output columns reaches a tensor's last axis column
for column, proved from shapes instead of a run.

The output-aware pass (and INT4 AWQ) fold a smoothing s into the layer that makes a tensor t, along
`fold_scale.producer_path`: through bias Adds, reshapes, transposes and the right operand of
MatMuls of two activations. t comes out divided by s only where every step keeps t's last axis the
layer's output columns, in order; a reshape that splits the columns one way and merges them another
does not. Each step is followed here on the path's shapes (ONNX shape inference at a calibration sample's
input shapes, `shapes`; a dimension inference leaves symbolic is a name, solved where the step
fixes it): the layer's column index c is carried as factors of its mixed-radix digits, (stride,
size) meaning (c // stride) % size, beside the factors of the other axes. A reshape re-cuts the row-major sequence of factors, a transpose permutes the axes, a
MatMul contracts its right operand's second-to-last axis (which must carry no digit of c) and keeps
its last; a bias Add changes no shape. The fold is proved when t's last axis carries exactly c,
whole and in order, and no other axis carries any of it. Anything else (a shape that is not known where
it matters, another op, a shape that does not add up) proves nothing, and the caller checks the fold on a sample as
before: the proof only spares that run where it holds.
"""
from __future__ import annotations

import math

import onnx_graphsurgeon as gs

from ..graph.view import GraphView
from .fold_scale import MAX_PATH, path_tensors

# a factor of an axis: ("c", stride, size), a digit of the column index (its size an int); or
# ("x", size), a part of an axis the columns do not run over (its size an int, or a symbol's name)
Factor = tuple
Dim = int | str


def proved(view: GraphView, t: gs.Tensor, shapes: dict[str, tuple], seen: tuple[int, ...] | None = None) -> bool:
    """Does dividing the output columns of the layer at the end of t's producer path divide t's
    last axis column for column? `shapes`: tensor name -> its shape (see the module doc); `seen`:
    t's shape on the sample, which fixes the symbols of its inferred shape."""
    names = path_tensors(view, t, MAX_PATH)
    if len(names) < 2:
        return False
    env: dict[str, int] = {}
    mine = shapes.get(t.name)
    if seen is not None:
        if mine is None or len(mine) != len(seen):
            return False
        for d, v in zip(mine, seen):
            if (_dim(d) and d != v) or (_sym(d) and env.setdefault(d, int(v)) != v):
                return False
    chain = list(reversed(names))           # the layer's output first, t last
    start = shapes.get(chain[0])
    if not start or not _dim(start[-1]):
        return False
    axes: list | None = [[("x", d)] for d in start[:-1]] + [[("c", 1, start[-1])]]
    for before, after in zip(chain, chain[1:]):
        node = view.producer(view.tensors[after])
        out = shapes.get(after)
        if node is None or out is None or axes is None:
            return False
        axes = _resolved(axes, env)
        if not _fits(axes, shapes.get(before), env):
            return False
        if view.vocab.is_(node, "add") and not _whole_last(axes, start[-1]):
            return False                    # its bias is divided in t's column order: it must be this one
        axes = _step(view, node, before, axes, _known(out, env), shapes, env)
    if axes is None:
        return False
    axes = _resolved(axes, env)
    return _fits(axes, shapes.get(chain[-1]), env) and _whole_last(axes, start[-1])


def _resolved(axes: list, env: dict) -> list:
    """`axes` with the symbols `env` has solved as their sizes (parts of size 1 dropped)."""
    out = []
    for axis in axes:
        parts = [("x", env.get(f[1], f[1])) if f[0] == "x" and isinstance(f[1], str) else f for f in axis]
        out.append([f for f in parts if f[-1] != 1])
    return out


def _dim(d) -> bool:
    return isinstance(d, int) and d > 0


def _sym(d) -> bool:
    return isinstance(d, str) and bool(d)


def _carries(axis: list[Factor]) -> bool:
    """Does the axis carry a digit of the column index?"""
    return any(f[0] == "c" for f in axis)


def _known(dims, env: dict) -> list:
    """`dims` with the symbols `env` has solved as their sizes."""
    return [env.get(d, d) if isinstance(d, str) else d for d in dims]


def _size(axis: list[Factor]) -> Dim | None:
    """An axis's size: an int, a symbol (an axis of one symbolic part), or None (unknown)."""
    parts = [f[-1] for f in axis if f[-1] != 1]
    if not parts:
        return 1
    if len(parts) == 1:
        return parts[0]
    return math.prod(parts) if all(isinstance(p, int) for p in parts) else None


def _fits(axes: list, shape, env: dict) -> bool:
    """Do the factors agree with the shape inference gives the tensor (symbols solved so far)?"""
    if shape is None or len(shape) != len(axes):
        return False
    for axis, d in zip(axes, _known(shape, env)):
        size = _size(axis)
        if _dim(d) and _dim(size) and d != size:
            return False
        if _carries(axis) and not _dim(size):
            return False
    return True


def _step(view: GraphView, node: gs.Node, before: str, axes: list, out: list, shapes: dict,
          env: dict) -> list | None:
    """The factors of `node`'s output (shape `out`), its path input `before` holding `axes`; None
    where the step is not one this module follows or its shapes do not add up."""
    if view.vocab.is_(node, "add"):
        return _broadcast(axes, out, env)
    if view.vocab.is_(node, "matmul"):
        return _matmul(node, before, axes, out, shapes, env)
    if view.vocab.is_(node, "transpose"):
        perm = list(node.attrs.get("perm", range(len(axes) - 1, -1, -1)))
        if sorted(perm) != list(range(len(axes))) or len(out) != len(axes):
            return None
        return _settled([axes[p] for p in perm], out, env)
    if view.vocab.is_(node, "reshape"):     # Reshape, Flatten, Squeeze, Unsqueeze: row-major re-cuts
        return _recut(axes, out, env)
    return None


def _settled(axes: list, out: list, env: dict) -> list | None:
    """`axes` as the output's, each of its symbols that an axis's size fixes bound in `env`; None
    where a size disagrees."""
    for axis, d in zip(axes, out):
        size = _size(axis)
        if _sym(d) and _dim(size):
            env[d] = size
        elif _dim(d) and _dim(size) and d != size:
            return None
        elif _dim(d) and _sym(size) and size not in env:
            env[size] = d
    return axes


def _broadcast(axes: list, out: list, env: dict) -> list | None:
    """An elementwise op with a constant (the bias): the output's axes (`_aligned`)."""
    return _settled(_aligned(axes, out), out, env) if len(out) >= len(axes) else None


def _aligned(axes: list, out: list) -> list:
    """The axes of a broadcast to the sizes `out` (at least as many), aligned from the right: an axis
    the columns run over keeps its factors (and so its size); every other is a plain axis of out's."""
    lead = [[("x", d)] for d in out[:len(out) - len(axes)]]
    return lead + [axis if _carries(axis) else [("x", d)] for axis, d in zip(axes, out[len(out) - len(axes):])]


def _recut(axes: list, out: list, env: dict) -> list | None:
    """The row-major sequence of `axes`' factors cut into axes of the sizes `out`; a factor that
    straddles a cut is split into its high and low parts. The one symbol the two sides do not share,
    where there is one, is solved from their sizes; a shared symbolic part passes only into an
    output axis of the same symbol, in its place."""
    seq = [f for a in axes for f in a if f[-1] != 1]
    _solve_one(seq, out, env)
    out = _known(out, env)
    seq = _resolved([seq], env)[0]
    result: list[list[Factor]] = []
    for d in out:
        if _sym(d):
            if not (seq and seq[0][0] == "x" and seq[0][1] == d):
                return None
            result.append([seq.pop(0)])
            continue
        axis = _take(seq, d)
        if axis is None:
            return None
        result.append(axis)
    return result if not seq else None


def _solve_one(seq: list, out: list, env: dict) -> None:
    """Where the input's factors and the output's sizes hold exactly one symbol between them that
    the other side lacks, bind it to the quotient of the two sides' known sizes (a symbol on both
    sides is the same size there, and cancels)."""
    ins = _unknown([f[1] for f in seq if f[0] == "x"], env)
    outs = _unknown(out, env)
    lone = [d for d in ins if d not in outs] + [d for d in outs if d not in ins]
    if len(lone) != 1 or len(set(ins)) != len(ins) or len(set(outs)) != len(outs):
        return
    known_in, known_out = _known_product([f[-1] for f in seq], env), _known_product(out, env)
    num, den = (known_out, known_in) if lone[0] in ins else (known_in, known_out)
    if num % den == 0 and num // den > 0:
        env[lone[0]] = num // den


def _unknown(dims: list, env: dict) -> list[str]:
    return [d for d in dims if isinstance(d, str) and d not in env]


def _known_product(dims: list, env: dict) -> int:
    return math.prod(env.get(d, d) if isinstance(d, str) else d for d in dims if not (isinstance(d, str) and d not in env))


def _take(seq: list, d: int) -> list | None:
    """The factors at the front of `seq` that make an axis of size `d` (one split where it straddles)."""
    axis: list[Factor] = []
    need = d
    while need > 1:
        if not seq or not isinstance(seq[0][-1], int):
            return None
        f = seq.pop(0)
        n = f[-1]
        if n <= need:
            if need % n:
                return None
            axis.append(f)
            need //= n
            continue
        if n % need:
            return None
        low = n // need                     # f splits into (high: `need`, low: `low`), high first
        if f[0] == "c":
            axis.append(("c", f[1] * low, need))
            seq.insert(0, ("c", f[1], low))
        else:
            axis.append(("x", need))
            seq.insert(0, ("x", low))
        need = 1
    return axis


def _matmul(node: gs.Node, before: str, axes: list, out: list, shapes: dict, env: dict) -> list | None:
    """The path tensor as the right operand B [..., k, n] of A @ B: n stays the last axis, k is
    summed over (it must carry no digit of the columns), batch axes broadcast from the right (an
    axis the columns run over keeps its size)."""
    if len(node.inputs) != 2 or node.inputs[1].name != before or len(axes) < 2 or len(out) < 2:
        return None
    a = shapes.get(node.inputs[0].name)
    if a is None or len(a) < 2 or _carries(axes[-2]) or len(out) < len(axes):
        return None
    return _settled(_aligned(axes[:-2], out[:-2]) + [[("x", out[-2])], axes[-1]], out, env)


def _whole_last(axes: list, columns: int) -> bool:
    """Does the last axis carry the column index whole and in order, and no other axis any of it?"""
    if any(_carries(axis) for axis in axes[:-1]):
        return False
    last = [f for f in axes[-1] if f[-1] != 1]
    if not last or any(f[0] != "c" for f in last):
        return False
    stride, size = last[-1][1], last[-1][2]
    for f in reversed(last[:-1]):           # each factor one level more significant than the next
        if f[1] != stride * size:
            return False
        size *= f[2]
    return stride == 1 and size == columns
