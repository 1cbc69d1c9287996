"""Float against quantized, through onnxruntime: per-output agreement and per-tensor SQNR.

`compare(float_model, quant_model, data)` runs both models on the same samples. For every output
it gives cosine similarity, SQNR (dB), max abs error and, where the output looks like logits,
top-1 agreement. For every tensor that is quantized in the Q/DQ model and present in the float
model, it gives the SQNR of the dequantized tensor against the float one, so the layer where the
error jumps can be named.
"""
from __future__ import annotations

import gc
import json
import os
from dataclasses import asdict, dataclass, field

import numpy as np
import onnx_graphsurgeon as gs

from ..graph import io, proto
from ..samples.data import CalibrationData, require_numeric, read_arrays
from ..errors import QdqError
from ..ops import CAST, DEQUANTIZE, MUL, QUANTIZE
from ..prepare import model_inputs
from .progress import stage, step
from .runtime import graph_session, session


@dataclass
class Agreement:
    name: str
    cosine: float
    sqnr_db: float
    max_abs_error: float
    top1: float | None = None


@dataclass
class Comparison:
    samples: int
    outputs: list[Agreement] = field(default_factory=list)
    tensors: list[Agreement] = field(default_factory=list)   # in topological order
    stopped_at: int | None = None     # output values compared, where `enough` stopped it before the samples asked
    rescaled: list[str] = field(default_factory=list)   # quantized tensors not compared: scaled per channel on purpose
    unmatched: list[str] = field(default_factory=list)  # quantized tensors the float model has none of that name

    def to_dict(self) -> dict:
        return asdict(self)

    def worst_tensors(self, k: int = 5) -> list[Agreement]:
        return sorted(self.tensors, key=lambda a: a.sqnr_db)[:k]

    def largest_drop(self) -> tuple[Agreement, float] | None:
        """The quantized tensor whose SQNR falls most below the best SQNR of the tensors before it
        (topological order): where the error jumps."""
        best, found = None, None
        for a in self.tensors:
            if best is not None and np.isfinite(a.sqnr_db) and (found is None or best - a.sqnr_db > found[1]):
                found = (a, best - a.sqnr_db)
            if np.isfinite(a.sqnr_db):
                best = a.sqnr_db if best is None else max(best, a.sqnr_db)
        return found if found and found[1] > 0 else None

    def table(self, k: int = 10, every: bool = False) -> str:
        lines = [f"float vs quantized on {self.samples} samples"
                 + (f" (enough: {self.stopped_at / 1e6:.1f} M output values; --verify N compares N)"
                    if self.stopped_at else "")]
        for a in self.outputs:
            t1 = f", top-1 agreement {a.top1:.3f}" if a.top1 is not None else ""
            lines.append(f"  output {a.name}: cosine {a.cosine:.4f}, SQNR {a.sqnr_db:.1f} dB, "
                         f"max abs error {a.max_abs_error:.3g}{t1}")
        if self.tensors and every:
            lines.append(f"  {len(self.tensors)} quantized tensors in graph order:")
            lines.extend(f"    {a.sqnr_db:6.1f} dB  cosine {a.cosine:.4f}  {a.name}" for a in self.tensors)
        elif self.tensors:
            lines.append(f"  lowest SQNR among {len(self.tensors)} quantized tensors:")
            for a in self.worst_tensors(k):
                lines.append(f"    {a.sqnr_db:6.1f} dB  cosine {a.cosine:.4f}  {a.name}")
        if self.rescaled:
            lines.append(f"  not compared: {len(self.rescaled)} quantized tensor(s) that the quantized model scales per "
                         f"channel on purpose (a smoothing or equalization folded into the layer before; the "
                         f"model's {io.RESCALED_KEY} metadata): {_shown(self.rescaled)}")
        if self.unmatched:
            lines.append(f"  not compared: {len(self.unmatched)} quantized tensor(s) with no tensor of that name in the "
                         f"float model (a smoothing's Mul output, say): {_shown(self.unmatched)}")
        drop = self.largest_drop()
        if drop:
            lines.append(f"  the error jumps at {drop[0].name}: {drop[0].sqnr_db:.1f} dB, {drop[1]:.1f} dB below the "
                         f"best tensor before it")
        return "\n".join(lines)


def _shown(names: list[str], k: int = 3) -> str:
    return ", ".join(names[:k]) + (f", ... ({len(names)} in all)" if len(names) > k else "")


