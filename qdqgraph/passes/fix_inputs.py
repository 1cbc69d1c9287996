"""Fix model inputs to constant values, and inline the If branches that this (or the export) made
constant.

Models exported from dynamic code carry inputs that select a path through If nodes: silero-vad
takes its sample rate `sr` as an input and runs one of two whole networks inside If branches.
qdqgraph leaves If bodies in float (as TensorRT builds them as separate conditional regions), so
such a model gets no INT8 at all. A deployment that always feeds the same value can fix the input
(`insert --fix-input sr=16000`): the input becomes a constant, constant folding decides the If
condition, and the taken branch is inlined into the main graph, where placement quantizes it
like any other layer. The output model no longer has that input.

Inlining is written here rather than taken from onnx-graphsurgeon's `fold_constants(
flatten_subgraphs=True)`, which left dangling references to If outputs on silero-vad (measured:
onnxruntime refused the flattened model).
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import onnx_graphsurgeon as gs

from ..errors import QdqError
from ..ops import IDENTITY, vocabulary
from .base import PassResult, result
from .registry import Condition, declare, describe


def parse_fixed(spec: str) -> tuple[str, list]:
    """'NAME=V' or 'NAME=V1,V2,...' -> (name, values as numbers); the dtype comes from the model."""
    name, sep, value = spec.partition("=")
    if not sep or not name or not value:
        raise QdqError(f"--fix-input {spec!r} is not NAME=VALUE", "write it like --fix-input sr=16000")
    try:
        values = [float(v) if any(c in v for c in ".eE") or v.strip().lower() in ("inf", "nan") else int(v)
                  for v in value.split(",")]
    except ValueError:
        raise QdqError(f"--fix-input {spec!r}: {value!r} is not a number or a comma-separated list of numbers",
                       "write it like --fix-input sr=16000 or --fix-input scale=0.5,0.5") from None
    return name, values


@declare("fix_inputs", ensures=(Condition("no fixed input is left a graph input", lambda g, r: [
    i.name for i in g.inputs if r is not None and i.name in r["fixed"]]),))
def fix_inputs(graph: gs.Graph, fixed: dict[str, object]) -> PassResult:
    """Replace the graph inputs named in `fixed` by constants of their declared dtype. The value
    takes a static input shape of as many elements; otherwise a scalar fixes a rank-0 input and a
    list a rank-1 input. Modifies `graph`; details: `fixed` (input name -> value as a list)."""
    inputs = {t.name: t for t in graph.inputs}
    for name, value in fixed.items():
        t = inputs.get(name)
        if t is None:
            raise QdqError(f"--fix-input names '{name}', which is not an input of the model",
                           f"the inputs are: {', '.join(inputs) or '(none)'}")
        if t.dtype is None:
            raise QdqError(f"input '{name}' declares no element type, so it cannot be fixed",
                           "give the input a type in the model")
        if np.dtype(t.dtype).kind in "OSU":
            raise QdqError(f"--fix-input {name}: input '{name}' is a string tensor, and --fix-input takes numbers",
                           "fix numeric inputs only (a model with a string input needs --calib-cache FILE)")
        a = np.asarray(value)
        with np.errstate(all="ignore"):
            cast = a.astype(t.dtype)
        if not np.array_equal(cast.astype(np.float64), a.astype(np.float64), equal_nan=True):
            raise QdqError(f"--fix-input {name}: {value!r} does not fit the input's type {np.dtype(t.dtype).name}",
                           "give a value of the input's type")
        shape = t.shape
        if shape is not None:
            want = list(shape)
            if all(isinstance(w, int) and w >= 0 for w in want) and int(np.prod(want)) == cast.size:
                cast = cast.reshape(want)            # 16000 for a [1] input, a list for a [1, 4] one
            if len(want) != cast.ndim or any(isinstance(w, int) and w >= 0 and w != g
                                            for w, g in zip(want, cast.shape)):
                raise QdqError(f"--fix-input {name}: the input has shape {want}, the value has shape "
                               f"{list(cast.shape)}", "give one number for a scalar input, a list for a 1-D input")
        const = gs.Constant(f"{name}_fixed", cast)
        for node in list(t.outputs):
            _replace_input(node, t, const)
        graph.outputs[:] = [const if o is t else o for o in graph.outputs]
        graph.inputs.remove(t)
    return result("fix_inputs", bool(fixed), fixed={k: np.asarray(v).tolist() for k, v in fixed.items()})


def _replace_input(node: gs.Node, old: gs.Tensor, new: gs.Tensor) -> None:
    for k, x in enumerate(node.inputs):
        if x is old:
            node.inputs[k] = new


def _condition(node: gs.Node):
    """The If node's condition as a Python bool, or None while it is not a constant."""
    c = node.inputs[0] if node.inputs else None
    if not isinstance(c, gs.Constant):
        return None
    v = np.asarray(c.values)
    return bool(v.reshape(-1)[0]) if v.size == 1 else None


