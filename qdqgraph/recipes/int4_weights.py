"""Weight-only INT4: MatMul/Gemm constant weights stored as 4-bit integers in blocks, read through a
blocked DequantizeLinear (TensorRT's weight-only block quantization for GEMMs; Model Optimizer's
`--quantize_mode int4`).

Each weight W, seen as [K, N] with K the reduction axis (MatMul's B; Gemm's B, transposed when
transB=1), is cut along K into blocks of `block_size` values per output column, and each block gets
its own scale. The graph then holds

    DequantizeLinear(q: INT4, scale: weight's dtype, zero_point: INT4 zeros, axis=K axis, block_size)

whose output (the weight's dtype) replaces W as the node's input. Blocked quantization is ONNX
DequantizeLinear from opset 21: the scale has the input's rank, with the `axis` dim divided by
`block_size`, and y[i] = (q[i] - zp[j]) * scale[j] where j is i with its `axis` index divided
(floored) by `block_size`. INT4 needs IR version 10; the tensors are stored packed, two per byte.

Quantization is symmetric: scale = amax / 7 over the block (Model Optimizer's INT4_SCALE and
onnxruntime's symmetric 4-bit quantizer), q = clamp(round_half_even(w / scale), -8, 7) (TensorRT's
INT4 range, with its rounding), zero point 0 (TensorRT takes no other). Unclipped, w / scale lies in
[-7, 7], so |w - q * scale| <= scale / 2. A block of zeros or non-finite values gets a finite
positive scale (`calib.methods.safe_scales`).

Two methods:

- "rtn": round to nearest, the block amax as it is; no data needed.
- "awq": activation-aware (Lin et al. 2023, AWQ: Activation-aware Weight Quantization for LLM
  Compression and Acceleration, sec. 3.2). On up to MAX_ROWS rows X [rows, K] of the weight's input
  (a seeded uniform sample over the first `samples` calibration samples of the float model):
  (a) a per-input-channel scale s = mean|X_k|^alpha, normalised by sqrt(max(s) * min(s)) as the
  reference implementation does, with alpha from ALPHAS minimising ||X W - (X / s) Q(s W)||^2
  summed over every layer that reads X (they share one s); alpha 0 (no scaling, plain RTN) is a
  candidate, so on the rows the choice is never worse than RTN. X / s must cost nothing at run
  time: s is folded into the LayerNorm or the linear layer that makes X (the output-aware pass's
  folds, checked the same way on one calibration sample) and the readers' weight rows are
  multiplied by s, so the float model computes what it did; where s cannot be folded, the weights
  are not scaled (alpha 0, reported as skipped with the reason). No node is inserted. A weight
  read from two different inputs is never scaled (one weight cannot take two s).
  (b) per block, a clip ratio from CLIP_RATIOS of the block amax (Model Optimizer's awq_clip grid),
  each block's ratio minimising that block's own share of the output error
  ||X_b (w_b - Q(w_b))||^2 (X_b: the block's input channels; Model Optimizer's and llm-awq's
  per-block search). Blocks are chosen independently, which ignores the error's cross terms
  between blocks, so the clipped weight is kept only if it lowers the whole output error.

The cost is linear in the model: each weight costs a few matrix products with at most MAX_ROWS
rows (alpha) and K * block_size * N per clip ratio (block Gram matrices).
"""
from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import onnx_graphsurgeon as gs

from ..graph import io, proto
from ..precisions.registry import precision
from ..precisions.scales import safe_scales
from ..samples.data import CalibrationData
from ..errors import QdqError, option
from ..ops import DEQUANTIZE
from ..execution import blas
from ..execution.runtime import float_activations
from ..graph.view import GraphView
from ..passes.base import PassResult, result
from ..passes.channel_scale import MAX_SCALE, divide, fold_kind, fold_producer, fold_reach, k_axis
from .output_aware import failed_folds

