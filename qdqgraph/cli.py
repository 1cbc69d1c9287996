"""`qdqgraph` command line: thin, parses arguments, calls the pipeline, prints reports.

Exit codes: 0 done, 2 bad input or usage (one line on stderr), 1 internal error, 130 interrupted.
"""
from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from .cli_build import add_build, add_engine_args, add_shape_args, require_folders
from .errors import QdqError


def _add_insert(sub):
    p = sub.add_parser("insert", help="float ONNX in, TensorRT-ready Q/DQ ONNX out",
                       description="Place Q/DQ by TensorRT's rules, calibrate, and write MODEL.qdq.onnx.")
    p.add_argument("model", help="float ONNX model")
    p.add_argument("-o", "--output", help="output path (default: MODEL.qdq.onnx beside the input)")
    p.add_argument("--calib", help="calibration data: .npz (one array per input, samples first), .npy, "
                                   "a folder of them, or 'random'")
    p.add_argument("--calib-cache", help="use ranges from a qdqgraph JSON or TensorRT calibration cache "
                   "(with --calib, the tensors it lacks are calibrated from the data)")
    p.add_argument("--method", default="percentile", choices=["max", "entropy", "percentile", "mse"],
                   help="calibration method (default: percentile, the best on the model zoo; see README)")
    p.add_argument("--percentile", type=float, default=99.99, help="for --method percentile (default 99.99)")
    p.add_argument("--batch-size", type=int, default=1, help="samples per onnxruntime run (dynamic batch only)")
    p.add_argument("--samples", type=int, help="use only the first N samples")
    _add_selection(p)
    p.add_argument("--weights", default="int8", choices=["int8", "qdq"],
                   help="int8: INT8 initializer + DequantizeLinear (default); qdq: float weight + Q->DQ")
    p.add_argument("--bias-correction", action="store_true",
                   help="fold the mean output shift of INT8 weights into the biases (measured on --calib)")
    p.add_argument("--smooth-quant", type=float, nargs="?", const=0.5, metavar="ALPHA",
                   help="migrate activation outliers of quantized MatMul/Gemm inputs into their weights "
                        "(SmoothQuant; alpha default 0.5, measured on --calib)")
    _add_fix_input(p)
    p.add_argument("--high-precision", default="fp16", choices=["fp16", "bf16", "fp32"],
                   help="type of the parts that stay float (default fp16: TensorRT runs a strongly typed "
                        "network in the types the ONNX gives; fp32 keeps them float32)")
    _add_preprocess(p)
    _add_runtime(p)
    p.add_argument("--report", metavar="REPORT.json", help="write the placement and calibration report as JSON")
    p.add_argument("--accuracy-budget", type=float, metavar="SQNR_DB",
                   help="return the most sensitive nodes to float until the output SQNR against float "
                        "reaches this many dB (measured on --sensitivity-samples calibration samples)")
    p.add_argument("--max-float-layers", type=int, metavar="K", help="at most K nodes returned to float")
    p.add_argument("--sensitivity-samples", type=int, default=8, metavar="N")
    p.add_argument("--verify", type=int, default=8, metavar="N",
                   help="compare float and INT8 outputs on the first N calibration samples (default 8; 0 = off)")
    p.add_argument("--engine", metavar="MODEL.plan",
                   help="also build a TensorRT engine from the output (needs TensorRT and a GPU)")
    add_shape_args(p)
    add_engine_args(p)
    p.add_argument("--force", action="store_true", help="overwrite an existing output")
    p.add_argument("--quiet", action="store_true", help="print only errors")
    p.set_defaults(run=_run_insert)


def _add_preprocess(p):
    p.add_argument("--preprocess", metavar="SPEC",
                   help='for a folder of images: "resize=256,crop=224,mean=0.485,0.456,0.406,'
                        'std=0.229,0.224,0.225,layout=NCHW,color=RGB" (or a file holding it)')


def _add_runtime(p):
    p.add_argument("--providers", default="cpu", help="onnxruntime providers for calibration, e.g. cuda,cpu")
    p.add_argument("--custom-op-library", action="append", default=[], metavar="LIB.so",
                   help="onnxruntime custom-op library for models with custom-domain ops (repeatable)")
    p.add_argument("--lanes", type=int, metavar="N",
                   help="calibration batches run at once on the CPU, the cores shared among them (default 2 "
                        "with two cores or more; 1 holds one batch's tensors at a time). Thresholds do not depend on it")


