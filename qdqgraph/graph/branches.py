"""Quantize inside If branches that an input chooses at run time.

A model exported from dynamic code may run one of several whole networks inside If branches,
picked by an input: a voice-activity model takes its sample rate `sr` (16000 or 8000) and runs one
of two encoders. Ifs whose condition is constant are inlined when the graph is cleaned; the rest
stay, and placement works on one graph at a time. So each branch is quantized as a model of its
own, by the same pipeline:

1. one onnxruntime run of the float graph per calibration sample gives each If's condition and the
   outer tensors its branches read (onnxruntime cannot hand out tensors inside a body, but the
   branch's inputs are tensors of the outer graph);
2. the samples are grouped by the branch they take; each branch becomes a stand-alone model whose
   inputs are the outer tensors it reads (outer constants become its initializers), and is
   quantized on its own samples (`run`, which is `pipeline.quantize`, in float32: rule H3 keeps
   If bodies float32, so the If's interface types do not change);
3. the quantized body replaces the branch: its inputs are read from the outer scope again, and
   names it added that the rest of the model already uses get the If's name as a prefix.

A branch no calibration sample takes stays float, with a note. Loop and Scan bodies stay float (a
body's inputs change from iteration to iteration). The simulator follows the branch the data took
(trtsim.branches).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from . import io, proto
from ..config import QuantizeConfig
from ..samples.data import CalibrationData
from ..errors import QdqError
from ..ops import Vocabulary, vocabulary
from ..passes.base import PassResult, result
from ..execution.runtime import session

BRANCHES = (("then_branch", True), ("else_branch", False))


def _weighted_inside(node: gs.Node, vocab: Vocabulary) -> bool:
    return any(vocab.is_(n, "weighted") for sub in node.subgraphs()
               for g in (sub, *sub.subgraphs(recursive=True)) for n in g.nodes)


def branch_ifs(graph: gs.Graph) -> list[gs.Node]:
    """The If nodes of `graph` (not inside a body) whose condition is not a constant and whose
    branches hold a weighted op (Conv, Gemm, MatMul, ...)."""
    vocab = vocabulary()
    return [n for n in graph.nodes if vocab.is_(n, "conditional") and n.inputs
            and not isinstance(n.inputs[0], gs.Constant) and _weighted_inside(n, vocab)]


def outer_reads(body: gs.Graph) -> list[gs.Variable]:
    """The outer-scope variables (not constants) that `body` reads, at any depth, in first-read order."""
    found: dict[str, gs.Variable] = {}

    def scan(sub: gs.Graph, local: set[str]) -> None:
        local = local | {t.name for t in sub.inputs} | {o.name for n in sub.nodes for o in n.outputs}
        for n in sub.nodes:
            for t in n.inputs:
                if t.name and t.name not in local and isinstance(t, gs.Variable):
                    found.setdefault(t.name, t)
            for nested in n.subgraphs():
                scan(nested, local)

    scan(body, set())
    return list(found.values())


def _onnx_type(t: gs.Tensor) -> int:
    return proto.tensor_dtype(t.dtype)


def outer_values(loaded: io.Loaded, ifs: list[gs.Node], data: CalibrationData,
                 providers: list[str] | None = None) -> tuple[dict[str, list[bool]], dict[str, list[np.ndarray]]]:
    """Per calibration sample, each If's condition (If name -> booleans) and the value of every
    outer tensor its branches read (name -> arrays), from runs of the float graph."""
    inputs = {t.name for t in loaded.graph.inputs}
    wanted: dict[str, gs.Tensor] = {}
    for node in ifs:
        for t in [node.inputs[0], *(r for key, _ in BRANCHES for r in outer_reads(node.attrs[key]))]:
            if t.name not in inputs:
                wanted.setdefault(t.name, t)
    model, weights = io.to_model_and_weights(io.Loaded(graph=loaded.graph.copy(), ir_version=loaded.ir_version))
    present = {o.name for o in model.graph.output}
    for name, t in wanted.items():
        if name not in present:
            model.graph.output.append(proto.value_info(name, t.dtype))
    sess = session(model, providers, "If-branch calibration", weights=weights)
    names = list(wanted)
    conds: dict[str, list[bool]] = {n.name: [] for n in ifs}
    values: dict[str, list[np.ndarray]] = {}
    for feed in data.batches(1):
        got = dict(zip(names, sess.run(names, feed))) if names else {}
        got.update(feed)
        for node in ifs:
            c = np.asarray(got[node.inputs[0].name])
            conds[node.name].append(bool(c.reshape(-1)[0]))
        for name, v in got.items():
            values.setdefault(name, []).append(np.asarray(v))
    return conds, values


def standalone(loaded: io.Loaded, body: gs.Graph, reads: list[gs.Variable]) -> proto.ModelProto:
    """`body` as a model of its own: the outer variables it reads are its inputs, the outer
    constants it reads its initializers (the caller's graph is not modified)."""
    g = gs.Graph(nodes=list(body.nodes), inputs=list(reads), outputs=list(body.outputs), name=body.name,
                 opset=loaded.graph.opset, import_domains=loaded.graph.import_domains)
    return io.to_model(io.Loaded(graph=g, ir_version=loaded.ir_version), tidy=False)


def _names(graphs) -> tuple[set[str], set[str]]:
    """Tensor and node names of `graphs`."""
    tensors: set[str] = set()
    nodes: set[str] = set()
    for g in graphs:
        tensors |= {t.name for t in g.tensors().values()} | {t.name for t in g.inputs + g.outputs}
        nodes |= {n.name for n in g.nodes}
    return tensors, nodes


def merge(quantized: proto.ModelProto, graph: gs.Graph, node: gs.Node, key: str) -> gs.Graph:
    """The quantized stand-alone body as branch `key` of If `node` in `graph`: it reads its inputs
    from the outer scope again (the outer tensors themselves, and the outer constants it kept as
    they were), and every name it adds that the model already uses elsewhere gets the prefix
    '<If name>/<then|else>/'."""
    original = node.attrs[key]
    body = io.load(quantized, check=False, min_opset=io.opset_of(quantized)).graph
    inner = [body, *body.subgraphs(recursive=True)]
    mine = {id(g) for g in (original, *original.subgraphs(recursive=True))}
    taken_t, taken_n = _names(g for g in (graph, *graph.subgraphs(recursive=True)) if id(g) not in mine)
    mine_t, _ = _names(g for g in (original, *original.subgraphs(recursive=True)))
    reads = {t.name: t for t in outer_reads(original)}
    consts = {t.name: t for t in graph.tensors().values() if isinstance(t, gs.Constant)}
    outer_ids = set()
    for g in inner:
        for n in g.nodes:
            for k, t in enumerate(n.inputs):
                if t.name in reads:
                    n.inputs[k] = reads[t.name]
                elif isinstance(t, gs.Constant) and t.name in consts and _same(t, consts[t.name]):
                    n.inputs[k] = consts[t.name]        # an outer weight the branch kept as it was
                else:
                    continue
                outer_ids.add(id(n.inputs[k]))
    body.inputs = []                    # read from the outer scope, by name
    prefix = f"{node.name}/{key.split('_')[0]}/"
    for g in inner:
        for n in g.nodes:
            if n.name in taken_n:
                n.name = prefix + n.name
        for t in g.tensors().values():
            if id(t) not in outer_ids and t.name in taken_t and t.name not in mine_t:
                t.name = prefix + t.name
    body.name = original.name
    return body


def _same(a: gs.Constant, b: gs.Constant) -> bool:
    va, vb = np.asarray(a.values), np.asarray(b.values)
    return va.dtype == vb.dtype and va.shape == vb.shape and np.array_equal(va, vb)


def _counts(model: proto.ModelProto) -> tuple[int, int]:
    """(activation QuantizeLinear nodes, weight DequantizeLinear nodes) of a quantized body."""
    vocab = vocabulary()
    inits = {t.name for t in model.graph.initializer}
    q = sum(1 for n in model.graph.node if vocab.is_(n.op_type, "quantize"))
    w = sum(1 for n in model.graph.node if vocab.is_(n.op_type, "dequantize") and n.input[0] in inits)
    return q, w


def branch_config(cfg: QuantizeConfig) -> QuantizeConfig:
    """What a branch is quantized with: the run's choices, in float32 (rule H3), without the
    choices that belong to the whole model (fixed inputs, --require-int8, the accuracy budget, the
    decisions measured on the model's outputs: bias correction auto, fragile heads, the SQNR floor)."""
    return dataclasses.replace(cfg, high_precision="fp32", fixed_inputs=(), require_int8=None,
                               accuracy_budget=None, max_float_layers=None, samples=None,
                               bias_correction=bool(cfg.bias_correction), fragile_heads=False, sqnr_floor=None)


def quantize_branches(loaded: io.Loaded, data: CalibrationData | None, cfg: QuantizeConfig,
                      run: Callable[..., Any]) -> PassResult:
    """Quantize the branches of every If of `loaded.graph` chosen at run time (module docstring),
    in place. `run(model, calib, config=...)` quantizes one branch model (pipeline.quantize).
    Details: `branches`, one entry per branch ({if, branch, samples, activation_qdq, weight_dq}
    or {if, branch, samples: 0, float: why}), and `notes`, a line for each branch left float."""
    ifs = branch_ifs(loaded.graph)
    if not ifs:
        return result("if_branches", False, branches=[], notes=[])
    entries: list[dict] = []
    notes: list[str] = []
    if data is None:
        for node in ifs:
            notes.append(f"If node {node.name}: its branches stay float (no calibration data to choose "
                         f"the samples each branch takes)")
        return result("if_branches", False, branches=entries, notes=notes)
    conds, values = outer_values(loaded, ifs, data, list(cfg.providers) if cfg.providers else None)
    sub_cfg = branch_config(cfg)
    changed = False
    for node in ifs:
        for key, taken in BRANCHES:
            which = key.split("_")[0]
            picked = [i for i, c in enumerate(conds[node.name]) if c == taken]
            entry = {"if": node.name, "branch": which, "samples": len(picked)}
            entries.append(entry)
            if not picked:
                entry["float"] = "no calibration sample takes it"
                notes.append(f"If node {node.name}: the {which}-branch stays float: no calibration sample "
                             f"takes it (add samples that do to quantize it)")
                continue
            reads = outer_reads(node.attrs[key])
            try:
                calib = {t.name: np.stack([values[t.name][i] for i in picked]) for t in reads}
            except ValueError:
                entry["float"] = "its inputs change shape between samples"
                notes.append(f"If node {node.name}: the {which}-branch stays float: the tensors it reads "
                             f"change shape between calibration samples")
                continue
            model = standalone(loaded, node.attrs[key], reads)
            try:
                quantized = run(model, calib, config=sub_cfg).model
            except QdqError as e:
                entry["float"] = e.problem
                notes.append(f"If node {node.name}: the {which}-branch stays float ({entry['float']})")
                continue
            entry["activation_qdq"], entry["weight_dq"] = _counts(quantized)
            node.attrs[key] = merge(quantized, loaded.graph, node, key)
            changed = True
    return result("if_branches", changed, branches=entries, notes=notes)


def summary(passed: PassResult) -> list[str]:
    """Lines for the report: each branch quantized (on how many samples, what was placed) and
    each left float (why)."""
    lines = []
    for e in passed["branches"]:
        if "float" not in e:
            lines.append(f"If node {e['if']}: the {e['branch']}-branch is quantized on the {e['samples']} "
                         f"calibration samples that take it ({e['activation_qdq']} activation Q/DQ, "
                         f"{e['weight_dq']} weight DQ)")
    return lines + list(passed["notes"])