INT4_MIN, INT4_MAX = -8, 7
MIN_OPSET = 21            # DequantizeLinear with block_size and INT4 inputs
MIN_IR_VERSION = 10       # INT4 tensors
METHODS = ("rtn", "awq")
ALPHAS = tuple(i / 10 for i in range(11))                  # AWQ scale exponents: 0, 0.1 .. 1
CLIP_RATIOS = tuple(1.0 - i / 20 for i in range(11))       # fractions of the block amax: 1 .. 0.5
MIN_CHANNEL_SCALE = 1e-4  # AWQ's floor on mean|x|^alpha before normalising
BLOCK_SIZES = (128, 64, 32, 16)                            # suggested when K does not divide
MAX_ROWS = 512            # rows of each activation the AWQ search runs on
SEARCH_THREADS = 4        # weights (or inputs) searched at once, one a core (execution.blas.mapped)
SAMPLES = 32              # calibration samples they are drawn from
ROW_SEED = 0
SCALE_DTYPES = (np.dtype(np.float32), np.dtype(np.float16))   # DequantizeLinear outputs qdqgraph writes


@dataclass(frozen=True)
class Target:
    """A MatMul/Gemm whose input 1 is a constant 2-D float weight; `axis` is the weight's
    reduction (K) axis: 0, or 1 for a Gemm with transB=1."""
    node: str
    weight: str
    k: int
    n: int
    axis: int


@dataclass
class Scaling:
    """The AWQ input-channel scale of one activation tensor, shared by the layers that read it.
    `scale` (None: not scaled) is the attribute `output_aware.failed_folds` checks folds against."""
    tensor: str
    alpha: float = 0.0
    scale: np.ndarray | None = None
    how: str = "none"       # "layernorm" or "producer" (folded), "none" (alpha 0 won), "skipped: why"

    def skip(self, why: str) -> None:
        self.alpha, self.scale, self.how = 0.0, None, f"skipped: {why}"


# ---------------------------------------------------------------------------- blocked arithmetic

def expand_blocked(scale: np.ndarray, axis: int, block_size: int) -> np.ndarray:
    """A blocked scale repeated to its input's shape (ONNX DequantizeLinear-21 block semantics)."""
    return np.repeat(scale, block_size, axis=axis)


