"""Run the float model through onnxruntime and reduce each planned tensor into running state.

Only the tensors the plan quantizes are observed. Each batch is reduced at once and dropped, so
memory does not grow with the number of samples; tensors that must share one scale (a Concat
group) feed one state. How each tensor is reduced:

* with the compiled kernel (`histogram.COMPILED`, the usual case), every method: the tensors
  themselves become graph outputs, written by onnxruntime into arrays bound once (IOBinding), and
  `RangeState.update` (or `MaxState.update`) reduces them in one pass per tensor, one thread per
  core. Outputs that onnxruntime computes in its blocked channel layout come out in that layout
  (`runtime.unordered_session`: no reorder per output, and a histogram or a max does not depend on
  the order of the values). Measured on ResNet-50 this is faster than reducing inside onnxruntime
  (below): the extra nodes cost onnxruntime more than the kernel costs. On the CPU, two batches
  run at once by default ("lanes", `_lanes`), each on half the cores and binned by its own
  thread into its own copy of the states, merged at the end; every range is started from the
  data set's first sample first, so the result is the one-at-a-time result to the bit. Measured
  on ResNet-50, 512 samples on 2 cores, in one process alternating: calibration 1.34-1.36x
  plain inference one batch at a time, 1.15-1.16x in two lanes (batch 8: 1.42x -> 1.29-1.32x),
  because one lane's binning and output writes overlap the other's inference, and two
  one-thread runs lose less to synchronisation than one two-thread run.
* without the kernel: the graph adds `ReduceMax(Abs(x))`, and for the histogram methods the bin
  index `Cast(Abs(x) * inv_width)` (truncation = floor for |x| >= 0; int32: int64 indices let
  `np.bincount` skip a conversion, twice as fast, but the larger outputs made the whole loop slower,
  1.68x -> 1.74x plain inference at batch 1 and 2.02x -> 2.42x at batch 8) with `inv_width` fed as
  an input each run; Python counts the indices with `np.bincount`. The first batch is run once more
  to learn the ranges. Both ways give the same counts (the same float32 arithmetic).

With `stride` > 1 (Python API), large feature maps are histogrammed on a spatial subsample: for
an NCHW tensor of at least SUBSAMPLE_MIN_HW positions, every `stride`-th row and column. Measured
on ResNet-50 (32 samples, batch 8): 1.94x -> 1.81x plain inference, with percentile thresholds
within 0.7% but entropy thresholds up to 10% off on one tensor; so the default histograms every
value, as TensorRT's calibrators do. The `max` method always sees every value.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs

from ..graph import io, proto
from ..samples.data import CalibrationData
from ..errors import QdqError
from ..ops import ABS, CAST, IDENTITY, MUL, REDUCE_MAX, SLICE
from ..execution.runtime import LARGE_GRAPH_NODES, BlockedOutputs, graph_session, unordered_session
from ..execution import runtime
from ..execution.profile import step
from .histogram import COMPILED, RangeState, abs_max, finite
from . import opening
import os
from concurrent.futures import ThreadPoolExecutor
import threading


HISTOGRAM_STRIDE = 1          # default spatial stride of the histogram subsample (1: every value)
SUBSAMPLE_MIN_HW = 1024       # H*W below which a feature map is histogrammed whole


def cores() -> int:
    """Cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:           # not on Linux
        return max(1, os.cpu_count() or 1)


def default_lanes() -> int:
    """Concurrent onnxruntime runs of a calibration: two where there are two cores or more, whatever
    the number of batches, so that peak memory does not depend on the number of samples. On very few
    batches the lanes cost a little time: a lane runs on part of the cores, so the last batch, when
    the other lane has nothing left, runs slower than alone (layout_cdla's 4 samples on 2 cores: loop
    0.46-0.49 s in one lane, 0.70-0.71 s in two)."""
    return 2 if cores() >= 2 else 1


class MaxState:
    """Running max |x| (the `max` method needs nothing more)."""

    __slots__ = ("amax", "count")

    def __init__(self):
        self.amax = 0.0
        self.count = 0

    def add(self, amax: float, n: int) -> None:
        self.amax = max(self.amax, float(amax))
        self.count += int(n)

    def update(self, x) -> None:
        """Add the values of `x` (any shape). Raises ValueError if any value is NaN or +-Inf."""
        a = np.asarray(x)
        self.add(finite(abs_max(a if a.dtype.kind == "f" else a.astype(np.float64))), a.size)

    def to_dict(self) -> dict:
        return {"format": "qdqgraph-max-state", "amax": self.amax, "count": self.count}

    def blank(self) -> "MaxState":
        """A state that has seen nothing (a max needs no range)."""
        return MaxState()

    def merge(self, other: "MaxState") -> "MaxState":
        out = MaxState()
        out.amax, out.count = max(self.amax, other.amax), self.count + other.count
        return out


