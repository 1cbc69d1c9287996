"""Argument groups shared by the commands, parsed and checked once into a QuantizeConfig.

Every option has help text and shows its default; numbers are checked when the config is made,
before any work. trtexec's spellings of the shape options are accepted as aliases.
"""
from __future__ import annotations

import argparse

from ..calib.methods import METHODS
from ..config import (ATTENTION_MAX_LOSS_DB, ATTENTION_MODES, DEFAULT_BLOCK_SIZE, DEFAULT_FLOOR_INT8_FLOPS,
                      DEFAULT_METHODS, DEFAULT_SQNR_FLOOR, EQUALIZE_MODES,
                      DEFAULT_PERCENTILE, DEFAULT_SENSITIVITY_SAMPLES, DEFAULT_SMOOTH_ALPHA, INT4_METHODS,
                      QuantizeConfig)
from ..execution.distributed import LOCAL as RAY_LOCAL
from ..precisions.formats import PRECISIONS
from ..precisions.registry import precision
from ..errors import QdqError
from ..passes.insert import WEIGHT_FORMATS
from ..passes.precision import HIGH_PRECISIONS
import onnxruntime as ort
from ..passes.fix_inputs import parse_fixed

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider",
             "tensorrt": "TensorrtExecutionProvider", "dml": "DmlExecutionProvider"}


class Formatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions and examples as written; each option's default shown after its help."""

    def _get_help_string(self, action):
        text = action.help or ""
        d = action.default
        if "%(default)" in text or "default" in text.lower() or d in (None, False, [], argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


class UsageError(QdqError):
    """A command line argparse rejects."""


class Parser(argparse.ArgumentParser):
    """argparse, with a one-line error (and a pointer to --help) instead of the whole usage."""

    def error(self, message):
        raise UsageError(message, f"see `{self.prog} --help`")


def add_calibration(p, data_help: str = "calibration data: .npz (one array per input, samples first), .npy, a "
                                          "folder of them, a folder of images (with --preprocess), or 'random'"):
    g = p.add_argument_group("calibration")
    g.add_argument("--calib", metavar="DATA", help=data_help)
    g.add_argument("--method", default=None, choices=list(METHODS),
                   help="how each tensor's range is chosen (default: " +
                        ", ".join(f"{m} for {p}" for p, m in DEFAULT_METHODS.items() if not precision(p).weights_only) +
                        ", the best on the model zoo; docs/CALIBRATION.md)")
    g.add_argument("--percentile", type=float, default=DEFAULT_PERCENTILE,
                   help="for --method percentile: the percentile of |x| kept, in (0, 100]")
    g.add_argument("--batch-size", type=int, default=1,
                   help="samples concatenated per onnxruntime run (models with a dynamic batch axis)")
    g.add_argument("--samples", type=int, metavar="N", help="use only the first N samples")
    g.add_argument("--lanes", type=int, metavar="N",
                   help="batches run at once on the CPU, the cores shared among them (default 2 with two cores "
                        "or more; 1 holds one batch's tensors at a time); the ranges do not depend on it")
    g.add_argument("--preprocess", metavar="SPEC",
                   help='for a folder of images: "resize=256,crop=224,mean=0.485,0.456,0.406,'
                        'std=0.229,0.224,0.225,layout=NCHW,color=RGB" (or a file holding it)')
    return g


def add_placement(p, require_int8: bool = False):
    """The placement group; `require_int8`: with --require-int8 (insert's, which predicts the engine)."""
    g = p.add_argument_group("placement")
    g.add_argument("--rules", action="append", default=[], metavar="FILE",
                   help="extra placement rules (TOML, like rules/placement.toml; repeatable)")
    g.add_argument("--exclude-op", action="append", default=[], metavar="TYPE",
                   help="never quantize this ONNX op type, e.g. Softmax (repeatable)")
    g.add_argument("--exclude-node", action="append", default=[], metavar="REGEX",
                   help="never quantize nodes whose name matches (repeatable)")
    g.add_argument("--include-node", action="append", default=[], metavar="REGEX",
                   help="quantize matching nodes even where a default (advisory) rule would skip them (repeatable)")
    g.add_argument("--fix-input", action="append", default=[], metavar="NAME=VALUE",
                   help="make a model input a constant (a number, or a comma-separated list for a 1-D input), so the "
                        "If nodes it selects are decided and their taken branch quantized; the written model no "
                        "longer has that input (repeatable)")
    add_target(g)
    if require_int8:
        g.add_argument("--require-int8", type=float, metavar="PCT",
                       help="exit 2 and write nothing when TensorRT would run less than PCT%% of the weighted "
                            "FLOPs in INT8 (FP8 with --precision fp8), as the summary's prediction counts them; "
                            "without it, a plan that quantizes little of a model with convolutions or GEMMs is "
                            "a warning")
    return g


def add_target(g):
    g.add_argument("--target", choices=("tensorrt", "tensorrt-rtx"), default="tensorrt",
                   help="the compiler to place for and predict: datacenter TensorRT, or TensorRT for RTX (its "
                        "rules in rules/tensorrt_rtx/ and rules/placement_tensorrt_rtx.toml)")
    g.add_argument("--gpu", metavar="NAME",
                   help="the GPU of the summary's speed estimate against FP16 (qdqgraph estimate --gpu list; "
                        "default a100-sxm4-80gb for tensorrt, rtx-4090 for tensorrt-rtx)")
    return g


def add_runtime(p):
    g = p.add_argument_group("runtime")
    g.add_argument("--providers", default="cpu", help=f"onnxruntime providers for the runs on data: "
                                                      f"{', '.join(PROVIDERS)} (comma-separated, in order)")
    g.add_argument("--custom-op-library", action="append", default=[], metavar="LIB.so",
                   help="onnxruntime custom-op library for models with custom-domain ops (repeatable)")
    g.add_argument("--ray", nargs="?", const=RAY_LOCAL, metavar="ADDRESS",
                   help="calibrate (and measure sensitivity) in parallel on Ray: alone, a Ray started on this "
                        "machine for the run; with an address (auto, HOST:PORT, ray://HOST:PORT), that cluster. "
                        "Same ranges and ranking as one process; needs qdqgraph[ray]. Write it after MODEL (it "
                        "takes a word after it as the address)")
    return g


def add_shapes(p):
    g = p.add_argument_group("engine shapes (trtexec's spellings work too)")
    g.add_argument("--shapes", metavar="NAME:1x3x224x224,...", help="fixed shapes of dynamic inputs; min = opt = max")
    g.add_argument("--min", "--minShapes", dest="min_shapes", metavar="SPEC", help="smallest shapes (with --opt and --max)")
    g.add_argument("--opt", "--optShapes", dest="opt_shapes", metavar="SPEC", help="most frequent shapes")
    g.add_argument("--max", "--maxShapes", dest="max_shapes", metavar="SPEC", help="largest shapes")
    g.add_argument("--max-batch", type=int, metavar="N",
                   help="with shapes taken from data: let a dynamic batch dim range over 1..N")
    return g


def add_engine(p):
    g = p.add_argument_group("engine")
    g.add_argument("--backend", choices=("auto", "tensorrt", "tensorrt-rtx"), default="auto",
                   help="the compiler: datacenter TensorRT (needs a GPU) or TensorRT for RTX (builds without "
                        "one); auto takes TensorRT where it imports, else TensorRT for RTX")
    g.add_argument("--compute-capability", metavar="SM[,SM...]",
                   help="TensorRT for RTX targets, e.g. sm89,sm120 (default: the builder's, or what FP8/INT4 need)")
    g.add_argument("--layer-info", metavar="LAYERS.json",
                   help="write the compiled engine's kernels (precisions, shapes, ONNX nodes) as JSON")
    g.add_argument("--timing-cache", metavar="FILE", help="TensorRT timing cache to read and update")
    g.add_argument("--workspace", type=int, metavar="MB", help="builder workspace limit in MiB")
    return g


def add_output(p, force_help: str = "overwrite existing outputs"):
    g = p.add_argument_group("output")
    g.add_argument("--force", action="store_true", help=force_help)
    g.add_argument("--quiet", action="store_true", help="print only errors (and no progress bars)")
    return g


def providers(text: str) -> tuple[str, ...]:
    out = []
    for p in (x.strip().lower() for x in text.split(",") if x.strip()):
        if p not in PROVIDERS:
            raise QdqError(f"unknown provider {p!r}", f"use {', '.join(PROVIDERS)}")
        out.append(PROVIDERS[p])
    if not out:
        raise QdqError("--providers is empty", "write e.g. --providers cpu")
    return tuple(out)


def check_providers(names: tuple[str, ...]) -> None:
    missing = [p for p in names if p not in ort.get_available_providers()]
    if missing:
        raise QdqError(f"onnxruntime here has no {', '.join(missing)}",
                       "install qdqgraph[gpu] (onnxruntime-gpu) on a CUDA machine, or use --providers cpu")


def fixed_inputs(specs: list[str]) -> dict:
    fixed = {}
    for spec in specs:
        name, values = parse_fixed(spec)
        if name in fixed:
            raise QdqError(f"--fix-input {name} is given twice", "give each input once")
        fixed[name] = values[0] if len(values) == 1 else values
    return fixed


def config(args, **extra) -> QuantizeConfig:
    """The QuantizeConfig of the parsed arguments (checked now, before any work)."""
    found = dict(method=args.method, percentile=args.percentile, batch_size=args.batch_size, samples=args.samples,
                 lanes=args.lanes, preprocess=args.preprocess, providers=providers(args.providers),
                 custom_op_libraries=tuple(args.custom_op_library), rules=tuple(args.rules),
                 exclude_ops=tuple(args.exclude_op), exclude_nodes=tuple(args.exclude_node),
                 include_nodes=tuple(args.include_node), fixed_inputs=fixed_inputs(args.fix_input))
    for name in ("precision", "block_size", "int4_method", "weights", "high_precision", "smooth_quant", "accuracy_budget",
                 "max_float_layers", "sensitivity_samples", "int8_attention", "ray", "require_int8", "target", "gpu",
                 "equalize", "sqnr_floor", "floor_int8_flops", "learned_rounding"):
        if hasattr(args, name):
            found[name] = getattr(args, name)
    if hasattr(args, "output_aware"):
        found["output_aware"] = {"auto": None, "on": True, "off": False}[args.output_aware]
    if hasattr(args, "bias_correction"):
        found["bias_correction"] = {"auto": None, "on": True, "off": False}[args.bias_correction]
    if hasattr(args, "fragile_heads"):
        found["fragile_heads"] = args.fragile_heads == "on"
    if hasattr(args, "depthwise_check"):
        found["depthwise_check"] = args.depthwise_check == "on"
    found.update(extra)
    return QuantizeConfig(**found)


def floor_db(text: str) -> float | None:
    """--sqnr-floor: a number of dB, or off."""
    if text.strip().lower() in ("off", "none"):
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an output SQNR in dB or 'off', got {text!r}") from None


def at_least(value, name: str, minimum: int) -> None:
    if value is not None and value < minimum:
        raise QdqError(f"{name} must be at least {minimum}, got {value}", f"pass {name} {minimum} or more")


__all__ = ["Formatter", "Parser", "UsageError", "add_calibration", "add_placement", "add_runtime", "add_shapes",
           "add_engine", "add_output", "add_target", "config", "providers", "check_providers", "fixed_inputs", "at_least",
           "WEIGHT_FORMATS", "HIGH_PRECISIONS", "PRECISIONS", "DEFAULT_BLOCK_SIZE", "INT4_METHODS", "DEFAULT_SMOOTH_ALPHA", "DEFAULT_SENSITIVITY_SAMPLES",
           "ATTENTION_MODES", "ATTENTION_MAX_LOSS_DB", "EQUALIZE_MODES", "DEFAULT_SQNR_FLOOR", "DEFAULT_FLOOR_INT8_FLOPS",
           "floor_db"]
