"""Output-aware scales with per-layer smoothing: each linear layer's input scale (and SmoothQuant
strength) chosen by the error it causes in the layer's output, not in the tensor itself.

Transformer activations carry a few outlier channels (the residual stream and what LayerNorm makes
of it, the FFN's inner activation): a per-tensor INT8 scale set by a range estimate of the tensor
alone either clips those channels or leaves the others a handful of levels, and which hurts more
depends on the weights that read them (Bondarenko et al. 2021). For every activation that only
linear layers read (MatMul/Gemm with a constant 2-D weight, the plan quantizing both), this recipe
takes a few hundred rows of it from the float model on the calibration data and, for each
SmoothQuant strength alpha in ALPHAS (0: none; Xiao et al. 2023, s_k = max|x_k|^alpha /
max|W_k|^(1-alpha)) and each clipping range in a grid, quantizes the activation (per tensor) and
the weights (per output channel) as insertion will and measures ||X W - Q(X / s) Q(s W)||^2 over
all the layers that read it. The best (alpha, range) wins; alpha 0 with the range calibration
would give is always a candidate, so on the rows measured the choice is never worse than without
the pass.

The smoothing adds no node where it can be folded: into a LayerNormalization's scale and bias
where the LayerNorm output feeds nothing else, or into the output columns (and bias) of the linear
layer that makes the tensor, through reshapes, transposes and the right operand of a MatMul (an
attention's context is its value projection's columns, mixed over tokens). A fold into a producer
keeps the column order where the path's shapes prove it (passes/fold_columns); any other is
checked on one calibration sample (the tensor must come out divided by s) and undone, for a Mul,
where it is not. Elsewhere the smoothing is a Mul in front of the readers, taken only when it cuts
the error by MUL_GAIN or more, since TensorRT runs the Q after that Mul as a standalone reformat.
The chosen range of each tensor is returned, to replace the calibrated one (`ranges`).

A convolution whose output a global max pool reads is searched the same way, its input read as
receptive-field patches and one smoothing factor per input channel, but measured where the pool
reads it (recipes/pooled.py).
"""
from __future__ import annotations

import functools
from typing import Protocol

import numpy as np
import onnx_graphsurgeon as gs

from ..graph import io
from ..graph.view import GraphView
from ..passes.base import PassResult
from ..passes.channel_scale import MAX_SCALE, fold_kind, k_axis
from ..passes.fold_columns import proved
from ..passes.output_aware import Choice, apply
from ..passes.smooth import conv_targets, targets
from ..placement.plan import Plan
from ..precisions.scales import safe_scales
from ..samples.data import CalibrationData
from ..samples.rows import RowSample
from ..execution import blas
from ..execution.profile import step
from ..execution.runtime import float_activations, float_runs
from .conv_math import patch_rows, position_step
from .pooled import PooledRows, max_pooled
from .pooled import errors as pooled_errors
ALPHAS = (0.0, 0.5, 0.65, 0.8)
CLIP_GRID = tuple(2.0 ** (-i / 2) for i in range(20))    # fractions of max|x|: 1 .. 0.0014, then
REFINE = 2.0 ** 0.25                                      # the best one's neighbours at this ratio
MAX_ROWS = 512            # rows of each activation the search runs on, strided over the rows seen
SAMPLES = 32              # calibration samples they are taken from, at most ...
# ... and no more than it takes each activation to show this many rows. Fewer samples cost the choice
# accuracy: on Whisper tiny.en's encoder (1,500 tokens a sample) the rows of the first 6 of its 16
# calibration samples (9,000 rows) took the written model from 25.1 to 22.0 dB output SQNR on the 16
# held-out samples, so the budget stays above its 24,000 rows and bounds only longer inputs
ROW_BUDGET = 32768
# a tensor that shows fewer rows (a pooled vector, a row a sample, shows at most SAMPLES) keeps its
# calibrated range and no smoothing: a choice made on so few rows follows them. EfficientNet-Lite0's
# classifier input (32 rows of 1,280 channels) took a smoothing at alpha 0.65 with --output-aware
# on, and its held-out outputs fell from 13.8 to 9.7 dB (top-1 agreement 0.836 -> 0.758); every
# linear input of the transformer set shows 1,024 rows or more
MIN_ROWS = 2 * SAMPLES
PROJECT = 128             # outputs the error is measured on (a random projection of them)
SCAN_TOP_ROWS = 1 / 16    # the grid is scanned on the rows with the largest values (this share of them)...
SCAN_STRIDE = 8           # ... and every 8th of the others
SCAN_KEEP = 2             # the best grid points of the scan, measured again on all rows
SCAN_SAMPLES_SHARE = 4    # a pooled layer's grid is scanned on this share of its samples (recipes/pooled)
MUL_GAIN = 0.25           # a smoothing that needs an inserted Mul must cut the output error by this much
SEARCH_THREADS = 4        # tensors searched at once, at most one a core (on one BLAS thread each)
PATCH_POSITIONS = 2048    # output positions of a convolution taken as rows from each sample, at most


