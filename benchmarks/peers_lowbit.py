"""Peer FP8 / INT4-weight quantizers for the low-bit benchmark: NVIDIA Model Optimizer and onnxruntime.

    python benchmarks/peers_lowbit.py TOOL MODEL.onnx CALIB.npz OUT.onnx [--block-size 128] [--samples 64]
        [--op-types MatMul,Gemm,Conv]
        [--check-with /work/main/.venv/bin/python] [--timeout 1800]

TOOL (run each with a python that has the tool: `benchmarks/setup_modelopt.sh` makes /tmp/mo-venv for
modelopt-*, the project's .venv has onnxruntime for ort-*):
  modelopt-fp8       modelopt.onnx.quantization.quantize(quantize_mode="fp8", calibration_method="entropy"
                     (its default for fp8/int8), calibration_eps=["cpu"]); other arguments keep their
                     defaults, so the rest of the model is converted to fp16 (high_precision_dtype="fp16")
                     and weights stay fp16 initializers behind QuantizeLinear -> DequantizeLinear (the
                     int4 modes keep fp32 and store INT4 weights, opset 21)
  modelopt-int4-rtn  quantize_mode="int4", calibration_method="rtn_dq", block_size=--block-size
  modelopt-int4-awq  quantize_mode="int4", calibration_method="awq_clip" (its int4 default), block_size
  ort-fp8            onnxruntime.quantization.quantize_static, QuantFormat.QDQ, activations and weights
                     QuantType.QFLOAT8E4M3FN, per_channel=True, CalibrationMethod.Distribution (the only
                     method it accepts for float8). With its default op types it also calibrates Add/Where
                     outputs, and fails on attention masks filled with float32's lowest value ("Too many
                     bins for data range"): --op-types MatMul,Gemm,Conv limits it to the compute ops
  ort-int4           onnxruntime's MatMulNBitsQuantizer with DefaultWeightOnlyQuantConfig (RTN), symmetric,
                     block --block-size, quant_format=QuantFormat.QDQ: DequantizeLinear(INT4) -> MatMul;
                     models below opset 21 are first converted with onnx.version_converter. Needs the
                     onnx-ir package, which onnxruntime 1.32's matmul_nbits_quantizer imports but does not
                     declare (pip install onnx-ir, or put a --target install of it on PYTHONPATH)

CALIB.npz maps each model input name to its samples along axis 0: either (N, *input_shape) with a batch
axis of 1 inside each sample, or (N, *input_shape[1:]); keys starting with "__" (e.g. __meta__) are
skipped. At most --samples samples are used, fed one at a time (ORT; Model Optimizer gets them
concatenated along the batch axis and splits them into batches of the model's batch size itself).

Prints one JSON line: tool, seconds (the quantize call only), ok, error (one line, null when ok), bytes
(OUT plus its external data files), peak_mb (the tool process's peak RSS), nodes_by_type (count of
QuantizeLinear / DequantizeLinear, and per op a count by zero-point dtype; "none:X" = no zero point,
X the dtype of the input when it is an initializer) and, with --check-with PY, ort_check: that python's
onnxruntime loads OUT on the CPU and runs the first calibration sample (and the float MODEL, for the
lowest cosine similarity over the float outputs, null when not finite; nonfinite_outputs counts NaN/inf
values in OUT's outputs; when OUT fails at ORT's default optimization level, runs_at_extended_optimization
says whether it runs at ORT_ENABLE_EXTENDED, i.e. without the level-3 layout transformations). The tool
runs in a child process, so a crash is reported too; the exit status is 0 whenever the JSON line was printed.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

TOOLS = ("modelopt-fp8", "modelopt-int4-rtn", "modelopt-int4-awq", "ort-fp8", "ort-int4")


def load_samples(model_path: str, calib_path: str, limit: int) -> list[dict[str, np.ndarray]]:
    """One feed dict per calibration sample, each with the model's batch axis (of 1) and input dtype."""
    m = onnx.load(model_path, load_external_data=False)
    inits = {i.name for i in m.graph.initializer}
    inputs = {i.name: i.type.tensor_type for i in m.graph.input if i.name not in inits}
    d = np.load(calib_path, allow_pickle=False)
    keys = [k for k in d.files if not k.startswith("__")]
    missing = set(inputs) - set(keys)
    if missing:
        raise KeyError(f"calibration file lacks inputs {sorted(missing)} (has {keys})")
    arrays = {}
    for name, tt in inputs.items():
        a = d[name]
        rank = len(tt.shape.dim)
        if a.ndim == rank:  # (N, *input_shape[1:]): give each sample its batch axis
            a = a[:, None]
        elif a.ndim != rank + 1:
            raise ValueError(f"{name}: calibration array {a.shape} does not fit input rank {rank}")
        arrays[name] = a.astype(onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type), copy=False)
    n = min(min(len(a) for a in arrays.values()), limit)
    return [{k: np.ascontiguousarray(a[i]) for k, a in arrays.items()} for i in range(n)]