def _check_counts(args) -> None:
    """--batch-size and --lanes, before any work."""
    if args.batch_size < 1:
        raise QdqError("--batch-size must be at least 1", "pass a positive number")
    if args.lanes is not None and args.lanes < 1:
        raise QdqError("--lanes must be at least 1", "pass 1 (one batch at a time) or more")


def _add_fix_input(p):
    p.add_argument("--fix-input", action="append", default=[], metavar="NAME=VALUE",
                   help="make a model input a constant (a number, or a comma-separated list for a 1-D input), "
                        "so the If nodes it selects are decided and their taken branch quantized; the written "
                        "model no longer has that input (repeatable)")


def _fixed_inputs(specs: list[str]) -> dict:
    from .passes.fix_inputs import parse_fixed
    fixed = {}
    for spec in specs:
        name, values = parse_fixed(spec)
        if name in fixed:
            raise QdqError(f"--fix-input {name} is given twice", "give each input once")
        fixed[name] = values[0] if len(values) == 1 else values
    return fixed


def _add_selection(p):
    p.add_argument("--rules", action="append", default=[], metavar="FILE", help="extra placement rules (TOML)")
    p.add_argument("--exclude-op", action="append", default=[], metavar="TYPE", help="never quantize this op type")
    p.add_argument("--exclude-node", action="append", default=[], metavar="REGEX", help="never quantize matching nodes")
    p.add_argument("--include-node", action="append", default=[], metavar="REGEX",
                   help="quantize matching nodes even where a default (advisory) rule would skip them")


def _add_calibrate(sub):
    p = sub.add_parser("calibrate", help="calibrate only: write a calibration cache (or shard state)",
                       description="Calibrate the tensors qdqgraph would quantize and write their ranges "
                                   "as a qdqgraph JSON or TensorRT calibration cache. Split large data with "
                                   "--shard I/N (writes state) and combine with --merge.")
    p.add_argument("model", nargs="?", help="float ONNX model (not needed with --merge)")
    p.add_argument("-o", "--output", required=True, help="cache (or state) file to write")
    p.add_argument("--calib", help="calibration data, as for insert")
    p.add_argument("--method", default="percentile", choices=["max", "entropy", "percentile", "mse"])
    p.add_argument("--percentile", type=float, default=99.99)
    p.add_argument("--format", choices=["json", "tensorrt", "state"],
                   help="json (default), tensorrt (calibration-cache text), state (histograms, mergeable)")
    p.add_argument("--shard", metavar="I/N", help="calibrate only shard I of N of the samples; writes state")
    p.add_argument("--merge", nargs="+", metavar="STATE", help="merge state files from --shard runs")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--samples", type=int)
    _add_preprocess(p)
    _add_runtime(p)
    p.add_argument("--force", action="store_true")
    p.add_argument("--quiet", action="store_true")
    _add_selection(p)
    _add_fix_input(p)
    p.set_defaults(run=_run_calibrate)


def _add_report(sub):
    p = sub.add_parser("report", help="predict TensorRT's layers, precisions and reformats for any Q/DQ model",
                       description="Simulate TensorRT's explicit-quantization optimizer (Q/DQ propagation and "
                                   "fusion) on a Q/DQ ONNX model, lint its placement, and with --against diff "
                                   "the prediction against a real engine's layer information.")
    p.add_argument("model", help="a Q/DQ ONNX model (qdqgraph's, Model Optimizer's, onnxruntime's, a QAT export)")
    p.add_argument("--json", metavar="FILE", help="write the simulation report as JSON")
    p.add_argument("--graph", metavar="FILE", help="write the fused-layer graph as ONNX (opens in Netron)")
    p.add_argument("--against", metavar="LAYERS.json",
                   help="TensorRT layer information (trtexec --exportLayerInfo, or the engine inspector's JSON)")
    p.add_argument("--strict", action="store_true", help="exit 3 when the linter finds a problem")
    p.add_argument("--quiet", action="store_true", help="print only the summary line and diagnostics")
    p.set_defaults(run=_run_report)