class _Acc:
    """Running sums for cosine and SQNR over samples."""

    def __init__(self):
        self.dot = self.ff = self.qq = self.err = 0.0
        self.max_err = 0.0
        self.top1_hits = self.top1_n = 0

    def add(self, f: np.ndarray, q: np.ndarray, logits: bool):
        f64, q64 = f.astype(np.float64).ravel(), q.astype(np.float64).ravel()
        self.dot += float(f64 @ q64)
        self.ff += float(f64 @ f64)
        self.qq += float(q64 @ q64)
        d = f64 - q64
        self.err += float(d @ d)
        self.max_err = max(self.max_err, float(np.abs(d).max()) if d.size else 0.0)
        if logits and f.ndim >= 1 and f.shape[-1] > 1:
            fa, qa = f.reshape(-1, f.shape[-1]).argmax(-1), q.reshape(-1, q.shape[-1]).argmax(-1)
            self.top1_hits += int((fa == qa).sum())
            self.top1_n += fa.size

    def result(self, name: str) -> Agreement:
        cos = self.dot / (np.sqrt(self.ff * self.qq) + 1e-30) if self.ff and self.qq else (1.0 if self.ff == self.qq else 0.0)
        sqnr = 10 * np.log10(self.ff / self.err) if self.err > 0 else float("inf")
        return Agreement(name, float(cos), float(sqnr), self.max_err,
                         self.top1_hits / self.top1_n if self.top1_n else None)


def quantized_tensor_pairs(quant: gs.Graph, float_graph: gs.Graph,
                           unmatched: list[str] | None = None) -> list[tuple[str, str]]:
    """(float tensor, its dequantized twin in the Q/DQ model) for activations quantized in `quant`
    whose name exists in `float_graph`, in topological order; the names of those it has not are
    appended to `unmatched`."""
    quant.toposort()
    present = float_graph.tensors()
    pairs = []
    for n in quant.nodes:
        if n.op != QUANTIZE or isinstance(n.inputs[0], gs.Constant):
            continue
        dq = next((c for c in n.outputs[0].outputs if c.op == DEQUANTIZE), None)
        if dq is None:
            continue
        if n.inputs[0].name in present:
            pairs.append((n.inputs[0].name, dq.outputs[0].name))
        elif unmatched is not None:
            unmatched.append(n.inputs[0].name)
    return pairs


def _looks_like_logits(shape) -> bool:
    """[batch, classes]: a classifier's output, where top-1 agreement means something."""
    return shape is not None and len(shape) == 2 and isinstance(shape[-1], int) and shape[-1] > 1


def _name(model, default: str) -> str:
    return str(model) if isinstance(model, (str, os.PathLike)) else default


def check_same_inputs(f_loaded: io.Loaded, q_loaded: io.Loaded, f_name: str, q_name: str) -> None:
    """The quantized model must take the float model's inputs: the same names, element types and
    ranks (it may lack inputs the float one has: --fix-input made them constants)."""
    require_numeric(model_inputs(f_loaded.graph), "qdqgraph runs models on numeric inputs only",
                    "compare models whose inputs are numbers")
    f_inputs = {s.name: s for s in model_inputs(f_loaded.graph)}
    for q in model_inputs(q_loaded.graph):
        f = f_inputs.get(q.name)
        if f is None:
            raise QdqError(f"input '{q.name}' of {q_name} is not an input of {f_name} (its inputs: "
                           f"{', '.join(f_inputs) or 'none'})",
                           "compare a float model with its own quantized version (the same input names)")
        if f.dtype != q.dtype:
            raise QdqError(f"input '{q.name}' is {f.dtype} in {f_name} but {q.dtype} in {q_name}",
                           "compare a float model with its own quantized version (the same input types)")
        if f.shape is not None and q.shape is not None and len(f.shape) != len(q.shape):
            raise QdqError(f"input '{q.name}' has rank {len(f.shape)} in {f_name} but rank {len(q.shape)} in "
                           f"{q_name}", "compare a float model with its own quantized version (the same input shapes)")


