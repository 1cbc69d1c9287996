"""`qdqgraph insert`: float ONNX in, TensorRT-ready Q/DQ ONNX out."""
from __future__ import annotations

import shlex

from pathlib import Path

from ..graph import io, outputs
from ..errors import QdqError
from ..precisions.registry import precision
from . import args as a
from .messages import warn_all
from .progress import bars, run_with_bars
from .. import pipeline
from ..pipeline import default_output
from .build import check_engine_args, build_and_check
from ..execution.distributed import require
from ..prepare import read_data
from ..execution import ahead, evaluate, runtime
from typing import Any
import numpy as np
from ..backends.profiles import from_flags
from ..samples.data import InputSpec

EXAMPLES = """examples:
  qdqgraph insert model.onnx --calib data.npz                    # writes model.qdq.onnx beside it
  qdqgraph insert model.onnx --calib images/ --preprocess "resize=256,crop=224,mean=0.485,0.456,0.406,std=0.229,0.224,0.225"
  qdqgraph insert model.onnx --calib-cache calib.json -o out.onnx --report report.json
  qdqgraph insert model.onnx --calib data.npz --accuracy-budget 30 --max-float-layers 5
  qdqgraph insert model.onnx --calib data/ --accuracy-budget 30 --ray   # calibration and sensitivity on Ray
  qdqgraph insert model.onnx --calib data.npz --exclude-op Softmax --include-node 'attn/.*'
  qdqgraph insert model.onnx --calib data.npz --precision fp8     # FP8 (E4M3) for Ada, Hopper, Blackwell
  qdqgraph insert model.onnx --calib data.npz --precision int4    # INT4 MatMul/Gemm weights, activations float
  qdqgraph insert model.onnx --calib data.npz --require-int8 50   # exit 2 unless >= 50% of the FLOPs run INT8
"""