def new_state(method: str):
    return MaxState() if method == "max" else RangeState()


@dataclass
class Collected:
    states: dict[str, object]          # group representative -> state
    samples: int
    seconds: float
    runs: int = 0                      # onnxruntime runs, reruns for range growth included
    providers: list[str] = field(default_factory=list)
    outputs: "FloatOutputs | None" = None   # the float graph's outputs on the first samples


KEEP_SAMPLES = 8                 # samples whose graph outputs a calibration keeps (`insert --verify`'s default)
KEEP_BYTES = 64 << 20            # ... while they take no more memory than this (held until the run ends)


@dataclass
class FloatOutputs:
    """The float graph's outputs on the first samples of a calibration, as the runs computed them
    (no run of their own): `batches` the feeds in order, `outputs` each output's value per batch,
    `samples` how many samples they cover (execution.evaluate.reused reads them)."""
    batches: list[dict] = field(default_factory=list)
    outputs: dict[str, list[np.ndarray]] = field(default_factory=dict)
    samples: int = 0


class Keeper:
    """Copies of the graph outputs `names` of the runs of the first KEEP_SAMPLES samples (any
    order, several threads), then those of the samples from 0 on without a gap."""

    def __init__(self, names: list[str]):
        self.names = names
        self.runs: dict[int, tuple[dict, int, list[np.ndarray]]] = {}
        self.bytes = 0
        self.lock = threading.Lock()

    def add(self, sample: int, n: int, feed: dict, out: dict) -> None:
        if not self.names or sample >= KEEP_SAMPLES or self.bytes > KEEP_BYTES:
            return
        values = [np.array(out[k]) for k in self.names]
        with self.lock:
            self.bytes += sum(v.nbytes for v in values)
            self.runs[sample] = (dict(feed), n, values)

    def result(self) -> FloatOutputs | None:
        if not self.names or self.bytes > KEEP_BYTES:
            return None
        kept = FloatOutputs(outputs={k: [] for k in self.names})
        while kept.samples in self.runs:
            feed, n, values = self.runs[kept.samples]
            kept.batches.append(feed)
            for k, v in zip(self.names, values):
                kept.outputs[k].append(v)
            kept.samples += n
        return kept if kept.samples else None


def output_keeper(graph: gs.Graph) -> Keeper:
    """A Keeper of the float graph outputs of `graph`, for a float run of it other than a
    calibration's (recipes.output_aware.rows hands its runs' outputs to it)."""
    return Keeper(_kept_outputs(graph, {}, None))


def _kept_outputs(graph: gs.Graph, fetch: dict, blocked: BlockedOutputs | None) -> list[str]:
    """The float graph outputs whose values a run hands out as the model computes them (not a
    graph input, not fetched in a blocked layout)."""
    inputs = {t.name for t in graph.inputs}
    moved = {t for t, f in fetch.items() if f is not None and blocked is not None and blocked.fetch.get(f, f) != f}
    return [t.name for t in graph.outputs if t.name and t.name not in inputs and t.name not in moved
            and t.dtype is not None and np.dtype(t.dtype) == np.float32]


@dataclass
class _Probe:
    tensor: str
    amax_out: str
    index_out: str | None = None
    inv_in: str | None = None


def _large_map(t: gs.Tensor, stride: int) -> bool:
    """Whether `_subsampled` takes every `stride`-th row and column of `t` (a large static NCHW map)."""
    shape = t.shape
    return not (stride <= 1 or shape is None or len(shape) != 4
                or not all(isinstance(d, int) and d > 0 for d in shape[2:]) or shape[2] * shape[3] < SUBSAMPLE_MIN_HW)


def _subsampled(g: gs.Graph, t: gs.Tensor, i: int, stride: int) -> gs.Tensor:
    """`t[:, :, ::stride, ::stride]` for a large static NCHW map, else `t` itself."""
    if not _large_map(t, stride):
        return t
    shape = t.shape

    def const(stem, v):
        return gs.Constant(f"qdqgraph_calib_{stem}_{i}", np.array(v, dtype=np.int64))
    return _add(g, SLICE, f"qdqgraph_calib_subsample_{i}",
                [t, const("starts", [0, 0]), const("ends", [shape[2], shape[3]]), const("axes", [2, 3]),
                 const("steps", [stride, stride])], np.float32)