def compare(float_model, quant_model, data: CalibrationData | None = None, calib=None,
            samples: int | None = None, tensors: bool = True, preprocess: str | None = None,
            progress=None, reference=None, enough: int | None = None) -> Comparison:
    """Run both models over `data` (or `calib`, read like calibration data) and compare.
    `progress`: see qdqgraph.execution.progress. `reference`: the float outputs a quantize run
    computed on the first calibration samples (pipeline.Result.reference: the float graph as
    qdqgraph cleaned it, the same function up to float32 rounding); where it holds every sample
    compared, and no tensors are compared, the float model is not run again (`reused`). `enough`:
    with outputs only, stop after the sample that brings the output values compared to this many
    (the comparison says so: `stopped_at`)."""
    if reference is not None and not tensors:
        f_face, q_face = io.Loaded(graph=io.interface(float_model)), io.Loaded(graph=io.interface(quant_model))
        check_same_inputs(f_face, q_face, _name(float_model, "the float model"), _name(quant_model, "the quantized model"))
        data = data if data is not None else _read(f_face, calib, preprocess, samples)
        done = _against(reference, f_face, quant_model, data, progress, enough)
        if done is not None:
            return done
    f_loaded, q_loaded = io.load(float_model), io.load(quant_model)
    check_same_inputs(f_loaded, q_loaded, _name(float_model, "the float model"), _name(quant_model, "the quantized model"))
    data = data if data is not None else _read(f_loaded, calib, preprocess, samples)
    unmatched: list[str] = []
    scaled = rescaled_tensors(q_loaded)
    if tensors:
        add_float_twins(f_loaded.graph, q_loaded.graph, scaled)
    pairs = quantized_tensor_pairs(q_loaded.graph, f_loaded.graph, unmatched) if tensors else []
    pairs, rescaled = _apart_rescaled(pairs, scaled)
    f_graph, q_graph = f_loaded.graph.copy(), q_loaded.graph.copy()
    outs = [t.name for t in f_graph.outputs]
    shapes = {t.name: t.shape for t in f_graph.outputs}
    _add_pair_outputs(f_graph, q_graph, pairs)
    f_names = outs + [f for f, _ in pairs]
    q_names = outs + [q for _, q in pairs]
    out_acc = {o: _Acc() for o in outs}
    t_acc = {f: _Acc() for f, _ in pairs}
    q_inputs = {t.name for t in q_graph.inputs}
    f_sess = graph_session(io.Loaded(graph=f_graph, ir_version=f_loaded.ir_version), purpose="comparison")
    f_runs = None
    if not pairs:
        # outputs only: the float model runs every sample first and goes before the quantized
        # model's session is made, so that the two sessions (each holding its model's weights)
        # are never alive at once
        f_runs = _float_runs(f_sess, f_names, data, enough)
        del f_sess, f_graph, f_loaded
        gc.collect()
    q_sess = graph_session(io.Loaded(graph=q_graph, ir_version=q_loaded.ir_version), purpose="comparison", widen=True)
    n, values = 0, 0
    stage(progress, "comparing", data.count)
    for i, feed in enumerate(data.batches(1)):
        if _enough(values, enough, pairs):
            break
        fv = dict(zip(f_names, f_runs[i] if f_runs is not None else f_sess.run(f_names, feed)))
        qv = q_sess.run(q_names, {k: v for k, v in feed.items() if k in q_inputs})  # fixed inputs are gone
        values += _accumulate(fv, qv, outs, pairs, shapes, out_acc, t_acc)
        n += 1
        step(progress)
    return Comparison(n, [out_acc[o].result(o) for o in outs if out_acc[o].ff or out_acc[o].qq],
                      [t_acc[f].result(f) for f, _ in pairs], _stopped(values, enough, n, data.count, pairs), rescaled, unmatched)


def add_float_twins(f_graph: gs.Graph, q_graph: gs.Graph, scaled: set[str]) -> None:
    """Give `f_graph` the float twin of each quantized tensor that a Mul by a constant makes in
    `q_graph` from a tensor both graphs have (a smoothing's Mul: x_smoothed = x * 1/s): the same Mul,
    on the float model's x, under the same name, so that the quantized tensor is compared with what
    it would be without quantization. Not where x is in `scaled` (its float values are not the
    quantized model's)."""
    present = f_graph.tensors()
    added = False
    for n in q_graph.nodes:
        if n.op != MUL or len(n.inputs) != 2 or len(n.outputs) != 1 or n.outputs[0].name in present:
            continue
        if not any(c.op == QUANTIZE for c in n.outputs[0].outputs):
            continue
        x, c = n.inputs if isinstance(n.inputs[1], gs.Constant) else n.inputs[::-1]
        x = _before_casts(x, present)          # an FP16 island's Cast of a tensor both graphs have
        if not isinstance(c, gs.Constant) or isinstance(x, gs.Constant) or x.name not in present or x.name in scaled:
            continue
        fx = present[x.name]
        dtype = fx.dtype if fx.dtype is not None else np.float32
        y = gs.Variable(n.outputs[0].name, dtype=dtype, shape=n.outputs[0].shape)
        f_graph.nodes.append(gs.Node(MUL, f"{n.name}_float_twin", inputs=[fx, gs.Constant(
            f"{c.name}_float_twin", np.asarray(c.values, dtype=dtype))], outputs=[y]))
        present[y.name] = y
        added = True
    if added:
        f_graph.toposort()