def _weight(view: GraphView, node: gs.Node) -> np.ndarray:
    """The node's weight as [K, M] (K: the input channels; a convolution's [O, C, *kernel] as
    [C * prod(kernel), O], channel-major, the order of its patch rows)."""
    w = view.constant(node.inputs[1]).astype(np.float32)
    if w.ndim >= 3:
        return w.reshape(w.shape[0], -1).T
    return w if k_axis(view, node) == 0 else w.T


def _taps(view: GraphView, node: gs.Node) -> int:
    """Kernel taps per input channel: 1 for a MatMul/Gemm, prod(kernel) for a convolution."""
    w = view.constant(node.inputs[1])
    return int(np.prod(w.shape[2:])) if w.ndim >= 3 else 1


def _quant_weight(w: np.ndarray) -> np.ndarray:
    """[K, M] weight quantized per output channel (axis 1), as insertion does, dequantized."""
    s = safe_scales(np.maximum(w.max(axis=0), -w.min(axis=0)))
    return _fake_quant(w / s, s).astype(np.float32, copy=False)


def _fake_quant(q: np.ndarray, s: np.ndarray) -> np.ndarray:
    """`q` (a fresh array of x / s) rounded, clipped to INT8 and multiplied by `s` again, in place."""
    np.rint(q, out=q)
    np.clip(q, -128, 127, out=q)
    q *= s
    return q


def _quant_act(x: np.ndarray, amax: float) -> np.ndarray:
    s = np.float32(safe_scales(np.array([amax]))[0])
    return _fake_quant(x / s, s).astype(np.float32, copy=False)


def _quant_acts(x: np.ndarray, ranges: list[float]) -> np.ndarray:
    """[len(ranges), N, K]: `_quant_act` of `x` at each range, the same values, computed at once."""
    scales = safe_scales(np.array(ranges))[:, None, None]
    return _fake_quant(x[None] / scales, scales)


class Rider(Protocol):
    """Another use of the float run `rows` makes: of the tensors `names`, those the run fetches
    anyway (its own tensors and the graph outputs) are handed to `add(sample, 1, feed, {name:
    value})` for each sample it runs (calib.collect's keeper of the float outputs is one, massive
    columns' Products another). No other tensor is fetched for a rider: another output asked of
    the session could change what onnxruntime fuses, and with it the last bits of the rows."""

    names: list[str]

    def add(self, sample: int, n: int, feed: dict, out: dict) -> None: ...