def _add(g: gs.Graph, op: str, name: str, inputs: list[gs.Tensor], dtype, attrs: dict | None = None,
         shape=None) -> gs.Variable:
    """A node `name` appended to `g`, its one output a new tensor of the same name. (graphsurgeon's
    `Graph.layer` maps every tensor of the graph on each call to check names: a calibration graph
    of a 10,000-node model, built with it, took more than 15 minutes.) The names are the
    qdqgraph_calib_ prefix's, numbered per observed tensor."""
    out = gs.Variable(name, dtype=dtype, shape=shape)
    g.nodes.append(gs.Node(op=op, name=name, attrs=attrs or {}, inputs=list(inputs), outputs=[out]))
    return out


def raw_graph(graph: gs.Graph, tensors: list[str], stride: int = HISTOGRAM_STRIDE,
              only: bool = False) -> tuple[gs.Graph, dict]:
    """A copy of `graph` that also outputs each tensor (or the spatial subsample of a large map):
    (graph, {tensor: output to fetch, or None for a graph input, which is read from the feed}).
    `only`: the copy computes nothing else (`_pruned`). Where nothing is to be added but outputs
    (no map subsampled, no input observed in a copy) `graph` itself comes back, unchanged, with the
    tensors to fetch: the session's export adds them as outputs (io.with_outputs), and a copy of a
    10,000-node graph was a second or more of its calibration."""
    if not only and not _adds_nodes(graph, tensors, stride):
        inputs = {t.name for t in graph.inputs}           # observed only where stride is 1 (_adds_nodes)
        return graph, {name: None if name in inputs else name for name in tensors}
    g = graph.copy()
    existing = g.tensors()
    inputs = {t.name for t in g.inputs}
    outputs = {t.name for t in g.outputs}
    fetch: dict[str, str | None] = {}
    for i, name in enumerate(tensors):
        if name in inputs and stride <= 1:
            fetch[name] = None
            continue
        t = _subsampled(g, existing[name], i, stride)
        if t.name in inputs:             # a graph input cannot also be a graph output
            t = _add(g, IDENTITY, f"qdqgraph_calib_copy_{i}", [t], t.dtype)
        if t.name not in outputs:
            if t.dtype is None:          # after an op shape inference does not know (a custom op);
                t.dtype = np.float32     # planned tensors are float, and onnxruntime checks the type
            g.outputs.append(t)
            outputs.add(t.name)
        fetch[name] = t.name
    if only:
        _pruned(g, sorted({f for f in fetch.values() if f is not None}))
    return g, fetch


def _adds_nodes(graph: gs.Graph, tensors: list[str], stride: int) -> bool:
    """Whether `raw_graph` adds a node for any of `tensors`: a large map's subsample, or the copy of
    a graph input it observes through a graph output (stride above 1)."""
    if stride <= 1:
        return False
    existing = graph.tensors()
    inputs = {t.name for t in graph.inputs}
    return any(name in inputs or _large_map(existing[name], stride) for name in tensors)


def _pruned(g: gs.Graph, names: list[str]) -> None:
    """`g` (in place) with the tensors `names` as its only outputs and without the nodes that do
    not lead to them: what follows the last observed tensor is not run. onnxruntime runs every
    node of its graph whichever outputs a run asks for, and the nodes kept compute what they
    computed in the whole graph. Where no tensor is left to compute (every one is read from the
    feed), an Identity of the first input keeps a graph to open a session on."""
    tensors = g.tensors()
    outputs = [tensors[n] for n in names]
    if not outputs:
        x = g.inputs[0]
        outputs = g.layer(op=IDENTITY, name="qdqgraph_calib_nothing", inputs=[x],
                          outputs=[gs.Variable("qdqgraph_calib_nothing", dtype=x.dtype)])
    g.outputs = list(outputs)
    g.cleanup(recurse_subgraphs=False, remove_unused_graph_inputs=False)


def prunable(graph: gs.Graph) -> bool:
    """Whether a calibration graph may be cut down to its observed tensors (`_pruned`): a graph
    whose session is of the kind a smaller graph gets too (below LARGE_GRAPH_NODES nodes and
    SHARE_WEIGHTS_MIN_BYTES of weights: above either, onnxruntime is opened another way, whose
    arithmetic differs in the last bits), so that the values observed do not move."""
    if len(graph.nodes) >= LARGE_GRAPH_NODES:
        return False
    if runtime.SHARE_WEIGHTS_MIN_BYTES is None:
        return True
    weights = sum(int(t.values.nbytes) for t in graph.tensors().values() if isinstance(t, gs.Constant))
    return weights < runtime.SHARE_WEIGHTS_MIN_BYTES