def add(sub) -> None:
    p = sub.add_parser("insert", help="float ONNX in, TensorRT-ready Q/DQ ONNX out", formatter_class=a.Formatter,
                       description="Place Q/DQ by TensorRT's rules, calibrate, and write MODEL.qdq.onnx.",
                       epilog=EXAMPLES)
    g = p.add_argument_group("input")
    g.add_argument("model", help="float ONNX model")
    g = a.add_calibration(p)
    g.add_argument(
        "--calib-cache", metavar="FILE", help="ranges from a qdqgraph JSON or TensorRT calibration cache (with "
                                              "--calib, what it lacks is calibrated from the data)")
    a.add_placement(p, require_int8=True)
    g = p.add_argument_group("precision")
    g.add_argument("--precision", default="int8", choices=list(a.PRECISIONS),
                   help="int8: INT8 activations and weights; fp8: FP8 E4M3 (Ada, Hopper and later); int4: INT4 "
                        "MatMul/Gemm weights in blocks, activations left in the float type")
    g.add_argument("--block-size", type=int, metavar="N",
                   help=f"int4: weights per scale along the reduction axis (must divide it) (default: "
                        f"{a.DEFAULT_BLOCK_SIZE})")
    g.add_argument("--int4-method", choices=list(a.INT4_METHODS),
                   help="int4: rtn (round to nearest) or awq (activation-aware scale and clip search on --calib) "
                        "(default: awq)")
    g.add_argument("--weights", default="int8", choices=list(a.WEIGHT_FORMATS),
                   help="int8: INT8 initializer + DequantizeLinear; qdq: float weight + Q->DQ")
    g.add_argument("--high-precision", default="fp16", choices=list(a.HIGH_PRECISIONS),
                   help="type of the parts that stay float (TensorRT runs a strongly typed network in the "
                        "types the ONNX gives)")
    g.add_argument("--smooth-quant", type=float, nargs="?", const=a.DEFAULT_SMOOTH_ALPHA, metavar="ALPHA",
                   help=f"migrate activation outliers of quantized MatMul/Gemm inputs into their weights "
                        f"(SmoothQuant; ALPHA in [0, 1], {a.DEFAULT_SMOOTH_ALPHA} when omitted)")
    g.add_argument("--bias-correction", nargs="?", const="on", default="off", choices=["auto", "on", "off"],
                   help="fold the mean output shift of INT8 weights into the biases (measured on --calib); "
                        "auto: kept where it raises the written model's output SQNR on the first 32 calibration "
                        "samples (alone: on)")
    g.add_argument("--equalize", choices=list(a.EQUALIZE_MODES), default="off",
                   help="cross-layer equalization of Conv -> [Relu] -> Conv pairs (depthwise-separable blocks), "
                        "folded into the weights: on scales each pair fully (by the measured ranges of the tensor "
                        "between the convs with --calib, else by the weights); auto scales a pair as far as an "
                        "estimate of its rounding noise says it gains (needs --calib). Off by default: it helps "
                        "constructed pairs and cost silero_vad_op15 10 dB (docs/ACCURACY.md)")
    g.add_argument("--depthwise-check", choices=["on", "off"], default="on",
                   help="keep float the depthwise convolutions whose own output the quantized input and weight "
                        "ruin (a tensor's small channels on a few INT8 steps, under a large folded weight), where "
                        "the outputs gain and they cost at most 3%% of the FLOPs (measured; needs --calib)")
    g.add_argument("--fragile-heads", choices=["on", "off"], default="on",
                   help="keep float the last layers of an output whose own SQNR is far below the others' (a "
                        "regression head beside a classifier), where they cost at most 2%% of the FLOPs")
    g.add_argument("--output-aware", choices=["auto", "on", "off"], default="auto",
                   help="choose each MatMul/Gemm input's range and smoothing by the error in the layer's output, "
                        "and a convolution's where a global max pool reads it, by the error at the maxima (auto: "
                        "on for transformers: a LayerNorm or an attention block, and for those convolutions, "
                        "with --calib data)")
    g.add_argument("--int8-attention", choices=list(a.ATTENTION_MODES), default="auto",
                   help="INT8 for the attention's two batched GEMMs (TensorRT's fused INT8 attention); auto: "
                        f"keep it while it costs at most {a.ATTENTION_MAX_LOSS_DB:g} dB output SQNR, measured")
    g.add_argument("--learned-rounding", choices=["auto", "on", "off"], default="off",
                   help="learn each INT8 Conv/Gemm/MatMul weight's rounding (up or down per element) from its "
                        "layer's output error on --calib (AdaRound; same scales, only the INT8 values change); "
                        "needs PyTorch (pip install 'qdqgraph[learn]'); auto: where PyTorch is installed, on models "
                        "whose layers take about 15 s or less to learn")
    g = p.add_argument_group("accuracy")
    g.add_argument("--accuracy-budget", type=float, metavar="SQNR_DB",
                   help="return the most sensitive nodes to float until the output SQNR against float reaches "
                        "this many dB (measured on --sensitivity-samples calibration samples)")
    g.add_argument("--max-float-layers", type=int, metavar="K", help="at most K nodes returned to float")
    g.add_argument("--sqnr-floor", type=a.floor_db, default=None, metavar="DB|off",
                   help=f"without --accuracy-budget: when the output SQNR on the first 32 calibration samples is "
                        f"below DB (e.g. {a.DEFAULT_SQNR_FLOOR:g}), return Conv/Gemm/MatMul nodes to float, most dB "
                        f"per FLOP first, within --floor-int8-flops (default off: docs/ACCURACY.md)")
    g.add_argument("--floor-int8-flops", type=float, default=a.DEFAULT_FLOOR_INT8_FLOPS, metavar="PCT",
                   help="the --sqnr-floor fallback keeps at least PCT%% of the weighted FLOPs quantized")
    g.add_argument("--sensitivity-samples", type=int, default=a.DEFAULT_SENSITIVITY_SAMPLES, metavar="N",
                   help="samples the sensitivity analysis runs on")
    g.add_argument("--verify", type=int, default=None, metavar="N",
                   help=f"compare float and quantized outputs on the first N calibration samples (0 = off; "
                        f"default: {VERIFY_SAMPLES}, stopping once {VERIFY_VALUES / 1e6:g} M output values are "
                        f"compared: 4 samples of a 1,500-token encoder's states; on a written graph of "
                        f"{runtime.LARGE_GRAPH_NODES:,} nodes or more it runs in a child process while the prediction runs)")
    g = p.add_argument_group("deployment (TensorRT and a GPU)")
    g.add_argument("--engine", metavar="MODEL.plan", help="also build a TensorRT engine from the output")
    a.add_shapes(p)
    a.add_engine(p)
    a.add_runtime(p)
    g = a.add_output(p)
    g.add_argument("-o", "--output", metavar="OUT.onnx", help="the Q/DQ model (default: MODEL.qdq.onnx beside the input)")
    g.add_argument("--report", metavar="REPORT.json", help="write the placement and calibration report as JSON")
    g.add_argument("--verbose", action="store_true",
                   help="also print the stage profile: seconds and memory per stage and per step (the JSON "
                        "report always holds it)")
    p.set_defaults(run=run)


