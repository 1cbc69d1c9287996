"""Per-layer sensitivity and float fallback within an accuracy budget.

A *unit* is one quantized node of the plan with the Q/DQ edges it consumes (a Conv's activation
input and its weight; a residual Add's skip input; ...). Sensitivity is measured on a switchable
model: every quantized edge goes through `If(flag_unit) then Q->DQ else float`, with one boolean
input per unit, so one onnxruntime session evaluates any mix of float and INT8 units, computing
only the Q/DQ of the units that are INT8 in that run (a `Where` would compute both sides). For each
unit it measures the output SQNR (against float) when only that unit is quantized, and when only
that unit is left in float. Cost: (2 x units + 2) runs of the sensitivity batch (a few samples,
`samples`), each a full inference; it grows linearly with the number of units and does not
recalibrate (the scales of the one calibration are reused).

Fallback returns units to float greedily, most harmful first (largest SQNR gain when left in float),
until the output SQNR reaches the budget or `max_float` units are float.

With `ray` (an address, or "local"), the per-unit runs are split over Ray tasks (qdqgraph.execution.distributed):
each task opens its own session on the very model this process's session runs (the same bytes and
weights) and measures a contiguous run of the units against this process's float outputs; the
all-INT8 run and the evaluator stay here. Every SQNR, and so the ranking, is the one-process value.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs

from ..graph import proto, io
from ..execution import distributed
from ..execution.evaluate import reused
from ..samples.data import CalibrationData
from ..execution.runtime import graph_session, session
from ..ops import DEQUANTIZE, IDENTITY, IF, QUANTIZE
from ..execution.progress import stage, step
from ..placement.plan import Plan
from ..passes.insert import insert_qdq


@dataclass
class UnitSensitivity:
    node: str
    op: str
    rule: str
    only_quantized_db: float     # output SQNR with only this unit in INT8
    only_float_db: float         # output SQNR with every unit but this one in INT8
    gain_db: float               # only_float_db - all-INT8 SQNR


@dataclass
class Sensitivity:
    samples: int
    all_int8_db: float
    units: list[UnitSensitivity] = field(default_factory=list)
    seconds: float = 0.0
    runs: int = 0
    # (batches, float outputs) the SQNRs were measured on: `output_sqnr` measures another model there
    reference: tuple = field(default=((), ()), repr=False, compare=False)

    def ranked(self) -> list[UnitSensitivity]:
        return sorted(self.units, key=lambda u: (-u.gain_db, u.only_quantized_db, u.node))

    def table(self, k: int = 10) -> str:
        lines = [f"sensitivity on {self.samples} samples ({self.runs} runs, {self.seconds:.1f} s): "
                 f"all INT8 output SQNR {self.all_int8_db:.1f} dB",
                 "  gain_dB  only_int8_dB  node (op, rule)"]
        for u in self.ranked()[:k]:
            lines.append(f"  {u.gain_db:7.2f}  {u.only_quantized_db:12.1f}  {u.node} ({u.op}, {u.rule})")
        return "\n".join(lines)


def _sqnr(ref: list[np.ndarray], got: list[np.ndarray]) -> float:
    sig = sum(float(np.sum(r.astype(np.float64) ** 2)) for r in ref)
    err = sum(float(np.sum((r.astype(np.float64) - g) ** 2)) for r, g in zip(ref, got))
    return 10 * np.log10(sig / err) if err > 0 else float("inf")


def _if(flag: gs.Variable, name: str, then_nodes: list[gs.Node], then_out: gs.Variable,
        float_t: gs.Tensor, out: gs.Variable) -> gs.Node:
    """If(flag) then <then_nodes> else Identity(float_t): only the chosen branch runs."""
    else_out = gs.Variable(f"{out.name}_float", dtype=np.float32)
    then_g = gs.Graph(nodes=then_nodes, inputs=[], outputs=[then_out], name=f"{name}_int8")
    else_g = gs.Graph(nodes=[gs.Node(IDENTITY, name=f"{name}_id", inputs=[float_t], outputs=[else_out])],
                      inputs=[], outputs=[else_out], name=f"{name}_float")
    return gs.Node(IF, name=name, inputs=[flag], outputs=[out],
                   attrs={"then_branch": then_g, "else_branch": else_g})


def switchable(quant_graph: gs.Graph, plan: Plan, only: set[str] | None = None,
               float_graph: gs.Graph | None = None) -> tuple[gs.Graph, dict[str, str]]:
    """A copy of a Q/DQ graph made by insert_qdq where each quantized unit's edges pass through
    If(flag) then Q->DQ (or the dequantized weight) else the float tensor, so that a run computes
    only the Q/DQ of the units switched to INT8. Returns the graph and {unit node name: flag input}.
    `only`: the units to make switchable (the others stay INT8 in every run; a float copy of each
    switchable weight is held, so fewer units is less memory). `float_graph`: the float graph the
    Q/DQ one was made from; a unit's float weight is then the original one, as a unit returned to
    float has it (without it, the INT8 weight dequantized: only the activations' error is seen)."""
    g = quant_graph.copy()
    nodes = {n.name: n for n in g.nodes}
    originals = {n.name: n for n in float_graph.nodes} if float_graph is not None else {}
    flags = {}
    for k, (name, d) in enumerate(sorted((n, d) for n, d in plan.decisions.items() if d.quantized)):
        node = nodes.get(name)
        if node is None or (only is not None and name not in only):
            continue
        flag = gs.Variable(f"qdqgraph_unit_{k}", dtype=np.bool_, shape=[])
        if _switch_unit(g, node, k, flag, originals.get(name)):
            g.inputs.append(flag)
            flags[name] = flag.name
    g.cleanup().toposort()
    return g, flags


def _switch_unit(g: gs.Graph, node: gs.Node, k: int, flag: gs.Variable, original: gs.Node | None) -> bool:
    """Route each dequantized input of unit `k` through If(flag); whether any input was routed."""
    used = False
    for i, t in enumerate(list(node.inputs)):
        p = t.inputs[0] if t.inputs else None
        if p is None or p.op != DEQUANTIZE:
            continue
        branch = _int8_branch(t, p, k, i, original)
        if branch is None:
            continue
        then_nodes, then_out, float_t, sel = branch
        g.nodes.append(_if(flag, f"qdqgraph_switch_{k}_{i}", then_nodes, then_out, float_t, sel))
        node.inputs[i] = sel
        used = True
    return used


def _int8_branch(t: gs.Tensor, p: gs.Node, k: int, i: int, original: gs.Node | None) -> tuple | None:
    """(INT8 nodes, their output, float tensor, switched tensor) for input `i` of unit `k`, read
    through the DQ `p`; None when the DQ reads neither a Q nor a constant."""
    src = p.inputs[0]
    q = src.inputs[0] if src.inputs else None
    sel = gs.Variable(f"{t.name}_sel_{k}_{i}", dtype=np.float32, shape=t.shape)
    then_out = gs.Variable(f"{sel.name}_int8", dtype=np.float32)
    if q is not None and q.op == QUANTIZE:
        float_t = q.inputs[0]
        q8 = gs.Variable(f"{sel.name}_q", dtype=src.dtype)
        then_nodes = [gs.Node(QUANTIZE, name=f"{sel.name}_qn", inputs=[float_t, *q.inputs[1:]],
                              outputs=[q8], attrs=dict(q.attrs)),
                      gs.Node(DEQUANTIZE, name=f"{sel.name}_dqn", inputs=[q8, *p.inputs[1:]],
                              outputs=[then_out], attrs=dict(p.attrs))]
    elif isinstance(src, gs.Constant):   # INT8 weight: both values are constants
        float_t = gs.Constant(f"{src.name}_float", _float_weight(src, p, original, i))
        then_nodes = [gs.Node(DEQUANTIZE, name=f"{sel.name}_dqn", inputs=list(p.inputs),
                              outputs=[then_out], attrs=dict(p.attrs))]
    else:
        return None
    return then_nodes, then_out, float_t, sel


def _float_weight(src: gs.Constant, p: gs.Node, original: gs.Node | None, i: int) -> np.ndarray:
    """A unit's float weight: input `i` of the float graph's node when it fits, else the INT8 weight dequantized."""
    scale = p.inputs[1].values
    axis = p.attrs.get("axis")
    shape = [-1 if (axis is not None and dim == axis % src.values.ndim) else 1
             for dim in range(src.values.ndim)] if np.ndim(scale) else []
    deq = (src.values.astype(np.float32) * (scale.reshape(shape) if shape else scale)).astype(np.float32)
    weight = original.inputs[i] if original is not None and i < len(original.inputs) else None
    if isinstance(weight, gs.Constant) and weight.values.shape == deq.shape:
        deq = np.asarray(weight.values, dtype=np.float32)
    return deq


def _feed(batch: dict, flags: dict, on: set[str]) -> dict:
    f = dict(batch)
    for unit, name in flags.items():
        f[name] = np.array(unit in on, dtype=np.bool_)
    return f


LEAN_SESSION_MIN_BYTES = 64 << 20     # weights from which the switchable session computes the Q/DQ as written


class _Switch:
    """One session over the switchable model and the batches it runs: `outputs(on)` runs every
    batch with the units `on` in INT8 and the others float, and returns the float outputs."""

    def __init__(self, model: proto.ModelProto, weights: dict, flags: dict[str, str], outs: list[str],
                 batches: list[dict], threads: int = 0):
        # onnxruntime's Q/DQ fusions held 165 MiB more than the Q/DQ computed as written on a 453 MB
        # encoder (115 MB of INT8 weights), the run's peak
        lean = sum(np.asarray(a).nbytes for a in weights.values()) >= LEAN_SESSION_MIN_BYTES
        self.sess = session(model, purpose="sensitivity", weights=weights, threads=threads, as_written=lean)
        self.flags, self.outs, self.batches = flags, outs, batches
        self.runs = 0

    def outputs(self, on: set[str]) -> list[np.ndarray]:
        self.runs += len(self.batches)  # one run per batch of samples
        return _flat([self.sess.run(self.outs, _feed(b, self.flags, on)) for b in self.batches])


def _kept_outputs(float_outputs, data: CalibrationData, outs: list[str], batches: list, taken: int
                  ) -> list[np.ndarray] | None:
    """`_flat` of the float outputs of `batches` (the first `taken` samples of `data`, one batch or one
    sample each) taken from the outputs a run kept (execution.evaluate.reused: the samples'
    inputs are checked), or None where they do not hold them all. On a 453 MB encoder the attention
    check's float session held a second copy of the weights, the run's peak."""
    if float_outputs is None:
        return None
    per = reused(float_outputs, data.head(taken), outs)
    if per is None or len(per) != taken:
        return None
    if len(batches) == len(per):                  # a sample a batch
        return _flat([[p[o] for o in outs] for p in per])
    if len(batches) != 1:
        return None
    try:                                          # one batch of the samples on axis 0
        return _flat([[np.concatenate([np.asarray(p[o]) for p in per], axis=0) for o in outs]])
    except ValueError:
        return None


def _flat(results) -> list[np.ndarray]:
    return [o for per in results for o in per if np.issubdtype(o.dtype, np.floating)]


def _unit_sqnrs(switch: _Switch, ref: list[np.ndarray], units: set[str], part: list[str],
                progress=None, float_only: bool = False) -> list[tuple[float, float]]:
    """(output SQNR with only the unit INT8, with only the unit float) for each unit of `part`;
    `float_only`: the first is not measured (NaN), half the runs."""
    out = []
    for u in part:
        only_q = float("nan") if float_only else _sqnr(ref, switch.outputs({u}))
        out.append((only_q, _sqnr(ref, switch.outputs(units - {u}))))
        step(progress)
    return out


def _unit_part(model, weights, flags, outs, batches, ref, units, part, float_only: bool = False,
               progress=None) -> tuple[list, int]:
    """In a Ray task: `_unit_sqnrs` of the units of `part` on a session of its own (one thread per
    CPU the task has). Returns (SQNR pairs, runs)."""
    switch = _Switch(model, weights, flags, outs, batches, threads=distributed.TASK_CPUS)
    return _unit_sqnrs(switch, ref, units, part, progress, float_only), switch.runs


def measure(quant_model: proto.ModelProto | io.Loaded, plan: Plan, data: CalibrationData, samples: int = 8,
            stop_above_db: float | None = None, progress=None, only: set[str] | None = None,
            reference: io.Loaded | None = None, ray: str | None = None, float_only: bool = False,
            float_outputs=None) -> tuple:
    """(Sensitivity, evaluator) where evaluator(float_units) -> output SQNR with those units float.
    `quant_model`: the Q/DQ model insert_qdq made for `plan` (a ModelProto, or its graph as a
    Loaded). With `stop_above_db`, per-unit measurement is skipped when all-INT8 already reaches it.
    `only`: the units that can be switched (and measured); the rest stay INT8, so the float outputs
    to compare against come from `reference`, the float graph (needed with `only`); with it, a
    unit's float weights are the reference's, so the SQNR is against float, weights included. `ray`: a Ray
    address (or "local") to measure the units on, split among its task slots. `float_only`: only
    the gain of each unit left float is measured (its only_quantized_db is NaN): half the runs.
    `float_outputs`: the reference's outputs the run already holds (calib.collect.FloatOutputs);
    where they cover the samples measured, the reference is not run again."""
    if only is not None and reference is None:
        raise ValueError("measure(only=...) needs the float graph as reference")
    start = time.perf_counter()
    loaded = quant_model if isinstance(quant_model, io.Loaded) else io.load(quant_model)
    graph, flags = switchable(loaded.graph, plan, only, reference.graph if reference is not None else None)
    # the model and weights of this session are what the Ray tasks' sessions run too
    model, weights = io.to_model_and_weights(io.Loaded(graph=graph, ir_version=loaded.ir_version))
    outs = [o.name for o in graph.outputs]
    # the first `samples` samples, as one batch where the model's batch axis is dynamic
    batches, seen, taken = [], 0, 0
    for b, k in data.counted_batches(samples if data.batchable() else 1):
        n = int(np.shape(next(iter(b.values())))[0]) if data.batchable() else 1
        batches.append(b)
        seen += n
        taken += k
        if seen >= samples:
            break
    units = set(flags)
    if reference is not None:
        kept = _kept_outputs(float_outputs, data, outs, batches, taken)
        if kept is not None:
            ref = kept
        else:
            # the float outputs before the switchable session is made: one session (and its copy
            # of a model's weights) at a time
            float_sess = graph_session(reference, purpose="sensitivity reference")
            ref = _flat([float_sess.run(outs, b) for b in batches])
            del float_sess
    switch = _Switch(model, weights, flags, outs, batches)
    if reference is None:
        ref = switch.outputs(set())

    def sqnr_with_float(float_units: set[str]) -> float:
        return _sqnr(ref, switch.outputs(units - set(float_units)))

    all_db = sqnr_with_float(set())
    report = Sensitivity(min(seen, samples), all_db, reference=(batches, ref))
    skip = stop_above_db is not None and all_db >= stop_above_db
    order = [] if skip else sorted(units)
    stage(progress, "sensitivity", len(order), unit="unit")
    runs = 0
    if ray and order:
        shared = (model, weights, flags, outs, batches, ref, units)
        parts = distributed.run(ray, _unit_part, shared,
                                lambda slots: [(p, float_only) for p in distributed.split(order, slots)],
                                progress, what="sensitivity part")
        pairs = [pair for got, _ in parts for pair in got]
        runs = sum(n for _, n in parts)
    else:
        pairs = _unit_sqnrs(switch, ref, units, order, progress, float_only)
    for u, (only_q, only_f) in zip(order, pairs):
        d = plan.decisions[u]
        report.units.append(UnitSensitivity(u, d.op, d.rule or "", only_q, only_f, only_f - all_db))
    report.runs = switch.runs + runs
    report.seconds = time.perf_counter() - start
    return report, sqnr_with_float


def output_sqnr(model: proto.ModelProto, sens: Sensitivity) -> float:
    """The output SQNR of `model` (a quantized model as written: float islands and all) against
    float, on the batches and float outputs `sens` was measured on: the figure the sweep's estimate
    stands for."""
    batches, ref = sens.reference
    sess = session(model, purpose="accuracy check", widen=True)
    names = [o.name for o in sess.get_outputs()]
    inputs = {i.name for i in sess.get_inputs()}
    got = _flat([sess.run(names, {k: v for k, v in b.items() if k in inputs}) for b in batches])
    return _sqnr(list(ref), got)


def choose_fallback(sens: Sensitivity, evaluate, budget_db: float | None, max_float: int | None) -> tuple[list[str], float]:
    """Greedy: most harmful units to float until the output SQNR reaches `budget_db` (or the
    number of float units reaches `max_float`). Returns (units, final SQNR)."""
    chosen: list[str] = []
    current = sens.all_int8_db
    limit = max_float if max_float is not None else len(sens.units)
    for u in sens.ranked():
        if budget_db is not None and current >= budget_db:
            break
        if len(chosen) >= limit:
            break
        trial = evaluate(set(chosen) | {u.node})
        if trial > current or budget_db is None:
            chosen.append(u.node)
            current = trial
    return chosen, current


def floated_gain(loaded: io.Loaded, plan: Plan, amax: dict, data: CalibrationData, cfg, units: set[str],
                 progress=None, float_outputs=None) -> tuple[float, float, int]:
    """(output SQNR all quantized, with `units` float, samples): the Q/DQ model of `plan` built once
    in a switchable session where only `units` can return to float, measured on
    cfg.sensitivity_samples calibration samples against the float graph `loaded`."""
    fmt = cfg.format
    assert fmt is not None, "weight-only runs take their own pipeline, without these checks"
    trial = loaded.graph.copy()
    insert_qdq(trial, plan, amax, weights=cfg.weights, fmt=fmt)
    sens, evaluate = measure(io.Loaded(graph=trial, ir_version=loaded.ir_version), plan, data,
                             cfg.sensitivity_samples, stop_above_db=float("-inf"), progress=progress,
                             only=set(units), reference=loaded, float_outputs=float_outputs)
    floated_db = evaluate(set(units))
    del evaluate, trial                # the trial graph and its session go before the plan is redone
    return float(sens.all_int8_db), float(floated_db), int(sens.samples)
