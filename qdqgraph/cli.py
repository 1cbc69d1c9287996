"""`qdqgraph` command line: thin, parses arguments, calls the pipeline, prints reports.

Exit codes: 0 done, 2 bad input or usage (one line on stderr), 1 internal error, 130 interrupted.
"""
from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from .errors import QdqError


def _add_insert(sub):
    p = sub.add_parser("insert", help="float ONNX in, TensorRT-ready Q/DQ ONNX out",
                       description="Place Q/DQ by TensorRT's rules, calibrate, and write MODEL.qdq.onnx.")
    p.add_argument("model", help="float ONNX model")
    p.add_argument("-o", "--output", help="output path (default: MODEL.qdq.onnx beside the input)")
    p.add_argument("--calib", help="calibration data: .npz (one array per input, samples first), .npy, "
                                   "a folder of them, or 'random'")
    p.add_argument("--calib-cache", help="use ranges from a qdqgraph JSON or TensorRT calibration cache")
    p.add_argument("--method", default="max", choices=["max", "entropy", "percentile", "mse"],
                   help="calibration method (default: max)")
    p.add_argument("--percentile", type=float, default=99.99, help="for --method percentile (default 99.99)")
    p.add_argument("--batch-size", type=int, default=1, help="samples per onnxruntime run (dynamic batch only)")
    p.add_argument("--samples", type=int, help="use only the first N samples")
    p.add_argument("--rules", action="append", default=[], metavar="FILE", help="extra placement rules (TOML)")
    p.add_argument("--exclude-op", action="append", default=[], metavar="TYPE", help="never quantize this op type")
    p.add_argument("--exclude-node", action="append", default=[], metavar="REGEX", help="never quantize matching nodes")
    p.add_argument("--include-node", action="append", default=[], metavar="REGEX",
                   help="quantize matching nodes even where a default (advisory) rule would skip them")
    p.add_argument("--weights", default="int8", choices=["int8", "qdq"],
                   help="int8: INT8 initializer + DequantizeLinear (default); qdq: float weight + Q->DQ")
    p.add_argument("--providers", default="cpu", help="onnxruntime providers for calibration, e.g. cuda,cpu")
    p.add_argument("--report", metavar="REPORT.json", help="write the placement and calibration report as JSON")
    p.add_argument("--force", action="store_true", help="overwrite an existing output")
    p.add_argument("--quiet", action="store_true", help="print only errors")
    p.set_defaults(run=_run_insert)


def _add_example(sub):
    p = sub.add_parser("example", help="write a small ResNet-style model and calibration data to try qdqgraph on")
    p.add_argument("folder", help="where to write tiny_resnet.onnx and tiny_resnet_calib.npz")
    p.add_argument("--samples", type=int, default=64)
    p.set_defaults(run=_run_example)


def _add_strip(sub):
    p = sub.add_parser("strip", help="remove Q/DQ from a model (back to float, weights dequantized)")
    p.add_argument("model")
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--force", action="store_true")
    p.set_defaults(run=_run_strip)


_PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider",
              "tensorrt": "TensorrtExecutionProvider", "dml": "DmlExecutionProvider"}


def _providers(text: str) -> list[str]:
    out = []
    for p in (x.strip().lower() for x in text.split(",") if x.strip()):
        if p not in _PROVIDERS:
            raise QdqError(f"unknown provider {p!r}", f"use {', '.join(_PROVIDERS)}")
        out.append(_PROVIDERS[p])
    import onnxruntime as ort
    missing = [p for p in out if p not in ort.get_available_providers()]
    if missing:
        raise QdqError(f"onnxruntime here has no {', '.join(missing)}",
                       "install qdqgraph[gpu] (onnxruntime-gpu) on a CUDA machine, or use --providers cpu")
    return out


def _output_path(args, suffix_default) -> Path:
    out = Path(args.output) if args.output else suffix_default(args.model)
    if Path(args.model).exists() and out.resolve() == Path(args.model).resolve():
        raise QdqError(f"the output {out} is the input model", "choose another output with -o")
    if out.exists() and not args.force:
        raise QdqError(f"{out} exists", "pass --force to overwrite it, or choose another output with -o")
    return out


def _run_insert(args) -> int:
    from . import io
    from .pipeline import default_output, quantize
    out = _output_path(args, default_output)
    if args.report:
        rp = Path(args.report)
        if not rp.parent.exists():
            raise QdqError(f"report folder {rp.parent} does not exist", "create it or choose another --report path")
    if args.batch_size < 1:
        raise QdqError("--batch-size must be at least 1", "pass a positive number")
    if args.samples is not None and args.samples < 1:
        raise QdqError("--samples must be at least 1", "pass a positive number")
    if args.calib is None and args.calib_cache is None:
        raise QdqError("no calibration data given",
                       "pass --calib DATA.npz, --calib-cache FILE, or --calib random (scales then mean nothing)")
    result = quantize(args.model, args.calib, method=args.method, rules=args.rules,
                      exclude_ops=args.exclude_op, exclude_nodes=args.exclude_node,
                      include_nodes=args.include_node, weights=args.weights, batch_size=args.batch_size,
                      samples=args.samples, providers=_providers(args.providers), percentile=args.percentile,
                      calib_cache=args.calib_cache)
    written = io.save(result.model, out, protect=(Path(args.model),))
    result.report.output = str(written[0])
    if args.report:
        io.write_text_atomic(Path(args.report), result.report.to_json())
    if not args.quiet:
        print(result.report.summary())
    return 0


def _run_example(args) -> int:
    import numpy as np

    from . import io
    from .example import smooth_images, tiny_resnet
    folder = Path(args.folder)
    folder.mkdir(parents=True, exist_ok=True)
    model_path = folder / "tiny_resnet.onnx"
    data_path = folder / "tiny_resnet_calib.npz"
    io.save(tiny_resnet(), model_path)
    np.savez(data_path, input=smooth_images(args.samples))
    print(f"wrote {model_path} and {data_path} ({args.samples} samples)")
    print(f"next: qdqgraph insert {model_path} --calib {data_path}")
    return 0


def _run_strip(args) -> int:
    from . import io
    from .passes.strip import strip_qdq
    out = _output_path(args, lambda m: Path(args.output))
    loaded = io.load(args.model)
    n = strip_qdq(loaded.graph)
    io.save(io.to_model(loaded), out, protect=(Path(args.model),))
    print(f"removed {n} DequantizeLinear nodes; wrote {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="qdqgraph", description="Float ONNX to TensorRT-ready explicit-quantization ONNX.")
    ap.add_argument("--debug", action="store_true", help="show tracebacks")
    ap.add_argument("--version", action="version", version=f"qdqgraph {_version()}")
    sub = ap.add_subparsers(dest="command", required=True)
    _add_insert(sub)
    _add_example(sub)
    _add_strip(sub)
    return ap


def _version() -> str:
    from . import __version__
    return __version__


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    if debug:
        argv.remove("--debug")
    args = build_parser().parse_args(argv)

    def show_warning(message, category, filename, lineno, file=None, line=None):
        print(f"qdqgraph: warning: {message}", file=sys.stderr)
    warnings.showwarning = show_warning
    try:
        return args.run(args)
    except QdqError as e:
        if debug:
            raise
        print(f"qdqgraph: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if debug:
            raise
        print("qdqgraph: interrupted; no output was written", file=sys.stderr)
        return 130
    except Exception as e:  # a bug in qdqgraph: one line, the traceback with --debug
        if debug:
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"qdqgraph: internal error: {type(e).__name__}: {first} (rerun with --debug for the traceback "
              f"and report it)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