def rows(loaded: io.Loaded, tensors: list[str], data: CalibrationData,
         first_of: set[str] | None = None, riders: tuple[Rider, ...] = (),
         pooled: dict[str, list[PooledRows]] | None = None) -> tuple[dict, dict, dict, dict]:
    """({tensor: up to MAX_ROWS rows [N, K]}, {tensor: max |x| per channel over all rows seen},
    {tensor: its value on the first sample} for the tensors of `first_of` (all when None), what
    was sampled). The samples stream past (samples.rows.RowSample): at most SAMPLES of them, no
    more than it takes every tensor to show ROW_BUDGET rows, and only the rows kept are held.
    `riders` get the graph outputs of the same runs. A tensor of `pooled` (-> the PooledRows of each
    convolution that reads it, recipes/pooled) shows every position of each sample to each of them,
    and is read as the first one's receptive fields (conv_math.patch_rows, at most PATCH_POSITIONS
    positions a sample), its channel maxima over axis 1 of all its values."""
    sample = RowSample(MAX_ROWS, ROW_BUDGET, SAMPLES)
    pooled = pooled or {}
    conv_max: dict[str, np.ndarray] = {}
    first: dict[str, np.ndarray] = {}
    outputs = {t.name for t in loaded.graph.outputs}
    extra = sorted({n for r in riders for n in r.names if n in outputs} - set(tensors))
    for i, (feed, got) in enumerate(float_runs(loaded, list(tensors) + extra, data, SAMPLES, "output-aware scales")):
        for r in riders:
            r.add(i, 1, feed, {n: got[n] for n in r.names if n in got})
        values = {t: got[t] for t in tensors}
        if not sample.samples:
            first = {k: np.asarray(v, dtype=np.float32) for k, v in values.items() if first_of is None or k in first_of}
        for t, layers in pooled.items():
            v = np.asarray(values[t], dtype=np.float32)
            m = np.abs(v).max(axis=tuple(i for i in range(v.ndim) if i != 1))
            conv_max[t] = m if t not in conv_max else np.maximum(conv_max[t], m)
            values[t] = _pooled_rows(v, layers)
        if not sample.add(values, data.count):
            break
    return sample.rows(), {**sample.channel_max(), **conv_max}, first, sample.stated()


def _pooled_rows(v: np.ndarray, layers: list[PooledRows]) -> np.ndarray:
    """Show each sample of `v` [N, C, *spatial] (every position) to each layer not yet full, and
    return the first layer's receptive fields at most PATCH_POSITIONS positions a sample apart
    (conv_math.patch_rows), taken from the every-position rows where the first layer made them."""
    first: list[np.ndarray] = []
    for k, layer in enumerate(layers):
        for one in v if not layer.full() else []:
            every = patch_rows(layer.node, one[None], layer.kernel, 1 << 62)
            layer.add(every)
            if k == 0:
                first.append(every)
    if not first:
        return patch_rows(layers[0].node, v, layers[0].kernel, PATCH_POSITIONS)
    step = position_step(first[0].shape[0], PATCH_POSITIONS)
    return np.concatenate([every[::step] for every in first])


def _smoothing(cmax: np.ndarray, w: np.ndarray, alpha: float, taps: int = 1,
               wmax: np.ndarray | None = None) -> np.ndarray:
    """s of each input channel (of `cmax`); `w` [K, M] with K = channels * `taps` (channel-major),
    or `wmax`, each channel's max |weight| over every layer that reads the tensor."""
    aw = _channel_wmax(w, taps) if wmax is None else wmax
    ok = (cmax > 0) & (aw > 0)
    s = np.ones_like(cmax, dtype=np.float64)
    if alpha > 0:
        s[ok] = cmax[ok].astype(np.float64) ** alpha / aw[ok].astype(np.float64) ** (1.0 - alpha)
    return np.clip(s, 1.0 / MAX_SCALE, MAX_SCALE).astype(np.float32)


def _channel_wmax(w: np.ndarray, taps: int = 1) -> np.ndarray:
    """Each input channel's max |weight| of `w` [K, M], K = channels * `taps` (channel-major)."""
    aw = np.abs(w).max(axis=1)
    return aw.reshape(-1, taps).max(axis=1) if taps > 1 else aw


@functools.lru_cache(maxsize=8)
def _projection(m: int) -> np.ndarray | None:
    """[M, PROJECT] random Gaussian columns (fixed seed) scaled so ||E P||^2 estimates ||E||^2 without
    bias, or None when M is small enough to use E itself. The same for every layer of M outputs:
    made once (read-only) and shared."""
    if m <= PROJECT:
        return None
    p = (np.random.default_rng(0).standard_normal((m, PROJECT)) / np.sqrt(PROJECT)).astype(np.float32)
    p.flags.writeable = False
    return p