def block_amax(w: np.ndarray, axis: int, block_size: int) -> np.ndarray:
    """max |w| over each block of `block_size` values along `axis`: `w`'s shape with that axis
    divided by `block_size`."""
    if w.shape[axis] % block_size:
        raise ValueError(f"axis {axis} of a {w.shape} array does not divide into blocks of {block_size}")
    moved = np.abs(np.moveaxis(w, axis, 0))
    blocks = moved.reshape(moved.shape[0] // block_size, block_size, *moved.shape[1:])
    return np.moveaxis(blocks.max(axis=1), 0, axis)


def _representable(scale: np.ndarray, dtype) -> np.ndarray:
    """`scale` in `dtype`, kept finite and > 0 there (a float16 scale can underflow or overflow)."""
    info = np.finfo(dtype)
    return np.clip(scale, float(info.tiny), float(info.max)).astype(dtype)


def quantize_blocked(w: np.ndarray, axis: int, block_size: int, clip=None,
                     dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
    """(q, scale): symmetric INT4 block quantization of `w` along `axis` (see the module doc).

    scale = clip * amax / 7 per block, in `dtype` (the DequantizeLinear's output type); `clip` is a
    ratio, a scalar or one per block (the scale's shape), None for 1. q = clamp(round_half_even(w /
    scale), -8, 7) as int8 (values in the INT4 range), computed with the scale as stored."""
    amax = block_amax(np.asarray(w, dtype=np.float32), axis, block_size)
    if clip is not None:
        amax = amax * np.asarray(clip, dtype=np.float32)
    scale = _representable(safe_scales(amax, INT4_MAX), dtype)
    full = expand_blocked(scale.astype(np.float32), axis, block_size)
    q = np.clip(np.rint(np.asarray(w, dtype=np.float32) / full), INT4_MIN, INT4_MAX).astype(np.int8)
    return q, scale


def dequantize_blocked(q: np.ndarray, scale: np.ndarray, axis: int, block_size: int) -> np.ndarray:
    """q * scale with the scale repeated over its blocks, as float32 (zero point 0)."""
    return q.astype(np.float32) * expand_blocked(scale.astype(np.float32), axis, block_size)


# ---------------------------------------------------------------------------- targets

def _found(graph: gs.Graph, exclude=frozenset()) -> list[tuple[Target, gs.Node]]:
    view = GraphView(graph)
    out = []
    for node in graph.nodes:
        if node.name in exclude or not (view.vocab.is_(node, "matmul") or view.vocab.is_(node, "gemm")):
            continue
        axis = k_axis(view, node)
        if axis is None:
            continue
        shape = view.constant(node.inputs[1]).shape
        out.append((Target(node.name, node.inputs[1].name, shape[axis], shape[1 - axis], axis), node))
    return out


def int4_targets(graph: gs.Graph, exclude=frozenset()) -> list[Target]:
    """Every MatMul whose input 1 is a constant 2-D float weight [K, N] (reduction axis 0) and every
    Gemm with transA=0 and a constant 2-D B (axis 0, or 1 when transB=1), in graph order; nodes
    named in `exclude` are left out."""
    return [t for t, _ in _found(graph, exclude)]


def _check_request(loaded: io.Loaded, block_size: int, method: str, data) -> None:
    if method not in METHODS:
        raise QdqError(f"unknown INT4 method {method!r}", f"use one of {', '.join(METHODS)}")
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) or block_size < 1:
        raise QdqError(f"INT4 block size must be a positive integer, got {block_size!r}",
                       f"use {option('block_size', BLOCK_SIZES[0])}")
    if method == "awq" and data is None:
        raise QdqError("INT4 method 'awq' needs calibration data",
                       f"pass {option('calib', 'DATA.npz', literal=False)}, or use method 'rtn'")
    opset = loaded.graph.opset
    if opset < MIN_OPSET:
        raise QdqError(f"INT4 blocked DequantizeLinear needs opset {MIN_OPSET}; the graph is at opset {opset}",
                       f"raise it first (qdqgraph.graph.io.raise_opset(model, {MIN_OPSET})) or re-export at opset "
                       f"{MIN_OPSET} or newer")


def block_sizes_for(ks) -> list[int]:
    """Block sizes that divide every K in `ks`, largest first: those of BLOCK_SIZES that divide
    their greatest common divisor, else its largest even divisors up to BLOCK_SIZES[0] (a block
    holds an even number of INT4 values, two per byte); at most three; empty when it is odd."""
    g = math.gcd(*(int(k) for k in ks))
    usual = [b for b in BLOCK_SIZES if g % b == 0]
    return (usual or [b for b in range(min(g, BLOCK_SIZES[0]), 1, -1) if g % b == 0 and b % 2 == 0])[:3]


def _check_divisible(found: list[tuple[Target, gs.Node]], block_size: int) -> None:
    """A QdqError naming the first target whose K is not a multiple of `block_size`, and the block
    sizes that divide every K (or why none does)."""
    bad = [t for t, _ in found if t.k % block_size]
    if not bad:
        return
    more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
    ks = sorted({t.k for t, _ in found})
    fits = block_sizes_for(ks)
    every = f"K={ks[0]}" if len(ks) == 1 else f"every K: {', '.join(map(str, ks))}"
    names = "|".join(re.escape(t.node) for t in bad[:3]) + ("|..." if len(bad) > 3 else "")
    exclude = (f"exclude the nodes whose K {block_size} does not divide "
               f"({option('exclude_nodes', repr(names), literal=False)})") if len(bad) < len(found) else ""
    if fits:
        fix = f"use {option('block_size', fits[0])}{''.join(f' or {b}' for b in fits[1:])} (each divides {every})"
        fix += f", or {exclude}" if exclude else ""
    else:
        odd = f"K={ks[0]} is odd" if len(ks) == 1 else f"their greatest common divisor {math.gcd(*ks)} is odd"
        fix = (f"no INT4 block size divides {every} ({odd}, and a block holds an even number of values); "
               f"{exclude + ', or ' if exclude else ''}use {option('precision', 'int8')} or fp8")
    raise QdqError(f"{bad[0].node}: K={bad[0].k} (weight {bad[0].weight}) is not divisible by the INT4 block size "
                   f"{block_size}{more}", fix)


def _check_scale_values(found: list[tuple[Target, gs.Node]], block_size: int) -> None:
    """A QdqError naming the first target whose blocked scale ((K / block_size) x N values) holds
    fewer values than TensorRT's parser takes (rules/precisions.toml, int4.min_scale_values: a
    one-column weight in a single block), and the block sizes that give it enough."""
    least = precision("int4").min_scale_values
    bad = [t for t, _ in found if (t.k // block_size) * t.n < least]
    if not bad:
        return
    t = bad[0]
    more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
    enough = [b for b in block_sizes_for([x.k for x, _ in found]) + [b for b in range(block_size // 2, 1, -2)]
              if b < block_size and all((x.k // b) * x.n >= least for x in bad)
              and all(x.k % b == 0 for x, _ in found)]
    fixes = [f"use {option('block_size', enough[0])}"] if enough else []
    names = "|".join(re.escape(x.node) for x in bad[:3]) + ("|..." if len(bad) > 3 else "")
    fixes.append(f"exclude it ({option('exclude_nodes', repr(names), literal=False)})")
    raise QdqError(f"{t.node}{more}: its {t.k}x{t.n} weight {t.weight} in blocks of {block_size} has a scale of "
                   f"{(t.k // block_size) * t.n} value, and TensorRT's ONNX parser rejects a blocked scale of "
                   f"fewer than {least} ('ScaleMode is illegal')", ", or ".join(fixes))


# ---------------------------------------------------------------------------- activations

def sample_rows(loaded: io.Loaded, tensors: list[str], data: CalibrationData, samples: int = SAMPLES,
                max_rows: int = MAX_ROWS, seed: int = ROW_SEED) -> tuple[dict, dict]:
    """({tensor: up to `max_rows` rows [rows, channels]}, {tensor: its value on the first sample}).

    The rows (last axis: channels) are a uniform sample without replacement, seeded, over the first
    `samples` calibration samples of the float model: every row gets a random key and the
    `max_rows` smallest keys are kept, so memory stays at `max_rows` plus one sample's rows."""
    rng = np.random.default_rng(seed)
    pool: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    first: dict[str, np.ndarray] = {}
    for values in float_activations(loaded, tensors, data, samples, "INT4 AWQ"):
        for name, v in values.items():
            v = np.asarray(v, dtype=np.float32)
            first.setdefault(name, v)
            rows = v.reshape(-1, v.shape[-1])
            keys = rng.random(rows.shape[0])
            if name in pool:
                keys, rows = np.concatenate([pool[name][0], keys]), np.concatenate([pool[name][1], rows])
            keep = np.argsort(keys, kind="stable")[:max_rows]
            pool[name] = (keys[keep], rows[keep])
    return {name: rows for name, (_, rows) in pool.items()}, first


# ---------------------------------------------------------------------------- AWQ search

def _as_kn(w: np.ndarray, axis: int) -> np.ndarray:
    """A weight as float32 [K, N]."""
    w = np.asarray(w, dtype=np.float32)
    return w if axis == 0 else w.T


def awq_scale(mean_abs: np.ndarray, alpha: float) -> np.ndarray:
    """AWQ's per-input-channel scale mean|x_k|^alpha, floored at MIN_CHANNEL_SCALE and normalised by
    sqrt(max * min) (llm-awq's auto_scale), clipped to [1/MAX_SCALE, MAX_SCALE]."""
    s = np.maximum(np.asarray(mean_abs, dtype=np.float64) ** alpha, MIN_CHANNEL_SCALE)
    s = s / np.sqrt(s.max() * s.min())
    return np.clip(s, 1.0 / MAX_SCALE, MAX_SCALE).astype(np.float32)


def output_error(x: np.ndarray, w: np.ndarray, approx: np.ndarray) -> float:
    """||x w - x approx||^2 (x [rows, K], w and approx [K, N]), in float64."""
    return float(np.sum((x @ (w - approx)).astype(np.float64) ** 2))


def _rtn_kn(w: np.ndarray, block_size: int, dtype) -> np.ndarray:
    return dequantize_blocked(*quantize_blocked(w, 0, block_size, dtype=dtype), 0, block_size)


def search_alpha(x: np.ndarray, weights: list[np.ndarray], block_size: int,
                 dtype=np.float32) -> tuple[float, np.ndarray]:
    """(alpha, s) for the layers whose [K, N] `weights` read rows `x` [rows, K]: the alpha in ALPHAS
    minimising sum ||x W - (x / s) Q(s W)||^2 (RTN, no clipping). Alpha 0 (s = 1) is RTN itself,
    so the choice is never worse than RTN on these rows."""
    mean_abs = np.abs(x).mean(axis=0)
    best = None
    for alpha in ALPHAS:
        s = awq_scale(mean_abs, alpha)
        err = sum(output_error(x, w, _rtn_kn(w * s[:, None], block_size, dtype) / s[:, None]) for w in weights)
        if best is None or err < best[2]:
            best = (alpha, s, err)
    assert best is not None, "ALPHAS is not empty"
    return best[0], best[1]


def _block_grams(x: np.ndarray, block_size: int) -> np.ndarray:
    """X_b^T X_b of every block b of input channels: [K / block_size, block_size, block_size]
    (float64 sums, kept as float32: the clip search compares errors, it does not add them up)."""
    xb = x.reshape(x.shape[0], -1, block_size).transpose(1, 0, 2).astype(np.float64)
    return np.matmul(xb.transpose(0, 2, 1), xb).astype(np.float32)


def block_errors(err: np.ndarray, grams: np.ndarray) -> np.ndarray:
    """||X_b e_bn||^2 = e_bn^T G_b e_bn for every block b and column n of a [K, N] weight error."""
    eb = err.reshape(grams.shape[0], grams.shape[1], -1).astype(np.float32)
    return np.sum(np.matmul(grams, eb) * eb, axis=1)


def search_clip(x: np.ndarray, w: np.ndarray, block_size: int, dtype=np.float32) -> np.ndarray:
    """The ratio from CLIP_RATIOS of each block's amax, [K / block_size, N], that minimises the
    block's own output error ||X_b (w_b - Q(w_b))||^2 on rows `x` (w: [K, N])."""
    grams = _block_grams(x, block_size)
    best: np.ndarray | None = None
    ratio: np.ndarray | None = None
    for r in CLIP_RATIOS:
        q, scale = quantize_blocked(w, 0, block_size, clip=r, dtype=dtype)
        err = block_errors(w - dequantize_blocked(q, scale, 0, block_size), grams)
        if best is None:
            best, ratio = err, np.full(err.shape, r, dtype=np.float32)
        else:
            assert ratio is not None     # set with best
            better = err < best
            best, ratio = np.where(better, err, best), np.where(better, np.float32(r), ratio)
    assert ratio is not None, "CLIP_RATIOS is not empty"
    return ratio


def _by_input(found: list[tuple[Target, gs.Node]]) -> dict[str, list[tuple[Target, gs.Node]]]:
    """The targets by the activation tensor they read (input 0)."""
    readers: dict[str, list[tuple[Target, gs.Node]]] = {}
    for t, node in found:
        readers.setdefault(node.inputs[0].name, []).append((t, node))
    return readers


def _choose_scalings(view: GraphView, readers: dict[str, list[tuple[Target, gs.Node]]], rows: dict,
                     block_size: int) -> dict[str, Scaling]:
    """The AWQ scale of each activation tensor read by targets, searched jointly over its
    `readers`, where it can be folded (see the module doc)."""
    inputs_of_weight: dict[str, set[str]] = {}
    for name, group in readers.items():
        for t, _ in group:
            inputs_of_weight.setdefault(t.weight, set()).add(name)
    out = {}
    jobs = []                   # searched together below; the graph is read here only
    for name, group in readers.items():
        c = out[name] = Scaling(name)
        x = rows.get(name)
        if x is None or x.shape[1] != group[0][0].k:
            c.skip("no calibration rows of the input with K channels")
            continue
        if any(len(inputs_of_weight[t.weight]) > 1 for t, _ in group):
            c.skip("a weight is shared with layers that read another input")
            continue
        c.how = fold_kind(view, view.tensors[name], {n.name for _, n in group})
        if not c.how:
            c.skip("no LayerNorm or linear producer that only these layers read, to fold 1/s into")
            continue
        jobs.append((c, x, [(view.constant(n.inputs[1]), t.axis) for t, n in group]))

    def search(job):            # the float32 [K, N] weights made here, one search's at a time
        _, x, values = job
        return search_alpha(x, [_as_kn(v, axis) for v, axis in values], block_size, values[0][0].dtype)
    found = list(blas.mapped(search, jobs, SEARCH_THREADS))
    for (c, _, _), (alpha, s) in zip(jobs, found):
        c.alpha = alpha
        if c.alpha == 0:
            c.how = "none"
        else:
            c.scale = s
    return out


def _scale_rows(view: GraphView, group: list[tuple[Target, gs.Node]], scale: np.ndarray) -> dict:
    """Multiply the input-channel rows of the group's weights by `scale` (one new constant per
    weight, so readers that shared one still do); returns {node name: its old weight} to undo."""
    old, new = {}, {}
    for t, node in group:
        w = node.inputs[1]
        if w.name not in new:
            v = view.constant(w)
            shaped = scale.reshape(-1, 1) if t.axis == 0 else scale.reshape(1, -1)
            new[w.name] = gs.Constant(f"{w.name}_awq", (v.astype(np.float64) * shaped).astype(v.dtype))
        old[node.name] = w
        node.inputs[1] = new[w.name]
    return old


def _fold_scalings(loaded: io.Loaded, view: GraphView, scalings: dict[str, Scaling],
                   readers: dict[str, list[tuple[Target, gs.Node]]], first: dict, data: CalibrationData) -> None:
    """Divide each scaled tensor by its s in the LayerNorm or layer that makes it (output_aware's
    folds) and multiply its readers' weight rows by s, so the float model computes what it did. A
    producer fold that does not divide the tensor on the first sample is undone, and that tensor's
    scaling skipped."""
    pending = {}
    for c in scalings.values():
        if c.scale is None:
            continue
        x = view.tensors[c.tensor]
        if c.how == "layernorm":
            ln = view.producer(x)
            divide(view, ln, 1, c.scale, -1, "awq")
            divide(view, ln, 2, c.scale, -1, "awq")
            _scale_rows(view, readers[c.tensor], c.scale)
            continue
        undo = fold_producer(view, x, c.scale)
        if undo is None:
            c.skip("the producer's shapes do not take a per-channel scale")
        else:
            pending[c.tensor] = (c, (undo, _scale_rows(view, readers[c.tensor], c.scale)))
    for c, (undo, weights) in failed_folds(loaded, pending, first, data).values():
        for node, k, axis in undo:
            divide(view, node, k, 1.0 / c.scale, axis, "unawq")
        for _, node in readers[c.tensor]:
            node.inputs[1] = weights[node.name]
        c.skip("the fold into the producer does not keep the column order")


# ---------------------------------------------------------------------------- graph rewrite

def _int4_constant(name: str, q: np.ndarray) -> gs.Constant:
    """A constant exported as a packed TensorProto.INT4. onnx_graphsurgeon 0.6.1 writes an
    ml_dtypes.int4 array one value per byte, which onnx rejects; the TensorProto made by
    onnx.numpy_helper packs it, and graphsurgeon exports a lazy value's TensorProto as it is."""
    return gs.Constant(name, gs.ir.tensor.LazyValues(proto.tensor(q.astype(ml_dtypes.int4), name)))


def _int4_bytes(count: int) -> int:
    return (count + 1) // 2


def _quantize_weight(w: np.ndarray, x: np.ndarray | None, s: np.ndarray | None, block_size: int,
                     dtype) -> tuple:
    """(q, scale, clip ratios or None, error, RTN error) of a [K, N] weight as the graph holds it
    (its rows multiplied by the AWQ scale `s`, if any), read by rows `x` of its input before the
    input was divided by `s`. With rows the clip is searched and kept only if it lowers the output
    error; errors are relative to ||x w||^2, RTN's for the weight without `s` and without clip."""
    q, scale = quantize_blocked(w, 0, block_size, dtype=dtype)
    if x is None:
        return q, scale, None, None, None
    xs = x if s is None else x / s
    plain = w if s is None else w / s[:, None]
    norm = float(np.sum((xs @ w).astype(np.float64) ** 2)) or 1.0
    rtn = output_error(x, plain, _rtn_kn(plain, block_size, dtype)) / norm
    err = output_error(xs, w, dequantize_blocked(q, scale, 0, block_size)) / norm
    ratio = search_clip(xs, w, block_size, dtype)
    qc, sc = quantize_blocked(w, 0, block_size, clip=ratio, dtype=dtype)
    clipped = output_error(xs, w, dequantize_blocked(qc, sc, 0, block_size)) / norm
    if clipped < err:
        return qc, sc, ratio, clipped, rtn
    return q, scale, None, err, rtn


def _clip_stats(ratio: np.ndarray | None) -> dict:
    if ratio is None:
        return {"clipped_blocks": 0, "mean_ratio": 1.0, "min_ratio": 1.0}
    return {"clipped_blocks": int(np.count_nonzero(ratio < 1.0)), "mean_ratio": round(float(ratio.mean()), 4),
            "min_ratio": round(float(ratio.min()), 4)}


def _replace(graph: gs.Graph, name: str, nodes: list[gs.Node], q: np.ndarray, scale: np.ndarray,
             axis: int, block_size: int, shape: tuple) -> str:
    """Feed `nodes` input 1 from DequantizeLinear(q, scale, zeros) (q, scale: [K, N] layout);
    returns the DequantizeLinear's name."""
    if axis == 1:
        q, scale = q.T, scale.T
    zero = _int4_constant(f"{name}_int4_zero_point", np.zeros(scale.shape, np.int8))
    out = gs.Variable(f"{name}_int4_dequantized", dtype=scale.dtype, shape=list(shape))
    graph.nodes.append(gs.Node(DEQUANTIZE, f"{name}_int4_dequantize",
                               attrs={"axis": axis, "block_size": int(block_size)},
                               inputs=[_int4_constant(f"{name}_int4", q), gs.Constant(f"{name}_int4_scale", scale), zero],
                               outputs=[out]))
    for node in nodes:
        node.inputs[1] = out
    return f"{name}_int4_dequantize"


def quantize_int4_weights(loaded: io.Loaded, *, block_size: int = 128, method: str = "rtn",
                          data: CalibrationData | None = None, exclude=frozenset(),
                          samples: int = SAMPLES) -> PassResult:
    """Replace every target's weight (`int4_targets`) by an INT4 blocked DequantizeLinear; see the
    module doc. `method` "awq" needs `data`; the graph must be at opset 21 or newer. A weight read by
    several targets is quantized once, and one DequantizeLinear feeds them all. Raises QdqError
    when a target's K is not a multiple of `block_size`. Modifies `loaded` (its IR version is raised
    to 10 for INT4).

    Details: `weights` {weight: {nodes, k, n, axis, blocks, method, alpha, scaling, clip, error,
    rtn_error, float_kept, bytes_before, bytes_after}} (errors: relative output error on the sample
    rows, AWQ only; float_kept: other nodes still read the float weight, which then stays and counts
    in bytes_after), `skipped` {node: reason}, `bytes_before` and `bytes_after` (in all)."""
    _check_request(loaded, block_size, method, data)
    graph = loaded.graph
    view = GraphView(graph)
    skipped, found = {}, []
    for t, node in _found(graph, exclude):
        dtype = view.constant(node.inputs[1]).dtype
        if dtype in SCALE_DTYPES:
            found.append((t, node))
        else:
            skipped[t.node] = f"a {dtype} weight: DequantizeLinear writes float32 or float16 here"
    _check_divisible(found, block_size)
    _check_scale_values(found, block_size)
    rows: dict[str, np.ndarray] = {}
    scalings: dict[str, Scaling] = {}
    rescaled: list[str] = []           # what the folds divide per channel (io.RESCALED_KEY)
    if method == "awq" and found:
        assert data is not None, "_check_request: awq needs data"
        readers = _by_input(found)
        rows, first = sample_rows(loaded, sorted(readers), data, samples)
        scalings = _choose_scalings(view, readers, rows, block_size)
        _fold_scalings(loaded, view, scalings, readers, first, data)
        rescaled = _rescaled(view, scalings)
    by_weight: dict[str, list[tuple[Target, gs.Node]]] = {}
    for t, node in found:           # the weights as the folds left them
        by_weight.setdefault(node.inputs[1].name, []).append((t, node))
    weights = {}
    keys = []
    for name, group in by_weight.items():
        keys.append(group[0][0].weight if group[0][0].weight not in keys else name)   # the model's name
    # each weight's quantization is numeric (searched at once); the graph is changed here as each comes
    jobs = [_weight_job(view, group, rows, scalings, method) for group in by_weight.values()]
    done = blas.mapped(lambda job: _quantize_weight(_as_kn(job[0], job[1]), job[2], job[3], block_size,
                                                    job[0].dtype), jobs, SEARCH_THREADS)
    with contextlib.closing(done):      # BLAS's threads back at once, should a replacement fail
        for key, group, quantized in zip(keys, by_weight.values(), done):
            weights[key] = _int4_weight(graph, view, key, group, scalings, method, block_size, quantized)
    before = sum(w["bytes_before"] for w in weights.values())
    after = sum(w["bytes_after"] for w in weights.values())
    if weights:
        loaded.ir_version = max(loaded.ir_version, MIN_IR_VERSION)
        graph.cleanup(remove_unused_graph_inputs=False).toposort()
    return result("int4_weights", bool(weights), weights=weights, skipped=skipped,
                  bytes_before=before, bytes_after=after, rescaled=rescaled)


def _rescaled(view: GraphView, scalings: dict[str, Scaling]) -> list[str]:
    """The tensors the folded scalings divide: a LayerNorm's output, or the path from the layer."""
    return sorted({n for c in scalings.values() if c.scale is not None and c.how in ("layernorm", "producer")
                   for n in fold_reach(view, view.tensors[c.tensor], c.how)})


def _weight_job(view: GraphView, group: list[tuple[Target, gs.Node]], rows: dict, scalings: dict[str, Scaling],
                method: str) -> tuple:
    """(the weight the nodes of `group` read, its K axis, its rows or None, the AWQ scale or None):
    what `_quantize_weight` takes for it (the float32 [K, N] copy is made by the search itself)."""
    t, node = group[0]
    value = view.constant(node.inputs[1])
    c = scalings.get(node.inputs[0].name)       # a weight read from several inputs is never scaled
    x = _rows_of(group, rows, t.k) if method == "awq" else None
    return value, t.axis, x, c.scale if c else None


def _int4_weight(graph: gs.Graph, view: GraphView, name: str, group: list[tuple[Target, gs.Node]],
                 scalings: dict[str, Scaling], method: str, block_size: int, quantized: tuple) -> dict:
    """Feed the nodes of `group` from one DequantizeLinear named after `name` of their weight
    `quantized` (`_quantize_weight`'s answer), and return its details."""
    t, node = group[0]
    value = view.constant(node.inputs[1])
    c = scalings.get(node.inputs[0].name)
    q, scale, ratio, err, rtn = quantized
    kept = _read_elsewhere(view, node.inputs[1], [n for _, n in group])
    dq = _replace(graph, name, [n for _, n in group], q, scale, t.axis, block_size, value.shape)
    size = _int4_bytes(q.size) + scale.nbytes + _int4_bytes(scale.size) + (value.nbytes if kept else 0)
    return {"nodes": [n.name for _, n in group], "dequantize": dq, "k": t.k, "n": t.n, "axis": t.axis, "blocks": int(scale.size),
            "method": method, "alpha": c.alpha if c else 0.0, "scaling": c.how if c else "none",
            "clip": _clip_stats(ratio), "error": err, "rtn_error": rtn, "float_kept": kept,
            "bytes_before": int(value.nbytes), "bytes_after": int(size)}


def _read_elsewhere(view: GraphView, weight: gs.Tensor, readers: list[gs.Node]) -> bool:
    """Do nodes other than `readers` (excluded or non-target ones) still read the float weight?"""
    return any(all(c is not r for r in readers) for c, _ in view.consumers(weight)) or view.is_graph_output(weight)


def _rows_of(group: list[tuple[Target, gs.Node]], rows: dict, k: int) -> np.ndarray | None:
    """The float rows the readers of one weight see (stacked when the weight is read from several
    inputs); None when there are none."""
    parts = [rows[name] for name in dict.fromkeys(n.inputs[0].name for _, n in group)
             if name in rows and rows[name].shape[1] == k]
    return np.concatenate(parts) if parts else None