def write_result(result, args, out: Path, report_path, verify=None) -> list:
    """Save the model (the input protected) and the JSON report, print the summary unless quiet,
    then the warnings on stderr; then `verify()`, a stage of the profile that --verbose prints at
    the end (the JSON, written before it so that an interrupted check leaves it, has not got it).
    Returns the written paths."""
    with result.report.stage("save"):
        written = io.save(result.model, out, protect=(Path(args.model),), force=args.force)
    result.report.output = str(written[0])
    if report_path:
        outputs.write_text(report_path, result.report.to_json(), force=args.force)
    if not args.quiet:
        print(result.report.summary(warnings=False))
    warn_all(result.report.warnings)
    if verify is not None:
        with result.report.stage("verify"):
            verify()
    if getattr(args, "verbose", False) and not args.quiet:
        print("\n".join(result.report.profile.lines()))
    return written


# the flags that only say how to build the engine: (argparse dest, as written, its default)
ENGINE_FLAGS = (("shapes", "--shapes", None), ("min_shapes", "--min/--minShapes", None),
                ("opt_shapes", "--opt/--optShapes", None), ("max_shapes", "--max/--maxShapes", None),
                ("max_batch", "--max-batch", None), ("backend", "--backend", "auto"),
                ("compute_capability", "--compute-capability", None), ("layer_info", "--layer-info", None),
                ("timing_cache", "--timing-cache", None), ("workspace", "--workspace", None))


def refuse_engine_flags(args) -> None:
    """Engine flags without --engine would be accepted and unused: one line instead (calibration
    runs on the shapes of the data, and the written model keeps its own input shapes)."""
    for dest, flag, default in ENGINE_FLAGS:
        if getattr(args, dest, default) != default:
            shapes = "shapes" in dest or dest == "max_batch"
            what = ("sets the engine's optimization profile, and this run builds no engine (no --engine; "
                    "calibration runs on the shapes of the --calib data)") if shapes else \
                "is an engine build option, and this run builds no engine (no --engine)"
            raise QdqError(f"{flag} {what}", f"add --engine MODEL.plan to build one, or drop {flag}")


def check_shapes(args, config) -> None:
    """--shapes / --min/--opt/--max, checked against the model's inputs before any work (the
    engine is built after the model is written): their syntax, the input names, ranks and order."""
    if not any(getattr(args, d) for d in ("shapes", "min_shapes", "opt_shapes", "max_shapes")):
        return

    graph = io.read_model(args.model, external_data=False).graph      # a bad file: one line, exit 2
    weights = {i.name for i in graph.initializer}
    specs = []
    for v in graph.input:
        if v.name in weights or v.name in config.fixed:          # a fixed input leaves the written model
            continue
        t = v.type.tensor_type
        shape: Any = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim) \
            if t.HasField("shape") else None
        specs.append(InputSpec(v.name, np.dtype(np.float32), shape))
    from_flags(specs, args.shapes, args.min_shapes, args.opt_shapes, args.max_shapes)


# --verify compares on calibration samples, the ones the run chose its ranges and smoothing on: samples
# it has not seen can score lower (the Whisper tiny.en decoder 34.6 dB on its calibration samples,
# 32.9 on 16 held-out ones; MiniLM-L6 with stronger smoothing 21.9 against 19.3: docs/ACCURACY.md)
HELD_OUT_HINT = ("  (calibration samples; on samples the run has not seen: "
                 "qdqgraph compare {model} {out} --data HELD_OUT)")
# --verify's default: the first VERIFY_SAMPLES calibration samples, stopping at the sample that brings
# the output values compared to VERIFY_VALUES. Whisper tiny.en's encoder writes 576,000 values a
# sample (1,500 tokens x 384): 4 samples instead of 8, each a run of the FP16 model (1.2 CPU s here);
# a classifier's or a CNN's outputs never reach it in 8 samples.
VERIFY_SAMPLES = 8
VERIFY_VALUES = 2 ** 21


def verify_samples(asked: int | None, config) -> tuple[int, int | None]:
    """(samples, output values that are enough) of --verify: N samples where N is given; else the
    default, bounded by VERIFY_VALUES, except where --accuracy-budget claims the written model's
    SQNR on VERIFY_SAMPLES samples (what --verify prints must be that figure)."""
    if asked is not None:
        return asked, None
    return VERIFY_SAMPLES, None if config.accuracy_budget is not None else VERIFY_VALUES