class Reader:
    """onnxruntime CalibrationDataReader over a list of feeds (with set_range for strided calibration)."""

    def __init__(self, feeds):
        self.feeds, self.it = feeds, iter(feeds)

    def get_next(self):
        return next(self.it, None)

    def __len__(self):
        return len(self.feeds)

    def set_range(self, start_index: int, end_index: int):
        self.it = iter(self.feeds[start_index:end_index])

    def rewind(self):
        self.it = iter(self.feeds)


def private_copy(model: str, folder: str) -> str:
    """A copy of `model` (and its external data files) in `folder`: Model Optimizer 0.47 saves the
    shape-inferred model over the path it is given, which would change the zoo's files."""
    src = Path(model)
    m = onnx.load(str(src), load_external_data=False)
    for f in {e.value for t in m.graph.initializer for e in t.external_data if e.key == "location"}:
        shutil.copy2(src.parent / f, Path(folder) / f)
    return str(shutil.copy2(src, Path(folder) / src.name))


def quantize(tool: str, model: str, out: str, feeds, block_size: int, op_types: list[str] | None = None) -> None:
    if tool.startswith("modelopt-"):
        from modelopt.onnx.quantization import quantize as mo_quantize
        data = {k: np.concatenate([f[k] for f in feeds]) for k in feeds[0]}
        kw = {"fp8": {"quantize_mode": "fp8", "calibration_method": "entropy"},
              "int4-rtn": {"quantize_mode": "int4", "calibration_method": "rtn_dq", "block_size": block_size},
              "int4-awq": {"quantize_mode": "int4", "calibration_method": "awq_clip", "block_size": block_size},
              }[tool[len("modelopt-"):]]
        if op_types and tool == "modelopt-fp8":
            kw["op_types_to_quantize"] = op_types
        with tempfile.TemporaryDirectory() as d:      # Model Optimizer writes into its input file
            private = private_copy(model, d)
            mo_quantize(private, calibration_data=data, calibration_eps=["cpu"], output_path=out,
                        log_level="WARNING", **kw)
    elif tool == "ort-fp8":
        from onnxruntime.quantization import (
            CalibrationMethod,
            QuantFormat,
            QuantType,
            quantize_static,
        )
        # The Distribution calibrator keeps every intermediate output of the samples it has seen until
        # collect_data returns: calibrating 4 samples at a time (CalibStridedMinMax, which despite its
        # name strides any calibrator) keeps memory bounded; histograms merge across the strides.
        stride = next(s for s in (4, 3, 2, 1) if len(feeds) % s == 0)
        quantize_static(model, out, Reader(feeds), quant_format=QuantFormat.QDQ,
                        activation_type=QuantType.QFLOAT8E4M3FN, weight_type=QuantType.QFLOAT8E4M3FN,
                        per_channel=True, calibrate_method=CalibrationMethod.Distribution,
                        op_types_to_quantize=op_types, extra_options={"CalibStridedMinMax": stride})
    elif tool == "ort-int4":
        from onnxruntime.quantization import QuantFormat
        from onnxruntime.quantization.matmul_nbits_quantizer import (
            DefaultWeightOnlyQuantConfig,
            MatMulNBitsQuantizer,
        )
        cfg = DefaultWeightOnlyQuantConfig(block_size=block_size, is_symmetric=True,
                                           quant_format=QuantFormat.QDQ, op_types_to_quantize=("MatMul",))
        # MatMulNBitsQuantizer only relabels a model below opset 21 as opset 21 ("the generated model may
        # not be a valid model": e.g. ReduceL2's axes attribute became an input at opset 18), so convert it
        # first with onnx's version converter, as quantize_static does when it needs a newer opset.
        m = onnx.load(model)
        if next(o.version for o in m.opset_import if o.domain in ("", "ai.onnx")) < 21:
            m = onnx.version_converter.convert_version(m, 21)
        q = MatMulNBitsQuantizer(m, algo_config=cfg)
        q.process()
        q.model.save_model_to_file(out, use_external_data_format=False)
    else:
        raise ValueError(f"unknown tool {tool!r}; one of {', '.join(TOOLS)}")