def _before_casts(t: gs.Tensor, present: dict) -> gs.Tensor:
    """`t`, or the tensor a chain of Casts makes it from where `present` lacks `t` (a float island's
    input cast to FP16 keeps the float model's values up to rounding)."""
    while t.name not in present and len(t.inputs) == 1 and t.inputs[0].op == CAST and t.inputs[0].inputs:
        t = t.inputs[0].inputs[0]
    return t


def _apart_rescaled(pairs: list[tuple[str, str]], scaled: set[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """(the pairs to compare, the float names of those left out as scaled on purpose)."""
    return [p for p in pairs if p[0] not in scaled], [f for f, _ in pairs if f in scaled]


def rescaled_tensors(loaded: io.Loaded) -> set[str]:
    """The tensors a model qdqgraph wrote scales per channel against the float model (io.RESCALED_KEY):
    their values are not the float model's by design. Empty for any other model."""
    text = loaded.metadata_props.get(io.RESCALED_KEY)
    if not text:
        return set()
    try:
        names = json.loads(text)
    except ValueError:
        return set()
    return {n for n in names if isinstance(n, str)} if isinstance(names, list) else set()


def _add_pair_outputs(f_graph, q_graph, pairs: list[tuple[str, str]]) -> None:
    """Each compared tensor pair (float name, quantized name) made an output of its graph."""
    ft, qt = f_graph.tensors(), q_graph.tensors()
    for fname, qname in pairs:
        if ft[fname] not in f_graph.outputs:
            f_graph.outputs.append(ft[fname])
        q_graph.outputs.append(qt[qname])


def _accumulate(fv: dict, qv: list, outs: list[str], pairs: list[tuple[str, str]], shapes: dict, out_acc: dict,
                t_acc: dict) -> int:
    """One sample's float values `fv` and quantized values `qv` (the outputs, then the pairs) into
    the accumulators; returns the output values compared."""
    for o, q in zip(outs, qv[:len(outs)]):
        if np.issubdtype(fv[o].dtype, np.floating):
            out_acc[o].add(fv[o], q, _looks_like_logits(shapes[o]))
    for (f, _), q in zip(pairs, qv[len(outs):]):
        t_acc[f].add(fv[f], q, False)
    return _float_values(fv[o] for o in outs)


def _float_values(arrays) -> int:
    """The values of the floating-point arrays among `arrays`: those a comparison of outputs counts."""
    return sum(int(np.size(a)) for a in arrays if np.issubdtype(np.asarray(a).dtype, np.floating))


def _float_runs(f_sess, names: list[str], data: CalibrationData, enough: int | None) -> list:
    """The float model's runs of the samples a comparison of outputs only will take (`enough`)."""
    runs, values = [], 0
    for feed in data.batches(1):
        if _enough(values, enough):
            break
        runs.append(f_sess.run(names, feed))
        values += _float_values(runs[-1])
    return runs


def _enough(values: int, enough: int | None, pairs: list | tuple = ()) -> bool:
    """Whether the output values compared so far are `enough` (never with tensors compared)."""
    return enough is not None and not pairs and values >= enough


def _stopped(values: int, enough: int | None, n: int, asked: int, pairs: list | tuple = ()) -> int | None:
    """The output values compared, where `enough` stopped the comparison before the samples asked."""
    return values if _enough(values, enough, pairs) and n < asked else None


def _read(f_loaded: io.Loaded, calib, preprocess: str | None, samples: int | None) -> CalibrationData:
    inputs = model_inputs(f_loaded.graph)
    return CalibrationData(read_arrays(calib, inputs, preprocess), inputs, samples)


def reused(reference, data: CalibrationData, outs: list[str]) -> list[dict] | None:
    """Per sample of `data` (one at a time): {output: float value} taken from `reference` (batches
    of the first samples and each output's value per batch), or None where it does not hold them
    all: too few samples, an output missing, a batch whose inputs are not the samples'. A batch of
    several samples is cut on axis 0: the samples must be its rows in order (checked on the
    inputs) and each output must have as many rows as the batch."""
    if reference is None or reference.samples < data.count:
        return None
    found: list[dict] = []
    for k, batch in enumerate(reference.batches):
        if len(found) >= data.count:
            break
        rows = _rows(batch, data, len(found))
        if rows is None:
            return None
        size, spans = rows
        for lo, hi in spans:
            one = {}
            for o in outs:
                values = reference.outputs.get(o)
                if values is None or len(values) <= k:
                    return None
                value = np.asarray(values[k])
                if size is None:
                    one[o] = value
                elif value.ndim and value.shape[0] == size:
                    one[o] = value[lo:hi]
                else:
                    return None
            found.append(one)
    return found if len(found) >= data.count else None


def _rows(batch: dict, data: CalibrationData, first: int) -> tuple[int | None, list[tuple[int, int]]] | None:
    """(the rows of `batch`, the rows (start, stop) of each sample of `data` from `first` on it
    holds) where it is several samples on axis 0; (None, [(0, 0)]) where it is the sample itself;
    None where it is neither."""
    sample = data.sample(first)
    if batch.keys() != sample.keys():
        return None
    if all(np.array_equal(batch[k], v) for k, v in sample.items()):
        return None, [(0, 0)]
    sizes = {int(np.shape(v)[0]) if np.ndim(v) else -1 for v in batch.values()}
    if len(sizes) != 1 or min(sizes) < 1:
        return None
    size = sizes.pop()
    spans, at = [], 0
    for i in range(first, data.count):
        one = data.sample(i)
        rows = {int(np.shape(v)[0]) if np.ndim(v) else -1 for v in one.values()}
        if len(rows) != 1 or min(rows) < 1 or at + min(rows) > size:
            break
        n = rows.pop()
        if not all(np.array_equal(batch[k][at:at + n], v) for k, v in one.items()):
            return None
        spans.append((at, at + n))
        at += n
    return (size, spans) if spans else None


def _against(reference, f_face: io.Loaded, quant_model, data: CalibrationData, progress,
             enough: int | None = None) -> Comparison | None:
    """compare() of the outputs against the float outputs of `reference` where it holds them
    (`reused`): only the quantized model runs, as its file or ModelProto is (not through a graph:
    on a 10,000-node CNN, loading the written model and exporting it again took 7.8 s), and of the
    float model only its inputs and outputs are read (`f_face`: io.interface). None where
    `reference` does not hold them."""
    outs = [t.name for t in f_face.graph.outputs]
    shapes = {t.name: t.shape for t in f_face.graph.outputs}
    known = reused(reference, data, outs)
    if known is None:
        return None
    model = quant_model if proto.is_model(quant_model) else io.read_model(quant_model)
    # its threads stop spinning when a run ends (numerics unchanged): they held the cores the
    # accumulation between runs wants (MiniLM-L6's 16 sums took 0.2 CPU s, 0.1 ms each alone)
    q_sess = session(model, purpose="comparison", widen=True, spin=False)
    del model
    q_inputs = {i.name for i in q_sess.get_inputs()}
    out_acc = {o: _Acc() for o in outs}
    stage(progress, "comparing", data.count)
    n, values = 0, 0
    for fv, feed in zip(known, data.batches(1)):
        if _enough(values, enough):
            break
        qv = q_sess.run(outs, {k: v for k, v in feed.items() if k in q_inputs})
        values += _accumulate(fv, qv, outs, [], shapes, out_acc, {})
        n += 1
        step(progress)
    return Comparison(n, [out_acc[o].result(o) for o in outs if out_acc[o].ff or out_acc[o].qq],
                      stopped_at=_stopped(values, enough, n, data.count))


def fp16_within_tolerance(fp16_vs_float: float, fp32_vs_float: float, fp16_vs_fp32: float) -> bool:
    """FP16 tolerance: the FP16-island output is within 1% RMS of the FP32 Q/DQ output (40 dB), or,
    where FP16 scales move the INT8 grid enough that the two Q/DQ models differ by quantization noise,
    it loses at most 1 dB of SQNR against float."""
    return fp16_vs_fp32 >= 40.0 or fp16_vs_float >= min(fp32_vs_float, 60.0) - 1.0