@declare("inline_constant_ifs", fixpoint=True, graph_only=True)
def inline_constant_ifs(graph: gs.Graph, choose: Callable[[gs.Node], bool] | None = None) -> PassResult:
    """Replace every If node of `graph` whose condition is a constant by the nodes of the branch it
    takes. Repeats until none is left (an inlined branch may hold Ifs of its own; their conditions
    are decided by the caller's next constant folding). `choose(node)`: the branch (True: then) to
    inline where the condition is not constant (the simulator's view of the branch that runs); by
    default those Ifs stay. Modifies `graph`; details: `inlined`."""
    vocab = vocabulary()
    inlined: list[str] = []
    for node in [n for n in graph.nodes if vocab.is_(n, "conditional")]:
        cond = _condition(node)
        if cond is None and choose is not None:
            cond = choose(node)
        if cond is None:
            continue
        branch: gs.Graph = node.attrs["then_branch" if cond else "else_branch"]
        graph.nodes.extend(branch.nodes)
        for if_out, br_out in zip(node.outputs, branch.outputs):
            for consumer in list(if_out.outputs):
                _replace_input(consumer, if_out, br_out)
            if if_out in graph.outputs:          # keep the model's output name: copy under it
                keep = gs.Variable(if_out.name, dtype=if_out.dtype, shape=if_out.shape)
                if_out.name = f"{if_out.name}_if_output"
                graph.layer(op=IDENTITY, name=f"{node.name}_output_{keep.name}", inputs=[br_out], outputs=[keep])
                graph.outputs[:] = [keep if o is if_out else o for o in graph.outputs]
        node.inputs.clear()
        node.outputs.clear()
        inlined.append(node.name)
    if inlined:
        graph.cleanup(remove_unused_graph_inputs=False).toposort()
    return result("inline_constant_ifs", bool(inlined), inlined=inlined)


def _fixed(results) -> dict:
    return dict(results[-1]["fixed"]) if results else {}


def _fixed_lines(results, ctx) -> list[str]:
    fixed = ", ".join(f"{k}={v}" for k, v in _fixed(results).items())
    return [f"fixed inputs: {fixed} (the written model no longer has them)"] if fixed else []


def _inlined(results) -> list[str]:
    return [n for r in results for n in r["inlined"]]


def _inlined_lines(results, ctx) -> list[str]:
    inlined = _inlined(results)
    if not inlined:
        return []
    more = ", ..." if len(inlined) > ctx.max_examples else ""
    return [f"inlined: {len(inlined)} If node(s) with a constant condition ({', '.join(inlined[:ctx.max_examples])}{more})"]


describe("fix_inputs", 10, lines=_fixed_lines, fields={"fixed_inputs": _fixed})
describe("inline_constant_ifs", 20, lines=_inlined_lines, fields={"ifs_inlined": _inlined})