def calibration_graph(graph: gs.Graph, tensors: list[str], histogram: bool,
                      stride: int = HISTOGRAM_STRIDE, only: bool = False) -> tuple[gs.Graph, list[_Probe]]:
    """A copy of `graph` that also outputs max|x| of each tensor and, with `histogram`, its bin
    indices at a width fed through an extra input (over a spatial subsample of large maps).
    `only`: the copy computes nothing else (`_pruned`)."""
    g = graph.copy()
    existing = g.tensors()
    probes = []
    for i, name in enumerate(tensors):
        t = _subsampled(g, existing[name], i, stride) if histogram else existing[name]
        a = _add(g, ABS, f"qdqgraph_calib_abs_{i}", [t], np.float32)
        amax = _add(g, REDUCE_MAX, f"qdqgraph_calib_amax_{i}", [a], np.float32, {"keepdims": 0}, shape=[])
        g.outputs.append(amax)
        probe = _Probe(name, amax.name)
        if histogram:
            inv = gs.Variable(f"qdqgraph_calib_inv_{i}", dtype=np.float32, shape=[])
            g.inputs.append(inv)
            # no clipping: a value past the range means the range grows and the batch is rerun,
            # so indices of a batch that did not fit are never counted
            scaled = _add(g, MUL, f"qdqgraph_calib_scaled_{i}", [a, inv], np.float32)
            idx = _add(g, CAST, f"qdqgraph_calib_index_{i}", [scaled], np.int32, {"to": proto.INT32})
            g.outputs.append(idx)
            probe.index_out, probe.inv_in = idx.name, inv.name
        probes.append(probe)
    if only:
        _pruned(g, [n for p in probes for n in (p.amax_out, p.index_out) if n is not None])
    return g, probes


def collect(loaded: io.Loaded, groups: dict[str, list[str]], data: CalibrationData,
            method: str = "max", batch_size: int = 1, providers: list[str] | None = None,
            progress=None, stride: int = HISTOGRAM_STRIDE, lanes: int | None = None,
            threads: int | None = None, outputs: bool = True, opened: opening.Opened | None = None) -> Collected:
    """`_collect`, whose failure on a sample of data qdqgraph made up (`--calib random`) says so.
    `opened`: a session opened ahead (`open_ahead`), taken where it is the one this would open."""
    try:
        return _collect(loaded, groups, data, method, batch_size, providers, progress, stride, lanes, threads,
                        outputs, opened)
    except SampleFailed as e:
        fix = _random_dims_fix(data)
        if fix is None:
            raise
        raise QdqError(e.problem, fix) from e.__cause__


def _collect(loaded: io.Loaded, groups: dict[str, list[str]], data: CalibrationData,
             method: str = "max", batch_size: int = 1, providers: list[str] | None = None,
             progress=None, stride: int = HISTOGRAM_STRIDE, lanes: int | None = None,
             threads: int | None = None, outputs: bool = True,
             opened: opening.Opened | None = None) -> Collected:
    """Reduce every tensor of `groups` (representative -> member tensors) over all samples;
    histograms of large maps over every `stride`-th row and column (1: every value). `threads`:
    onnxruntime's threads per lane (default: the cores shared among the lanes; a Ray task, which
    has one core of a node whose cores other tasks use, passes 1). `outputs`: the graph outputs
    of the first samples are kept (Collected.outputs); without them, the graph run is cut down to
    the observed tensors where that leaves their values as they are (`prunable`)."""
    providers = providers or ["CPUExecutionProvider"]
    tensors, owner = _tensors_and_owners(groups)
    histogram = method != "max"
    compiled = COMPILED
    only = not outputs and prunable(loaded.graph)
    lanes, threads = _lanes_and_threads(lanes, threads, compiled, providers)
    taken = None
    if compiled and opened is not None:
        with step("onnxruntime session (opened ahead)"):
            taken = opened.take(opening.key(loaded, tensors, stride if histogram else 1, only, providers, threads))
    if taken is not None:
        shell, fetch, observed, sess, blocked = taken
    elif compiled:                       # max sees every value, whatever the stride
        shell, fetch, observed = _raw_shell(loaded, tensors, stride if histogram else 1, only)
        sess, blocked = unordered_session(shell, observed, providers, threads=threads)
    else:
        graph, probes = calibration_graph(loaded.graph, tensors, histogram, stride, only=only)
        shell = io.Loaded(graph=graph, ir_version=loaded.ir_version)
        sess = graph_session(shell, providers)
    states = {rep: new_state(method) for rep in groups}
    start = time.perf_counter()
    seed = _seed(data, histogram, batch_size)

    keeper = None
    if compiled:
        try:
            keeper = Keeper(_kept_outputs(loaded.graph, fetch, blocked) if outputs else [])
            seen, runs = _collect_raw(sess, fetch, owner, states, data.counted_batches(batch_size), progress,
                                      blocked, seed, lanes, keeper)
        except _Padded:                  # blocked outputs with channel padding: again, in plain layout
            sess, blocked = unordered_session(shell, observed, providers, blocked=False, threads=threads)
            states = {rep: new_state(method) for rep in groups}
            keeper = Keeper(_kept_outputs(loaded.graph, fetch, blocked) if outputs else [])
            seen, runs = _collect_raw(sess, fetch, owner, states, data.counted_batches(batch_size), progress,
                                      blocked, seed, lanes, keeper)
    elif histogram:
        seen, runs = _collect_histograms(sess, probes, owner, states, data.counted_batches(batch_size), progress,
                                         data.origin() if seed is None else seed)
    else:
        seen, runs = _collect_maxima(sess, probes, owner, states, data.counted_batches(batch_size), progress)
    return Collected(states, seen, time.perf_counter() - start, runs, list(sess.get_providers()),
                     keeper.result() if keeper is not None and seen else None)