# --verify's comparison starts in a child process (execution.ahead) as soon as the written model
# exists, where the session it opens costs more than forking: on a written graph of
# runtime.LARGE_GRAPH_NODES nodes or more, whose weights are at most AHEAD_MAX_BYTES (the child's
# session holds a float32 copy of them beside the parent's memory for the while).
AHEAD_MAX_BYTES = 256 << 20


def verify_ahead(model) -> bool:
    """Whether --verify's comparison of the written `model` starts ahead (see AHEAD_MAX_BYTES)."""
    return len(model.graph.node) >= runtime.LARGE_GRAPH_NODES and \
        sum(io.declared_bytes(t) for t in model.graph.initializer) <= AHEAD_MAX_BYTES


def _read_ahead(result):
    """The comparison the run started ahead (ahead.Failed where it has none or the child failed)."""
    started, result.ahead = result.ahead, None
    if started is None:
        raise ahead.Failed("not started ahead")
    return started.result()


def run(args) -> int:
    config = a.config(args)                          # every option checked before any work
    a.at_least(args.verify, "--verify", 0)
    samples, enough = verify_samples(args.verify, config)
    a.at_least(args.max_batch, "--max-batch", 1)
    a.at_least(args.workspace, "--workspace", 1)
    if args.calib is None and args.calib_cache is None and not precision(config.precision).weights_only:   # quantize() decides
        raise QdqError("no calibration data given",
                       "pass --calib DATA.npz, --calib-cache FILE, or --calib random (scales then mean nothing)")
    io.require_model_file(args.model)
    plan = outputs.Plan(args.force, inputs=[args.model, *args.rules, args.calib_cache,
                                            args.calib if args.calib != "random" else None])
    out = plan.output(args.output or default_output(args.model), "output model")
    assert out is not None                          # a path is always given
    report_path = plan.output(args.report, "--report")
    if args.engine:                                 # fail before any work when the engine cannot be built
        plan.output(args.engine, "--engine")
        plan.output(args.layer_info, "--layer-info")
        check_engine_args(args)
        check_shapes(args, config)
    else:
        refuse_engine_flags(args)
    if config.providers:
        a.check_providers(config.providers)
    if config.ray:                                  # Ray missing: one line naming the extra, before any work
        require()
    compares = not args.quiet and samples > 0 and args.calib is not None and args.calib != "random" \
        and config.high_precision != "bf16"

    def comparison(model, reference, progress=None):
        # against the float outputs the run computed where it has them (evaluate.reused), else
        # against the float model run again
        return evaluate.compare(args.model, model, calib=args.calib, samples=samples, tensors=False,
                                preprocess=args.preprocess, progress=progress, reference=reference, enough=enough)

    def compare_ahead(model, reference):
        return ahead.start(lambda: comparison(model, reference)) if verify_ahead(model) else None

    result = run_with_bars(args, lambda progress: pipeline.quantize(
        args.model, args.calib, config=config, calib_cache=args.calib_cache, progress=progress,
        ahead=compare_ahead if compares and not config.ray else None))
    verify = None
    if not args.quiet and samples > 0 and config.high_precision == "bf16":
        def verify():                  # onnxruntime's CPU kernels stop at FP16; TensorRT runs BF16 islands
            print("verify skipped: onnxruntime's CPU has no bfloat16 kernels for this model's BF16 islands "
                  "(compare it on a GPU provider, or insert with --high-precision fp16 or fp32 to check here)")
    elif compares:
        def verify():
            progress = None
            try:
                try:
                    found = _read_ahead(result)
                except ahead.Failed:
                    progress = bars(args)
                    found = comparison(result.model, result.reference, progress)
                print(found.table())
                print(HELD_OUT_HINT.format(model=shlex.quote(str(args.model)), out=shlex.quote(str(out))))
            finally:
                result.reference = None
                if progress is not None:
                    progress.close()
    try:
        written = write_result(result, args, out, report_path, verify)
    finally:
        if result.ahead is not None:            # not read: the run failed before --verify
            result.ahead.cancel()
    if args.engine:
        loaded = io.load(written[0])
        loaded.fixed_inputs = tuple(config.fixed)    # the written model lacks them
        data = read_data(loaded, args.calib, config) if args.calib and args.calib != "random" else None
        build_and_check(written[0], Path(args.engine), args, loaded, data)
    return 0