def _run_report(args) -> int:
    from . import io
    from .placement import load_ruleset
    from .trtsim import diff, lint, read_engine_report, simulate
    loaded = io.load(args.model)
    require_folders(args.json, args.graph)
    sim = simulate(loaded.graph)
    diagnostics = lint(loaded.graph, sim, region=load_ruleset().region)
    if args.quiet:
        print(sim.table().splitlines()[-1])
    else:
        print(sim.table())
    for d in diagnostics:
        print(d)
    if args.against:
        print(diff(sim, read_engine_report(args.against)).table())
    if args.json:
        io.write_text_atomic(Path(args.json), sim.to_json() + "\n")
    if args.graph:
        io.save(sim.to_onnx(), args.graph, protect=(Path(args.model),))
    return 3 if args.strict and diagnostics else 0


def _add_compare(sub):
    p = sub.add_parser("compare", help="float vs quantized: per-output and per-tensor agreement on data",
                       description="Run both models on the same samples: per output cosine, SQNR, max abs error "
                                   "and top-1 agreement (logits); per quantized tensor present in both, its SQNR, "
                                   "so the layer where the error jumps is named.")
    p.add_argument("float_model", help="the float ONNX model")
    p.add_argument("quant_model", help="its quantized version (any Q/DQ model with the same tensor names)")
    p.add_argument("--data", required=True, help="samples, read like insert's --calib")
    p.add_argument("--samples", type=int, default=32, help="first N samples (default 32)")
    p.add_argument("--all", action="store_true", help="list every quantized tensor, in graph order")
    p.add_argument("--json", metavar="FILE", help="write the comparison as JSON")
    _add_preprocess(p)
    p.set_defaults(run=_run_compare)


def _run_compare(args) -> int:
    import json

    from . import io
    from .evaluate import compare
    if args.samples < 1:
        raise QdqError("--samples must be at least 1", "pass a positive number")
    require_folders(args.json)
    c = compare(args.float_model, args.quant_model, calib=args.data, samples=args.samples,
                preprocess=args.preprocess)
    print(c.table(every=args.all))
    if args.json:
        io.write_text_atomic(Path(args.json), json.dumps(c.to_dict(), indent=1, default=float) + "\n")
    return 0


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


def _providers(text: str, libraries=()) -> list[str]:
    out = []
    for p in (x.strip().lower() for x in text.split(",") if x.strip()):
        if p not in _PROVIDERS:
            raise QdqError(f"unknown provider {p!r}", f"use {', '.join(_PROVIDERS)}")
        out.append(_PROVIDERS[p])
    import onnxruntime as ort

    from .runtime import register_custom_ops
    for lib in libraries:
        register_custom_ops(lib)
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
    from .config import QuantizeConfig
    from .pipeline import default_output, quantize
    out = _output_path(args, default_output)
    if args.report:
        rp = Path(args.report)
        if not rp.parent.exists():
            raise QdqError(f"report folder {rp.parent} does not exist", "create it or choose another --report path")
    _check_counts(args)
    if args.samples is not None and args.samples < 1:
        raise QdqError("--samples must be at least 1", "pass a positive number")
    if args.verify < 0:
        raise QdqError("--verify must be 0 (off) or a number of samples", "pass e.g. --verify 8")
    if args.calib is None and args.calib_cache is None:
        raise QdqError("no calibration data given",
                       "pass --calib DATA.npz, --calib-cache FILE, or --calib random (scales then mean nothing)")
    if args.engine:                         # fail before any work when the engine cannot be built
        from .cli_build import _check_paths
        from .engine import import_tensorrt
        _check_paths(out, Path(args.engine), args.layer_info, args.force)
        import_tensorrt()
    progress = _progress(args)
    config = QuantizeConfig(method=args.method, percentile=args.percentile, batch_size=args.batch_size,
                            samples=args.samples, lanes=args.lanes, preprocess=args.preprocess,
                            providers=_providers(args.providers, args.custom_op_library),
                            rules=args.rules, exclude_ops=args.exclude_op, exclude_nodes=args.exclude_node,
                            include_nodes=args.include_node, fixed_inputs=_fixed_inputs(args.fix_input),
                            weights=args.weights, high_precision=args.high_precision,
                            bias_correction=args.bias_correction, smooth_quant=args.smooth_quant,
                            accuracy_budget=args.accuracy_budget, max_float_layers=args.max_float_layers,
                            sensitivity_samples=args.sensitivity_samples)
    result = quantize(args.model, args.calib, config=config, calib_cache=args.calib_cache, progress=progress)
    if progress is not None:
        progress.close()
    written = io.save(result.model, out, protect=(Path(args.model),))
    result.report.output = str(written[0])
    if args.report:
        io.write_text_atomic(Path(args.report), result.report.to_json())
    if not args.quiet:
        print(result.report.summary())
        if args.verify > 0 and args.calib is not None and args.calib != "random":
            from .evaluate import compare
            print(compare(args.model, result.model, calib=args.calib, samples=args.verify, tensors=False,
                          preprocess=args.preprocess).table())
    if args.engine:
        from .cli_build import build_and_diff
        from .prepare import read_data
        loaded = io.load(written[0])
        loaded.fixed_inputs = tuple(_fixed_inputs(args.fix_input))   # the written model lacks them
        data = (read_data(loaded, args.calib, QuantizeConfig(preprocess=args.preprocess))
                if args.calib and args.calib != "random" else None)
        build_and_diff(written[0], Path(args.engine), args, loaded, data)
    return 0