def search(x: np.ndarray, w: np.ndarray, cmax: np.ndarray, extra: tuple[float, ...] = (),
           alphas: tuple[float, ...] = ALPHAS) -> tuple:
    """((alpha, amax, relative error) of the best candidate, best relative error at alpha 0).
    `x` [N, K] rows, `w` [K, M] the weights of every reader side by side, `extra`: more ranges to
    try at alpha 0 (the calibration's). The output error is measured through a random projection
    of the M outputs to PROJECT (Johnson-Lindenstrauss), which keeps the comparison between
    candidates and makes each one PROJECT/M as costly. The grid is scanned on a sample of the rows
    (`_scan_rows`); the SCAN_KEEP best of the scan, the `extra` ranges and the refinement are
    measured on all of them, and only those errors are compared and returned."""
    best, at_zero = _search(x, w, cmax, extra, alphas)
    return best, (at_zero[2] if at_zero is not None else None)


def _scan_rows(x: np.ndarray) -> tuple:
    """(row indices, their weights) of the sample the grid is scanned on, or (None, None) to measure
    every grid point on all rows: the SCAN_TOP_ROWS share of rows with the largest max|x| (which
    decide the clipping), every one, and every SCAN_STRIDE-th of the others, weighted by the stride
    (so the sum estimates the error over all rows)."""
    n = x.shape[0]
    if SCAN_STRIDE <= 1 or n < SCAN_STRIDE * 8:
        return None, None
    peak = np.abs(x).max(axis=1)
    order = np.argsort(-peak, kind="stable")
    top = order[:max(1, int(n * SCAN_TOP_ROWS))]
    rest = np.sort(order[len(top):])[::SCAN_STRIDE]
    rows = np.concatenate([np.sort(top), rest])
    weights = np.concatenate([np.ones(len(top)), np.full(len(rest), (n - len(top)) / max(len(rest), 1))])
    return rows, weights