def file_bytes(path: str) -> int:
    """Size of the model file plus the external data files its tensors name."""
    m = onnx.load(path, load_external_data=False)
    files = set()
    for t in onnx.external_data_helper._get_all_tensors(m):
        if t.data_location == onnx.TensorProto.EXTERNAL:
            files.update(e.value for e in t.external_data if e.key == "location")
    return os.path.getsize(path) + sum(os.path.getsize(Path(path).parent / f) for f in files)


def qdq_summary(path: str) -> dict:
    """QuantizeLinear / DequantizeLinear counts by zero-point dtype, over the main graph and subgraphs."""
    m = onnx.load(path, load_external_data=False)
    name = onnx.TensorProto.DataType.Name
    out: dict = {}

    def walk(g, dtypes):
        dtypes = dict(dtypes)
        dtypes.update({i.name: i.data_type for i in g.initializer})
        for n in g.node:
            if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
                dtypes[n.output[0]] = n.attribute[0].t.data_type
        for n in g.node:
            for a in n.attribute:
                for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                    walk(sub, dtypes)
            if n.op_type in ("QuantizeLinear", "DequantizeLinear"):
                if len(n.input) > 2 and n.input[2]:
                    key = name(dtypes[n.input[2]]) if n.input[2] in dtypes else "dynamic"
                else:
                    x = n.input[0] if n.op_type == "DequantizeLinear" else None
                    key = f"none:{name(dtypes[x])}" if x in dtypes else "none"
                e = out.setdefault(n.op_type, {"count": 0, "zero_point": {}})
                e["count"] += 1
                e["zero_point"][key] = e["zero_point"].get(key, 0) + 1
            elif "Quant" in n.op_type or "NBits" in n.op_type:
                out.setdefault(n.op_type, {"count": 0})["count"] += 1

    walk(m.graph, {})
    return out


def ort_check(model: str, calib: str, out: str) -> dict:
    """Load OUT in this python's onnxruntime on the CPU, run one sample; compare to the float model."""
    import onnxruntime as ort
    r = {"onnxruntime": ort.__version__, "ok": False, "error": None}
    try:
        feed = load_samples(model, calib, 1)[0]
        opts = ort.SessionOptions()
        opts.log_severity_level = 4
        t = time.perf_counter()
        try:
            got = ort.InferenceSession(out, opts, providers=["CPUExecutionProvider"]).run(None, feed)
        except Exception as e:  # noqa: BLE001 - say whether ORT's level-3 (layout) optimizations are the cause
            r["error"] = one_line(e)
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
            try:
                got = ort.InferenceSession(out, opts, providers=["CPUExecutionProvider"]).run(None, feed)
                r["runs_at_extended_optimization"] = True
            except Exception:  # noqa: BLE001
                r["runs_at_extended_optimization"] = False
                return r
        r.update(ok=r["error"] is None, seconds=round(time.perf_counter() - t, 3))
        opts = ort.SessionOptions()
        opts.log_severity_level = 4
        ref = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"]).run(None, feed)
        pairs = [(a.astype(np.float64).ravel(), b.astype(np.float64).ravel())
                 for a, b in zip(ref, got) if np.issubdtype(a.dtype, np.floating) and a.size]
        r["nonfinite_outputs"] = int(sum((~np.isfinite(b)).sum() for _, b in pairs))
        cos = [float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30)) for a, b in pairs]
        r["min_cos_vs_float"] = round(min(cos), 5) if cos and np.isfinite(min(cos)) else None
    except Exception as e:  # noqa: BLE001 - the benchmark table shows the failure
        r["error"] = one_line(e)
    return r