def open_ahead(loaded: io.Loaded, groups: dict[str, list[str]], method: str = "max",
               providers: list[str] | None = None, lanes: int | None = None, threads: int | None = None,
               stride: int = HISTOGRAM_STRIDE) -> opening.Opened | None:
    """The session `collect(loaded, groups, ..., outputs=True)` would open, opening in a thread
    (calib.opening), or None: only on a graph of runtime.LARGE_GRAPH_NODES nodes or more (below it the
    session is opened another way, and costs less than the thread), with the compiled kernel on the
    CPU provider and a second core to open it on."""
    providers = providers or ["CPUExecutionProvider"]
    if not COMPILED or providers != ["CPUExecutionProvider"] or cores() < 2 \
            or len(loaded.graph.nodes) < runtime.LARGE_GRAPH_NODES:
        return None
    tensors, _ = _tensors_and_owners(groups)
    lanes, threads = _lanes_and_threads(lanes, threads, True, providers)
    stride = stride if method != "max" else 1
    shell, fetch, observed = _raw_shell(loaded, tensors, stride, False)
    if len(shell.graph.nodes) < runtime.LARGE_GRAPH_NODES:
        return None
    opener, blocked = runtime.large_unordered(shell, observed, providers, threads=threads)
    return opening.Opened(opening.key(loaded, tensors, stride, False, providers, threads), shell, fetch, observed,
                          opener, blocked)


def _raw_shell(loaded: io.Loaded, tensors: list[str], stride: int, only: bool) -> tuple[io.Loaded, dict, list[str]]:
    """The calibration graph of the compiled kernel's path (`raw_graph`) as a model, the tensor each
    observed one is fetched as, and the outputs its session adds."""
    graph, fetch = raw_graph(loaded.graph, tensors, stride, only=only)
    return io.Loaded(graph=graph, ir_version=loaded.ir_version), fetch, [f for f in fetch.values() if f]


def _tensors_and_owners(groups: dict[str, list[str]]) -> tuple[list[str], dict[str, str]]:
    """The tensors of all groups, sorted, and the representative whose state each one feeds."""
    tensors = sorted({t for members in groups.values() for t in members})
    owner = {t: rep for rep, members in groups.items() for t in members}
    return tensors, owner