def _search(x: np.ndarray, w: np.ndarray, cmax: np.ndarray, extra: tuple[float, ...],
            alphas: tuple[float, ...], taps: int = 1, pooled: list[PooledRows] | None = None,
            wmax: np.ndarray | None = None) -> tuple:
    """`search`, returning the best candidate at alpha 0 as (0.0, amax, error) in second place (or
    None when alpha 0 is not among `alphas`).

    Measured on MiniLM's 24 linear-layer inputs (512 rows each): the same choice, range and error
    for every tensor as measuring every grid point on all rows, with 3.5x fewer row products.

    The products are most of the cost (about 60% on MiniLM and Whisper tiny.en's encoder) and each is
    needed: a candidate changes the quantized rows themselves, so the error has no form through a
    Gram matrix of the rows computed once (X^T X would cost N K^2 a candidate, against N K PROJECT
    here, K >= PROJECT on those models). A coarser projection is cheaper but not the same choice:
    at PROJECT = 32 the search took half the time and ViT-S's written model fell from 32.8 to
    28.8 dB output SQNR on its held-out samples."""
    p = _projection(w.shape[1])
    ref = x @ (w if p is None else w @ p)
    norm = float(np.sum(ref.astype(np.float64) ** 2)) or 1.0
    scan_rows, scan_weights = _scan_rows(x) if pooled is None else (None, None)
    ref_scan = ref[scan_rows]
    peaks = [layer.peaks() for layer in pooled] if pooled is not None else []

    def errors(xs, wq, ranges):
        """The relative output error of each range, on all rows: one product for all of them."""
        if not ranges:
            return []
        q = _quant_acts(xs, ranges)
        e = (q.reshape(-1, q.shape[-1]) @ wq).reshape(len(ranges), len(xs), -1)
        e -= ref
        e2 = np.square(e, dtype=np.float64)
        return [float(np.sum(r)) / norm for r in e2]

    def estimates(xs_scan, wq, grid):
        """The scan's error of every range of `grid` at once: one product for all of them."""
        q = _quant_acts(xs_scan, grid)
        e = (q.reshape(-1, q.shape[-1]) @ wq).reshape(len(grid), len(xs_scan), -1)
        e -= ref_scan
        e = e.astype(np.float64)
        return [float(scan_weights @ row) for row in np.einsum("gij,gij->gi", e, e)]

    best, at_zero = None, None
    for alpha in alphas:
        per_channel = _smoothing(cmax, w, alpha, taps, wmax)
        s = np.repeat(per_channel, taps) if taps > 1 else per_channel
        xs = x / s
        wq = _quant_weight(w * s[:, None])
        top = float(np.abs(xs).max()) or 1.0
        scan = None
        if pooled:                  # the error where a global max pool reads the output (recipes/pooled)
            layers = [(layer, pk, sl, _quant_weight(layer.w * sl[:, None])) for layer, pk in zip(pooled, peaks)
                      for sl in [np.repeat(per_channel, layer.taps)]]
            top = max([top] + [float(np.abs(r / sl).max()) for layer, _, sl, _ in layers for r in layer.rows])
            measure = functools.partial(pooled_errors, layers, _quant_act)
            samples = min(len(layer.rows) for layer in pooled)
            if samples >= 2 * SCAN_SAMPLES_SHARE:
                scan = functools.partial(measure, part=samples // SCAN_SAMPLES_SHARE)
        else:
            if p is not None:
                wq = wq @ p
            measure = functools.partial(errors, xs, wq)
            if scan_rows is not None:
                scan = functools.partial(estimates, xs[scan_rows], wq)
        here = _best_range(top, measure, scan, list(extra) if alpha == 0 else [])
        if best is None or here[1] < best[2]:
            best = (alpha, here[0], here[1])
        if alpha == 0:
            at_zero = (0.0, here[0], here[1])
    return best, at_zero


def _best_range(top: float, measure, scan, extra: list[float]) -> tuple[float, float]:
    """(range, error) of the best of the grid below `top` (the SCAN_KEEP best of `scan`'s estimate of
    it, where there is a scan) and `extra`, measured by `measure(ranges)`, then of its two neighbours
    at REFINE."""
    grid = [top * f for f in CLIP_GRID]
    if scan is not None and len(grid) > SCAN_KEEP:
        estimate = scan(grid)
        keep = set(sorted(range(len(grid)), key=estimate.__getitem__)[:SCAN_KEEP])
        grid = [amax for i, amax in enumerate(grid) if i in keep]
    here = None
    candidates = grid + extra
    for amax, err in zip(candidates, measure(candidates)):
        if here is None or err < here[1]:
            here = (amax, err)
    assert here is not None, "CLIP_GRID is not empty"
    refine = [amax for amax in (here[0] / REFINE, here[0] * REFINE) if amax <= top]
    for amax, err in zip(refine, measure(refine)):
        if err < here[1]:
            here = (amax, err)
    return here


def choose(loaded: io.Loaded, plan: Plan, data: CalibrationData) -> tuple[list[Choice], dict]:
    """The (alpha, range) of every activation read only by linear layers (see the module doc), and
    each tensor's value on the first sample, where a fold into its producer is possible (for
    `apply` to check folds against)."""
    choices, first, _ = _sampled(loaded, plan, data)
    return choices, first


def _targets(view: GraphView, loaded: io.Loaded, plan: Plan) -> tuple[dict, set[str]]:
    """({activation: the linear layers or the convolutions that read it}, the convolutions' inputs)
    of every activation the search can choose for: read only by such layers, with a site of its
    own whose range is not exact. A convolution's input only where a global max pool reads each
    convolution that reads it, whatever their kernel sizes (recipes/pooled.py; Kim's text CNN reads
    its input with three): on other convolutions, measured on Whisper tiny.en's
    encoder (its two) and ViT-S (its patch embedding), searching them lost 0.1 dB held out on
    both, at the cost of their patches' float runs and search (docs/ACCURACY.md)."""
    sites = {s.tensor: s for s in plan.activation_sites()}

    def own(t: str, nodes: list) -> bool:
        return t in sites and len(sites[t].edges) == len(nodes) and sites[t].exact_amax is None and not sites[t].group
    linear = {t: nodes for t, nodes in targets(loaded.graph, plan).items() if own(t, nodes)}
    pooled = {t: nodes for t, nodes in conv_targets(loaded.graph, plan).items()
              if own(t, nodes) and all(max_pooled(view, n) for n in nodes)}
    return linear | pooled, set(pooled)


def pooled_targets(loaded: io.Loaded, plan: Plan) -> list[str]:
    """The activations the search measures where a global max pool reads their layer."""
    view = GraphView(loaded.graph, lazy=True)
    if not any(view.vocab.is_(n, "max_over_positions") for n in view.nodes):
        return []                   # no pool: the targets are not looked for (a 10,000-node CNN)
    return sorted(_targets(view, loaded, plan)[1])


def _sampled(loaded: io.Loaded, plan: Plan, data: CalibrationData,
             riders: tuple[Rider, ...] = (), pooled_only: bool = False) -> tuple[list[Choice], dict, dict]:
    """`choose` (of the activations whose convolutions global max pools read, with `pooled_only`),
    and what was sampled (RowSample.stated) or {} when nothing was (and nothing was run: the
    `riders` then got nothing)."""
    view = GraphView(loaded.graph)
    linear, pooled_set = _targets(view, loaded, plan)
    if pooled_only:
        linear = {t: nodes for t, nodes in linear.items() if t in pooled_set}
    if not linear:
        return [], {}, {}
    pooled = {t: [PooledRows(_weight(view, n), _taps(view, n), n, view.constant(n.inputs[1]).shape[2:])
                  for n in linear[t]] for t in sorted(pooled_set)}
    producer = {t for t, nodes in linear.items()
                if t not in pooled and fold_kind(view, view.tensors[t], {n.name for n in nodes}) == "producer"}
    with step("float rows"):
        xs, cmax, first, stated = rows(loaded, sorted(linear), data, producer, riders, pooled)
    with step("search"):
        return _choose(view, linear, xs, cmax, pooled), first, stated


def _choose(view: GraphView, linear: dict, xs: dict, cmax: dict,
            pooled: dict[str, list[PooledRows]] | None = None) -> list[Choice]:
    # the graph is read here, on this thread; only each tensor's numeric search (`_search`: numpy,
    # which lets go of the GIL) runs in `_searched`'s threads, and its results are taken in order
    jobs = []
    for t, nodes in sorted(linear.items()):
        if t not in xs or xs[t].shape[0] < MIN_ROWS:
            continue
        layers = (pooled or {}).get(t)
        # the rows are the first reader's patches; the other readers of a pooled tensor (other kernel
        # sizes) are measured on their own (PooledRows) and share each channel's smoothing factor
        w = _weight(view, nodes[0]) if layers else np.concatenate([_weight(view, n) for n in nodes], axis=1)
        taps = _taps(view, nodes[0])
        trailing = view.constant(nodes[0].inputs[1]).ndim - 2     # a convolution's axes after its channels
        if w.shape[0] != xs[t].shape[1] or cmax[t].shape[0] * taps != w.shape[0]:
            continue
        wmax = np.max([_channel_wmax(layer.w, layer.taps) for layer in layers], axis=0) if layers else None
        jobs.append((t, nodes, w, taps, trailing, layers, wmax))
    out = []
    for (t, nodes, w, taps, trailing, layers, wmax), found in zip(jobs, _searched(jobs, xs, cmax)):
        (alpha, amax, err), at_zero = found
        assert at_zero is not None, "ALPHAS holds 0"
        plain = at_zero[2]
        folded = fold_kind(view, view.tensors[t], {n.name for n in nodes}) if alpha > 0 and trailing <= 0 else ""
        if alpha > 0 and not folded and err > (1.0 - MUL_GAIN) * plain:
            (alpha, amax, err) = at_zero          # what a search at alpha 0 alone finds
        out.append(Choice(t, [n.name for n in nodes], alpha, amax, err, plain, folded,
                          _smoothing(cmax[t], w, alpha, taps, wmax) if alpha > 0 else None, max(trailing, 0),
                          bool(layers)))
    return out


def _searched(jobs: list[tuple], xs: dict, cmax: dict) -> list[tuple]:
    """`_search` of each job's tensor, in order, SEARCH_THREADS at once (execution.blas.mapped)."""
    def one(job):
        t, _, w, taps, _, layers, wmax = job
        calibrated = high_percentile(np.abs(xs[t]), 99.99)
        return _search(xs[t], w, cmax[t], (calibrated,), ALPHAS, taps, layers, wmax)
    return list(blas.mapped(one, jobs, SEARCH_THREADS))


def high_percentile(a: np.ndarray, q: float) -> float:
    """float(np.percentile(a, q)) of a 2-D array (numpy's linear method, bit for bit), found among
    the rows that hold its largest values: the k values from the one at q up are among the rows
    with the k largest maxima, so only those rows are partitioned (MiniLM-L6's 24 linear inputs,
    512 rows each: 0.13 -> 0.015 s). Where they are not fewer than half the rows, or a value is
    not finite, np.percentile itself."""
    n = a.size
    qq = np.true_divide(q, 100)
    virtual = n * qq + (1 + qq * (1 - 1 - 1)) - 1       # numpy's virtual index for the linear method
    lo = min(max(int(np.floor(virtual)), 0), n - 1)
    hi = min(lo + 1, n - 1)
    k = n - lo                                          # the top k values hold positions lo and hi
    rowmax = a.max(axis=1) if a.ndim == 2 and a.size else None
    if rowmax is None or 2 * k > a.shape[0] or not np.isfinite(rowmax).all():
        return float(np.percentile(a, q))
    rows = np.argpartition(rowmax, a.shape[0] - k)[a.shape[0] - k:]
    s = a[rows].ravel()
    s.partition([s.size - k, s.size - (n - hi)])
    prev, nxt = s[s.size - k], s[s.size - (n - hi)]
    gamma = float(virtual - np.floor(virtual))
    diff = nxt - prev                                   # numpy's _lerp, in the array's type
    return float(nxt - diff * (1 - gamma)) if gamma >= 0.5 else float(prev + diff * gamma)


def failed_folds(loaded: io.Loaded, pending: dict, first: dict, data: CalibrationData) -> dict:
    """The producer folds whose tensor, on the first sample, is not its float value divided by the
    smoothing (a reshape that does not keep the column order). The folds their shapes prove
    (`_proved`) are not run; the others are, on the graph with every fold in it."""
    if not pending:
        return {}
    names = sorted(set(pending) - _proved(loaded, pending, first, data))
    if not names:
        return {}
    try:
        now: dict[str, np.ndarray] = next(iter(float_activations(loaded, names, data, 1, "output-aware fold check")), {})
    except Exception:  # noqa: BLE001 - a fold that breaks the model is undone like one that changes it
        return dict(pending)
    failed = {}
    for name in names:
        c, _ = pending[name]
        want = first[name] / c.scale
        got = np.asarray(now.get(name, np.zeros(0)), dtype=np.float32)
        if got.shape != want.shape or not np.allclose(got, want, rtol=1e-3, atol=1e-4 * (float(np.abs(want).max()) or 1.0)):
            failed[name] = pending[name]
    return failed


def _proved(loaded: io.Loaded, pending: dict, first: dict, data: CalibrationData) -> set[str]:
    """The pending folds that keep the column order by their shapes (passes.fold_columns), at the
    first sample's input shapes, each tensor's symbols fixed by the shape the float run saw it
    with: those need no run to check."""
    try:
        shapes = io.shapes_at(loaded, {k: tuple(v.shape) for k, v in data.sample(0).items()})
    except Exception:  # noqa: BLE001 - no shapes, no proof: the run checks every fold
        return set()
    view = GraphView(loaded.graph)
    return {name for name in pending if name in first and _proves(view, name, shapes, tuple(first[name].shape))}


def _proves(view: GraphView, name: str, shapes: dict, seen: tuple) -> bool:
    try:
        return proved(view, view.tensors[name], shapes, seen)
    except Exception:  # noqa: BLE001 - a graph the proof cannot read is run and checked instead
        return False


def run(loaded: io.Loaded, plan: Plan, data: CalibrationData, riders: tuple[Rider, ...] = (),
        pooled_only: bool = False) -> tuple[PassResult, dict[str, float]]:
    """Choose each linear-layer input's smoothing and range on `data` (only those of `pooled_targets`
    with `pooled_only`), apply them (checking producer folds on the first sample), and return the
    pass's result (with what was sampled, `rows`) and the chosen ranges. `riders`: see `rows`."""
    choices, first, stated = _sampled(loaded, plan, data, riders, pooled_only)
    passed, ranges = apply(loaded, choices, first, lambda pending: failed_folds(loaded, pending, first, data))
    if stated:
        passed.details["rows"] = stated
    return passed, ranges