def one_line(e: BaseException | str) -> str:
    s = e if isinstance(e, str) else f"{type(e).__name__}: {e}"
    lines = [x.strip() for x in s.splitlines() if x.strip()]
    return (lines[0] if lines else s)[:300]


def child(args) -> dict:
    r = {"tool": args.tool, "seconds": None, "ok": False, "error": None, "bytes": None, "nodes_by_type": None}
    try:
        feeds = load_samples(args.model, args.calib, args.samples)
        r["samples"] = len(feeds)
        if args.op_types:
            r["op_types"] = args.op_types
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        quantize(args.tool, args.model, args.out, feeds, args.block_size,
                 args.op_types.split(",") if args.op_types else None)
        r["seconds"] = round(time.perf_counter() - t, 2)
        r["bytes"] = file_bytes(args.out)
        r["nodes_by_type"] = qdq_summary(args.out)
        r["ok"] = True
    except Exception as e:  # noqa: BLE001 - the benchmark table shows the failure
        r["error"] = one_line(e)
    r["peak_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tool", help=" | ".join(TOOLS) + " (or _check, used internally)")
    ap.add_argument("model")
    ap.add_argument("calib")
    ap.add_argument("out")
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--samples", type=int, default=64, help="most calibration samples used (default 64)")
    ap.add_argument("--op-types", help="comma list of op types to quantize (fp8 tools; default: the tool's own)")
    ap.add_argument("--check-with", help="python whose onnxruntime should load and run OUT (CPU)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds before the tool is killed")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.tool == "_check":
        print(json.dumps(ort_check(args.model, args.calib, args.out)), flush=True)
        return 0
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return 0

    cmd = [sys.executable, __file__, args.tool, args.model, args.calib, args.out,
           "--block-size", str(args.block_size), "--samples", str(args.samples), "--child"]
    if args.op_types:
        cmd += ["--op-types", args.op_types]
    t = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, check=False)
        sys.stderr.write(p.stderr[-20000:])
        lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
        if lines:
            r = json.loads(lines[-1])
        else:
            why = f"killed by signal {-p.returncode}" if p.returncode < 0 else f"exit {p.returncode}"
            tail = [x for x in p.stderr.splitlines() if x.strip()]
            r = {"tool": args.tool, "seconds": round(time.perf_counter() - t, 2), "ok": False,
                 "error": one_line(f"{why}: {tail[-1]}" if tail else why), "bytes": None, "nodes_by_type": None}
    except subprocess.TimeoutExpired:
        r = {"tool": args.tool, "seconds": args.timeout, "ok": False, "error": f"timed out after {args.timeout} s",
             "bytes": None, "nodes_by_type": None}
    if args.check_with and r["ok"]:
        p = subprocess.run([args.check_with, __file__, "_check", args.model, args.calib, args.out],
                           capture_output=True, text=True, timeout=args.timeout, check=False)
        lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
        r["ort_check"] = json.loads(lines[-1]) if lines else {
            "ok": False, "error": one_line(p.stderr.strip().splitlines()[-1] if p.stderr.strip() else "failed")}
    print(json.dumps(r), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