def _lanes_and_threads(lanes: int | None, threads: int | None, compiled: bool,
                       providers: list[str]) -> tuple[int, int]:
    """The lanes (checked, 1 unless the compiled kernel runs on the CPU) and onnxruntime's threads per lane."""
    if lanes is None:
        lanes = default_lanes()
    if lanes < 1:
        raise QdqError(f"lanes must be at least 1, got {lanes}", "pass 1 (one batch at a time) or more")
    if not compiled or list(providers) != ["CPUExecutionProvider"]:
        lanes = 1                        # one GPU stream; the index graph's path stays sequential
    if threads is None:
        threads = max(1, cores() // lanes) if lanes > 1 else 0
    return lanes, threads


def _seed(data: CalibrationData, histogram: bool, batch_size: int) -> dict | None:
    """The sample that starts every histogram range, where batching or sharding would start it elsewhere."""
    # every histogram range starts from the data set's first sample, whatever the batch size and
    # also in a shard: then batching and sharding do not change the histograms (histogram.py)
    return data.origin() if histogram and (data.first > 0 or (batch_size > 1 and data.batchable())) else None


def _collect_maxima(sess, probes, owner, states, batches, progress) -> tuple[int, int]:
    """Run the batches through the ReduceMax graph and add each tensor's max|x| to its state.
    Returns (samples, runs)."""
    seen = runs = 0
    amax_names = [p.amax_out for p in probes]
    for feed, n in batches:
        for p, v in zip(probes, _run(sess, amax_names, feed, seen)):
            _check(v, p.tensor, seen)
            states[owner[p.tensor]].add(v, 0)
        runs += 1
        seen += n
        if progress is not None:
            progress(n)
    return seen, runs


def _check(amax, tensor, sample):
    if not np.isfinite(amax):
        raise QdqError(f"tensor '{tensor}' became NaN or Inf on calibration sample {sample}",
                       "check the calibration data and the float model's numerics")


def _first_ranges(sess, probes, owner, states, feed, sample) -> None:
    """Set each empty state's range from the maxima of the first sample (the index graph needs a
    width before it runs)."""
    full = dict(feed)
    for p in probes:
        full[p.inv_in] = np.array(0.0, dtype=np.float32)
    for p, a in zip(probes, sess.run([p.amax_out for p in probes], full)):
        _check(a, p.tensor, sample)
        st = states[owner[p.tensor]]
        if st.width == 0.0:
            st.prepare(float(a))


def _reduce(probes, owner, states, out, widths, sample) -> None:
    """Count one batch's bin indices into the states (runs on the worker thread)."""
    amaxes, indices = out[:len(probes)], out[len(probes):]
    for p, a, idx in zip(probes, amaxes, indices):
        _check(a, p.tensor, sample)
        st = states[owner[p.tensor]]
        w = widths[p.tensor]
        if float(a) / w >= 2.0 ** 30:  # np.bincount would need a count array of gigabytes
            raise QdqError(f"tensor '{p.tensor}' jumped from a range of {w * st.num_bins:.3g} to "
                           f"{float(a):.3g} on calibration sample {sample}",
                           "check the calibration data for outliers")
        st.add_counts(np.bincount(idx.reshape(-1), minlength=st.num_bins), float(a), idx.size, w)


def _collect_histograms(sess, probes, owner, states, batches, progress, origin) -> tuple[int, int]:
    """Run the batches; counting batch k's indices (a worker thread) overlaps running batch k+1
    in onnxruntime, which releases the GIL. The ranges start from the `origin` sample's maxima.
    Returns (samples, runs)."""
    seen = runs = 0
    pending = None
    names = [p.amax_out for p in probes] + [p.index_out for p in probes]
    with ThreadPoolExecutor(max_workers=1) as pool:
        try:
            for feed, n in batches:
                if seen == 0:
                    _first_ranges(sess, probes, owner, states, origin, seen)
                    runs += 1
                # widths may be stale by a doubling or two while the worker counts the last batch;
                # add_counts folds counts binned at a narrower width exactly
                widths = {p.tensor: states[owner[p.tensor]].width for p in probes}
                full = dict(feed)
                for p in probes:
                    full[p.inv_in] = np.array(1.0 / widths[p.tensor], dtype=np.float32)
                out = _run(sess, names, full, seen)
                runs += 1
                if pending is not None:
                    pending.result()
                pending = pool.submit(_reduce, probes, owner, states, out, widths, seen)
                seen += n
                if progress is not None:
                    progress(n)
        finally:
            if pending is not None:
                pending.result()
    return seen, runs


def _reduce_into(reduce, value, name, sample) -> None:
    """`reduce(value)` (a state's update or start); non-finite data becomes the error that names
    the tensor and the sample."""
    try:
        reduce(value)
    except ValueError:
        _check(float(np.max(np.abs(value))), name, sample)
        raise


def _bin_group(tensors, states, state, values, sample) -> None:
    """Bin the batch's tensors of one state (one shared-scale group), in order."""
    for name in tensors:
        _reduce_into(states[state].update, values[name], name, sample)


class _BoundOutputs:
    """onnxruntime writes the observed tensors into arrays allocated once per input shape
    (IOBinding), instead of allocating fresh ones every run: at batch 8 on ResNet-50 that is
    340 MB of new pages per batch, which cost more than the binning itself."""

    def __init__(self, sess, names):
        self.sess, self.names = sess, names
        self.binding = sess.io_binding()
        self.key = None
        self.arrays: list[np.ndarray] = []

    def run(self, feed, sample) -> list[np.ndarray]:
        key = tuple((k, np.shape(v), np.asarray(v).dtype.str) for k, v in sorted(feed.items()))
        if key == self.key:
            for k, v in feed.items():
                self.binding.bind_cpu_input(k, np.ascontiguousarray(v))
            try:
                self.sess.run_with_iobinding(self.binding)
                return self.arrays
            except Exception:            # a tensor whose shape depends on the data: unbound run
                self.key = None
        out = _run(self.sess, self.names, feed, sample)
        self._bind(key, out)
        return out

    def _bind(self, key, out) -> None:
        self.binding.clear_binding_outputs()
        # the unbound run's own outputs become the bound arrays: their pages are already in memory
        # (fresh np.empty arrays made the first bound run at batch 8 take 2.5x a later one)
        self.arrays = [o if o.flags.c_contiguous and o.flags.writeable else np.empty_like(o) for o in out]
        for name, a in zip(self.names, self.arrays):
            self.binding.bind_output(name, "cpu", 0, a.dtype, list(a.shape), a.ctypes.data)
        for o in self.sess.get_outputs():
            if o.name not in self.names:
                self.binding.bind_output(o.name, "cpu")
        self.key = key


class _Padded(Exception):
    """A blocked output came with more channels than its tensor has (padding): not one of them
    may be binned."""


def _values(names, out, feed, fetch, blocked, keeper: Keeper | None = None, sample: int = 0, n: int = 1) -> dict:
    """tensor -> value of one run: its outputs `out` (in the order of `names`) or, for observed
    graph inputs, the feed. Raises _Padded if a blocked output carries padding. `keeper` copies
    the kept graph outputs of the run of `n` samples from `sample` on."""
    out = dict(zip(names, out))
    if blocked is not None and not blocked.check(out):
        raise _Padded
    if keeper is not None:
        keeper.add(sample, n, feed, out)
    return {t: feed[t] if f is None else out[f] for t, f in fetch.items()}


def _collect_raw(sess, fetch, owner, states, batches, progress,
                 blocked: BlockedOutputs | None = None, seed: dict | None = None, lanes: int = 1,
                 keeper: Keeper | None = None) -> tuple[int, int]:
    """Run the batches with the planned tensors as outputs, then bin them, one thread per core
    over the states (the compiled kernel releases the GIL); with `lanes` > 1, in that many lanes
    instead (`_lanes`). Measured on ResNet-50 with 2 cores, binning batch k while a two-thread
    onnxruntime run computes batch k+1 gained nothing (both want the same cores); the lanes gain
    because each run has fewer threads.
    `blocked`: the outputs of `unordered_session`, checked for padding before any is binned
    (raises _Padded, with no progress reported). `seed`: a sample run first, alone, to start each
    histogram's range (`RangeState.start`); the first batch's first sample does that otherwise.
    `keeper`: copies the kept graph outputs of the first samples' runs (not the seed's).
    Returns (samples, runs)."""
    seen = runs = 0
    if blocked is not None:
        fetch = {t: None if f is None else blocked.fetch[f] for t, f in fetch.items()}
    names = [n for n in fetch.values() if n is not None]
    names += [k for k in (keeper.names if keeper is not None else ()) if k not in names]
    by_state: dict[str, list[str]] = {}
    for t in fetch:
        by_state.setdefault(owner[t], []).append(t)
    if seed is not None:
        values = _values(names, _run(sess, names, seed, 0), seed, fetch, blocked)
        for rep, ts in by_state.items():  # the first member, as the first update would
            _reduce_into(states[rep].start, values[ts[0]], ts[0], 0)
        runs += 1
    if lanes > 1:
        batches = iter(batches)
        if seed is None:                 # the first batch is the first sample: it starts the ranges
            for feed, n in itertools.islice(batches, 1):
                values = _values(names, _run(sess, names, feed, 0), feed, fetch, blocked, keeper, 0, n)
                for rep, ts in by_state.items():
                    _bin_group(ts, states, rep, values, 0)
                runs, seen = runs + 1, n
                if progress is not None:
                    progress(n)
        more_seen, more = _lanes(sess, fetch, names, by_state, states, batches, progress, blocked, lanes, seen, keeper)
        return seen + more_seen, runs + more
    bound = _BoundOutputs(sess, names)
    workers = max(1, min(cores(), len(by_state)))
    shares = None
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for feed, n in batches:
            values = _values(names, bound.run(feed, seen), feed, fetch, blocked, keeper, seen, n)
            runs += 1
            if shares is None:
                shares = _shares(by_state, values, workers)
            for f in [pool.submit(_bin_groups, share, by_state, states, values, seen) for share in shares]:
                f.result()
            seen += n
            if progress is not None:
                progress(n)
    return seen, runs


def _lanes(sess, fetch, names, by_state, states, batches, progress, blocked, lanes, first: int = 0,
           keeper: Keeper | None = None) -> tuple[int, int]:
    """Run the batches in `lanes` threads at once, each taking the next batch, running it through
    the shared session (whose own thread count the caller divided among the lanes) and binning
    the outputs into its own blank copy of the states (their range, nothing counted); the copies
    merge into the states at the end. The states' ranges must already be started from one sample
    (or be max states): every copy then doubles from the same width, so the merge equals the
    sequential run bit for bit (histogram.py). `first`: the index of the first sample to come. Of
    several failures, the one at the earliest sample is raised. Returns (samples, runs) of these
    batches."""
    lock = threading.Lock()
    stop = threading.Event()
    batches = iter(batches)
    tally = {"seen": first, "runs": 0}
    failures: list[tuple[int, int, BaseException]] = []

    def lane(k: int, mine: dict) -> None:
        bound = _BoundOutputs(sess, names)
        sample = 0
        try:
            while not stop.is_set():
                with lock:
                    got = next(batches, None)
                    if got is None:
                        return
                    feed, n = got
                    sample = tally["seen"]
                    tally["seen"] += n
                values = _values(names, bound.run(feed, sample), feed, fetch, blocked, keeper, sample, n)
                for rep, ts in by_state.items():
                    _bin_group(ts, mine, rep, values, sample)
                with lock:
                    tally["runs"] += 1
                    if progress is not None:
                        progress(n)
        except BaseException as e:   # noqa: BLE001 - handed to the caller below
            stop.set()
            with lock:
                failures.append((sample, k, e))

    copies = [{rep: st.blank() for rep, st in states.items()} for _ in range(lanes)]
    with ThreadPoolExecutor(max_workers=lanes) as pool:
        try:
            for f in [pool.submit(lane, k, c) for k, c in enumerate(copies)]:
                f.result()
        finally:
            stop.set()
    if failures:
        raise min(failures, key=lambda f: (f[0], f[1]))[2]
    for rep in states:
        for c in copies:
            states[rep] = states[rep].merge(c[rep])
    return tally["seen"] - first, tally["runs"]


def _shares(by_state: dict[str, list[str]], values: dict, workers: int) -> list[list[str]]:
    """The states split into `workers` lists of about equal numbers of values, largest first (one
    task per worker and batch: a task per state cost more in hand-offs than some of them bin)."""
    sizes = {rep: sum(int(np.size(values[t])) for t in ts) for rep, ts in by_state.items()}
    shares: list[list[str]] = [[] for _ in range(workers)]
    load = [0] * workers
    for rep in sorted(sizes, key=lambda r: -sizes[r]):
        k = load.index(min(load))
        shares[k].append(rep)
        load[k] += sizes[rep]
    return [s for s in shares if s]


def _bin_groups(reps, by_state, states, values, sample) -> None:
    for rep in reps:
        _bin_group(by_state[rep], states, rep, values, sample)


class SampleFailed(QdqError):
    """onnxruntime failed on a calibration sample (`collect` says more where qdqgraph made the data)."""


def _run(sess, names, feed, sample):
    try:
        return sess.run(names, feed)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SampleFailed(f"onnxruntime failed on calibration sample {sample} ({first})",
                           "check that the data fits the model's inputs") from e


def _random_dims_fix(data: CalibrationData) -> str | None:
    """What to do when a model fails on `--calib random`'s samples, whose dynamic dims are 1."""
    dims = [f"{s.name}[{k}]" for s in data.inputs for k, d in enumerate(s.shape or ())
            if not (isinstance(d, int) and d > 0)]
    if not getattr(data, "random", False) or not dims:
        return None
    shown = ", ".join(dims[:4]) + (", ..." if len(dims) > 4 else "")
    return (f"--calib random sets the dynamic dims ({shown}) to 1, which this model does not take; "
            f"pass calibration data of the shapes it runs on with --calib DATA")