def _parse_shard(text: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise QdqError(f"--shard {text!r} is not I/N", "write e.g. --shard 2/4") from None
    if not (1 <= i <= n):
        raise QdqError(f"--shard {text}: I must be between 1 and N", "write e.g. --shard 2/4")
    return i, n


def _run_calibrate(args) -> int:
    from .calibration import calibrate, merge_calibrations
    from .config import QuantizeConfig
    out = Path(args.output)
    if out.exists() and not args.force:
        raise QdqError(f"{out} exists", "pass --force to overwrite it, or choose another output with -o")
    if args.model and out.resolve() == Path(args.model).resolve():
        raise QdqError(f"the output {out} is the input model", "choose another output with -o")
    if args.merge:
        if args.shard or args.calib:
            raise QdqError("--merge combines saved shards; it takes no --calib or --shard", "drop them")
        cal = merge_calibrations(args.merge, args.method, args.percentile)
        cal.save(out, args.format or "json")
        if not args.quiet:
            print(f"merged {len(args.merge)} shards ({cal.samples} samples, {len(cal.groups)} scale groups); wrote {out}")
        return 0
    if not args.model:
        raise QdqError("no model given", "pass MODEL.onnx (or --merge STATE...)")
    _check_counts(args)
    if not args.calib:
        raise QdqError("no calibration data given", "pass --calib DATA.npz")
    shard = _parse_shard(args.shard) if args.shard else None
    fmt = args.format or ("state" if shard else "json")
    if shard and fmt != "state":
        raise QdqError("--shard writes calibration state, to be merged", "drop --format, or use --format state")
    config = QuantizeConfig(method=args.method, percentile=args.percentile, batch_size=args.batch_size,
                            samples=args.samples, lanes=args.lanes, preprocess=args.preprocess,
                            providers=_providers(args.providers, args.custom_op_library), rules=args.rules,
                            exclude_ops=args.exclude_op, exclude_nodes=args.exclude_node,
                            include_nodes=args.include_node, fixed_inputs=_fixed_inputs(args.fix_input))
    progress = _progress(args)
    try:
        cal = calibrate(args.model, args.calib, config=config, shard=shard, keep_states=fmt == "state",
                        progress=progress)
    finally:
        if progress is not None:
            progress.close()
    cal.save(out, fmt)
    if not args.quiet:
        print(f"calibrated {len(cal.groups)} scale groups over {cal.samples} samples in {cal.seconds:.1f} s; wrote {out}")
    return 0


class _Progress:
    """A tqdm bar on a terminal; nothing otherwise."""

    def __init__(self, total: int | None = None):
        from tqdm import tqdm
        self.bar = tqdm(total=total, unit="sample", file=sys.stderr, leave=False, dynamic_ncols=True)

    def __call__(self, n: int) -> None:
        self.bar.update(n)

    def close(self) -> None:
        self.bar.close()


def _progress(args):
    if getattr(args, "quiet", False) or not sys.stderr.isatty():
        return None
    try:
        return _Progress()
    except ImportError:
        return None


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
    _add_calibrate(sub)
    _add_report(sub)
    _add_compare(sub)
    _add_example(sub)
    _add_strip(sub)
    add_build(sub)
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
