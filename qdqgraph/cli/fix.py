"""`qdqgraph fix`: any Q/DQ model rewritten to TensorRT's placement, its scales kept."""
from __future__ import annotations

import argparse

from ..graph import outputs, io
from ..errors import QdqError
from . import args as a
from .insert import write_result
from .progress import run_with_bars
from ..fix import default_output, fix

EXAMPLES = """examples:
  qdqgraph fix model_qat.onnx                            # writes model_qat.fixed.onnx beside it
  qdqgraph fix model_ort.onnx --calib data.npz -o fixed.onnx --report fix.json
  qdqgraph fix model_qat.onnx --exclude-node 'head/.*' --high-precision fp16
"""

DESCRIPTION = """\
Read a Q/DQ model's quantization (each tensor's scale, zero point, axis and type), remove its Q/DQ,
place them again by TensorRT's rules (the rules and flags of `insert`) and write them with the
model's own scales: carried across ops that keep values (MaxPool, Reshape, Transpose, Concat, nearest
Resize, ...), one scale per Concat group (the largest), asymmetric or uint8 ranges converted to
symmetric INT8 (amax = max(|qmin - zp|, |qmax - zp|) x scale), weights per channel with their own
scales and values. A tensor the placement quantizes but the model holds no scale for is calibrated
from --calib, or refused by name. The summary and --report list what was kept, moved, merged,
converted, dropped and added, and the linter's findings and predicted reformats before and after."""


def add(sub) -> None:
    p = sub.add_parser("fix", help="rewrite any Q/DQ model (QAT export, another tool's output) to TensorRT's "
                                   "placement, its scales kept", formatter_class=a.Formatter,
                       description=DESCRIPTION, epilog=EXAMPLES)
    g = p.add_argument_group("input")
    g.add_argument("model", help="a Q/DQ ONNX model (INT8 or FP8)")
    a.add_calibration(p, data_help="calibration data for tensors the placement quantizes that hold no scale in "
                                   "the model: .npz, .npy, a folder of them, or a folder of images (with "
                                   "--preprocess); not needed when the model holds every scale")
    a.add_placement(p)
    for action in p._actions:                        # the graph is kept as it is: no input made constant
        if action.dest == "fix_input":
            action.help = argparse.SUPPRESS
    g = p.add_argument_group("precision")
    g.add_argument("--high-precision", dest="fix_high_precision", default="keep",
                   choices=["keep", *a.HIGH_PRECISIONS],
                   help="type of the parts that stay float: keep (the model's own types, scales written bit for "
                        "bit), or fp16/bf16/fp32 as `insert` makes them (scales then rounded to that type)")
    a.add_runtime(p)
    g = a.add_output(p)
    g.add_argument("-o", "--output", metavar="OUT.onnx",
                   help="the fixed model (default: MODEL.fixed.onnx beside the input)")
    g.add_argument("--report", metavar="REPORT.json", help="write every move, the findings and the prediction as JSON")
    p.set_defaults(run=run)


def run(args) -> int:
    config = a.config(args)                          # every option checked before any work
    if config.fixed_inputs:
        raise QdqError("--fix-input is not supported by fix (it would change the graph, not only its Q/DQ)",
                       "fix the model, then quantize its float version with `qdqgraph insert --fix-input`")
    io.require_model_file(args.model)
    plan = outputs.Plan(args.force, inputs=[args.model, *args.rules, args.calib if args.calib != "random" else None])
    out = plan.output(args.output or default_output(args.model), "output model")
    assert out is not None                          # a path is always given
    report_path = plan.output(args.report, "--report")
    if config.providers:
        a.check_providers(config.providers)
    result = run_with_bars(args, lambda progress: fix(args.model, args.calib, config=config,
                                                      high_precision=args.fix_high_precision, progress=progress))
    write_result(result, args, out, report_path)
    return 0
